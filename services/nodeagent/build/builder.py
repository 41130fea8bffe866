"""Build a template from a parsed Dockerfile (:class:`~podbay.contracts.templates.BuildSpec`) on this node.

Design (why it boots nothing, resources aside): guests here run under TCG, where a cold boot of a Debian guest takes seconds
and a restore about 200 ms (docs/DESIGN.md §3). So a build never boots. Its builder VM is a *restore* of the
``FROM`` template's full snapshot, or of the deepest cached layer, and every layer is itself a full
snapshot (device state + RAM + disk, all reflinks on btrfs), not a disk image alone: a layer taken from the
running builder can be restored and built on without a boot, and the last layer *is* the template's booted
snapshot, restorable by every create path (warm, cold, fork) exactly like ``base``. The builder VM stays up
across steps; each step costs one full snapshot (a pause of tens of ms plus reflinks). A rebuild whose
prefix is unchanged restores the last cached layer (or, when every step is cached, starts no VM at all)
and says ``cached`` for each reused step.

Resources: a build that asks for other memory, vCPUs or a larger disk than its FROM template's (which a
restore cannot change) boots the parent's disk once with them and builds on that snapshot, a layer keyed by
the parent and the resources (build/resources.py); a build that asks for none restores as above.

The builder VM is confined like a sandbox: the same VMM (bubblewrap-confined QEMU), its own lease, tap and
binding on the sandbox network, so its traffic can only reach the gateway. The gateway knows no sandbox row
for a builder, so egress from RUN steps is denied (builds with an egress policy are not done yet).

Steps: RUN through the guest channel's exec (argv or ``/bin/sh -c``, with the step's env, working directory
and user); COPY/ADD through the channel's file writes (directories made, modes kept, ``--chown`` applied
with ``chown -R``, a user alone with its primary group; ADD of a local tar archive unpacks it in the guest with ``tar -x``); WORKDIR as ``mkdir
-p``. ENV, WORKDIR, USER, LABEL, CMD/ENTRYPOINT and EXPOSE become the template's :class:`ImageConfig`,
which the node's data plane applies as the defaults of every exec in its sandboxes.

A failed step ends the build with :class:`StepFailed` (step, exit code, output tail): nothing is
registered and the failed step's layer is never written (layers appear whole by rename; layers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import logging
import os
import shutil
import tarfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from podbay import build_state, template_state
from podbay.buildcontext import MissingSource, sources_digest
from podbay.channel.client import GuestChannel
from podbay.contracts.channel import ExecSpec
from podbay.contracts.templates import (
    BuildEvent,
    BuildSpec,
    BuildStep,
    CopyStep,
    ImageConfig,
    RunStep,
    TemplateDetail,
    TemplateTag,
    WorkdirStep,
)
from podbay.errors import Conflict, InvalidRequest, NotFound, PodbayError
from podbay.promotion import promote_template, template_root
from podbay.template_versions import REFERENCED_DIGESTS_SQL, tag_build

from .template import TemplateSnapshot
from ..vm.vmdriver import TemplateImage, VmHandle
from ..vm.vmm import reflink_or_copy
from .layers import LAYER_FILES, LayerCache, layer_key, start_key, template_digest, uncached_key
from .oci import image_ref, prepare_oci_template
from .resources import Resources, leftover_vm_dirs, resize_key, resized_root, resolve

if TYPE_CHECKING:
    from ..ops.sandboxes import SandboxManager

__all__ = ["BuildRequest", "StepFailed", "TemplateNameTaken", "TemplateBuilder", "STEP_TIMEOUT_S", "OUTPUT_TAIL_BYTES", "Emit"]

log = logging.getLogger("podbay.nodeagent.build")

#: The longest one RUN step may take, seconds.
STEP_TIMEOUT_S = 3600.0
#: Bytes of a failed step's output its error keeps.
OUTPUT_TAIL_BYTES = 4096
#: How long a start command may take to get ready, seconds.
READY_TIMEOUT_S = 300.0  # headless Chromium under TCG opens its DevTools port after ~90 s (the browser template)
#: Built-in templates, which no build may replace.
BUILTIN = ("base",)

Emit = Callable[[BuildEvent], Awaitable[None]]


def inherit(parent: ImageConfig | None, req: BuildRequest, steps: list[BuildStep]) -> tuple[BuildRequest,
                                                                                           list[BuildStep]]:
    """What a build inherits from its ``FROM``, as Docker's does: the parent's ENV under the Dockerfile's (in
    every RUN step and in the result), and its WORKDIR and USER where the Dockerfile sets none. The start
    command is not inherited. A parent without a config (``base``) changes nothing."""
    if parent is None or not (parent.env or parent.workdir or parent.user):
        return req, steps
    cfg = req.spec.config
    merged = cfg.model_copy(update={"env": {**parent.env, **cfg.env}, "workdir": cfg.workdir or parent.workdir,
                                    "user": cfg.user or parent.user})
    out: list[BuildStep] = [s.model_copy(update={"env": {**parent.env, **s.env}}) if isinstance(s, RunStep) else s
                            for s in steps]
    spec = req.spec.model_copy(update={"config": merged, "steps": out})
    return BuildRequest(build_id=req.build_id, name=req.name, spec=spec, context=req.context, tag=req.tag), out


class TemplateNameTaken(Conflict):
    """The build's template key is held by another owner (409 ``template_name_taken``): not expected, since the
    API gives each owner's name its own key (services/api/services/template_access.build_key); kept as the last guard."""

    code = "template_name_taken"


