"""``FROM`` an OCI image: the image becomes a root template of its own, booted once and snapshotted.

Tools: ``skopeo copy`` (a Debian package, no daemon) reads every transport the Dockerfile may name
(``oci:``, ``oci-archive:``, ``docker-archive:``, ``docker://``) and writes one OCI layout, whose manifest
digest is the image's identity; podbay applies its layers itself (build/unpack.py), as hostile input: every
path an image's member names is resolved inside the root being built (``openat2`` with
``RESOLVE_IN_ROOT``), device nodes are refused, and nothing of the image runs on the host. What podbay then
writes into the root (below) goes through the same confinement (build/rootfs.py). ``docker://`` (a
registry pull from the node's own network) is for the operator's tenant only; the API refuses it for others.

The image's files are the guest's root filesystem; podbay adds only what the guest needs to be a sandbox,
all of it under ``/opt/podbay`` (which an image's own files never use), plus ``/sbin/podbay-init``:

- a self-contained runtime for guestd (``/opt/podbay/rt``): Debian's Python 3.11 with its standard library,
  the shared libraries it and its extension modules load, and the dynamic loader, taken from the base
  template's own Debian userland and started through that loader (``ld-linux --library-path``), so it runs
  on images with another libc (musl) or none, and never reads the image's libraries;
- a static busybox (its applets do the init's work) and a static tini (reaps orphans, forwards signals);
- an init (``assets/podbay-init-oci.sh``) that uses only those.

The user ``user`` (uid 1000, as in ``base``) is added when the image lacks it. The image's ``Env``,
``WorkingDir`` and ``User`` become the template's exec defaults, as Docker's ``FROM`` inherits them; its
``Cmd``/``Entrypoint`` are recorded as labels but not started (an image's command is often an interactive
shell, which would exit at once): a Dockerfile that wants a start command says ``CMD``. An image whose
files lack ``/bin/sh`` runs argv commands only.

The template is named ``oci-<12 hex of the manifest digest>`` and cached like ``base`` (in the build cache,
keyed by every input), so a second build FROM the same image reuses it in milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
from pathlib import Path

import zstandard

from pydantic import BaseModel, Field

from podbay.config import Settings
from podbay.contracts.templates import ImageConfig
from podbay.errors import PodbayError, Unprocessable

from ..vm.accel import host_tsc_khz, qemu_version, resolve_accel
from .image import ASSETS_DIR, BaseImage, ProgressFn, build_base_image, debootstrap_tarball, guestd_sources
from .template import TemplateSnapshot, boot_and_snapshot, guest_aslr, locked, snapshot_key
from ..vm.vmm import Vmm
from .rootfs import Root
from .unpack import UnpackPolicy, UnsafeImage, blob_path, unpack_layout

__all__ = ["OciImage", "OciError", "UnsafeImage", "image_ref", "prepare_oci_template", "oci_template_name",
           "unpack_image", "unpack_policy", "RUNTIME_RECIPE"]

#: Changes whenever what goes into ``/opt/podbay`` changes (part of every OCI template's key).
RUNTIME_RECIPE = "oci-runtime-1"
_INIT = ASSETS_DIR / "podbay-init-oci.sh"
_BUSYBOX = Path("/bin/busybox")
_TRANSPORTS = ("oci:", "oci-archive:", "docker-archive:", "docker://")
#: Standard-library parts guestd never loads (tests, GUI, build tooling): 25 MiB of the 54.
_STDLIB_PRUNE = ("test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
                 "distutils", "unittest/test", "config-3.11-x86_64-linux-gnu")
_LIB_RE = re.compile(r"=>\s*(/\S+)\s+\(0x|^\s*(/\S+)\s+\(0x")


class OciError(Unprocessable):
    """The image cannot be read, unpacked or used; ``details.from`` names it."""

    code = "invalid_image"


class OciImage(BaseModel):
    """An image read into an OCI layout: its manifest digest (``sha256:<hex>``) and its config's fields
    (OCI image spec, ``config`` object of the image configuration)."""

    digest: str
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    cmd: list[str] = Field(default_factory=list)
    entrypoint: list[str] = Field(default_factory=list)
    exposed: list[str] = Field(default_factory=list)

    def template_config(self) -> ImageConfig:
        """The exec defaults a template of this image gets (module docstring: no start command)."""
        labels = {}
        if self.entrypoint or self.cmd:
            labels["org.opencontainers.image.command"] = json.dumps(self.entrypoint + self.cmd)
        return ImageConfig(env=self.env, workdir=self.workdir or None, user=self.user or None,
                           expose=self.exposed, labels=labels)


def oci_template_name(digest: str) -> str:
    """The template an image becomes: ``oci-`` and the first 12 hex of its manifest digest."""
    return "oci-" + digest.removeprefix("sha256:")[:12]


def image_ref(ref: str, context: Path) -> str:
    """Skopeo's source reference for ``ref`` as the Dockerfile wrote it, with a local path made absolute
    inside the build context. Raises :class:`OciError` for a path that leaves the context or does not
    exist, or an unknown transport."""
    transport = next((t for t in _TRANSPORTS if ref.startswith(t)), None)
    if transport is None:
        raise OciError(f"FROM {ref}: not an image reference (use oci:, oci-archive:, docker-archive: or docker://)",
                       details={"from": ref})
    if transport == "docker://":
        return ref
    rest = ref[len(transport):]
    path, sep, tag = rest.partition(":")
    if not path:
        raise OciError(f"FROM {ref}: no path", details={"from": ref})
    root = context.resolve()
    local = (context / path).resolve()
    if local != root and root not in local.parents:
        raise OciError(f"FROM {ref}: {path!r} is outside the build context", details={"from": ref})
    if not local.exists():
        raise OciError(f"FROM {ref}: {path!r} is not in the build context", details={"from": ref})
    return f"{transport}{local}{sep}{tag}"


async def _tool(argv: list[str], ref: str, what: str) -> bytes:
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
    except FileNotFoundError as exc:
        raise PodbayError(f"{argv[0]} is not installed on this node (scripts/setup.sh installs it)") from exc
    out, err = await proc.communicate()
    if proc.returncode != 0:
        msg = err.decode(errors="replace").strip()[-2000:]
        raise OciError(f"FROM {ref}: {what} failed: {msg}", details={"from": ref})
    return out


def _blob(layout: Path, digest: str) -> bytes:
    return blob_path(layout, digest).read_bytes()  # ValueError for a digest that is not sha256 hex


def _read_config(layout: Path) -> OciImage:
    index = json.loads((layout / "index.json").read_text())
    desc = index["manifests"][0]
    manifest = json.loads(_blob(layout, desc["digest"]))
    cfg = json.loads(_blob(layout, manifest["config"]["digest"])).get("config") or {}
    env = {}
    for item in cfg.get("Env") or []:
        k, _, v = item.partition("=")
        env[k] = v
    return OciImage(digest=desc["digest"], env=env, workdir=cfg.get("WorkingDir") or None,
                    user=cfg.get("User") or None, cmd=cfg.get("Cmd") or [], entrypoint=cfg.get("Entrypoint") or [],
                    exposed=sorted(cfg.get("ExposedPorts") or {}))


#: Host files skopeo may read inside its sandbox (TLS roots and name resolution for ``docker://``), when present.
_SKOPEO_ETC = ("/etc/ssl", "/etc/ca-certificates", "/etc/pki", "/etc/resolv.conf", "/etc/hosts",
               "/etc/nsswitch.conf", "/etc/containers")


def confined_argv(argv: list[str], reads: list[Path], work: Path, network: bool) -> list[str]:
    """``argv`` (skopeo) run under bubblewrap: the host's ``/usr`` (and its merged-usr links) and a few
    ``/etc`` files read-only, ``reads`` (the build context) read-only, ``work`` the only writable place,
    fresh ``/tmp``, ``/proc`` and ``/dev``, new pid/ipc/uts namespaces, no capabilities, and no network unless
    ``network`` (``docker://``). A hostile archive or a layout whose blobs link out of the context can then
    neither read nor write the host beyond those. Raises ``PodbayError`` when bwrap is missing."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise PodbayError("bwrap is not installed on this node (scripts/setup.sh installs it): images are "
                          "read only inside its sandbox")
    out = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
           "--unshare-cgroup-try", *([] if network else ["--unshare-net"]), "--cap-drop", "ALL",
           "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
        if os.path.islink(top):
            out += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            out += ["--ro-bind", top, top]
    for p in _SKOPEO_ETC:
        out += ["--ro-bind-try", p, p]
    out += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp"]
    for r in reads:
        out += ["--ro-bind", str(r), str(r)]
    out += ["--bind", str(work), str(work), "--chdir", str(work), "--", *argv]
    return out


