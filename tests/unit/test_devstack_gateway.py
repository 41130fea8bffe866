"""The dev stack's gateway wiring (podbay.devstack.stack): which podbay-gateway runs, its ports, and the
credential key shared by the API and the gateway."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from podbay.config import Settings
from podbay.devstack.stack import SERVICES, StackPorts, credential_key_for, gateway_executable, internal_token_for


def test_gateway_is_a_stack_service_with_its_ports() -> None:
    assert "gateway" in [s.name for s in SERVICES]
    ports = StackPorts.from_settings(Settings(gateway_port=18095, gateway_proxy_port=18094, gateway_dns_port=18053))
    assert (ports.gateway, ports.gateway_proxy, ports.gateway_dns) == (18095, 18094, 18053)
    free = StackPorts.free()
    assert len(set(free.model_dump().values())) == len(free.model_dump())


def test_gateway_executable_prefers_explicit_then_sibling_venv(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PODBAY_GATEWAY_BIN", raising=False)
    bins = tmp_path / ".venv" / "bin"
    bins.mkdir(parents=True)
    assert gateway_executable("/opt/gw/podbay-gateway", bins) == Path("/opt/gw/podbay-gateway")
    monkeypatch.setenv("PODBAY_GATEWAY_BIN", "/env/podbay-gateway")
    assert gateway_executable(None, bins) == Path("/env/podbay-gateway")
    monkeypatch.delenv("PODBAY_GATEWAY_BIN")
    sibling = tmp_path / ".venv-gateway" / "bin" / "podbay-gateway"
    sibling.parent.mkdir(parents=True)
    sibling.touch()
    assert gateway_executable(None, bins) == sibling


def test_credential_key_is_kept_in_the_data_dir(tmp_path: Path) -> None:
    assert credential_key_for(tmp_path, {"PODBAY_CREDENTIAL_KEY": "given"}) == "given"
    first = credential_key_for(tmp_path / "d", {})
    assert len(first) == 44 and credential_key_for(tmp_path / "d", {}) == first
    mode = (tmp_path / "d" / "credential.key").stat().st_mode
    assert stat.S_IMODE(mode) == 0o600


def test_the_internal_token_is_kept_in_the_data_dir_so_derived_tokens_survive_a_restart(tmp_path: Path) -> None:
    """Port-edge traffic tokens, their cookies and E2B's envd tokens are derived from it: a new one at every
    `podbay up` broke every link handed out before."""
    assert internal_token_for(tmp_path, {"PODBAY_INTERNAL_TOKEN": "given"}) == "given"
    first = internal_token_for(tmp_path / "d", {})
    assert len(first) >= 32 and internal_token_for(tmp_path / "d", {}) == first
    assert internal_token_for(tmp_path / "other", {}) != first
    assert stat.S_IMODE((tmp_path / "d" / "internal.token").stat().st_mode) == 0o600