class StepFailed(PodbayError):
    """A step failed: ``details`` has ``step`` (1-based), ``line``, ``exit_code`` (RUN) and ``output_tail``."""

    code = "build_step_failed"
    http_status = 422


@dataclass
class BuildRequest:
    build_id: str
    name: str
    spec: BuildSpec
    context: Path  # the unpacked build context
    tag: str | None = None  # also tag the build so (template_versions.py)


def _describe(step: BuildStep) -> str:
    if isinstance(step, RunStep):
        return "RUN " + (step.shell if step.shell is not None else str(step.argv))
    if isinstance(step, CopyStep):
        chown = f"--chown={step.chown} " if step.chown else ""
        return f"{'ADD' if step.add else 'COPY'} {chown}{' '.join(step.sources)} {step.dest}"
    return f"WORKDIR {step.path}"


def chown_spec(chown: str) -> str:
    """``--chown``'s value as ``chown(1)``'s owner: a user without a group gets the user's primary group, as
    Docker does (``app`` -> ``app:``, which GNU chown reads as the user's login group; a bare numeric uid
    ``1000`` -> ``1000:1000``, as Docker uses the uid as the gid when no passwd entry names it)."""
    if ":" in chown:
        return chown
    return f"{chown}:{chown}" if chown.isdigit() else f"{chown}:"


async def _chunks(path: Path, size: int = 1 << 20) -> AsyncIterator[bytes]:
    with open(path, "rb") as f:
        while chunk := await asyncio.to_thread(f.read, size):
            yield chunk


