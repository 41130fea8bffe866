"""FROM an OCI image, the pure parts (services/nodeagent/build/oci.py, builder.inherit): references stay in the
build context, an image's config becomes exec defaults, account and init files are written inside the image
even through its symlinks, and a build inherits its parent's ENV, WORKDIR and USER as Docker's does."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from podbay.contracts.templates import BuildSpec, FromRef, ImageConfig, RunStep, WorkdirStep
from podbay_nodeagent.build.builder import BuildRequest, inherit
from podbay_nodeagent.build.oci import OciError, _add_user, _inside, _read_config, image_ref, oci_template_name


def test_image_ref_resolves_paths_inside_the_context_only(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "img").mkdir(parents=True)
    (ctx / "img.tar").write_bytes(b"x")
    assert image_ref("oci:./img:v1", ctx) == f"oci:{ctx / 'img'}:v1"
    assert image_ref("oci:img", ctx) == f"oci:{ctx / 'img'}"
    assert image_ref("docker-archive:./img.tar", ctx) == f"docker-archive:{ctx / 'img.tar'}"
    assert image_ref("docker://debian:12", ctx) == "docker://debian:12"
    for bad in ("oci:../ctx2:t", "oci:/etc:t", "oci:./missing:t", "oci-archive:", "podbay/base"):
        with pytest.raises(OciError) as info:
            image_ref(bad, ctx)
        assert info.value.code == "invalid_image" and info.value.http_status == 422


def _blob(layout: Path, doc: dict[str, object]) -> str:
    data = json.dumps(doc).encode()
    hexd = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / hexd).write_bytes(data)
    return f"sha256:{hexd}"


def test_image_config_becomes_exec_defaults_without_a_start_command(tmp_path: Path) -> None:
    cfg = _blob(tmp_path, {"config": {"Env": ["PATH=/bin", "A=b=c"], "WorkingDir": "/app", "User": "nobody",
                                      "Cmd": ["sh"], "ExposedPorts": {"80/tcp": {}}}})
    man = _blob(tmp_path, {"config": {"digest": cfg}, "layers": []})
    (tmp_path / "index.json").write_text(json.dumps({"manifests": [{"digest": man}]}))
    img = _read_config(tmp_path)
    assert img.digest == man and oci_template_name(man) == "oci-" + man[7:19]
    tc = img.template_config()
    assert tc.env == {"PATH": "/bin", "A": "b=c"} and tc.workdir == "/app" and tc.user == "nobody"
    assert tc.start_cmd is None and tc.expose == ["80/tcp"]
    assert json.loads(tc.labels["org.opencontainers.image.command"]) == ["sh"]


def test_files_are_written_inside_the_image_through_its_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr" / "sbin").mkdir(parents=True)
    (root / "sbin").symlink_to("usr/sbin")
    (root / "etc").mkdir()
    assert _inside(root, "/sbin/podbay-init") == root / "usr" / "sbin" / "podbay-init"
    (root / "abs").symlink_to("/usr")
    assert _inside(root, "/abs/sbin/x") == root / "usr" / "sbin" / "x"
    (root / "up").symlink_to("../../..")
    with pytest.raises(OSError):
        _inside(root, "/up/etc/passwd")
    _add_user(root)
    assert "user:x:1000:1000::/home/user:/bin/sh" in (root / "etc" / "passwd").read_text()
    assert "user:x:1000:" in (root / "etc" / "group").read_text()
    _add_user(root)  # idempotent
    assert (root / "etc" / "passwd").read_text().count("user:x:1000") == 1


def test_a_build_inherits_env_workdir_and_user_from_its_parent(tmp_path: Path) -> None:
    run = RunStep(shell="echo $A", env={"B": "dockerfile"})
    spec = BuildSpec(base=FromRef(kind="template", ref="x"), steps=[run, WorkdirStep(path="/w")],
                     config=ImageConfig(env={"B": "dockerfile"}, user="me"))
    req = BuildRequest(build_id="b", name="n", spec=spec, context=tmp_path, tag="v2")
    parent = ImageConfig(env={"A": "parent", "B": "parent"}, workdir="/p", user="root", start_cmd=["srv"])
    out, steps = inherit(parent, req, list(spec.steps))
    assert out.tag == "v2" and out.build_id == "b"  # a build as NAME:TAG FROM a template with a config keeps its tag
    assert out.spec.config.env == {"A": "parent", "B": "dockerfile"}
    assert out.spec.config.workdir == "/p" and out.spec.config.user == "me" and out.spec.config.start_cmd is None
    assert isinstance(steps[0], RunStep) and steps[0].env == {"A": "parent", "B": "dockerfile"}
    assert out.spec.steps == steps
    same, same_steps = inherit(None, req, list(spec.steps))
    assert same is req and same_steps == list(spec.steps)