async def pull(ref: str, context: Path, work: Path) -> tuple[Path, OciImage]:
    """Copy image ``ref`` into an OCI layout under ``work``; returns the layout and the image's config.
    skopeo runs confined (:func:`confined_argv`): it sees the build context read-only and writes only
    ``work``."""
    layout = work / "layout"
    tmp = work / "skopeo-tmp"
    tmp.mkdir(exist_ok=True)
    argv = ["skopeo", "--insecure-policy", "--tmpdir", str(tmp), "copy", "--quiet", image_ref(ref, context),
            f"oci:{layout}:img"]
    await _tool(confined_argv(argv, [context.resolve()], work.resolve(), network=ref.startswith("docker://")),
                ref, "reading the image (skopeo copy)")
    try:
        return layout, await asyncio.to_thread(_read_config, layout)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise OciError(f"FROM {ref}: the image's manifest or config is unreadable: {exc}", details={"from": ref}) from exc


def _inside(root: Path, path: str) -> Path:
    """``path`` (absolute in the guest) resolved inside ``root``, following the image's symlinks as the guest
    would (``/sbin`` -> ``usr/sbin``), never out of ``root``."""
    cur = root
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        nxt = cur / part
        hops = 0
        while nxt.is_symlink() and hops < 40 and i < len(parts) - 1:
            target = os.readlink(nxt)
            nxt = (root / target.lstrip("/")) if target.startswith("/") else (nxt.parent / target)
            nxt = Path(os.path.normpath(nxt))
            if nxt != root and root not in nxt.parents:
                raise OSError(f"{path}: a symlink leaves the image")
            hops += 1
        cur = nxt
    return cur