class _Builder:
    """The builder VM of one build: restored on demand, one step at a time, then killed."""

    def __init__(self, m: SandboxManager, req: BuildRequest, parent: TemplateImage, emit: Emit,
                 memory_mib: int, vcpus: int) -> None:
        self.m = m
        self.req = req
        self.parent = parent
        self.emit = emit
        self.memory_mib = memory_mib  # the snapshot's it restores: the parent's, or the build's resized root's
        self.vcpus = vcpus
        self.vm_id = f"build-{req.build_id}"
        self.vm_dir = m.store.build_dir(req.build_id)
        self.handle: VmHandle | None = None
        self.ch: GuestChannel | None = None

    async def start(self, snapshot_dir: Path) -> None:
        m = self.m
        binding, tap_fd = await asyncio.to_thread(m.net.prepare, self.vm_id, 1)
        try:
            self.handle = await m.driver.restore_from(snapshot_dir, self.parent, self.vm_dir,
                                                      memory_mib=self.memory_mib, vcpus=self.vcpus, tap_fd=tap_fd)
        finally:
            os.close(tap_fd)
        self.ch = await GuestChannel.connect(self.handle.channel_path, timeout_s=m.settings.restore_timeout_s)
        await self.ch.after_restore(hostname=f"build-{self.req.name}"[:63], seed=os.urandom(64),
                                    time_ns=time.time_ns(), net=m.guest_net(binding))

    async def frozen_disk(self, dest: Path) -> None:
        """A reflink of the guest's disk taken with its filesystems frozen (all written back, the journal
        clean), so that it boots as it is (build/resources.py)."""
        assert self.ch is not None and self.handle is not None
        await self.ch.freeze(["/"], timeout_s=60.0)
        try:
            await asyncio.to_thread(reflink_or_copy, self.handle.process.paths.disk, dest)
        finally:
            await self.ch.thaw(["/"])

    async def close(self) -> None:
        if self.ch is not None:
            with contextlib.suppress(Exception):
                await self.ch.close()
        if self.handle is not None:
            with contextlib.suppress(Exception):
                await self.handle.kill()
        await asyncio.to_thread(shutil.rmtree, self.vm_dir, True)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.m.net.release, self.vm_id)

    async def sh(self, index: int, argv: list[str], user: str = "root") -> None:
        """Run a helper command of step ``index`` as root; a failure is the step's."""
        assert self.ch is not None
        out, err, ex = await self.ch.run(ExecSpec(argv=argv, user=user, timeout_s=600))
        if ex.exit_code != 0:
            tail = (out + err)[-OUTPUT_TAIL_BYTES:].decode(errors="replace")
            raise StepFailed(f"step {index}: {' '.join(argv)} exited {ex.exit_code}: {tail.strip()}",
                             details={"step": index, "exit_code": ex.exit_code, "output_tail": tail})

    async def run(self, index: int, step: RunStep) -> None:
        assert self.ch is not None
        spec = ExecSpec(argv=step.argv, shell=step.shell, env=step.env, cwd=step.workdir, user=step.user,
                        timeout_s=STEP_TIMEOUT_S)
        tail = bytearray()
        try:
            async with self.ch.exec(spec) as proc:
                async for _kind, data in proc:
                    tail += data
                    del tail[:-OUTPUT_TAIL_BYTES]
                    await self.emit(BuildEvent(type="log", step=index, text=data.decode(errors="replace")))
                ex = await proc.wait()
        except InvalidRequest as exc:  # the guest refused the exec itself, e.g. USER names no user
            raise StepFailed(f"step {index} (line {step.line}) {_describe(step)!r}: {exc.message}",
                             details={"step": index, "line": step.line}) from exc
        if ex.exit_code != 0 or ex.timed_out:
            text = tail.decode(errors="replace")
            why = "timed out" if ex.timed_out else f"exited {ex.exit_code}"
            raise StepFailed(f"step {index} (line {step.line}) {_describe(step)!r} {why}",
                             details={"step": index, "line": step.line, "exit_code": ex.exit_code,
                                      "output_tail": text})

    async def copy(self, index: int, step: CopyStep) -> None:
        ch = self.ch
        assert ch is not None
        ctx = self.req.context
        into_dir = step.dest.endswith("/") or len(step.sources) > 1
        if not into_dir:
            with contextlib.suppress(PodbayError):
                into_dir = (await ch.stat(step.dest)).type == "directory"
        tops: list[str] = []
        for src in step.sources:
            local = ctx / src
            if step.add and local.is_file() and await asyncio.to_thread(tarfile.is_tarfile, local):
                dest = step.dest.rstrip("/") or "/"
                tmp = f"/tmp/.podbay-add-{index}"
                await ch.write_file(tmp, _chunks(local), 0o600, parents=True)
                await self.sh(index, ["/bin/sh", "-c", 'mkdir -p "$1" && tar -xf "$2" -C "$1"; rc=$?; rm -f "$2";'
                                      ' exit $rc', "sh", dest, tmp])
                tops.append(dest)
                continue
            if local.is_dir() and not local.is_symlink():
                target = step.dest.rstrip("/") or "/"
                await ch.mkdir(target, parents=True, exist_ok=True)
                entries = sorted(local.rglob("*"))
            else:
                target = (step.dest.rstrip("/") + "/" + local.name) if into_dir else step.dest
                entries = [local]
            tops.append(target)
            for p in entries:
                guest = target if p == local else f"{target.rstrip('/')}/{p.relative_to(local).as_posix()}"
                st = p.lstat()
                if p.is_symlink():
                    await self.sh(index, ["ln", "-sfn", os.readlink(p), guest])
                elif p.is_dir():
                    await ch.mkdir(guest, parents=True, exist_ok=True, mode=st.st_mode & 0o7777)
                elif p.is_file():
                    await ch.write_file(guest, _chunks(p), st.st_mode & 0o7777, parents=True)
        if step.chown:
            await self.sh(index, ["chown", "-R", chown_spec(step.chown), *tops])

    async def _ready(self, cfg: ImageConfig) -> bool:
        assert self.ch is not None
        if cfg.ready_cmd is not None:
            spec = ExecSpec(shell=cfg.ready_cmd, env=cfg.env, cwd=cfg.workdir or "/", user=cfg.user or "root",
                            timeout_s=10)
        elif cfg.ready_port is not None:
            probe = f"import socket; socket.create_connection(('127.0.0.1', {cfg.ready_port}), 1).close()"
            spec = ExecSpec(argv=["python3", "-c", probe], timeout_s=10)
        else:
            return True  # no check: running (and not exited within the first poll) is ready
        _out, _err, ex = await self.ch.run(spec)
        return ex.exit_code == 0

    async def start_command(self, index: int, cfg: ImageConfig) -> None:
        """Start ``cfg.start_cmd`` as a kept process (it outlives this stream and is in the snapshot) and
        wait until it is ready; its output goes to the build log. Raises :class:`StepFailed` when it exits
        first or is not ready within :data:`READY_TIMEOUT_S`."""
        assert self.ch is not None and cfg.start_cmd is not None
        spec = ExecSpec(argv=cfg.start_cmd, env=cfg.env, cwd=cfg.workdir or "/", user=cfg.user or "root",
                        keep=True, tag="start")
        tail = bytearray()
        proc = self.ch.exec(spec)

        async def pump() -> None:
            async for _kind, data in proc:
                tail.extend(data)
                del tail[:-OUTPUT_TAIL_BYTES]
                await self.emit(BuildEvent(type="log", step=index, text=data.decode(errors="replace")))

        await proc.started()
        pumping = asyncio.create_task(pump())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        try:
            while True:
                await asyncio.sleep(0.5)
                if pumping.done():
                    code = proc.exit.exit_code if proc.exit is not None else None
                    raise StepFailed(f"the start command {cfg.start_cmd} exited ({code}) before it was ready",
                                     details={"step": index, "exit_code": code,
                                              "output_tail": tail.decode(errors="replace")})
                if await self._ready(cfg):
                    return
                if loop.time() > deadline:
                    raise StepFailed(f"the start command {cfg.start_cmd} was not ready within {READY_TIMEOUT_S:.0f} s",
                                     details={"step": index, "output_tail": tail.decode(errors="replace")})
        finally:
            pumping.cancel()
            with contextlib.suppress(BaseException):
                await pumping
            await proc.__aexit__(None, None, None)  # the stream ends; the kept process runs on

    async def layer(self, key: str, step: BuildStep | str, cache: LayerCache, took_s: float = 0.0) -> None:
        """Take the full snapshot of layer ``key``; ``took_s``: how long its step ran (slow ones are shared)."""
        assert self.handle is not None
        tmp = await asyncio.to_thread(cache.tmp_dir, key)
        try:
            await self.m.driver.snapshot_full(self.handle, tmp, leave_stopped=False)
            what = step if isinstance(step, str) else _describe(step)
            await asyncio.to_thread(cache.commit, tmp, key, {"step": what, "template": self.req.name}, took_s)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
            raise


