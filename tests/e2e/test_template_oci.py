"""A template built FROM an OCI image that has no Python and no glibc (build/oci.py), with real VMs.

The image is made here with umoci: a static busybox and its applets, an account file, ``Env`` and
``WorkingDir`` in its config. The build reads it from the context (``oci:./img:t``), boots it once as the
root template ``oci-<digest>``, and runs a RUN step in it; a sandbox of the result runs commands, sees the
image's and the Dockerfile's environment, and reads and writes files through guestd's own runtime. A
reference that leaves the context is a 422 before any VM starts.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from e2e_http import api_client, new_sandbox, sh

from podbay.config import Settings
from podbay.errors import PodbayError
from podbay.sdk import Client

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(shutil.which("umoci") is None or shutil.which("skopeo") is None,
                                 reason="needs umoci and skopeo (scripts/setup.sh installs them)")]

DOCKERFILE = """\
FROM oci:./img:t
RUN echo "built in $(cat /etc/os-name)" > /built.txt
ENV STAGE=two
"""


def _busybox_image(ctx: Path) -> None:
    """An OCI layout at ``ctx/img`` (tag ``t``): busybox alone, no Python, no libc."""
    layout, bundle = ctx / "img", ctx.parent / "bundle"
    subprocess.run(["umoci", "init", "--layout", str(layout)], check=True)
    subprocess.run(["umoci", "new", "--image", f"{layout}:t"], check=True)
    subprocess.run(["umoci", "unpack", "--image", f"{layout}:t", str(bundle)], check=True)
    root = bundle / "rootfs"
    for d in ("bin", "etc", "root", "srv/work"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2("/bin/busybox", root / "bin" / "busybox")
    subprocess.run(["chroot", str(root), "/bin/busybox", "--install", "-s", "/bin"], check=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    (root / "etc" / "os-name").write_text("busybox-only\n")
    # Repack first: a repack builds on the image the bundle was unpacked from, so it would drop a config
    # changed before it.
    subprocess.run(["umoci", "repack", "--image", f"{layout}:t", str(bundle)], check=True)
    subprocess.run(["umoci", "config", "--image", f"{layout}:t", "--config.env", "PATH=/bin",
                    "--config.env", "GREETING=from-image", "--config.workingdir", "/srv/work"], check=True)
    shutil.rmtree(bundle)


def test_build_from_an_oci_image_without_python(stack: Any, tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    _busybox_image(ctx)
    with Client(stack.api_url, stack.api_key, timeout_s=900) as c, api_client(stack) as h:
        for ref in ("oci:../outside:t", "oci:./missing:t"):
            with pytest.raises(PodbayError) as bad:
                c.build_template("e2e-oci-bad", f"FROM {ref}\n", ctx)
            assert bad.value.code == "invalid_image" and bad.value.http_status == 422, bad.value

        tpl = c.build_template("e2e-oci", DOCKERFILE, ctx)
        assert tpl.parent is not None and tpl.parent.startswith("oci-")
        try:
            _check_the_template(c, h, tpl, ctx)
        finally:
            _forget_root_template(tpl.parent)


def _forget_root_template(name: str) -> None:
    """Remove root template ``name`` (and its image) from the host's build cache. The image made above has a
    new digest each run, so no later run can use it; left there, the node agent of every later stack on this
    host would copy it into its store at start (about 190 MiB and half a second each)."""
    cache = Settings().cache_dir
    for d in [*(cache / "templates").glob(f"{name}-*"), *(cache / "images").glob(f"{name}-*")]:
        shutil.rmtree(d, ignore_errors=True)
    (cache / "templates" / f".{name}.lock").unlink(missing_ok=True)


def _check_the_template(c: Client, h: Any, tpl: Any, ctx: Path) -> None:
    assert tpl.config is not None and tpl.config.env["GREETING"] == "from-image"
    assert tpl.config.env["STAGE"] == "two" and tpl.config.workdir == "/srv/work"
    listed = {t["name"] for t in h.get("/v1/templates").json()["templates"]}
    assert {"e2e-oci", tpl.parent} <= listed
    with new_sandbox(h, "e2e-oci") as sid:
        assert sh(h, sid, "cat /built.txt") == "built in busybox-only\n"
        assert sh(h, sid, "echo $GREETING $STAGE; pwd") == "from-image two\n/srv/work\n"
        # The image has no Python of its own: guestd runs from podbay's runtime.
        assert sh(h, sid, "test -e /usr/bin/python3 || echo no-python; ls /opt/podbay/rt/bin") == \
            "no-python\npython3.11\ntini\n"
        r = h.put(f"/v1/sandboxes/{sid}/files", params={"path": "/srv/work/note.txt"}, content=b"hello oci\n")
        assert r.status_code in (200, 201, 204), r.text
        assert sh(h, sid, "cat /srv/work/note.txt") == "hello oci\n"
    # A second build FROM the same image reuses its template (no boot): same parent, every step cached.
    again = c.build_template("e2e-oci", DOCKERFILE, ctx)
    assert again.parent == tpl.parent and again.digest == tpl.digest
    assert h.delete("/v1/templates/e2e-oci").status_code in (200, 204)