def _ldd(root: Path, targets: list[str]) -> set[str]:
    """The shared libraries ``targets`` load, as paths inside ``root`` (``ldd`` run in a chroot; blocking)."""
    libs: set[str] = set()
    for t in targets:
        out = subprocess.run(["chroot", str(root), "/usr/bin/ldd", t], capture_output=True, text=True, check=False)
        for line in out.stdout.splitlines():
            m = _LIB_RE.search(line)
            if m:
                libs.add(m.group(1) or m.group(2))
    return libs


def _build_runtime(tarball: Path, dest: Path) -> None:
    """Unpack the Debian userland ``tarball`` and keep Python 3.11, its libraries, tini-static and the loader
    (blocking). Raises ``OSError`` or ``CalledProcessError``; nothing is left behind but a whole runtime."""
    with tempfile.TemporaryDirectory(prefix=".tmp-rt-", dir=dest.parent) as t:
        src = Path(t) / "root"
        src.mkdir()
        subprocess.run(["tar", "--zstd", "--numeric-owner", "-C", str(src), "-xpf", str(tarball)], check=True)
        out = Path(t) / "rt"
        (out / "bin").mkdir(parents=True)
        (out / "lib").mkdir()
        shutil.copy2(src / "usr/bin/python3.11", out / "bin" / "python3.11")
        shutil.copy2(src / "usr/bin/tini-static", out / "bin" / "tini")
        stdlib = src / "usr/lib/python3.11"
        shutil.copytree(stdlib, out / "lib" / "python3.11", symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "site-packages", "dist-packages"))
        for sub in _STDLIB_PRUNE:
            shutil.rmtree(out / "lib" / "python3.11" / sub, ignore_errors=True)
        dynload = sorted(p.relative_to(src) for p in (stdlib / "lib-dynload").glob("*.so"))
        libs = _ldd(src, ["/usr/bin/python3.11", *("/" + str(p) for p in dynload)])
        if not any(Path(lib).name == "libc.so.6" for lib in libs):
            raise OSError(f"ldd in {tarball.name} found no libc for python3.11: the runtime would not start")
        for lib in sorted(libs):
            real = src / Path(lib).relative_to("/")
            shutil.copy2(real.resolve() if real.is_symlink() else real, out / "lib" / Path(lib).name)
        # The loader itself, under the name every command line here uses.
        loader = src / "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
        shutil.copy2(loader.resolve(), out / "lib" / "ld-linux-x86-64.so.2")
        os.replace(out, dest)


