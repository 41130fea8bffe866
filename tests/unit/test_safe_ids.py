"""Ids that become host paths match strict patterns (podbay.naming): every id field of a JetStream command and
of the node's build request refuses traversal, separators, encodings, NUL and overlong values at the contract,
and the node's path joins (``safe_component``) refuse them again should a value skip the contract."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from podbay.contracts import messages
from podbay.contracts.egress import bindings_dir
from podbay.contracts.templates import NodeBuildRequest, split_template_ref
from podbay.e2b_build import E2bBuildError, E2bBuildStart, translate
from podbay.naming import ID_RE, UnsafeName, safe_component
from podbay.outbox import new_id
from podbay.promotion import snapshot_path
from podbay.volume_promotion import volume_path
from podbay_nodeagent.storage.store import NodeStore

BAD = ["..", "../x", "a/b", "/abs", "a%2fb", "%2e%2e", "a\x00b", "a\\b", "", "x" * 65, "sbx_1\n", " sbx", "Sbx_1"]
GOOD = [new_id("sbx"), new_id("snap"), new_id("bld"), new_id("op"), new_id("ten"), "node-1", "n1", "a" * 64, "op_create"]
_ID_NAMES = ("dest_node", "source_node", "template_digest")


def _id_fields() -> list[tuple[str, str, Any]]:
    """(model, field, adapter) for every id field of a command message and of NodeBuildRequest."""
    models: list[type[BaseModel]] = [getattr(messages, n) for n in messages.__all__
                                     if isinstance(getattr(messages, n), type) and issubclass(getattr(messages, n), BaseModel)
                                     and n != "Event"]
    out = []
    for model in [*models, NodeBuildRequest]:
        for name, fi in model.model_fields.items():
            if name.endswith("_id") or name in _ID_NAMES:
                out.append((model.__name__, name, TypeAdapter(Annotated[fi.annotation, *fi.metadata])))
    return out


_FIELDS = _id_fields()


def test_the_commands_have_id_fields_to_check() -> None:
    names = {(m, f) for m, f, _ in _FIELDS}
    for expected in [("CreateSandboxCmd", "sandbox_id"), ("CreateSandboxCmd", "template_digest"),
                     ("SnapshotCmd", "snapshot_id"), ("RestoreCmd", "snapshot_id"), ("PromoteCmd", "sandbox_id"),
                     ("WakeCmd", "snapshot_id"), ("MigrateOutCmd", "dest_node"), ("MigratePrepare", "source_node"),
                     ("DrainNodeCmd", "node_id"), ("NodeBuildRequest", "build_id"), ("ForkChild", "sandbox_id")]:
        assert expected in names


@pytest.mark.parametrize(("model", "field", "adapter"), _FIELDS, ids=[f"{m}.{f}" for m, f, _ in _FIELDS])
def test_every_id_field_refuses_what_is_not_an_id(model: str, field: str, adapter: Any) -> None:
    for bad in BAD:
        with pytest.raises(ValidationError):
            adapter.validate_python(bad)
    for good in GOOD:
        assert adapter.validate_python(good) == good


def test_a_build_request_with_a_traversing_id_is_refused() -> None:
    spec = {"base": {"kind": "template", "ref": "base"}, "steps": []}
    NodeBuildRequest.model_validate({"build_id": new_id("bld"), "name": "web", "spec": spec})
    for bad in ("../../etc", "bld_1/../../x", "bld%2f..", "bld\x00"):
        with pytest.raises(ValidationError):
            NodeBuildRequest.model_validate({"build_id": bad, "name": "web", "spec": spec})


def test_id_re_is_what_new_id_makes() -> None:
    import re

    assert all(re.fullmatch(ID_RE.strip("^$"), new_id(p)) for p in ("sbx", "snap", "vsnap", "bld", "op", "whk"))


@pytest.mark.parametrize("value", [new_id("sbx"), "web", "v1.2", "a" * 64, "node-1", "oci-3f2a9c01b7d4", "A1"])
def test_safe_component_keeps_safe_values(value: str) -> None:
    assert safe_component(value) == value


@pytest.mark.parametrize("value", [".", "..", "../x", "a/b", "/", "a%2fb", "%2e%2e", "a\x00", "", "x" * 129,
                                   "a\n", ".hidden", "-rf", "a b", "a\\b", "ä"])
def test_safe_component_refuses_anything_else(value: str) -> None:
    with pytest.raises(UnsafeName) as exc:
        safe_component(value, "sandbox id")
    assert exc.value.http_status == 400 and exc.value.code == "unsafe_name"
    assert "sandbox id" in str(exc.value)


def test_node_path_joins_refuse_unsafe_ids(tmp_path: Path) -> None:
    store = NodeStore(tmp_path, "node-1", 1)
    store.root = tmp_path
    sid = new_id("sbx")
    assert store.sandbox_dir(sid) == tmp_path / "sandboxes" / sid
    assert store.snapshot_dir(sid, "snap_1") == tmp_path / "snapshots" / sid / "snap_1"
    assert store.build_dir("bld_1") == tmp_path / "builds" / "bld_1"
    for call in (lambda: store.sandbox_dir("../x"), lambda: store.snapshot_dir(sid, ".."),
                 lambda: store.snapshot_dir("a/b", "s"), lambda: store.template_dir("web", "../../etc"),
                 lambda: store.template_dir("..", "d"), lambda: store.build_dir("../../tmp"),
                 lambda: store.build_dir("x/.."), lambda: store.sandbox_snapshots_dir("%2e%2e"),
                 lambda: volume_path(tmp_path, "node-1", "../v"), lambda: volume_path(tmp_path, "..", "vol_1"),
                 lambda: bindings_dir(tmp_path, "../n"), lambda: snapshot_path(tmp_path, "n1", "../s", "snap_1"),
                 lambda: snapshot_path(tmp_path, "n1", "sbx_1", "a/../.."), lambda: snapshot_path(tmp_path, "..", "s", "t")):
        with pytest.raises(UnsafeName):
            call()


@pytest.mark.parametrize("ref", ["web\n", "web:v1\n", "../web", "web/x", "web:..", "web:%2e", "web\x00"])
def test_template_refs_refuse_newlines_and_traversal(ref: str) -> None:
    with pytest.raises(ValueError):
        split_template_ref(ref)


@pytest.mark.parametrize("files_hash", ["abc\n", "../x", "a/b", "%2e%2e", "a" * 129])
def test_an_e2b_copy_step_refuses_a_files_hash_that_is_not_one(files_hash: str) -> None:
    body = E2bBuildStart.model_validate({"fromImage": "e2bdev/base", "steps": [
        {"type": "COPY", "args": ["a", "/b"], "filesHash": files_hash}]})
    with pytest.raises(E2bBuildError, match="filesHash"):
        translate(body)
