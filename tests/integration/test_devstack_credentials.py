"""The dev stack's credential plumbing: one credential key per data dir (mode 0600) in every service's
environment, and an OpenBao dev server when the openbao backend is chosen without an external one."""

from __future__ import annotations

import base64
import stat
from pathlib import Path

import pytest

from podbay.devstack.openbao import probe_openbao
from podbay.devstack.procs import run_sync
from podbay.devstack.stack import Stack, credential_key_for, internal_token_for

pytestmark = pytest.mark.integration


def test_services_get_the_stack_credential_key(stack: Stack) -> None:
    key = stack.env["PODBAY_CREDENTIAL_KEY"]
    assert len(base64.b64decode(key, validate=True)) == 32
    path = stack.data_dir / "credential.key"
    assert path.read_text().strip() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert key not in repr(stack)


def _bare_stack(data_dir: Path, **env: str) -> Stack:
    return Stack(data_dir=data_dir, log_dir=data_dir / "logs", cache_dir=data_dir / "cache",
                 base_env={"PATH": "/usr/bin:/bin", **env})


def test_the_key_is_made_once_per_data_dir(tmp_path: Path) -> None:
    # What Stack.start_servers does for the key (the servers themselves are not needed here).
    first = _bare_stack(tmp_path)
    first.credential_key = credential_key_for(first.data_dir, first.base_env)
    again = _bare_stack(tmp_path)
    again.credential_key = credential_key_for(again.data_dir, again.base_env)
    assert first.credential_key == again.credential_key
    given = _bare_stack(tmp_path, PODBAY_CREDENTIAL_KEY="x" * 44)
    given.credential_key = credential_key_for(given.data_dir, given.base_env)
    assert given.credential_key == "x" * 44  # the operator's key wins over the saved one


def test_openbao_backend_starts_a_dev_server(tmp_path: Path) -> None:
    s = _bare_stack(tmp_path, PODBAY_CREDENTIAL_BACKEND="openbao")
    try:
        s.credential_key = credential_key_for(s.data_dir, s.base_env)
        s.internal_token = internal_token_for(s.data_dir, s.base_env)
        s._start_openbao()
        assert "openbao" in s.servers and s.servers["openbao"].alive()
        env = s._service_env()
        assert env["PODBAY_OPENBAO_ADDR"] == s.openbao_addr and env["PODBAY_OPENBAO_TOKEN"] == s.openbao_token
        run_sync(probe_openbao(s.openbao_addr, s.openbao_token))
        assert s.openbao_token not in repr(s)
    finally:
        s.stop(grace_s=5)
    assert not s.servers["openbao"].alive()