async def runtime_dir(settings: Settings) -> Path:
    """The cached runtime (``cache/oci-runtime/<key>``), built from the base template's Debian tarball."""
    tarball = await debootstrap_tarball(settings)
    key = hashlib.sha256(f"{RUNTIME_RECIPE}\0{tarball.name}".encode()).hexdigest()[:16]
    dest = settings.cache_dir / "oci-runtime" / key
    if (dest / "bin" / "python3.11").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    async with locked(dest.parent / f".{key}.lock"):
        if not (dest / "bin" / "python3.11").exists():
            try:
                await asyncio.to_thread(_build_runtime, tarball, dest)
            except (OSError, subprocess.CalledProcessError) as exc:
                raise PodbayError(f"cannot make guestd's runtime for OCI images from {tarball.name}: {exc}") from exc
    return dest


def _add_user(root: Path) -> None:
    """``user`` (uid/gid 1000, home /home/user), as ``base`` has, written into the image's account files.
    Every read and write goes through :class:`~podbay_nodeagent.build.rootfs.Root` (the image's symlinks
    resolve inside it; a symlink at ``/etc/passwd`` is replaced, never written through; an account file that
    is not a regular file, or a link to none, counts as missing and is replaced). Raises ``OSError``."""
    with Root(root) as r:
        r.makedirs("/etc")
        passwd = r.read_bytes("/etc/passwd").decode(errors="replace") if r.is_file("/etc/passwd") else None
        lines = passwd.splitlines() if passwd is not None else ["root:x:0:0:root:/root:/bin/sh"]
        if not any(line.split(":")[0] == "user" for line in lines):
            shell = "/bin/bash" if r.stat("/bin/bash") is not None else "/bin/sh"
            r.write_bytes("/etc/passwd", ("\n".join([*lines, f"user:x:1000:1000::/home/user:{shell}"]) + "\n").encode())
            group = r.read_bytes("/etc/group").decode(errors="replace") if r.is_file("/etc/group") else None
            glines = group.splitlines() if group is not None else ["root:x:0:"]
            if not any(line.split(":")[0] == "user" for line in glines):
                r.write_bytes("/etc/group", ("\n".join([*glines, "user:x:1000:"]) + "\n").encode())
            r.makedirs("/home/user")
            r.chown("/home/user", 1000, 1000)
        if r.is_dir("/etc/sudoers.d"):
            r.write_bytes("/etc/sudoers.d/user", b"user ALL=(ALL:ALL) NOPASSWD:ALL\n", mode=0o440)


