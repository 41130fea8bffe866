"""Build the base template's artifacts: guest kernel, initramfs and root filesystem image.

Everything lands under ``Settings.cache_dir`` (outside the repository), keyed by a digest of its inputs, and is
built in a temporary directory that is renamed into place only when complete, so a crash never leaves a
half-built artifact that looks finished. Layout::

    CACHE/kernels/<pkg>_<version>/        vmlinuz, lib/modules/<kver>/...   (step "kernel")
    CACHE/debootstrap/<key>.tar.zst       bookworm minbase + packages      (step "debootstrap")
    CACHE/images/base-<digest16>/         vmlinuz, initrd.img, rootfs.img, image.json
    CACHE/logs/image-<time>.log           the build log, kept when a step fails

Steps (docs/DESIGN.md §2 "guest kernel" and "guest root filesystem"):

* ``kernel``: ``apt-get download`` the ``linux-image-*-cloud-amd64`` that ``linux-image-cloud-amd64`` depends
  on, unpack it with ``dpkg-deb -x`` (never installed), run ``depmod -b`` so that ``modules.dep`` exists.
* ``initramfs``: busybox-static, the virtio and ext4 modules with their dependencies from ``modules.dep`` in
  load order, and ``initramfs_init.sh`` as ``/init``; newc cpio, gzip.
* ``debootstrap``: ``debootstrap --variant=minbase`` from the mirror in the system's apt sources, cached as a
  tarball keyed by suite and package list (it takes minutes).
* ``rootfs``: user ``user`` (uid 1000), guestd and ``podbay.channel.frames`` under ``/opt/podbay/lib``,
  ``/sbin/podbay-init``, then ``mkfs.ext4 -d`` into a sparse raw image. The image digest covers guestd's
  sources, so a guestd change rebuilds only this step.

Errors: :class:`ImageBuildError` (names the failed ``step`` and the kept ``log_path``).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from pydantic import BaseModel, Field

from podbay.config import Settings
from podbay.errors import PodbayError

__all__ = [
    "ProgressFn",
    "ImageBuildError",
    "ImageSpec",
    "BaseImage",
    "build_base_image",
    "debootstrap_tarball",
    "guestd_sources",
    "resolve_module_order",
    "parse_modules_dep",
    "apt_mirror",
    "ASSETS_DIR",
    "REPO_ROOT",
]

ProgressFn = Callable[[str, float], None]
"""Progress callback: ``(step name, fraction of that step done in [0, 1])``."""

_HERE = Path(__file__).resolve().parent
ASSETS_DIR = _HERE / "assets"
REPO_ROOT = _HERE.parent.parent.parent
_INIT_SCRIPT = _HERE / "initramfs_init.sh"
_PODBAY_INIT = ASSETS_DIR / "podbay-init.sh"
_BUSYBOX = Path("/bin/busybox")

# Bumped when a step's recipe changes in a way its inputs do not capture (separately, so that a change in
# the image recipe does not redo the minutes-long debootstrap).
_DEBOOTSTRAP_RECIPE = "1"
_IMAGE_RECIPE = "2"


class ImageBuildError(PodbayError):
    """A build step failed. ``step`` names it; ``log_path`` is the kept build log."""

    code = "image_build_failed"

    def __init__(self, step: str, message: str, *, log_path: Path | None = None) -> None:
        super().__init__(
            f"template image step {step!r} failed: {message}" + (f" (log: {log_path})" if log_path else ""),
            details={"step": step, "log_path": str(log_path) if log_path else None},
        )
        self.step = step
        self.log_path = log_path


class ImageSpec(BaseModel):
    """Inputs of the base image besides the repository's sources."""

    suite: str = "bookworm"
    # What users of comparable systems take for granted: sudo, curl, wget, git, a `python` command
    # (python-is-python3), pip and venv, build essentials, and tzdata for the time zone (C.UTF-8 is in libc).
    packages: tuple[str, ...] = (
        "python3", "bash", "coreutils", "procps", "ca-certificates", "tini", "util-linux",
        "sudo", "curl", "wget", "git", "python-is-python3", "python3-pip", "python3-venv", "build-essential",
        "tzdata",
    )
    kernel_meta_package: str = "linux-image-cloud-amd64"
    # Load order matters only for humans: dependencies are resolved from modules.dep anyway.
    modules: tuple[str, ...] = ("virtio_ring", "virtio", "virtio_mmio", "virtio_console", "virtio_blk",
                                "failover", "net_failover", "virtio_net", "ext4")
    # crc32c is a soft dependency of ext4 (modules.softdep), loaded when it exists as a module.
    optional_modules: tuple[str, ...] = ("crc32c_generic",)
    disk_size_mib: int = Field(2048, ge=256, description="Size of the sparse raw root image.")
    hostname: str = "podbay"


