"""Build layers: one full snapshot (``state``, ``ram``, ``disk.img``) per disk step, keyed by its inputs.

A layer's key is ``sha256(parent key, step text)`` where the parent key is the previous layer's, or the
``FROM`` template's build key for the first step, and the step text (``step_text``) holds everything the
step depends on: its command or sources with their digests, env, working directory and user. Layers live in
the node store (btrfs) at ``store/layers/<key>/`` so that making and using one is a reflink. A layer appears
only whole: it is written to ``.tmp-<key>-<pid>`` and renamed, so a failed or interrupted step leaves no half
layer (a crashed build's temporary directories are removed by :meth:`LayerCache.sweep`).

Layers that took long to make (at least ``share_min_s``, e.g. a RUN that installs a browser) are also kept in
a shared directory outside every node store (``<cache_dir>/layers/<key>/``, the host's build cache, beside
the base template's), so that another store on the same host, such as a fresh test or CI stack, reuses them
instead of building again. The key already names every input, so a shared layer is valid wherever its key
is asked for. The cache directory is usually not on the store's btrfs: sharing and fetching are sparse
copies (seconds for a GiB), paid only for such slow layers.

Both directories are bounded by bytes on disk, least recently used first (:meth:`LayerCache.gc`, after each
build and each share). A layer's size is what its files allocate (``st_blocks * 512``: holes in the sparse
RAM and disk files cost nothing). Reflinked files share extents with their parent layer, the template they
came from and each other, and a file's allocation counts them all, so the sum is an upper bound of what the
layers hold alone: the bound may drop layers a little early, never too late.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from podbay.reflink import reflink_or_copy
from podbay.contracts.templates import BuildStep, ImageConfig, step_text

__all__ = ["LAYER_FILES", "layer_key", "uncached_key", "start_key", "template_digest", "layer_bytes", "LayerCache"]

LAYER_FILES = ("state", "ram", "disk.img")


def layer_key(parent_key: str, step: BuildStep) -> str:
    """The cache key (sha256 hex) of ``step`` on top of ``parent_key``."""
    # layer2: COPY --chown=USER gives the user's primary group (layer1 kept root), so older layers differ
    return hashlib.sha256(f"layer2\n{parent_key}\n{step_text(step)}".encode()).hexdigest()


def uncached_key(key: str, build_id: str) -> str:
    """``key`` made this build's own (``BuildSpec.no_cache_from``): no cached layer has it, so the step runs
    again, and the steps after it chain from it and run again too. The layers stay in the cache like any
    other, under keys no other build asks for (the LRU bound drops them)."""
    return hashlib.sha256(f"nocache1\n{build_id}\n{key}".encode()).hexdigest()


def start_key(last_key: str, config: ImageConfig) -> str:
    """The key of the snapshot taken with the start command running and ready: the last layer (or parent
    build), the command, its env, working directory, user and readiness check."""
    what = json.dumps([config.start_cmd, config.env, config.workdir, config.user, config.ready_cmd,
                       config.ready_port], separators=(",", ":"))
    return hashlib.sha256(f"start1\n{last_key}\n{what}".encode()).hexdigest()


def template_digest(last_key: str, config: ImageConfig) -> str:
    """A built template's digest: its last layer (or parent build) and its config (the defaults of exec)."""
    cfg = json.dumps(config.model_dump(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"template1\n{last_key}\n{cfg}".encode()).hexdigest()


def layer_bytes(layer: Path) -> int:
    """Bytes the files of directory ``layer`` allocate (``st_blocks * 512``; shared extents counted per file,
    module docstring); 0 for files that vanish meanwhile."""
    total = 0
    for f in layer.iterdir():
        try:
            total += f.lstat().st_blocks * 512
        except OSError:
            continue
    return total


def _copy_layer(src: Path, parent: Path, key: str) -> Path:
    """Copy layer ``src`` to ``parent/<key>`` whole (a temporary directory renamed; a concurrent copy wins)."""
    parent.mkdir(parents=True, exist_ok=True)
    dest = parent / key
    tmp = parent / f".tmp-{key[:16]}-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        for f in (*LAYER_FILES, "layer.json"):
            if (src / f).exists():
                reflink_or_copy(src / f, tmp / f)
        os.rename(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dest / "layer.json").exists():
            raise
    return dest


class LayerCache:
    """``root/<key>/{state, ram, disk.img, layer.json}``; blocking file I/O (call from a thread).

    ``shared``: the host-wide directory of slow layers (see the module docstring), None for none;
    ``share_min_s``: how long a step must have taken, seconds, for its layer to be shared;
    ``shared_max_bytes``: bytes of layers kept there (:meth:`gc`'s bound, least recently used go first).
    """

    def __init__(self, root: Path, shared: Path | None = None, share_min_s: float = 30.0,
                 shared_max_bytes: int = 16 << 30) -> None:
        self.root = root
        self.shared = shared
        self.share_min_s = share_min_s
        self.shared_max_bytes = shared_max_bytes

    def path(self, key: str) -> Path:
        """The layer in this store (see :meth:`local` for one that may be in the shared directory only)."""
        return self.root / key

    def _in_shared(self, key: str) -> bool:
        return self.shared is not None and (self.shared / key / "layer.json").exists()

    def has(self, key: str) -> bool:
        return (self.root / key / "layer.json").exists() or self._in_shared(key)

    def local(self, key: str) -> Path:
        """The layer's directory in this store, copied from the shared directory first when only it has it."""
        if not (self.root / key / "layer.json").exists() and self._in_shared(key):
            assert self.shared is not None
            _copy_layer(self.shared / key, self.root, key)
        return self.root / key

    def touch(self, key: str) -> None:
        """Mark ``key`` used now (the LRU order of :meth:`gc`)."""
        for d in (self.root, self.shared):
            if d is not None and (d / key / "layer.json").exists():
                os.utime(d / key / "layer.json")

    def tmp_dir(self, key: str) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{key[:16]}-{os.getpid()}-{time.monotonic_ns()}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, key: str, meta: dict[str, object], took_s: float = 0.0) -> Path:
        """Write ``layer.json`` into ``tmp`` and rename it to the layer (a concurrent identical layer wins);
        a layer whose step took at least ``share_min_s`` seconds is copied to the shared directory too."""
        (tmp / "layer.json").write_text(json.dumps({**meta, "key": key, "created_at": time.time(),
                                                    "took_s": round(took_s, 1)}))
        dest = self.root / key
        try:
            os.rename(tmp, dest)
        except OSError:  # already there (another build made the same layer): keep that one
            shutil.rmtree(tmp, ignore_errors=True)
        if self.shared is not None and took_s >= self.share_min_s and not self._in_shared(key):
            _copy_layer(dest, self.shared, key)
            self._gc_dir(self.shared, self.shared_max_bytes)
        return dest

    def sweep(self) -> int:
        """Remove temporary directories of builds that did not finish (at node agent start); returns how many."""
        n = 0
        for tmp in self.root.glob(".tmp-*") if self.root.exists() else ():
            shutil.rmtree(tmp, ignore_errors=True)
            n += 1
        return n

    def gc(self, max_bytes: int) -> list[str]:
        """Drop the least recently used layers (:meth:`touch`, else when made) until the rest allocate at most
        ``max_bytes`` (:func:`layer_bytes`); returns the keys removed, oldest first. The most recently used
        layer stays even when it alone is over the bound (it was just made or used; dropping it would only
        waste that work). Templates do not depend on layers (their files are reflinks of their own), so any
        other layer can go."""
        return self._gc_dir(self.root, max_bytes)

    @staticmethod
    def _gc_dir(root: Path, max_bytes: int) -> list[str]:
        if not root.exists():
            return []
        layers = sorted((p for p in root.iterdir() if (p / "layer.json").exists()),
                        key=lambda p: (p / "layer.json").stat().st_mtime)
        sizes = [layer_bytes(p) for p in layers]
        total = sum(sizes)
        gone: list[str] = []
        for p, size in zip(layers[:-1], sizes[:-1], strict=True):
            if total <= max_bytes:
                break
            shutil.rmtree(p, ignore_errors=True)
            total -= size
            gone.append(p.name)
        return gone