#: Guest paths podbay writes into an image (besides /opt/podbay, which it makes anew).
_WRITTEN = ("/sbin/podbay-init", "/etc/passwd", "/etc/group", "/etc/resolv.conf", "/etc/hostname", "/etc/hosts",
            "/etc/sudoers.d/user", "/home/user", "/proc", "/sys", "/dev", "/tmp", "/run", "/etc/ssl/certs")


def _install_podbay(root: Path, rt: Path) -> None:
    """podbay's guest files (module docstring) written into the unpacked image ``root``, every path resolved
    inside it (:class:`~podbay_nodeagent.build.rootfs.Root`). Raises ``OSError``, also for an image whose
    symlinks on those paths point above its root (refused rather than reinterpreted)."""
    for p in _WRITTEN:
        _inside(root, p)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    guestd, frames = guestd_sources()
    with Root(root) as r:
        r.remove("/opt/podbay")  # never the image's: /opt/podbay is ours
        r.makedirs("/opt/podbay/bin")
        r.copy_in(rt, "/opt/podbay/rt")
        r.copy_in(guestd, "/opt/podbay/lib/podbay_guestd", ignore=skip)
        r.makedirs("/opt/podbay/lib/podbay/channel")
        r.write_bytes("/opt/podbay/lib/podbay/__init__.py", b"")
        r.write_bytes("/opt/podbay/lib/podbay/channel/__init__.py", b"")
        r.copy_in(frames, "/opt/podbay/lib/podbay/channel/frames.py")
        r.copy_in(_BUSYBOX, "/opt/podbay/bin/busybox")
        r.makedirs("/sbin")
        r.copy_in(_INIT, "/sbin/podbay-init")
        r.chmod("/sbin/podbay-init", 0o755)
        # guestd writes the sandbox CA into the bundle under /etc/ssl/certs, which busybox-like images lack.
        for d in ("/proc", "/sys", "/dev", "/tmp", "/run", "/etc/ssl/certs"):
            r.makedirs(d)
        # The node writes the guest's resolver config and names the host at every start; the image's are not ours.
        for name, text in (("/etc/resolv.conf", ""), ("/etc/hostname", "podbay\n"),
                           ("/etc/hosts", "127.0.0.1\tlocalhost\n127.0.1.1\tpodbay\n::1\tlocalhost\n")):
            r.write_bytes(name, text.encode())
    _add_user(root)