class BaseImage(BaseModel):
    """A built base image (``image.json`` in its directory). Paths are absolute."""

    name: str
    digest: str = Field(description="sha256 hex over every input of the image.")
    dir: Path
    kernel: Path
    initrd: Path
    rootfs: Path
    kernel_package: str
    kernel_version: str = Field(description="The kernel release, e.g. 6.1.0-57-cloud-amd64.")
    modules: list[str] = Field(description="Initramfs modules in load order (file names).")
    disk_size_mib: int
    built_at: str


# --------------------------------------------------------------------------------------------- helpers


class _Log:
    """The build log: every command with its output, appended as it runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = path.open("a", encoding="utf-8", errors="replace")

    def write(self, text: str) -> None:
        self._fh.write(text if text.endswith("\n") else text + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


async def _run(
    log: _Log, step: str, argv: Sequence[str | Path], *, cwd: Path | None = None,
    stdout_path: Path | None = None, env: dict[str, str] | None = None, input_bytes: bytes | None = None,
) -> str:
    """Run ``argv``; log it; return stdout (unless redirected); raise :class:`ImageBuildError` on failure."""
    args = [str(a) for a in argv]
    log.write(f"[{step}] $ {' '.join(args)}")
    out_fh = stdout_path.open("wb") if stdout_path else None
    try:
        proc = await asyncio.create_subprocess_exec(
            *args, cwd=cwd, env=env,
            stdin=asyncio.subprocess.PIPE if input_bytes is not None else asyncio.subprocess.DEVNULL,
            stdout=out_fh if out_fh else asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate(input_bytes)
    except OSError as exc:
        raise ImageBuildError(step, f"cannot run {args[0]}: {exc}", log_path=log.path) from exc
    finally:
        if out_fh:
            out_fh.close()
    text = (out or b"").decode(errors="replace")
    if text and not stdout_path:
        log.write(text[-20000:])
    if err:
        log.write(err.decode(errors="replace")[-20000:])
    if proc.returncode != 0:
        tail = (err or b"").decode(errors="replace").strip().splitlines()[-3:]
        raise ImageBuildError(
            step, f"{args[0]} exited with {proc.returncode}: {' | '.join(tail)}", log_path=log.path
        )
    return text


def _sha256(parts: Iterable[bytes | str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _tree_digest(root: Path) -> list[str]:
    """Relative path and content digest of every file under ``root`` (bytecode caches excluded)."""
    out: list[str] = []
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"):
            out.append(f"{p.relative_to(root)}:{hashlib.sha256(p.read_bytes()).hexdigest()}")
    return out


def _promote(tmp: Path, final: Path) -> None:
    """Rename a finished build into place; if another build won the race, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if final.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise


# ------------------------------------------------------------------------------------ apt and modules


def apt_mirror(suite: str, sources_dirs: Sequence[Path] = (Path("/etc/apt"),)) -> str:
    """The first Debian mirror URI that serves ``suite`` in the system's apt sources.

    Reads deb822 ``*.sources`` files and one-line ``*.list`` files under ``<dir>/sources.list(.d)``.
    Raises ``ValueError`` when none serves the suite.
    """
    files: list[Path] = []
    for d in sources_dirs:
        files += [d / "sources.list"] + sorted((d / "sources.list.d").glob("*"))
    for f in files:
        if not f.is_file():
            continue
        text = f.read_text(errors="replace")
        if f.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line:
                        continue
                    k, _, v = line.partition(":")
                    fields[k.strip().lower()] = v.strip()
                if "deb" in fields.get("types", "").split() and suite in fields.get("suites", "").split():
                    if fields.get("enabled", "yes").lower() != "no" and fields.get("uris"):
                        return fields["uris"].split()[0]
        elif f.suffix == ".list" or f.name == "sources.list":
            for line in text.splitlines():
                words = re.sub(r"\[[^\]]*\]", " ", line.split("#", 1)[0]).split()
                if len(words) >= 3 and words[0] == "deb" and words[2] == suite:
                    return words[1]
    raise ValueError(f"no apt source serves suite {suite!r}")


