"""The blocking SDK: ``Client`` (one pooled HTTP connection set, every endpoint) and ``Sandbox``.

    from podbay import Sandbox
    with Sandbox.create(template="base") as sb:      # deleted when the block ends
        sb.files.write("/tmp/x.py", "print(6*7)")
        print(sb.exec(["python3", "/tmp/x.py"]).stdout)   # "42\\n"

GENERATED from ``_async.py`` by scripts/gen_sync_sdk.py: do not edit; change ``_async.py`` and run
``.venv/bin/python scripts/gen_sync_sdk.py`` (a unit test fails on drift). Method documentation is there too.

Requests are built and parsed in ``podbay.sdk._calls``; errors are mapped in ``podbay.sdk._http``
(``podbay.errors`` classes with the server's code, message and details; network failures become
``Unavailable``/``Timeout`` naming the URL).
"""

from __future__ import annotations

import time
import builtins
import inspect
import io
import itertools
from time import monotonic
from collections.abc import Iterator, Callable, Mapping, Sequence
from pathlib import Path
from contextlib import contextmanager
from datetime import datetime
from types import TracebackType
from typing import IO, Any, TypeVar, Unpack

import httpx

from podbay.contracts.api import (
    DrainStarted,
    NodeUndrained,
    ExecEvent,
    ExecResult,
    FileInfo,
    ForkResult,
    OperationInfo,
    PoolInfo,
    NodeInfo,
    SandboxInfo,
    SnapshotDiff,
    SnapshotInfo,
)
from podbay.errors import NotFound, PodbayError, Timeout, Unavailable
from podbay.contracts.events import EventOut
from podbay.sdk import _events as sdk_events
from podbay.contracts.access import AuditPage, NetworkInfo
from podbay.sdk import _access as access
from podbay.sdk import _computer as computer_calls
from podbay.sdk import _ports as ports_calls
from podbay.sdk import _code as code_calls
from podbay.sdk._code import CodeExecution, OutputHandler
from podbay.contracts.api import PortAccess, PortList, PortUrl
from podbay.contracts.computer import CdpEndpoint, ComputerResult, FillResult
from podbay.sdk import _sync_namespaces as ns
from podbay.sdk import _calls as calls
from podbay.sdk import _templates as _tpl
from podbay.contracts.templates import BuildEvent, BuildInfo, TemplateDetail
from podbay.sdk._access import NetworkArg
from podbay.sdk._calls import Call, Command, ExecOptions
from podbay.sdk._files import FileData, sync_body
from podbay.sdk._http import (
    DEFAULT_TIMEOUT_S,
    EventReader,
    client_options,
    error_for_response,
    network_errors,
    request_options,
    retry_delay,
)

__all__ = ["Client", "Sandbox", "Files"]

T = TypeVar("T")


