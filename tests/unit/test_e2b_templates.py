"""Pure parts of E2B's template build API on podbay (services/api/e2b/templates.py)."""

from __future__ import annotations

import pytest
from podbay.contracts.templates import BuildEvent
from podbay.errors import Conflict, InvalidRequest
from podbay_api.e2b.templates import _relative, _signature, _template_name, e2b_step, entries


def test_names_and_tags() -> None:
    assert _template_name("my-env", None) == "my-env"
    assert _template_name("my-env:default", ["latest"]) == "my-env"
    with pytest.raises(InvalidRequest, match="one version per template name"):
        _template_name("my-env:v2", None)
    with pytest.raises(InvalidRequest, match="one version per template name"):
        _template_name("my-env", ["stable"])
    with pytest.raises(InvalidRequest, match="lower-case"):
        _template_name("My_Env", None)
    with pytest.raises(InvalidRequest, match="required"):
        _template_name(None, None)
    with pytest.raises(Conflict, match="built in"):
        _template_name("base", None)


def test_podbay_steps_map_to_e2b_steps() -> None:
    origins = [1, 3, 3, 0]  # podbay steps 1..4 from E2B steps 1, 3, 3 and the ready check
    assert e2b_step(0, origins) == "base"
    assert [e2b_step(i, origins) for i in (1, 2, 3)] == ["1", "3", "3"]
    assert e2b_step(4, origins) == "finalize" and e2b_step(5, origins) == "finalize"
    assert e2b_step(None, origins) is None


def test_build_events_become_log_entries() -> None:
    origins = [2]
    assert entries(BuildEvent(type="step", step=1, total=1, text="RUN x", cached=True), origins) == [
        ("info", "CACHED [1/1] RUN x", "2")]
    assert entries(BuildEvent(type="log", step=1, text="a\n\nb\n"), origins) == [("info", "a", "2"), ("info", "b", "2")]
    failed = entries(BuildEvent(type="failed", step=1, exit_code=3, message="step 1 exited 3",
                                output_tail="boom\n"), origins)
    assert failed == [("error", "boom", "2"), ("error", "step 1 exited 3", "2")]


def test_upload_signature_binds_tenant_hash_and_expiry() -> None:
    sig = _signature("secret", "t1", "h", 100)
    assert sig == _signature("secret", "t1", "h", 100)
    assert sig not in {_signature("secret", "t2", "h", 100), _signature("secret", "t1", "g", 100),
                       _signature("secret", "t1", "h", 101), _signature("other", "t1", "h", 100)}


def test_archive_member_paths_keep_dot_files() -> None:
    assert [_relative(n) for n in ("./.env", "/abs/x", "././a/b/", ".", "data/hello.txt")] == [
        ".env", "abs/x", "a/b", "", "data/hello.txt"]
