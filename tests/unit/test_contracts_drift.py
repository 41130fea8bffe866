"""The committed OpenAPI document is generated from the code; this fails when the two drift apart.

Regenerate with: ``.venv/bin/podbay-api openapi > docs/openapi.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from podbay.config import Settings
from podbay_api.app import create_app

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_committed_openapi_matches_the_code() -> None:
    committed = json.loads((DOCS / "openapi.json").read_text())
    assert create_app(Settings()).openapi() == committed, (
        "docs/openapi.json is stale: run `.venv/bin/podbay-api openapi > docs/openapi.json`")


def test_every_error_response_is_documented_shape() -> None:
    spec = create_app(Settings()).openapi()
    paths = spec["paths"]
    assert "/v1/sandboxes" in paths and "/v1/sandboxes/{sandbox_id}/exec" in paths
    assert "/v1/sandboxes/{sandbox_id}/files" in paths and "/v1/operations/{operation_id}" in paths