def _used_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (``lstat``: no symlink followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            st = os.lstat(os.path.join(dirpath, f))
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def unpack_policy(settings: Settings) -> UnpackPolicy:
    """The node's :class:`UnpackPolicy` (``oci_allow_device_nodes``, ``oci_allow_setuid``)."""
    return UnpackPolicy(allow_device_nodes=settings.oci_allow_device_nodes, allow_setuid=settings.oci_allow_setuid)


async def unpack_image(ref: str, layout: Path, work: Path, rt: Path, policy: UnpackPolicy) -> Path:
    """The layers of OCI layout ``layout`` (image ``ref``, from :func:`pull`) unpacked as hostile into
    ``work/rootfs`` (build/unpack.py) and podbay's guest files added (``rt``: guestd's runtime); returns the
    root. Raises :class:`OciError` (422) or :class:`UnsafeImage` (422 ``unsafe_image``)."""
    rootfs = work / "rootfs"
    try:
        await asyncio.to_thread(unpack_layout, layout, rootfs, policy, ref)
    except (OSError, ValueError, KeyError, IndexError, tarfile.TarError, zstandard.ZstdError) as exc:
        raise OciError(f"FROM {ref}: cannot unpack the image: {exc}", details={"from": ref}) from exc
    try:
        await asyncio.to_thread(_install_podbay, rootfs, rt)
    except OSError as exc:
        raise OciError(f"FROM {ref}: cannot add podbay's guest files to the image: {exc}",
                       details={"from": ref}) from exc
    return rootfs


async def _build_image(settings: Settings, ref: str, context: Path, base: BaseImage, rt: Path,
                       progress: ProgressFn) -> tuple[BaseImage, OciImage]:
    root_dir = settings.cache_dir / "images"
    root_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tmp-oci-", dir=root_dir) as t:
        work = Path(t)
        progress("pull", 0.0)
        layout, img = await pull(ref, context, work)
        progress("pull", 1.0)
        name = oci_template_name(img.digest)
        digest = hashlib.sha256(json.dumps([img.digest, RUNTIME_RECIPE, rt.name, base.digest,
                                            _INIT.read_bytes().hex()]).encode()).hexdigest()
        final = root_dir / f"{name}-{digest[:16]}"
        if (final / "image.json").exists():
            return BaseImage.model_validate_json((final / "image.json").read_text()), img
        progress("unpack", 0.0)
        rootfs = await unpack_image(ref, layout, work, rt, unpack_policy(settings))
        progress("unpack", 1.0)
        progress("rootfs", 0.0)
        out = work / "image"
        out.mkdir()
        used = await asyncio.to_thread(_used_bytes, rootfs)
        size_mib = max(1024, (used * 3 // 2 >> 20) + 512)
        with (out / "rootfs.img").open("wb") as fh:
            fh.truncate(size_mib << 20)
        await _tool(["mkfs.ext4", "-q", "-F", "-L", "podbay-root", "-E", "lazy_itable_init=0,lazy_journal_init=0",
                     "-d", str(rootfs), str(out / "rootfs.img")], ref, "making its root filesystem (mkfs.ext4)")
        shutil.copy2(base.kernel, out / "vmlinuz")
        shutil.copy2(base.initrd, out / "initrd.img")
        image = base.model_copy(update={
            "name": name, "digest": digest, "dir": final, "kernel": final / "vmlinuz", "initrd": final / "initrd.img",
            "rootfs": final / "rootfs.img", "disk_size_mib": size_mib})
        (out / "image.json").write_text(image.model_dump_json(indent=2))
        (out / "oci.json").write_text(img.model_dump_json(indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.rename(out, final)
        progress("rootfs", 1.0)
        return image, img


async def prepare_oci_template(ref: str, context: Path, settings: Settings, vmm: Vmm,
                               progress: ProgressFn | None = None) -> tuple[TemplateSnapshot, OciImage]:
    """The root template of image ``ref`` (read relative to the build ``context``), booted once and
    snapshotted into the build cache, or the cached one. Its ``config`` holds the image's exec defaults.
    Seconds to a minute under TCG the first time (unpack, mkfs, one boot), milliseconds after. Raises
    :class:`OciError` (bad reference or image, 422) or ``TemplateError`` (the guest did not come up)."""
    report: ProgressFn = progress or (lambda _s, _f: None)
    base = await build_base_image(settings)
    rt = await runtime_dir(settings)
    image, img = await _build_image(settings, ref, context, base, rt, report)
    name = oci_template_name(img.digest)
    accel = await resolve_accel(settings, image.kernel, image.initrd)
    qver, tsc = qemu_version(settings.qemu_binary), host_tsc_khz()
    aslr = guest_aslr(settings, accel)
    key = snapshot_key(image, qver, accel, settings.sandbox_memory_mib, settings.sandbox_vcpus, tsc, aslr=aslr)
    final = settings.cache_dir / "templates" / f"{name}-{key[:16]}"
    async with locked(settings.cache_dir / "templates" / f".{name}.lock"):
        if (final / "template.json").exists():
            tpl = TemplateSnapshot.load(final)
        else:
            tpl = await boot_and_snapshot(name, settings, image, accel, qver, tsc, key, final, report, vmm,
                                        aslr=aslr)
        if tpl.config is None:
            tpl = tpl.model_copy(update={"config": img.template_config()})
            with contextlib.suppress(OSError):
                (final / "template.json").write_text(tpl.model_dump_json(indent=2))
    return tpl, img