def parse_modules_dep(text: str) -> dict[str, tuple[str, list[str]]]:
    """Parse ``modules.dep``: module name -> (relative path, dependency paths).

    Module names normalise ``-`` to ``_`` as the kernel does; ``.ko``, ``.ko.xz``, ``.ko.zst`` and ``.ko.gz``
    are recognised.
    """
    out: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        if ":" not in line:
            continue
        path, _, deps = line.partition(":")
        out[_module_name(path.strip())] = (path.strip(), deps.split())
    return out


def _module_name(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    base = re.sub(r"\.ko(\.(xz|zst|gz))?$", "", base)
    return base.replace("-", "_")


def resolve_module_order(
    wanted: Sequence[str], modules_dep: str, builtin: str = "", optional: Sequence[str] = ()
) -> list[str]:
    """The module files to ``insmod`` for ``wanted``, dependencies first, each once.

    ``modules_dep`` and ``builtin`` are the texts of ``modules.dep`` and ``modules.builtin``. Built-in modules
    are skipped; ``optional`` names are included only when they exist as modules. Raises ``KeyError`` for a
    wanted module that is neither a module nor built in.
    """
    table = parse_modules_dep(modules_dep)
    by_path = {p: n for n, (p, _) in table.items()}
    builtins = {_module_name(line.strip()) for line in builtin.splitlines() if line.strip()}
    order: list[str] = []
    seen: set[str] = set()

    def visit(name: str, trail: tuple[str, ...]) -> None:
        if name in seen:
            return
        if name in trail:
            raise ValueError(f"module dependency cycle: {' -> '.join(trail + (name,))}")
        path, deps = table[name]
        for dep in deps:
            visit(by_path.get(dep, _module_name(dep)), trail + (name,))
        seen.add(name)
        order.append(path)

    for raw in wanted:
        name = raw.replace("-", "_")
        if name in table:
            visit(name, ())
        elif name not in builtins:
            raise KeyError(f"module {raw!r} is neither a module nor built into the kernel")
    for raw in optional:
        name = raw.replace("-", "_")
        if name in table:
            visit(name, ())
    return order


# ----------------------------------------------------------------------------------------------- steps


def _resolve_kernel_package(meta: str) -> tuple[str, str]:
    """``(package, version)`` of the kernel image that ``meta`` depends on (from the apt cache)."""
    deps = subprocess.run(["apt-cache", "depends", meta], capture_output=True, text=True, check=True).stdout
    m = re.search(r"Depends:\s*(linux-image-\S+)", deps)
    if not m:
        raise ValueError(f"{meta} has no linux-image dependency in the apt cache")
    pkg = m.group(1)
    show = subprocess.run(
        ["apt-cache", "show", "--no-all-versions", pkg], capture_output=True, text=True, check=True
    ).stdout
    v = re.search(r"^Version:\s*(\S+)", show, re.M)
    if not v:
        raise ValueError(f"no version of {pkg} in the apt cache")
    return pkg, v.group(1)


async def _kernel_step(cache: Path, spec: ImageSpec, log: _Log, progress: ProgressFn) -> tuple[Path, str, str]:
    """Download and unpack the kernel; returns (dir, package, kernel release)."""
    step = "kernel"
    progress(step, 0.0)
    try:
        pkg, version = await asyncio.to_thread(_resolve_kernel_package, spec.kernel_meta_package)
    except (subprocess.CalledProcessError, ValueError) as exc:
        raise ImageBuildError(step, f"cannot resolve the kernel package: {exc}", log_path=log.path) from exc
    final = cache / "kernels" / f"{pkg}_{version}"
    release = pkg.removeprefix("linux-image-")
    if (final / "vmlinuz").exists():
        progress(step, 1.0)
        return final, pkg, release
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-kernel-", dir=final.parent))
    try:
        dl = tmp / "dl"
        dl.mkdir()
        os.chmod(tmp, 0o755)
        os.chmod(dl, 0o777)  # apt drops to the _apt user for downloads
        await _run(log, step, ["apt-get", "download", f"{pkg}={version}"], cwd=dl)
        progress(step, 0.5)
        debs = list(dl.glob("*.deb"))
        if len(debs) != 1:
            raise ImageBuildError(step, f"expected one .deb, found {debs}", log_path=log.path)
        root = tmp / "root"
        await _run(log, step, ["dpkg-deb", "-x", debs[0], root])
        vmlinuz = root / "boot" / f"vmlinuz-{release}"
        if not vmlinuz.exists():
            raise ImageBuildError(step, f"{vmlinuz.name} missing from {debs[0].name}", log_path=log.path)
        await _run(log, step, ["depmod", "-b", root, release])
        shutil.move(vmlinuz, tmp / "vmlinuz")
        shutil.move(root / "lib", tmp / "lib")
        shutil.rmtree(root)
        shutil.rmtree(dl)
        _promote(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(step, 1.0)
    return final, pkg, release


async def _initramfs_step(
    kdir: Path, release: str, spec: ImageSpec, out: Path, log: _Log, progress: ProgressFn
) -> list[str]:
    step = "initramfs"
    progress(step, 0.0)
    mroot = kdir / "lib" / "modules" / release
    try:
        order = resolve_module_order(
            spec.modules,
            (mroot / "modules.dep").read_text(),
            (mroot / "modules.builtin").read_text() if (mroot / "modules.builtin").exists() else "",
            spec.optional_modules,
        )
    except (OSError, KeyError, ValueError) as exc:
        raise ImageBuildError(step, f"module resolution: {exc}", log_path=log.path) from exc
    log.write(f"[{step}] modules in load order: {order}")
    with tempfile.TemporaryDirectory(prefix=".tmp-initramfs-", dir=out.parent) as t:
        root = Path(t)
        for d in ("bin", "dev", "proc", "sys", "newroot", "lib/modules", "etc"):
            (root / d).mkdir(parents=True, exist_ok=True)
        shutil.copy2(_BUSYBOX, root / "bin" / "busybox")
        names: list[str] = []
        for rel in order:
            src = mroot / rel
            name = _module_name(rel) + ".ko"
            if src.suffix == ".ko":
                shutil.copy2(src, root / "lib" / "modules" / name)
            else:  # busybox insmod cannot read compressed modules
                tool = {".xz": "xz", ".zst": "zstd", ".gz": "gzip"}[src.suffix]
                await _run(log, step, [tool, "-dc", src], stdout_path=root / "lib" / "modules" / name)
            names.append(name)
        (root / "etc" / "modules").write_text("\n".join(names) + "\n")
        shutil.copy2(_INIT_SCRIPT, root / "init")
        os.chmod(root / "init", 0o755)
        progress(step, 0.5)
        listing = "\n".join(sorted(str(p.relative_to(root)) for p in root.rglob("*"))) + "\n"
        cpio_path = Path(t + ".cpio")
        try:
            await _run(log, step, ["cpio", "-o", "-H", "newc", "-R", "0:0", "--quiet"], cwd=root,
                       stdout_path=cpio_path, input_bytes=(".\n" + listing).encode())
            await _run(log, step, ["gzip", "-9", "-n", "-c", cpio_path], stdout_path=out)
        finally:
            cpio_path.unlink(missing_ok=True)
    progress(step, 1.0)
    return names


def _debootstrap_key(spec: ImageSpec) -> str:
    return _sha256(["debootstrap", _DEBOOTSTRAP_RECIPE, spec.suite, "minbase", *sorted(spec.packages)])[:20]


async def _debootstrap_step(cache: Path, spec: ImageSpec, log: _Log, progress: ProgressFn) -> Path:
    """The cached debootstrap tarball (built when missing)."""
    step = "debootstrap"
    progress(step, 0.0)
    final = cache / "debootstrap" / f"{spec.suite}-minbase-{_debootstrap_key(spec)}.tar.zst"
    if final.exists():
        progress(step, 1.0)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        mirror = apt_mirror(spec.suite)
    except ValueError as exc:
        raise ImageBuildError(step, str(exc), log_path=log.path) from exc
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-debootstrap-", dir=final.parent))
    try:
        target = tmp / "root"
        await _run(log, step, [
            "debootstrap", "--variant=minbase", f"--include={','.join(spec.packages)}",
            spec.suite, target, mirror,
        ])
        progress(step, 0.8)
        # Drop downloaded .debs and apt lists: the guest never runs apt against them.
        shutil.rmtree(target / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        (target / "var" / "cache" / "apt" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
        part = tmp / "rootfs.tar.zst"
        await _run(log, step, ["tar", "--zstd", "--numeric-owner", "--xattrs", "-C", target, "-cf", part, "."])
        os.rename(part, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(step, 1.0)
    return final


def guestd_sources() -> tuple[Path, Path]:
    """guestd's package folder and ``podbay/channel/frames.py``, as installed (editable or not)."""
    guestd = REPO_ROOT / "guestd"
    spec = importlib.util.find_spec("podbay_guestd")
    if spec is not None and spec.submodule_search_locations:
        guestd = Path(list(spec.submodule_search_locations)[0])
    frames = REPO_ROOT / "libs" / "podbay" / "channel" / "frames.py"
    fspec = importlib.util.find_spec("podbay.channel.frames")
    if fspec is not None and fspec.origin:
        frames = Path(fspec.origin)
    return guestd, frames


async def _rootfs_step(
    tarball: Path, spec: ImageSpec, out: Path, log: _Log, progress: ProgressFn
) -> None:
    step = "rootfs"
    progress(step, 0.0)
    guestd, frames = guestd_sources()
    if not (guestd / "__main__.py").exists() or not frames.exists():
        raise ImageBuildError(
            step, f"guestd sources missing ({guestd}/__main__.py or {frames})", log_path=log.path
        )
    with tempfile.TemporaryDirectory(prefix=".tmp-rootfs-", dir=out.parent) as t:
        root = Path(t) / "root"
        root.mkdir()
        await _run(log, step, ["tar", "--zstd", "--numeric-owner", "--xattrs", "-C", root, "-xpf", tarball])
        progress(step, 0.3)
        if not (root / "home" / "user").exists():
            await _run(log, step, [
                "chroot", root, "/usr/sbin/useradd", "-m", "-u", "1000", "-U", "-d", "/home/user",
                "-s", "/bin/bash", "user",
            ])
        # `user` may use sudo without a password (an agent installs what it needs, as elsewhere).
        sudoers = root / "etc" / "sudoers.d" / "user"
        sudoers.write_text("user ALL=(ALL:ALL) NOPASSWD:ALL\n")
        os.chmod(sudoers, 0o440)
        # Locale C.UTF-8 (built into libc: no locales package) and time zone UTC.
        (root / "etc" / "default" / "locale").write_text("LANG=C.UTF-8\n")
        (root / "etc" / "timezone").write_text("Etc/UTC\n")
        (root / "etc" / "localtime").unlink(missing_ok=True)
        (root / "etc" / "localtime").symlink_to("/usr/share/zoneinfo/Etc/UTC")
        lib = root / "opt" / "podbay" / "lib"
        shutil.copytree(guestd, lib / "podbay_guestd",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (lib / "podbay" / "channel").mkdir(parents=True)
        (lib / "podbay" / "__init__.py").write_text("")
        (lib / "podbay" / "channel" / "__init__.py").write_text("")
        shutil.copy2(frames, lib / "podbay" / "channel" / "frames.py")
        (root / "opt" / "podbay" / "bin").mkdir(parents=True)
        shutil.copy2(_BUSYBOX, root / "opt" / "podbay" / "bin" / "busybox")
        shutil.copy2(_PODBAY_INIT, root / "sbin" / "podbay-init")
        os.chmod(root / "sbin" / "podbay-init", 0o755)
        # debootstrap copied the build host's resolver config; the guest's comes from the node at run time.
        (root / "etc" / "resolv.conf").unlink(missing_ok=True)
        (root / "etc" / "resolv.conf").write_text("")
        (root / "etc" / "hostname").write_text(spec.hostname + "\n")
        (root / "etc" / "hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{spec.hostname}\n::1\tlocalhost\n")
        # Bytecode in the image saves the guest compiling guestd at every first start.
        await _run(log, step, ["chroot", root, "python3", "-m", "compileall", "-q", "/opt/podbay/lib"])
        progress(step, 0.5)
        part = out.with_name(out.name + ".part")
        with part.open("wb") as fh:
            fh.truncate(spec.disk_size_mib * 1024 * 1024)
        await _run(log, step, [
            "mkfs.ext4", "-q", "-F", "-L", "podbay-root", "-E", "lazy_itable_init=0,lazy_journal_init=0",
            "-d", root, part,
        ])
        os.rename(part, out)
    progress(step, 1.0)


def _image_digest(spec: ImageSpec, kernel_pkg: str, kernel_dir: Path) -> str:
    guestd, frames = guestd_sources()
    parts: list[str | bytes] = [
        "image", _IMAGE_RECIPE, spec.model_dump_json(), kernel_pkg, kernel_dir.name, _debootstrap_key(spec),
        _INIT_SCRIPT.read_bytes(), _PODBAY_INIT.read_bytes(),
        hashlib.sha256(_BUSYBOX.read_bytes()).hexdigest(),
        *_tree_digest(guestd), frames.read_bytes() if frames.exists() else b"",
    ]
    return _sha256(parts)


# ----------------------------------------------------------------------------------------------- entry


async def debootstrap_tarball(settings: Settings, spec: ImageSpec | None = None) -> Path:
    """The base image's Debian userland as a cached ``.tar.zst`` (built by debootstrap when missing, minutes;
    otherwise milliseconds). Templates built FROM an OCI image take guestd's runtime from it (build/oci.py).
    Raises :class:`ImageBuildError`."""
    cache = settings.cache_dir
    log = _Log(cache / "logs" / f"debootstrap-{os.getpid()}.log")
    try:
        return await _debootstrap_step(cache, spec or ImageSpec(), log, lambda _s, _f: None)
    finally:
        log.close()


async def build_base_image(
    settings: Settings,
    progress: ProgressFn | None = None,
    *,
    force: bool = False,
    spec: ImageSpec | None = None,
    name: str = "base",
) -> BaseImage:
    """Build (or reuse from the cache) the base image and return it.

    ``force`` rebuilds the final image (kernel download and debootstrap tarball stay cached). Takes minutes on
    a cold cache (debootstrap), about 20 s when only guestd changed, milliseconds when cached. Must run as root
    (debootstrap, chroot). Raises :class:`ImageBuildError`.
    """
    spec = spec or ImageSpec()
    report: ProgressFn = progress or (lambda _s, _f: None)
    cache = settings.cache_dir
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S")
    log = _Log(cache / "logs" / f"image-{name}-{stamp}-{os.getpid()}.log")
    ok = False
    try:
        kdir, pkg, release = await _kernel_step(cache, spec, log, report)
        digest = _image_digest(spec, pkg, kdir)
        final = cache / "images" / f"{name}-{digest[:16]}"
        meta = final / "image.json"
        if meta.exists() and not force:
            for s in ("initramfs", "debootstrap", "rootfs"):
                report(s, 1.0)
            ok = True
            return BaseImage.model_validate_json(meta.read_text())
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=final.parent))
        try:
            shutil.copy2(kdir / "vmlinuz", tmp / "vmlinuz")
            modules = await _initramfs_step(kdir, release, spec, tmp / "initrd.img", log, report)
            tarball = await _debootstrap_step(cache, spec, log, report)
            await _rootfs_step(tarball, spec, tmp / "rootfs.img", log, report)
            image = BaseImage(
                name=name, digest=digest, dir=final, kernel=final / "vmlinuz", initrd=final / "initrd.img",
                rootfs=final / "rootfs.img", kernel_package=pkg, kernel_version=release, modules=modules,
                disk_size_mib=spec.disk_size_mib, built_at=_dt.datetime.now(_dt.UTC).isoformat(),
            )
            (tmp / "image.json").write_text(image.model_dump_json(indent=2))
            if force and final.exists():
                shutil.rmtree(final)
            _promote(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        ok = True
        return image
    except ImageBuildError:
        raise
    except OSError as exc:
        raise ImageBuildError("build", str(exc), log_path=log.path) from exc
    finally:
        log.close()
        if ok:
            # Keep the last successful log for reference, without piling one up per call.
            os.replace(log.path, log.path.with_name(f"image-{name}-last.log"))