class TemplateBuilder:
    """Builds templates on one node; one build per name at a time."""

    def __init__(self, manager: SandboxManager) -> None:
        self.m = manager
        st = manager.settings
        self.layers = LayerCache(manager.store.root / "layers", shared=st.cache_dir / "layers",
                                 share_min_s=st.build_layer_share_s,
                                 shared_max_bytes=int(st.build_layer_shared_gib * (1 << 30)))
        self._running: set[str] = set()

    async def recover(self) -> None:
        """At start: kill builder VMs an earlier agent left running, remove them, half-written layers and
        builder leases, and fail this node's builds that were running when the agent stopped (the API has no
        stream to finish them on)."""
        await asyncio.to_thread(self.layers.sweep)
        builds = self.m.store.root / "builds"
        for vm_dir in leftover_vm_dirs(builds):  # builder VMs and resized roots' boots
            with contextlib.suppress(Exception):  # VmGone: its QEMU is not running
                await (await self.m.driver.attach(vm_dir)).kill()
        await asyncio.to_thread(shutil.rmtree, builds, True)
        for vm_id in self.m.net.leased():
            if vm_id.startswith("build-"):
                await asyncio.to_thread(self.m.net.release, vm_id)
        for tdir in sorted(self.m.store.templates_dir.iterdir()) if self.m.store.templates_dir.exists() else ():
            if tdir.name not in self.m.templates or self.m.templates[tdir.name].snapshot.parent is not None:
                await self.reclaim(tdir.name)  # removed templates' builds, and builds left by earlier versions
        await build_state.fail_interrupted_builds(
            self.m.pool, self.m.node_id, {"code": "interrupted", "message": "the node agent restarted during the build"})

    async def reclaim(self, name: str) -> list[str]:
        """Remove builds of template ``name`` from this node's store that nothing references any more: not its
        current build here, not the build of a sandbox that is not deleted, not a warm slot's, not a build
        another template's files were taken FROM (their kernel is a reflink, so that costs nothing), not one a tag
        names (template_versions.py). Returns the digests removed. Built-in templates are left alone (their builds come from the build cache)."""
        if name in BUILTIN:
            return []
        root = self.m.store.templates_dir / name
        if not root.exists():
            return []
        keep = {r["d"] for r in await self.m.pool.fetch(REFERENCED_DIGESTS_SQL, name)}
        cur = self.m.templates.get(name)
        if cur is not None:
            keep.add(cur.digest)
        gone: list[str] = []
        for d in sorted(root.iterdir()):
            if d.name in keep or d.name.startswith("."):
                continue
            await asyncio.to_thread(shutil.rmtree, d, True)
            self.m.forget_template_build(name, d.name)
            gone.append(d.name)
        if gone:
            log.info("template %s: removed %d build(s) nothing uses: %s", name, len(gone),
                     ", ".join(g[:12] for g in gone))
        return gone

    def check_parent(self, spec: BuildSpec) -> None:
        """Refuse a build whose ``FROM`` template this node lacks (``NotFound``), or whose resources it cannot
        have (``Unprocessable``: a disk smaller than the parent's), before its stream starts. An OCI image is
        read during the build (:meth:`parent`), and its template's resources checked then."""
        if spec.base.kind == "template":
            if spec.base.ref not in self.m.templates:
                raise NotFound(f"FROM: unknown template {spec.base.ref!r} on node {self.m.node_id}",
                               details={"from": spec.base.ref})
            resolve(self.m.templates[spec.base.ref].snapshot, spec.resources)

    async def parent(self, req: BuildRequest, emit: Emit) -> TemplateImage:
        """The ``FROM`` template's current build on this node; for an OCI image, the image's root template
        (build/oci.py), made on first use and registered like ``base``. Raises ``NotFound`` (unknown
        template), :class:`~.oci.OciError` (422) or ``TemplateError``."""
        self.check_parent(req.spec)
        if req.spec.base.kind == "template":
            return self.m.templates[req.spec.base.ref]
        ref = req.spec.base.ref
        await emit(BuildEvent(type="log", step=0, text=f"reading image {ref}\n"))
        t = time.monotonic()
        tpl, img = await prepare_oci_template(ref, req.context, self.m.settings, self.m.driver.vmm)
        found = await asyncio.to_thread(self.m.driver.find_template, tpl.name, tpl.key)
        if found is None:
            raise PodbayError(f"FROM {ref}: its template {tpl.name} ({tpl.key[:12]}) was made but not found")
        await self._register(found, None)  # a root template, like base: no parent
        await emit(BuildEvent(type="log", step=0, text=f"image {img.digest[:19]} is template {found.name} "
                              f"({(time.monotonic() - t) * 1000:.0f} ms)\n"))
        return found

    def resolve(self, req: BuildRequest) -> list[BuildStep]:
        """The steps with each COPY's source digest filled in (blocking: hashes files). Raises
        :class:`~podbay.buildcontext.MissingSource`, or :class:`~.oci.OciError` for an image reference that
        leaves the context or names nothing in it."""
        if req.spec.base.kind == "oci":
            image_ref(req.spec.base.ref, req.context)  # a bad reference is refused before the build starts
        out: list[BuildStep] = []
        for step in req.spec.steps:
            if isinstance(step, CopyStep):
                for src in step.sources:
                    if not (req.context / src).exists() and not (req.context / src).is_symlink():
                        raise MissingSource(f"Dockerfile line {step.line}: source {src!r} is not in the build "
                                            "context", details={"line": step.line, "source": src})
                step = step.model_copy(update={"digests": sources_digest(req.context, step.sources)})
            out.append(step)
        return out

    def is_running(self, name: str) -> bool:
        """Whether a build of template ``name`` holds its claim here."""
        return name in self._running

    @contextlib.contextmanager
    def claim(self, name: str):  # type: ignore[no-untyped-def]  # a contextmanager generator; its Iterator type adds nothing here
        """Hold ``name`` for one build; ``Conflict`` when a build of it runs here, or it is built in."""
        if name in BUILTIN:
            raise Conflict(f"template {name!r} is built in and cannot be rebuilt through the API",
                           details={"template": name})
        if name in self._running:
            raise Conflict(f"a build of template {name!r} is already running", details={"template": name})
        self._running.add(name)
        try:
            yield
        finally:
            self._running.discard(name)

    async def build(self, req: BuildRequest, steps: list[BuildStep], emit: Emit) -> TemplateDetail:
        """Run the build (see the module docstring) and register the template; returns it. Raises
        :class:`StepFailed`, or a VMM/channel error; either way nothing is registered."""
        parent = await self.parent(req, emit)
        res = resolve(parent.snapshot, req.spec.resources)
        req, steps = inherit(parent.snapshot.config, req, steps)
        cfg = req.spec.config
        keys: list[str] = []
        # Other resources than the parent's: the steps build on the resized root (build/resources.py).
        root_key = resize_key(parent.digest, res) if res.boot else parent.digest
        prev = root_key
        no_cache = req.spec.no_cache_from
        for i, step in enumerate(steps):
            prev = layer_key(prev, step)
            if no_cache is not None and i >= no_cache:
                prev = uncached_key(prev, req.build_id)  # run again, not taken from the cache
            keys.append(prev)
        last = keys[-1] if keys else root_key
        skey = start_key(last, cfg) if cfg.start_cmd else None
        if skey is not None and no_cache is not None:
            skey = uncached_key(skey, req.build_id)
        total = len(steps) + (1 if skey else 0)
        t_all = time.monotonic()
        await emit(BuildEvent(type="step", step=0, total=total, cached=True,
                              text=f"FROM {parent.name} ({parent.digest[:12]})"))
        if res.boot:
            await emit(BuildEvent(type="log", step=0, text=f"resources: {res.memory_mib} MiB, {res.vcpus} vCPUs, "
                                  f"disk {res.disk_bytes >> 20} MiB (FROM has {parent.snapshot.memory_mib} MiB, "
                                  f"{parent.snapshot.vcpus} vCPUs, disk {parent.snapshot.disk.stat().st_size >> 20}"
                                  " MiB)\n"))
        # The deepest cached layer: keys chain their parents, so it implies every step before it (the shared
        # cache keeps only slow layers, so a cheap step's layer may be missing below a slow one's).
        done = len(steps)
        if skey is None or not await asyncio.to_thread(self.layers.has, skey):
            while done > 0 and not await asyncio.to_thread(self.layers.has, keys[done - 1]):
                done -= 1
        if done:
            await asyncio.to_thread(self.layers.touch, keys[done - 1])
        for i in range(done):
            await emit(BuildEvent(type="step", step=i + 1, total=total, cached=True, text=_describe(steps[i]),
                                  elapsed_ms=0.0))
        start_text = f"START {cfg.start_cmd}" + (f" (ready: {cfg.ready_cmd})" if cfg.ready_cmd else "") + (
            f" (ready: port {cfg.ready_port})" if cfg.ready_port else "")
        start_cached = done == len(steps) and skey is not None and await asyncio.to_thread(self.layers.has, skey)
        if start_cached:
            assert skey is not None
            await asyncio.to_thread(self.layers.touch, skey)
            await emit(BuildEvent(type="step", step=total, total=total, cached=True, text=start_text, elapsed_ms=0.0))
        builder: _Builder | None = None
        try:
            if done < len(steps) or (skey is not None and not start_cached):
                if done:
                    start_dir = await asyncio.to_thread(self.layers.local, keys[done - 1])
                else:
                    start_dir = (await self._resized_root(req, parent, res, root_key, emit)) if res.boot \
                        else parent.snapshot.dir
                builder = _Builder(self.m, req, parent, emit, res.memory_mib, res.vcpus)
                await builder.start(start_dir)
            for i in range(done, len(steps)):
                assert builder is not None
                step = steps[i]
                t = time.monotonic()
                await emit(BuildEvent(type="step", step=i + 1, total=total, cached=False, text=_describe(step)))
                if isinstance(step, RunStep):
                    await builder.run(i + 1, step)
                elif isinstance(step, CopyStep):
                    await builder.copy(i + 1, step)
                elif isinstance(step, WorkdirStep):
                    assert builder.ch is not None
                    await builder.ch.mkdir(step.path, parents=True, exist_ok=True)
                await builder.layer(keys[i], step, self.layers, time.monotonic() - t)
                await emit(BuildEvent(type="log", step=i + 1, text=f"step {i + 1} done in "
                                      f"{(time.monotonic() - t) * 1000:.0f} ms\n"))
            if skey is not None and not start_cached:
                assert builder is not None
                await emit(BuildEvent(type="step", step=total, total=total, cached=False, text=start_text))
                t = time.monotonic()
                await builder.start_command(total, cfg)
                await builder.layer(skey, start_text, self.layers, time.monotonic() - t)
        finally:
            if builder is not None:
                await builder.close()
        last_layer = skey or (keys[-1] if keys else None)
        if last_layer:
            src = await asyncio.to_thread(self.layers.local, last_layer)
        else:
            src = (await self._resized_root(req, parent, res, root_key, emit)) if res.boot else parent.snapshot.dir
        digest = template_digest(skey or last, cfg)
        img = await asyncio.to_thread(self._install, req, parent, src, digest, res)
        detail = await self._register(img, parent.name, tag=req.tag, build_id=req.build_id)
        await self._promote(img, parent, emit)
        await self.reclaim(req.name)
        await asyncio.to_thread(self.layers.gc, int(self.m.settings.build_layer_cache_gib * (1 << 30)))
        log.info("template %s built: %s (%d steps, %d cached) in %.1f s", req.name, digest[:12], total,
                 done, time.monotonic() - t_all)
        return detail

    async def _promote(self, img: TemplateImage, parent: TemplateImage, emit: Emit) -> None:
        """Promote the build to object storage (:func:`podbay.promotion.promote_template`) so that other nodes
        can fetch it (template_fetch.py); chunks of its root (the built-in template at the bottom of its FROM
        chain) are not uploaded. A failure leaves a template usable on this node only: it is logged and said in
        the build's log, and the build still succeeds."""
        try:
            if parent.snapshot.parent is None and parent.name not in BUILTIN:
                # An OCI image's root template: no other node has it, so it is promoted itself, against
                # base (whose chunks every node has), and becomes the build's root through base.
                base = self.m.templates[BUILTIN[0]]
                await promote_template(self.m.pool, self.m.suspend_ops.store, self.m.settings, parent.name,
                                       parent.digest, parent.snapshot.dir, root=base.name, root_digest=base.digest,
                                       root_dir=base.snapshot.dir)
                root = (base.name, base.digest)
            elif parent.snapshot.parent is None:
                root = (parent.name, parent.digest)
            else:
                found = await template_root(self.m.pool, parent.name, parent.digest)
                if found is None:
                    raise PodbayError(f"its FROM template {parent.name!r} ({parent.digest[:12]}) is not promoted")
                root = found
            root_img = await self.m.template(*root)
            res = await promote_template(self.m.pool, self.m.suspend_ops.store, self.m.settings, img.name,
                                         img.digest, img.snapshot.dir, root=root[0], root_digest=root[1],
                                         root_dir=root_img.snapshot.dir)
        except Exception as exc:
            reason = exc.message if isinstance(exc, PodbayError) else f"{type(exc).__name__}: {exc}"
            log.warning("template %s (%s) not promoted: %s", img.name, img.digest[:12], reason)
            await emit(BuildEvent(type="log", step=0, text=f"not promoted to object storage ({reason}): only "
                                  f"this node can run it\n"))
            return
        if not res.already:
            await emit(BuildEvent(type="log", step=0, text=f"promoted to object storage: {res.uploaded_bytes} of "
                                  f"{res.total_bytes} bytes uploaded ({res.chunks_uploaded} of {res.chunks} "
                                  f"chunks)\n"))

    async def _resized_root(self, req: BuildRequest, parent: TemplateImage, res: Resources, key: str,
                            emit: Emit) -> Path:
        """The layer ``key``: the parent's disk booted with ``res`` (:func:`.resources.resized_root`)."""
        snap = parent.snapshot

        async def frozen_copy(dest: Path) -> None:
            vm = _Builder(self.m, req, parent, emit, snap.memory_mib, snap.vcpus)
            try:
                await vm.start(snap.dir)
                await vm.frozen_disk(dest)
            finally:
                await vm.close()

        async def say(text: str) -> None:
            await emit(BuildEvent(type="log", step=0, text=text + "\n"))

        return await resized_root(self.layers, self.m.store.root / "builds", self.m.settings, self.m.driver.vmm,
                                  req.name, snap, res, key, frozen_copy, say)

    def _install(self, req: BuildRequest, parent: TemplateImage, src: Path, digest: str,
                 res: Resources) -> TemplateImage:
        """Reflink the final snapshot and the parent's kernel into ``store/templates/<name>/<digest>``."""
        dest = self.m.store.template_dir(req.name, digest)
        if not (dest / "template.json").exists():
            tmp = dest.with_name(f".tmp-{digest[:16]}-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for f in LAYER_FILES:
                reflink_or_copy(src / f, tmp / f)
            for f in ("vmlinuz", "initrd.img"):
                reflink_or_copy(parent.snapshot.dir / f, tmp / f)
            snap = parent.snapshot.model_copy(update={
                "name": req.name, "key": digest, "dir": dest, "kernel": dest / "vmlinuz",
                "initrd": dest / "initrd.img", "state": dest / "state", "ram": dest / "ram",
                "disk": dest / "disk.img", "created_at": _dt.datetime.now(_dt.UTC).isoformat(),
                "memory_mib": res.memory_mib, "vcpus": res.vcpus,
                "config": req.spec.config, "parent": parent.name, "boot_s": 0.0, "paused_ms": 0.0})
            (tmp / "template.json").write_text(snap.model_dump_json(indent=2))
            os.replace(tmp, dest)
        return TemplateImage(name=req.name, digest=digest, snapshot=TemplateSnapshot.load(dest))

    async def _register(self, img: TemplateImage, parent: str | None, *, tag: str | None = None,
                        build_id: str | None = None) -> TemplateDetail:
        """The template's row (new creates use this build), this node's holding of it, and the agent's map.
        ``parent``: the FROM template's name; None for a root template (an OCI image's, shared like base:
        ``build_id`` None). ``tag``: also tag this build so, in the same transaction. ``build_id``: the
        build's row, whose ``owner_tenant`` and ``alias`` (the API's decisions, services/api/services/template_access.py)
        the template gets (``img.name`` is the template's key; the alias is the name its owner gave, what
        the returned detail shows); a template of that key that another owner holds (not removed) is left
        alone and the build fails with :class:`TemplateNameTaken`."""
        snap = img.snapshot
        size = (snap.dir / "disk.img").stat().st_size
        cfg = snap.config.model_dump(mode="json") if snap.config is not None else None  # the pool encodes jsonb
        async with self.m.pool.acquire() as conn, conn.transaction():
            row = await template_state.register_build(conn, img.name, img.digest, snap.memory_mib, snap.vcpus,
                                                      parent, cfg, size, build_id)
            if row is None:
                raise TemplateNameTaken(f"the template name {img.name!r} was taken while this build ran; "
                                        "build under another name", details={"template": img.name})
            await conn.execute(
                "INSERT INTO node_templates (node_id, template, digest) VALUES ($1,$2,$3)"
                " ON CONFLICT (node_id, template) DO UPDATE SET digest=$3", self.m.node_id, img.name, img.digest)
            if tag is not None:
                await tag_build(conn, img.name, tag, img.digest, snap.memory_mib, snap.vcpus)
        self.m.templates[img.name] = img
        return TemplateDetail(name=row["alias"], digest=img.digest, memory_mib=snap.memory_mib, vcpus=snap.vcpus,
                              created_at=row["updated_at"], parent=row["parent_alias"], config=snap.config,
                              size_bytes=size, tags=[TemplateTag(tag=tag, digest=img.digest,
                                                                 memory_mib=snap.memory_mib, vcpus=snap.vcpus,
                                                                 created_at=row["updated_at"])] if tag else [])