class Client:
    """A connection to the podbay API; every endpoint as a method. Close it (or use ``with``) when done: in the
    asyncio SDK ``await client.aclose()`` or ``async with``.

    ``api_url``/``api_key`` default to ``PODBAY_API_URL``/``PODBAY_API_KEY``, then the config file that
    ``podbay up`` writes (``podbay.clientconfig``). ``timeout_s`` bounds connecting and waiting for each
    answer (exec waits as long as the command's own timeout). ``transport`` swaps httpx's transport
    (tests use ``httpx.MockTransport``; an async one for the asyncio SDK). One ``httpx.Client`` (or
    ``httpx.AsyncClient``) per object: connections are pooled.
    """

    def __init__(
        self,
        api_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        auto_resume: bool = False,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        opts = client_options(api_url, api_key, timeout_s)
        self.api_url: str = opts["base_url"]
        self._timeout_s = timeout_s
        #: Exec and file calls resume a suspended or paused sandbox first (``?auto_resume=true``).
        self.auto_resume = auto_resume
        self._http = httpx.Client(transport=transport, **opts)
        #: ``credentials.create/list/get/delete`` (values are write-only) and ``keys.create/list/revoke``.
        self.credentials = ns.Credentials(self._call)
        self.keys = ns.Keys(self._call)
        #: ``webhooks.create/list/delete`` (the secret is returned once, at create).
        self.webhooks = ns.Webhooks(self._call)
        #: ``schedules.add/list/get/runs/remove``: wake a sandbox on a cron expression or at a time.
        self.schedules = ns.Schedules(self._call)
        #: ``volumes.create/list/get/snapshots/restore/delete``: named ext4 volumes, mounted at create (``volumes=[...]``).
        self.volumes = ns.Volumes(self._call)

    def close(self) -> None:
        """Close the pooled connections."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, call: Call[T]) -> T:
        if self.auto_resume:
            call = calls.with_auto_resume(call)
        for attempt in itertools.count():
            try:
                with network_errors(self.api_url):
                    resp = self._http.request(
                        call.method, call.path, **request_options(call, self._timeout_s))
                break
            except Unavailable as exc:
                delay = retry_delay(call, attempt, exc)
                if delay is None:
                    raise
                time.sleep(delay)
        if resp.is_error:
            raise error_for_response(resp)
        return call.parse(resp)

    @contextmanager
    def _stream(self, call: Call[Any]) -> Iterator[httpx.Response]:
        if self.auto_resume:
            call = calls.with_auto_resume(call)
        opts = request_options(call, self._timeout_s)
        with network_errors(self.api_url):
            with self._http.stream(call.method, call.path, **opts) as resp:
                if resp.is_error:
                    resp.read()
                    raise error_for_response(resp)
                yield resp

    # sandboxes

    def create_sandbox(
        self,
        template: str = "base",
        *,
        memory_mib: int | None = None,
        vcpus: int | None = None,
        disk_mib: int | None = None,
        metadata: Mapping[str, str] | None = None,
        wait: bool = True,
        network: NetworkArg | None = None,
        volumes: Sequence[Any] | None = None,
    ) -> SandboxInfo:
        """Create a sandbox; with ``wait`` the answer comes when it runs (or failed), else at once with
        ``operation_id``. Raises ``InvalidRequest``/``Unprocessable`` (bad values), ``NotFound`` (template)."""
        return self._call(
            calls.create_sandbox(template, memory_mib=memory_mib, vcpus=vcpus, disk_mib=disk_mib, metadata=metadata,
                                 wait=wait, network=network, volumes=volumes)
        )

    def get_sandbox(self, sandbox_id: str) -> SandboxInfo:
        """The sandbox's current ``SandboxInfo``; ``NotFound`` if it is not this tenant's."""
        return self._call(calls.get_sandbox(sandbox_id))

    def list_sandboxes(self) -> builtins.list[SandboxInfo]:
        """The tenant's sandboxes."""
        return self._call(calls.list_sandboxes())

    def delete_sandbox(self, sandbox_id: str, *, wait: bool = True) -> SandboxInfo:
        """Delete a sandbox; with ``wait`` the answer comes when it is gone, else with ``operation_id``."""
        return self._call(calls.delete_sandbox(sandbox_id, wait=wait))


    # credentials, keys, audit, egress policy (podbay.sdk._access)

    def audit(
        self, *, action: str | None = None, sandbox_id: str | None = None, since: datetime | None = None,
        before: int | None = None, limit: int = 100,
    ) -> AuditPage:
        """The tenant's audit log, newest first (``action`` may end in ``*``); page with
        ``before=page.next_before``."""
        return self._call(
            access.audit_call(action=action, sandbox_id=sandbox_id, since=since, before=before, limit=limit))

    def get_network(self, sandbox_id: str) -> NetworkInfo:
        """The sandbox's effective egress policy and its source (sandbox, template or default)."""
        return self._call(access.get_network_call(sandbox_id))

    def set_network(self, sandbox_id: str, policy: NetworkArg) -> NetworkInfo:
        """Replace the sandbox's egress policy; the gateway applies it from the next connection."""
        return self._call(access.set_network_call(sandbox_id, policy))

    # guest ports (podbay.sdk._ports)

    # computer use (podbay.sdk._computer; a sandbox of a template with a browser, e.g. ``browser``)

    def screenshot(self, sandbox_id: str) -> bytes:
        """PNG bytes of the browser page's viewport, or of the whole X screen for a template with a display
        (``desktop``); password fields masked after a credential fill. ``NoBrowser`` (409) when its template runs
        no browser."""
        return self._call(computer_calls.screenshot_call(sandbox_id))

    def mouse(self, sandbox_id: str, action: str, x: float, y: float, **kw: Any) -> ComputerResult:
        """``action`` ``move``, ``click`` (``button``, ``clicks``), ``drag`` (``to_x``, ``to_y``) or ``scroll``
        (``delta_x``, ``delta_y``) at CSS pixel ``(x, y)`` of the page."""
        return self._call(computer_calls.mouse_call(sandbox_id, action, x, y, **kw))

    def keyboard(
        self, sandbox_id: str, *, text: str | None = None, keys: list[str] | None = None,
    ) -> ComputerResult:
        """Type ``text`` at the focus, or press ``keys`` (``["Enter"]``, ``["Control+a", "Backspace"]``)."""
        return self._call(computer_calls.keyboard_call(sandbox_id, text=text, keys=keys))

    def fill(self, sandbox_id: str, credential: str, selector: str) -> FillResult:
        """Type stored credential ``credential`` into the element ``selector`` matches, if the page's origin is
        one of its hosts (checked on the node, outside the guest); the answer never holds the value."""
        return self._call(computer_calls.fill_call(sandbox_id, credential, selector))

    def cdp(self, sandbox_id: str) -> CdpEndpoint:
        """The browser's CDP WebSocket: ``url`` (with the token) is what
        ``playwright.chromium.connect_over_cdp(url)`` takes."""
        return self._call(computer_calls.cdp_call(sandbox_id))

    def list_ports(self, sandbox_id: str) -> PortList:
        """The guest's listening TCP ports (and ports with a setting), each with ``public`` and ``reachable``."""
        return self._call(ports_calls.list_ports_call(sandbox_id))

    def port_url(self, sandbox_id: str, port: int) -> PortUrl:
        """Where guest ``port`` answers through the API's edge (``url``, ``path_url``) and the traffic
        ``token`` that opens it (header ``X-Podbay-Access-Token``)."""
        return self._call(ports_calls.port_url_call(sandbox_id, port))

    def set_port_public(self, sandbox_id: str, port: int, public: bool) -> PortAccess:
        """Open ``port`` to anyone with its URL (still rate-limited and logged), or make it private again."""
        return self._call(ports_calls.set_port_public_call(sandbox_id, port, public))

    def get_template_network(self, template: str) -> NetworkInfo:
        """The template's default egress policy."""
        return self._call(access.get_template_network_call(template))

    def set_template_network(self, template: str, policy: NetworkArg) -> NetworkInfo:
        """Replace the template's default egress policy."""
        return self._call(access.set_template_network_call(template, policy))

    def set_timeout(self, sandbox_id: str, lease_s: int, on_lease_expiry: str | None = None) -> SandboxInfo:
        """Renew the lease for ``lease_s`` seconds (10..30 days); ``on_lease_expiry``: ``pause`` or ``delete``."""
        return self._call(calls.timeout_call(sandbox_id, lease_s, on_lease_expiry))

    def snapshot_sandbox(self, sandbox_id: str, kind: str = "full") -> SnapshotInfo:
        """Take a ``disk`` or ``full`` snapshot now; returns it when ready (409 unless running or paused)."""
        return self._call(calls.snapshot_call(sandbox_id, kind))

    def list_snapshots(self, sandbox_id: str) -> builtins.list[SnapshotInfo]:
        """The sandbox's ready snapshots, newest first."""
        return self._call(calls.list_snapshots_call(sandbox_id))

    def diff_snapshots(self, sandbox_id: str, from_snapshot_id: str, to_snapshot_id: str) -> SnapshotDiff:
        """Files added, changed and removed between two of the sandbox's snapshots."""
        return self._call(calls.diff_call(sandbox_id, from_snapshot_id, to_snapshot_id))

    def restore_sandbox(self, sandbox_id: str, snapshot_id: str, *, volumes: bool = False) -> SandboxInfo:
        """Roll back to one of the sandbox's snapshots (same id, next generation); with ``volumes`` its
        read-write volumes too, to their copies in that full snapshot (they are not rolled back otherwise)."""
        return self._call(calls.restore_call(sandbox_id, snapshot_id, volumes))

    def fork_sandbox(
        self, sandbox_id: str, count: int = 1, snapshot_id: str | None = None, *,
        schedules: bool = False, volumes: str | None = None,
    ) -> ForkResult:
        """Start ``count`` children from a new full snapshot (or ``snapshot_id``); one outcome per child. With
        ``schedules`` each child gets a copy of the parent's schedules (by default none). ``volumes``: what a
        child gets of the parent's read-write volumes: ``readonly`` (default) a read-only view as of the fork,
        ``copy`` its own read-write reflink copy (a new volume)."""
        return self._call(calls.fork_call(sandbox_id, count, snapshot_id, schedules, volumes))

    def pause_sandbox(self, sandbox_id: str, *, wait: bool = True) -> SandboxInfo:
        """Pause a running sandbox in memory (409 ``InvalidState`` unless running)."""
        return self._call(calls.lifecycle_call(sandbox_id, "pause", wait=wait))

    def resume_sandbox(self, sandbox_id: str, *, wait: bool = True, fallback: bool = False) -> SandboxInfo:
        """Resume a paused sandbox, or wake a suspended one on a node with room (409 ``InvalidState``
        otherwise). ``SnapshotCorrupt`` when a suspended sandbox's snapshot fails its checksums (it stays
        suspended); ``fallback`` restores the newest older intact snapshot instead."""
        return self._call(calls.resume_call(sandbox_id, wait=wait, fallback=fallback))

    def suspend_sandbox(self, sandbox_id: str, *, wait: bool = True) -> SandboxInfo:
        """Suspend a running or paused sandbox to object storage (state ``suspended``: no VM, no node files).
        409 ``InvalidState`` otherwise; 409 ``suspend_failed`` when the promotion failed (it stays paused)."""
        return self._call(calls.suspend_call(sandbox_id, wait=wait))

    def get_operation(self, operation_id: str) -> OperationInfo:
        """The state of an operation started with ``wait=False``."""
        return self._call(calls.get_operation(operation_id))

    def list_templates(self) -> builtins.list[TemplateDetail]:
        """The templates sandboxes can be created from."""
        return self._call(calls.list_templates())

    def build_template(
        self, name: str, dockerfile: str | Path, context: str | Path | None = None, *,
        build_args: Mapping[str, str] | None = None, ready_cmd: str | None = None,
        ready_port: int | None = None, egress: Any = None,
        memory_mib: int | None = None, vcpus: int | None = None, disk_mib: int | None = None,
        on_event: Callable[[BuildEvent], None] | None = None,
    ) -> TemplateDetail:
        """Build template ``name`` from ``dockerfile`` (text or path) and the ``context`` directory (``web:v2``:
        build ``web`` and also tag the build ``v2``, which ``Sandbox.create("web:v2")`` uses after later
        rebuilds); calls ``on_event`` with each step and log event; returns the template. With a start command (CMD or
        ENTRYPOINT), ``ready_cmd`` (exits 0) or ``ready_port`` (answers) says when it is ready to snapshot.
        ``egress``: the RUN steps' network policy (an ``EgressPolicy`` or its JSON shape; default the FROM
        template's). ``memory_mib``, ``vcpus``, ``disk_mib``: the template's resources (default the FROM
        template's; others cost one boot of its disk before the steps). Raises ``TemplateBuildFailed`` (a
        step failed: ``details`` has step, exit_code, output_tail) or the API's typed 4xx errors."""
        call = _tpl.build_call(name, dockerfile, context, build_args, ready_cmd, ready_port, egress,
                               memory_mib, vcpus, disk_mib)
        build_id: str | None = None
        try:
            with self._stream(call) as resp:
                build_id = resp.headers.get(_tpl.BUILD_ID_HEADER)
                for line in resp.iter_lines():
                    ev = _tpl.parse_line(line)
                    if ev is None:
                        continue
                    if on_event is not None:
                        on_event(ev)
                    if (done := _tpl.outcome(ev)) is not None:
                        return done
            cause: PodbayError = PodbayError(f"the build of {name!r} ended without an outcome")
        except Unavailable as exc:
            cause = exc
        if build_id is None:
            raise cause
        if on_event is not None:
            on_event(_tpl.following_event(build_id, cause))
        return self._follow_build(name, build_id, cause)

    def _follow_build(self, name: str, build_id: str, cause: PodbayError) -> TemplateDetail:
        """A build whose stream broke off or ended without an outcome (``cause``) may still end on its node:
        its row, polled every ``_templates.FOLLOW_POLL_S`` s for up to ``_templates.FOLLOW_S`` s (API errors
        while the API restarts are retried), answers as the stream would have. Returns the template; raises
        ``TemplateBuildFailed`` (the row's code, e.g. ``interrupted``) or ``Unavailable`` (not ended)."""
        deadline = monotonic() + _tpl.FOLLOW_S
        while monotonic() < deadline:
            try:
                build = next((b for b in self.list_builds(name.split(":", 1)[0]) if b.id == build_id), None)
                if build is not None and build.state != "running":
                    done = _tpl.followed(build, self.list_templates())
                    if done is not None:
                        return done
            except Unavailable:
                pass  # the API is still restarting
            time.sleep(_tpl.FOLLOW_POLL_S)
        raise _tpl.not_ended(name, build_id, cause) from cause

    def list_builds(self, name: str) -> builtins.list[BuildInfo]:
        """The caller's builds of template ``name``, newest first: state, digest, error."""
        return self._call(calls.list_builds_call(name))

    def delete_template(self, name: str) -> None:
        """Remove template ``name`` (409 while sandboxes or a pool use it); ``name:tag`` removes only the tag
        (409 while sandboxes use its build)."""
        self._call(calls.delete_template_call(name))

    def set_pool(self, template: str, size: int, max_size: int | None = None) -> PoolInfo:
        """Keep at least ``size`` warm slots of ``template`` (up to ``max_size`` when demand asks);
        ``size`` 0 ends the pool. Creates from the template then claim a slot instead of restoring."""
        return self._call(calls.set_pool_call(template, size, max_size))

    def list_nodes(self) -> builtins.list[NodeInfo]:
        """Every node (operator tenant only): state, liveness, capacity, used and free resources, counts.
        Raises ``Forbidden`` for other tenants."""
        return self._call(calls.list_nodes_call())

    def drain_node(self, node_id: str) -> DrainStarted:
        """Start moving every sandbox off ``node_id`` (operator tenant only): running ones by live migration,
        paused ones paused; follow the returned operation with ``get_operation`` (``progress``)."""
        return self._call(calls.drain_node_call(node_id))

    def undrain_node(self, node_id: str) -> NodeUndrained:
        """Take a ``draining`` or ``drained`` node back into placement (operator tenant only): after
        maintenance, or after a drain that ended ``drain_incomplete``. Raises ``Forbidden``, ``NotFound``, and
        ``InvalidState`` while its drain runs or for a lost node."""
        return self._call(calls.undrain_node_call(node_id))

    def list_pools(self) -> builtins.list[PoolInfo]:
        """Every warm pool: bounds, target, and per node ready, preparing, claimed and failing slots."""
        return self._call(calls.list_pools_call())

    # processes

    def exec(self, sandbox_id: str, cmd: Command, **opts: Unpack[ExecOptions]) -> ExecResult:
        """Run ``cmd`` (argv list, or a ``str`` run by ``/bin/sh -c``) and wait for it to end.

        A non-zero exit is a result, not an error. Raises ``InvalidState`` (409) unless the sandbox runs,
        ``InvalidRequest`` for a bad request (see ``podbay.sdk._calls.exec_request``).
        """
        req = calls.exec_request(cmd, **opts)
        return self._call(calls.exec_call(sandbox_id, req))

    def run_code(self, sandbox_id: str, code: str, *, language: str | None = None, context: Any = None,
                       env: Mapping[str, str] | None = None, timeout: float | None = None,
                       on_stdout: OutputHandler | None = None, on_stderr: OutputHandler | None = None,
                       on_result: OutputHandler | None = None,
                       on_error: OutputHandler | None = None) -> CodeExecution:
        """Run ``code`` in the sandbox's code interpreter (a sandbox of the ``code-interpreter`` template,
        docs/code-interpreter.md) and return its ``CodeExecution`` (``results``, ``stdout``,
        ``stderr``, ``error``, ``execution_count``; ``.text`` is the value of the last expression).

        ``language``: ``python`` (default) or ``bash``, each language's default context; or ``context``: a
        context id (or an object with ``id``, as E2B's ``Context``), not both. ``env``: environment variables
        for this run only. ``timeout``: seconds, after which the kernel is interrupted and ``error`` is
        ``TimeoutError``. ``on_stdout``/``on_stderr`` get each text chunk as it is printed, ``on_result`` each
        ``CodeResult``, ``on_error`` the ``CodeError`` (in the asyncio SDK they may be coroutines). An error
        in the code is a result (``error``), not an exception. Raises ``InvalidRequest`` (arguments),
        ``NotFound`` (no such sandbox or context), ``Unavailable`` (nothing answers on port 49999: not a
        code-interpreter sandbox).
        """
        call = code_calls.run_code_call(sandbox_id, code, language=language, context=context, env=env,
                                        timeout=timeout)
        execution = CodeExecution()
        with self._stream(call) as resp:
            for line in resp.iter_lines():
                ended, out = code_calls.apply_line(execution, line, on_stdout=on_stdout, on_stderr=on_stderr,
                                                   on_result=on_result, on_error=on_error)
                # An asyncio handler's coroutine is awaited here (the blocking SDK has nothing to await).
                _ = out if inspect.isawaitable(out) else None
                if ended:
                    return execution
        raise Unavailable(f"the code interpreter of sandbox {sandbox_id} ended its answer early")

    def exec_stream(self, sandbox_id: str, cmd: Command, **opts: Unpack[ExecOptions]) -> Iterator[ExecEvent]:
        """Run ``cmd`` and yield its ``ExecEvent``s as the process produces them.

        ``start`` first, then ``stdout``/``stderr`` events with ``data``, last ``exit`` with ``exit_code``
        (and ``timed_out``). An ``error`` event raises the typed error it carries; a stream that ends
        without ``exit`` raises ``Unavailable``. The request is checked before this returns; the HTTP
        call starts on the first ``next()``. Breaking out of the loop closes the connection. In the asyncio SDK
        this is not awaited: ``async for event in client.exec_stream(...)``.
        """
        req = calls.exec_request(cmd, **opts)
        return self._events(calls.exec_stream_call(sandbox_id, req))

    def events(
        self, *, sandbox: str | Sequence[str] | None = None, types: Sequence[str] | None = None,
        after: int | None = None, follow: bool = False,
    ) -> Iterator[EventOut]:
        """Yield the tenant's lifecycle events (``EventOut``) after stream position ``after``, in order.

        ``sandbox`` (one id or several) and ``types`` filter. Without ``follow`` it ends at the newest
        event; with it, it waits for new ones forever, and a dropped connection is reopened after the last
        ``seq`` seen, so nothing is lost or repeated. Keep ``event.seq`` to resume later with ``after``.
        Raises ``InvalidRequest`` for a bad filter; without ``follow``, ``Unavailable``/``Timeout`` too.
        """
        last, wait = after, sdk_events.RECONNECT_S
        while True:
            call = sdk_events.events_call(sandbox=sandbox, types=types, after=last, follow=follow)
            try:
                with self._stream(call) as resp:
                    for line in resp.iter_lines():
                        event = sdk_events.parse_event_line(line, self.api_url + call.path)
                        if event is not None:
                            last, wait = event.seq, sdk_events.RECONNECT_S
                            yield event
                if not follow:
                    return
            except (Unavailable, Timeout):
                if not follow:
                    raise
            time.sleep(wait)
            wait = min(wait * 2, 10.0)

    def _events(self, call: Call[None]) -> Iterator[ExecEvent]:
        reader = EventReader(self.api_url + call.path)
        with self._stream(call) as resp:
            for line in resp.iter_lines():
                event = reader.feed(line)
                if event is not None:
                    yield event
        reader.finish()

    # files

    def read_file_into(self, sandbox_id: str, path: str, dest: IO[bytes]) -> int:
        """Stream the file at absolute ``path`` into ``dest``; returns the number of bytes written."""
        written = 0
        with self._stream(calls.read_file(sandbox_id, path)) as resp:
            for chunk in resp.iter_bytes():
                dest.write(chunk)
                written += len(chunk)
        return written

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        """The whole file at absolute ``path``; ``NotFound`` if it does not exist."""
        buf = io.BytesIO()
        self.read_file_into(sandbox_id, path, buf)
        return buf.getvalue()

    def write_file(self, sandbox_id: str, path: str, data: FileData, *, mode: int = 0o644) -> FileInfo:
        """Write ``data`` (bytes, str as UTF-8, or a file-like object, streamed) to ``path`` with ``mode``; in the
        asyncio SDK a file-like ``data`` may have a sync or an async ``read``."""
        return self._call(calls.write_file(sandbox_id, path, sync_body(data), mode))

    def stat_file(self, sandbox_id: str, path: str) -> FileInfo:
        """``FileInfo`` of ``path``; ``NotFound`` if it does not exist."""
        return self._call(calls.stat_file(sandbox_id, path))

    def list_files(self, sandbox_id: str, path: str) -> builtins.list[FileInfo]:
        """The entries of the directory ``path``."""
        return self._call(calls.list_files(sandbox_id, path))

    def mkdir(self, sandbox_id: str, path: str, *, parents: bool = True) -> FileInfo:
        """Create the directory ``path`` (and its parents, by default); returns its ``FileInfo``."""
        return self._call(calls.mkdir(sandbox_id, path, parents=parents))

    def remove_file(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        """Remove ``path``; a non-empty directory needs ``recursive``."""
        self._call(calls.remove_file(sandbox_id, path, recursive=recursive))


class Files:
    """``sandbox.files``: the sandbox's filesystem. Paths are absolute paths inside the guest."""

    def __init__(self, client: Client, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    def write(self, path: str, data: FileData, mode: int = 0o644) -> FileInfo:
        """Write bytes, text (UTF-8) or a file-like object (streamed) to ``path``."""
        return self._client.write_file(self._id, path, data, mode=mode)

    def read(self, path: str) -> bytes:
        """The file's bytes; ``NotFound`` if it does not exist."""
        return self._client.read_file(self._id, path)

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """The file decoded as ``encoding``."""
        data = self.read(path)
        return data.decode(encoding)

    def read_into(self, path: str, dest: IO[bytes]) -> int:
        """Stream the file into ``dest``; returns the byte count."""
        return self._client.read_file_into(self._id, path, dest)

    def list(self, path: str) -> builtins.list[FileInfo]:
        """The directory's entries."""
        return self._client.list_files(self._id, path)

    def stat(self, path: str) -> FileInfo:
        """``FileInfo`` of ``path``; ``NotFound`` if it does not exist."""
        return self._client.stat_file(self._id, path)

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists (a ``stat`` that answers ``NotFound`` means no)."""
        try:
            self.stat(path)
        except NotFound:
            return False
        return True

    def mkdir(self, path: str, parents: bool = True) -> FileInfo:
        """Create a directory (and its parents, by default)."""
        return self._client.mkdir(self._id, path, parents=parents)

    def remove(self, path: str, recursive: bool = False) -> None:
        """Remove a file, or a directory (non-empty needs ``recursive``)."""
        self._client.remove_file(self._id, path, recursive=recursive)


class Sandbox:
    """One sandbox. Build it with ``Sandbox.create`` or ``Sandbox.connect``; ``with`` deletes it at the end.

    Each ``Sandbox`` made by ``create``/``connect`` owns its ``Client`` (closed by ``close``/``delete``)
    unless one is passed in with ``client=``, which lets many sandboxes share one connection pool.
    """

    def __init__(self, client: Client, info: SandboxInfo, *, owns_client: bool = False) -> None:
        self._client = client
        self._owns_client = owns_client
        self.info: SandboxInfo = info
        self.files = Files(client, info.id)

    @property
    def schedules(self) -> ns.BoundSchedules:
        """This sandbox's schedules (``add(cron=..., tz=..., command=[...])``, ``list()``, ``runs(id)``, ``remove(id)``)."""
        return ns.BoundSchedules(self._client.schedules, self.id)

    @property
    def id(self) -> str:
        """The sandbox id."""
        return self.info.id

    @staticmethod
    def _open(
        client: Client | None, api_url: str | None, api_key: str | None, timeout_s: float
    ) -> tuple[Client, bool]:
        if client is not None:
            return client, False
        return Client(api_url, api_key, timeout_s=timeout_s), True

    @classmethod
    def create(
        cls,
        template: str = "base",
        *,
        memory_mib: int | None = None,
        vcpus: int | None = None,
        disk_mib: int | None = None,
        metadata: Mapping[str, str] | None = None,
        wait: bool = True,
        network: NetworkArg | None = None,
        volumes: Sequence[Any] | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        client: Client | None = None,
    ) -> Sandbox:
        """Create a sandbox from ``template`` (see ``Client.create_sandbox``) and return it.

        With ``wait`` (default) it is running when this returns; ``memory_mib``/``vcpus`` default to the
        template's; ``disk_mib`` makes the root disk larger than the template's (its filesystem grows to fill
        it). ``timeout_s`` bounds each HTTP call (not exec). Errors: ``podbay.errors`` classes.
        """
        http, owns = cls._open(client, api_url, api_key, timeout_s)
        try:
            info = http.create_sandbox(
                template, memory_mib=memory_mib, vcpus=vcpus, disk_mib=disk_mib, metadata=metadata, wait=wait,
                network=network, volumes=volumes
            )
        except BaseException:
            if owns:
                http.close()
            raise
        return cls(http, info, owns_client=owns)

    @classmethod
    def connect(
        cls,
        sandbox_id: str,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        client: Client | None = None,
    ) -> Sandbox:
        """The existing sandbox ``sandbox_id``; ``NotFound`` if there is none (for this tenant)."""
        http, owns = cls._open(client, api_url, api_key, timeout_s)
        try:
            info = http.get_sandbox(sandbox_id)
        except BaseException:
            if owns:
                http.close()
            raise
        return cls(http, info, owns_client=owns)

    @classmethod
    def list(
        cls,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        client: Client | None = None,
    ) -> builtins.list[SandboxInfo]:
        """The tenant's sandboxes, as ``SandboxInfo``."""
        http, owns = cls._open(client, api_url, api_key, timeout_s)
        try:
            return http.list_sandboxes()
        finally:
            if owns:
                http.close()

    def refresh(self) -> SandboxInfo:
        """Fetch the current ``SandboxInfo`` into ``info`` and return it."""
        self.info = self._client.get_sandbox(self.id)
        return self.info

    def exec(self, cmd: Command, **opts: Unpack[ExecOptions]) -> ExecResult:
        """Run ``cmd`` and wait: see ``Client.exec``."""
        return self._client.exec(self.id, cmd, **opts)

    def run_code(self, code: str, *, language: str | None = None, context: Any = None,
                       env: Mapping[str, str] | None = None, timeout: float | None = None,
                       on_stdout: OutputHandler | None = None, on_stderr: OutputHandler | None = None,
                       on_result: OutputHandler | None = None,
                       on_error: OutputHandler | None = None) -> CodeExecution:
        """Run ``code`` in this sandbox's code interpreter: see ``Client.run_code``."""
        return self._client.run_code(self.id, code, language=language, context=context, env=env,
                                           timeout=timeout, on_stdout=on_stdout, on_stderr=on_stderr,
                                           on_result=on_result, on_error=on_error)

    def exec_stream(self, cmd: Command, **opts: Unpack[ExecOptions]) -> Iterator[ExecEvent]:
        """Run ``cmd`` and iterate its events as produced: see ``Client.exec_stream``."""
        return self._client.exec_stream(self.id, cmd, **opts)

    def events(self, *, types: Sequence[str] | None = None, after: int | None = None,
               follow: bool = False) -> Iterator[EventOut]:
        """This sandbox's lifecycle events: see ``Client.events``."""
        return self._client.events(sandbox=self.id, types=types, after=after, follow=follow)


    def screenshot(self) -> bytes:
        """PNG of this sandbox's browser page: see ``Client.screenshot``."""
        return self._client.screenshot(self.id)

    def mouse(self, action: str, x: float, y: float, **kw: Any) -> ComputerResult:
        """Mouse input to this sandbox's browser: see ``Client.mouse``."""
        return self._client.mouse(self.id, action, x, y, **kw)

    def keyboard(self, *, text: str | None = None, keys: Sequence[str] | None = None) -> ComputerResult:
        """Keyboard input to this sandbox's browser: see ``Client.keyboard``."""
        return self._client.keyboard(self.id, text=text, keys=None if keys is None else [*keys])

    def fill(self, credential: str, selector: str) -> FillResult:
        """Fill a stored credential into this sandbox's browser page: see ``Client.fill``."""
        return self._client.fill(self.id, credential, selector)

    def cdp(self) -> CdpEndpoint:
        """This sandbox's browser CDP URL: see ``Client.cdp``."""
        return self._client.cdp(self.id)

    def ports(self) -> PortList:
        """This sandbox's listening ports: see ``Client.list_ports``."""
        return self._client.list_ports(self.id)

    def url(self, port: int) -> PortUrl:
        """Where ``port`` of this sandbox answers, and its token: see ``Client.port_url``."""
        return self._client.port_url(self.id, port)

    def network(self) -> NetworkInfo:
        """This sandbox's effective egress policy."""
        return self._client.get_network(self.id)

    def set_network(self, policy: NetworkArg) -> NetworkInfo:
        """Replace this sandbox's egress policy (``EgressPolicy`` or ``{"allow": [...], "deny": [...]}``)."""
        return self._client.set_network(self.id, policy)

    def set_timeout(self, lease_s: int, on_lease_expiry: str | None = None) -> SandboxInfo:
        """Renew this sandbox's lease (every call on it renews it too); when it runs out while the guest is
        idle, the sandbox is paused (or deleted with ``on_lease_expiry="delete"``)."""
        self.info = self._client.set_timeout(self.id, lease_s, on_lease_expiry)
        return self.info

    def snapshot(self, kind: str = "full") -> SnapshotInfo:
        """Take a ``disk`` or ``full`` snapshot of this sandbox; returns it when ready."""
        return self._client.snapshot_sandbox(self.id, kind)

    def snapshots(self) -> builtins.list[SnapshotInfo]:
        """This sandbox's ready snapshots, newest first."""
        return self._client.list_snapshots(self.id)

    def diff(self, from_snapshot_id: str, to_snapshot_id: str) -> SnapshotDiff:
        """What changed between two snapshots of this sandbox (path, change, kind, size)."""
        return self._client.diff_snapshots(self.id, from_snapshot_id, to_snapshot_id)

    def restore(self, snapshot_id: str, *, volumes: bool = False) -> SandboxInfo:
        """Roll this sandbox back to ``snapshot_id`` (memory and disk for a full snapshot); ``volumes``: its
        read-write volumes too."""
        self.info = self._client.restore_sandbox(self.id, snapshot_id, volumes=volumes)
        return self.info

    def fork(
        self, count: int = 1, snapshot_id: str | None = None, *, schedules: bool = False, volumes: str | None = None,
    ) -> ForkResult:
        """Start ``count`` children of this sandbox; connect to each with ``connect(child.sandbox_id)``.
        ``schedules``: copy this sandbox's schedules to each child; ``volumes``: ``readonly`` or ``copy``
        (``fork_sandbox``)."""
        return self._client.fork_sandbox(self.id, count, snapshot_id, schedules=schedules, volumes=volumes)

    def pause(self, wait: bool = True) -> SandboxInfo:
        """Pause the sandbox in memory: its processes stop and carry on after ``resume()``."""
        self.info = self._client.pause_sandbox(self.id, wait=wait)
        return self.info

    def resume(self, wait: bool = True, fallback: bool = False) -> SandboxInfo:
        """Resume a paused sandbox, or wake a suspended one (see ``Client.resume_sandbox``)."""
        self.info = self._client.resume_sandbox(self.id, wait=wait, fallback=fallback)
        return self.info

    def suspend(self, wait: bool = True) -> SandboxInfo:
        """Suspend to object storage: it costs nothing while it waits; ``resume()`` (or an exec with the client's
        ``auto_resume``) brings it back, processes and files intact, on any node."""
        self.info = self._client.suspend_sandbox(self.id, wait=wait)
        return self.info

    def delete(self, wait: bool = True) -> SandboxInfo:
        """Delete the sandbox (see ``Client.delete_sandbox``), then close an owned client."""
        try:
            self.info = self._client.delete_sandbox(self.id, wait=wait)
        finally:
            self.close()
        return self.info

    def kill(self) -> SandboxInfo:
        """Same as ``delete()``."""
        return self.delete()

    def close(self) -> None:
        """Close the client if this sandbox owns it; the sandbox itself keeps running."""
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.delete()
        except NotFound:
            pass  # already gone: the block's purpose is met
        except PodbayError:
            if exc is None:
                raise
            # else the block's own error is the one worth seeing; it propagates after this

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, state={self.info.state!r})"
