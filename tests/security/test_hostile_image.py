"""Image vs host: a hostile OCI archive unpacked by the node's build (services/nodeagent/build/oci.py
``pull`` + ``unpack_image``: skopeo, then podbay's own layer unpacker and podbay's guest files) leaves the host
alone.

Each image is built here with tarfile and the OCI layout JSON, packed as an ``oci-archive:`` in a build
context, and goes through exactly what a node runs for ``FROM oci-archive:...`` up to ``mkfs.ext4`` (which
only reads the tree). Before each unpack a sentinel tree (files, directories, modes, owners, mtimes) is made
beside the build folder; the layers aim at it with symlinks, hard links, ``..`` and absolute member names,
whiteouts and symlink chains. Afterwards, whether the image was refused or unpacked, the sentinel and
everything else outside the build folder is byte-identical, and so are the host's account files.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import stat
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from podbay.errors import PodbayError
from podbay_nodeagent.build.oci import OciError, UnsafeImage, pull, unpack_image
from podbay_nodeagent.build.unpack import UnpackPolicy

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the node builds as root; owners and device nodes need it")

#: Host files podbay writes inside an image under the same names; a confined unpack never touches these.
_HOST_FILES = ("/etc/passwd", "/etc/group", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/etc/shadow")
_HOST_DIRS = ("/etc", "/etc/sudoers.d", "/home", "/opt", "/sbin", "/root")

Member = Callable[[tarfile.TarFile], None]


def f(name: str, data: bytes = b"x", mode: int = 0o644) -> Member:
    def add(t: tarfile.TarFile) -> None:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mode, ti.mtime = len(data), mode, 1_600_000_000
        t.addfile(ti, io.BytesIO(data))
    return add


def d(name: str, mode: int = 0o755) -> Member:
    def add(t: tarfile.TarFile) -> None:
        ti = tarfile.TarInfo(name)
        ti.type, ti.mode = tarfile.DIRTYPE, mode
        t.addfile(ti)
    return add


def _link(kind: bytes, name: str, target: str) -> Member:
    def add(t: tarfile.TarFile) -> None:
        ti = tarfile.TarInfo(name)
        ti.type, ti.linkname = kind, target
        t.addfile(ti)
    return add


def sym(name: str, target: str) -> Member:
    return _link(tarfile.SYMTYPE, name, target)


def hard(name: str, target: str) -> Member:
    return _link(tarfile.LNKTYPE, name, target)


def node(name: str, kind: bytes, major: int = 1, minor: int = 3) -> Member:
    def add(t: tarfile.TarFile) -> None:
        ti = tarfile.TarInfo(name)
        ti.type, ti.devmajor, ti.devminor, ti.mode = kind, major, minor, 0o666
        t.addfile(ti)
    return add


def _layer(members: list[Member]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for m in members:
            m(t)
    return buf.getvalue()


def _oci_archive(path: Path, layers: list[bytes], as_dir: bool = False) -> None:
    """An ``oci-archive`` at ``path`` whose image has ``layers`` (uncompressed tars), tag ``t``; with ``as_dir``
    an OCI layout directory (``oci:``) instead."""
    blobs: dict[str, bytes] = {}

    def put(data: bytes) -> dict[str, object]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                         "rootfs": {"type": "layers",
                                    "diff_ids": ["sha256:" + hashlib.sha256(x).hexdigest() for x in layers]}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **put(config)},
                           "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **put(x)}
                                      for x in layers]}).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", **put(manifest),
         "annotations": {"org.opencontainers.image.ref.name": "t"}}]}).encode()
    files = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}', "index.json": index,
             **{f"blobs/sha256/{k.removeprefix('sha256:')}": v for k, v in blobs.items()}}
    if as_dir:
        for name, data in files.items():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_bytes(data)
        return
    with tarfile.open(path, "w") as t:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))


def _sentinel(root: Path) -> None:
    """Files, directories, modes, owners and old mtimes (any change shows)."""
    (root / "sub" / "deep").mkdir(parents=True)
    for rel, data in (("secret", b"host secret\n"), ("victim", b"do not delete\n"), ("passwd", b"root:x:0:0\n"),
                      ("sub/file", b"nested\n"), ("sub/deep/file", b"deeper\n")):
        (root / rel).write_bytes(data)
    (root / "sudoers.d").mkdir()
    (root / "link").symlink_to("secret")
    for p in [root, *root.rglob("*")]:
        os.chown(p, 1234, 2345, follow_symlinks=False)
        if not p.is_symlink():
            os.chmod(p, 0o750 if p.is_dir() else 0o640)
    for p in [*root.rglob("*"), root]:
        os.utime(p, (1_500_000_000, 1_500_000_000), follow_symlinks=False)


def _tree(root: Path, skip: Path | None = None) -> dict[str, tuple[object, ...]]:
    """Every entry under ``root`` (``skip`` and below left out): type, mode, owner, mtime, bytes or target."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirs, files in os.walk(root):
        if skip is not None:
            dirs[:] = [x for x in dirs if Path(dirpath, x) != skip]
        for name in [".", *dirs, *files]:
            p = Path(dirpath, name)
            st = os.lstat(p)
            body: object = None
            if stat.S_ISREG(st.st_mode):
                body = hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                body = os.readlink(p)
            out[str(p.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_size, body)
    return out


def _host() -> dict[str, tuple[object, ...]]:
    out: dict[str, tuple[object, ...]] = {}
    for p in (*_HOST_FILES, *_HOST_DIRS, "/sbin/podbay-init", "/opt/podbay"):
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            out[p] = ("missing",)
            continue
        body = hashlib.sha256(Path(p).read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
        out[p] = (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, body)
    return out


@dataclass
class Case:
    layers: list[list[Member]]
    refused: bool  # the build refuses the image (else it is unpacked, confined)
    inside: dict[str, bytes | None] = field(default_factory=dict)  # for an unpacked image: root paths -> bytes
    policy: UnpackPolicy = field(default_factory=UnpackPolicy)
    absent: list[str] = field(default_factory=list)  # for an unpacked image: root paths a whiteout removed


def _cases(s: str) -> dict[str, Case]:
    """``s``: the sentinel's absolute path. ``m`` (its path without the leading slash) is a directory made
    inside the image too, so links to ``s`` resolve (inside the root) to something."""
    m = s.lstrip("/")
    up = "../" * 12
    mirror = [d(p) for p in _parents(m)] + [f(m + "/secret", b"image's own\n")]
    return {
        "etc_symlink_then_passwd": Case([[sym("etc", "/etc"), f("etc/passwd", b"pwned::0:0::/:/bin/sh\n")]],
                                        refused=True),
        "etc_symlink_to_sentinel_then_files": Case([[sym("etc", s), d("etc/newdir"), f("etc/passwd", b"pwned")]],
                                                   refused=True),
        "symlink_out_then_file_through_it": Case([[sym("out", s), f("out/victim", b"overwritten"),
                                                   f("out/created", b"new")]], refused=True),
        "symlink_out_with_mirror": Case([[*mirror, sym("out", s), f("out/victim", b"overwritten"),
                                          f("out/created", b"new"), d("out/sub")]], refused=False,
                                        inside={m + "/victim": b"overwritten", m + "/created": b"new"}),
        "hard_link_to_host_file": Case([[hard("hl", s + "/secret")]], refused=True),
        "hard_link_relative_up": Case([[hard("hl", up + m + "/secret")]], refused=True),
        "hard_link_with_mirror": Case([[*mirror, hard("hl", s + "/secret"), f("hl", b"write via hardlink")]],
                                      refused=False, inside={"hl": b"write via hardlink"}),
        "hard_link_to_dir": Case([[d("a"), hard("b", "a")]], refused=True),
        "dotdot_members": Case([[f(up + m + "/victim", b"dotdot"), f("x/../../../" + m + "/created", b"dd2")]],
                               refused=False, inside={m + "/victim": b"dotdot", m + "/created": b"dd2"}),
        "absolute_members": Case([[f(s + "/victim", b"abs"), d(s + "/sub/deep/evil")]], refused=False,
                                 inside={m + "/victim": b"abs", m + "/sub/deep/evil": None}),
        "char_device": Case([[d("dev"), node("dev/mem", tarfile.CHRTYPE, 1, 1)]], refused=True),
        "block_device": Case([[node("sda", tarfile.BLKTYPE, 8, 0)]], refused=True),
        "device_aimed_outside": Case([[sym("out", s), node("out/null", tarfile.CHRTYPE, 1, 3)]], refused=True),
        "whiteout_through_symlink": Case([[sym("out", s)], [f("out/.wh.victim", b"")], [f("out/.wh.sub", b"")]],
                                         refused=False),
        "whiteout_dotdot": Case([[f(up + m + "/.wh.victim", b"")], [f(s + "/.wh.sub", b"")]], refused=False),
        "opaque_whiteout_in_linked_dir": Case([[sym("out", s)], [f("out/.wh..wh..opq", b"")]], refused=False),
        "opaque_whiteout_in_linked_mirror": Case([[*mirror, sym("out", s)], [f("out/.wh..wh..opq", b""),
                                                                               f("out/after", b"kept")]],
                                                 refused=False, inside={m + "/after": b"kept"},
                                                 absent=[m + "/secret"]),
        "symlink_chain": Case([[sym("c1", "c2"), sym("c2", "/c3"), sym("c3", up + m), f("c1/victim", b"chain")]],
                              refused=True),
        "symlink_loop": Case([[sym("l1", "l2"), sym("l2", "l1"), f("l1/x", b"loop")]], refused=True),
        "fifo_members": Case([[d("etc"), f("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"),
                               _fifo("etc/group"), _fifo("run/fifo")]], refused=False,
                             inside={"etc/group": b"root:x:0:\nuser:x:1000:\n"}),
        "podbay_paths_through_links": Case([[*mirror, d("etc"), sym("etc/passwd", s + "/passwd"),
                                             sym("etc/hosts", s + "/secret"), sym("etc/resolv.conf", up + m + "/x"),
                                             sym("etc/hostname", "/etc/hostname"), sym("etc/sudoers.d", s),
                                             sym("home", s), sym("opt", s), sym("run", s),
                                             sym("sbin", s)]],
                                           refused=False, inside={m + "/secret": b"image's own\n",
                                                                  m + "/user": None, m + "/podbay/bin/busybox": None,
                                                                  m + "/podbay-init": None}),
        "setuid_refused_by_policy": Case([[f("usr/bin/sudo", b"\x7fELF", 0o4755)]], refused=True,
                                         policy=UnpackPolicy(allow_setuid=False)),
        "magic_link_through_proc": Case([[sym("p", "/proc/self/root" + s), f("p/victim", b"magic")]],
                                        refused=True),
        "size_budget_over_two_layers": Case([[f("a", b"x" * 800)], [f("b", b"y" * 800)]], refused=True,
                                            policy=UnpackPolicy(max_bytes=1000)),
        "member_budget": Case([[d("a"), f("a/1"), f("a/2"), f("a/3"), f("a/4")]], refused=True,
                              policy=UnpackPolicy(max_members=3)),
        "setuid_kept_by_default": Case([[f("usr/bin/sudo", b"\x7fELF", 0o4755)]], refused=False,
                                       inside={"usr/bin/sudo": b"\x7fELF"}),
    }


def _fifo(name: str) -> Member:
    return node(name, tarfile.FIFOTYPE, 0, 0)


def _parents(rel: str) -> list[str]:
    parts = rel.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


_NAMES = sorted(_cases("/s"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", _NAMES)
def test_a_hostile_image_leaves_the_host_unchanged(name: str, tmp_path: Path) -> None:
    sentinel, ctx, work = tmp_path / "sentinel", tmp_path / "ctx", tmp_path / "work"
    sentinel.mkdir()
    _sentinel(sentinel)
    ctx.mkdir()
    work.mkdir()
    rt = tmp_path / "rt"
    (rt / "bin").mkdir(parents=True)
    (rt / "bin" / "python3.11").write_bytes(b"runtime")
    case = _cases(str(sentinel))[name]
    _oci_archive(ctx / "img.tar", [_layer(x) for x in case.layers])
    outside, host = _tree(tmp_path, skip=work), _host()

    async def build() -> Path:
        layout, _img = await pull("oci-archive:img.tar:t", ctx, work)
        return await unpack_image("oci-archive:img.tar:t", layout, work, rt, case.policy)

    try:
        rootfs: Path | None = asyncio.run(build())
        err: PodbayError | None = None
    except (OciError, UnsafeImage) as exc:
        rootfs, err = None, exc

    assert _tree(tmp_path, skip=work) == outside, "something outside the build folder changed"
    assert _host() == host, "a host file podbay writes inside images changed"
    if case.refused:
        assert err is not None, f"{name}: expected the image to be refused"
        if "device" in name or "setuid" in name or "budget" in name:
            assert isinstance(err, UnsafeImage) and err.http_status == 422
        return
    assert err is None and rootfs is not None, f"{name}: expected the image to unpack: {err}"
    for rel, data in case.inside.items():
        p = rootfs / rel
        assert p.is_symlink() or p.exists(), f"{rel} missing inside the root"
        if data is not None:
            assert p.read_bytes() == data
    for rel in case.absent:
        assert not (rootfs / rel).exists()
    if name == "setuid_kept_by_default":
        assert (rootfs / "usr/bin/sudo").stat().st_mode & stat.S_ISUID
    if name == "fifo_members":
        assert stat.S_ISFIFO((rootfs / "run" / "fifo").lstat().st_mode)
    if name == "podbay_paths_through_links":
        # podbay's own files replaced the links, never wrote through them
        assert b"user:x:1000" in (rootfs / "etc" / "passwd").read_bytes()
        assert not (rootfs / "etc" / "passwd").is_symlink()
        assert (rootfs / "etc" / "hosts").read_text().startswith("127.0.0.1")
    # the image's own files are owned as the layer says (root), whatever the sentinel's owner
    assert (rootfs / "etc" / "passwd").stat().st_uid == 0


@pytest.mark.timeout(120)
def test_a_layout_whose_blob_links_out_of_the_context_reads_nothing_of_the_host(tmp_path: Path) -> None:
    """``FROM oci:img:t`` where the layer blob in the context is a symlink to a host file (whose digest the
    tenant knows): skopeo runs confined to the context and the build folder, so the host file is not read."""
    ctx, work = tmp_path / "ctx", tmp_path / "work"
    ctx.mkdir()
    work.mkdir()
    layer = _layer([f("secret.txt", b"host secret\n")])
    host_file = tmp_path / "host-file.tar"
    host_file.write_bytes(layer)
    _oci_archive(ctx / "img", [layer], as_dir=True)
    blob = ctx / "img" / "blobs" / "sha256" / hashlib.sha256(layer).hexdigest()
    blob.unlink()
    blob.symlink_to(host_file)
    rt = tmp_path / "rt"
    (rt / "bin").mkdir(parents=True)

    async def build() -> Path:
        layout, _img = await pull("oci:img:t", ctx, work)
        return await unpack_image("oci:img:t", layout, work, rt, UnpackPolicy())

    with pytest.raises(OciError, match="skopeo"):
        asyncio.run(build())
    assert not list(work.rglob("secret.txt"))
