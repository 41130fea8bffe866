"""tests/security is a recognised folder: its tests are marked ``security`` and ``integration`` (real servers)
unless they mark themselves ``e2e``."""

from __future__ import annotations

import pytest


def test_security_tests_are_marked(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("security") is not None
    assert request.node.get_closest_marker("integration") is not None
    assert request.node.get_closest_marker("e2e") is None


def test_integration_helpers_are_importable() -> None:
    import access_helpers

    assert callable(access_helpers.new_tenant)
