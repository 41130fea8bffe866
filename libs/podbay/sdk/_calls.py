"""Request building and response parsing for every ``/v1`` endpoint, shared by the sync and async SDK.

Each builder returns a ``Call``: what to send (method, path, query, JSON or raw body) and how to turn a
successful ``httpx.Response`` into a typed result. The sync and async clients only execute calls, so the
shape of every request and every result is written once, here. The endpoint list is the API's
(``podbay.contracts.api`` holds the bodies).
"""

from __future__ import annotations

import builtins
import json
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypedDict, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from podbay.contracts.volumes import VolumeMount, parse_mount
from podbay.contracts.egress import EgressPolicy
from podbay.contracts.templates import BuildInfo, BuildList, TemplateDetail, TemplateDetailList, split_template_ref
from podbay.contracts.api import (
    DrainStarted,
    NodeUndrained,
    ExecRequest,
    ForkRequest,
    ForkResult,
    RestoreRequest,
    SnapshotCreate,
    SnapshotDiff,
    SnapshotInfo,
    SnapshotList,
    ExecResult,
    FileInfo,
    FileList,
    OperationInfo,
    LeaseUpdate,
    PoolInfo,
    NodeInfo,
    NodeList,
    PoolList,
    PoolSet,
    SandboxCreate,
    SandboxInfo,
    SandboxList,
)
from podbay.errors import InvalidRequest, PodbayError, Timeout, validation_message

__all__ = [
    "Call",
    "STDIN_MAX_BYTES",
    "Command",
    "ExecOptions",
    "create_sandbox",
    "CREATE_RETRY_DELAYS_S",
    "get_sandbox",
    "list_sandboxes",
    "delete_sandbox",
    "exec_request",
    "exec_call",
    "exec_stream_call",
    "read_file",
    "write_file",
    "stat_file",
    "list_files",
    "mkdir",
    "remove_file",
    "get_operation",
    "list_templates",
    "build_template_call",
    "delete_template_call",
    "list_builds_call",
    "suspend_call",
    "resume_call",
    "with_auto_resume",
    "set_pool_call",
    "list_pools_call",
    "list_nodes_call",
    "format_mode",
    "ID_PATTERN",
    "PATH_MAX_CHARS",
    "check_id",
    "check_path",
]

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

#: The API's limit on exec stdin (``ExecRequest.stdin``), in bytes of UTF-8.
STDIN_MAX_BYTES = 16 << 20

#: The shape of sandbox and operation ids (``sbx_<hex>``, ``op_<hex>``, ...); checked before any request.
ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")

#: The API's bound on a guest path (the ``path`` query value), in characters.
PATH_MAX_CHARS = 4096

#: What ``exec`` accepts: an argv list, or one string run by ``/bin/sh -c``.
Command = Sequence[str] | str


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One HTTP request and the parser of its successful response.

    ``long_running`` calls (exec) replace the client's read timeout by ``read_timeout_s`` (``None``: wait
    as long as the server does, since the server bounds the command).
    """

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    params: Mapping[str, str] | None = None
    json: Any = None
    content: Any = None
    #: multipart form fields and files (``httpx`` ``data=``/``files=``)
    data: Mapping[str, str] | None = None
    files: Mapping[str, Any] | None = None
    long_running: bool = False
    read_timeout_s: float | None = None
    headers: Mapping[str, str] | None = None
    #: Waits (seconds) before sending the call again after its connection broke or was refused; one entry
    #: per retry. Only for calls that are safe to repeat: a create carries an ``Idempotency-Key``.
    retry_delays_s: tuple[float, ...] = ()


class Caller(Protocol):
    """What a namespace (``client.credentials``, ``client.volumes``, ...) sends its calls through: the blocking
    client's ``_call``, which answers with the parsed result."""

    def __call__(self, call: Call[T], /) -> T: ...


class AsyncCaller(Protocol):
    """The asyncio client's ``_call``: the parsed result, awaited (``Caller``'s twin)."""

    def __call__(self, call: Call[T], /) -> Awaitable[T]: ...


def ndjson_line(cls: type[M], line: str | bytes, malformed: Callable[[ValidationError], str]) -> M | None:
    """One line of an NDJSON stream (without its newline) as a ``cls``; None for a blank (keep-alive) line.
    A line that is not a ``cls`` raises ``PodbayError(malformed(the validation error))``."""
    if not line.strip():
        return None
    try:
        return cls.model_validate_json(line)
    except ValidationError as exc:
        raise PodbayError(malformed(exc)) from exc


def _model(cls: type[M]) -> Callable[[httpx.Response], M]:
    def parse(resp: httpx.Response) -> M:
        try:
            return cls.model_validate_json(resp.content)
        except ValidationError as exc:
            raise PodbayError(
                f"unexpected {cls.__name__} response from {resp.request.url}: {exc.error_count()} errors"
            ) from exc

    return parse


def _settled(wait: bool) -> Callable[[httpx.Response], SandboxInfo]:
    """Parse a lifecycle answer. With ``wait``, a 202 means the server's bounded wait ran out before the
    operation finished (e.g. a node agent restarting mid-way): that is not success, so raise ``Timeout``
    carrying the ``operation_id`` to follow with ``GET /v1/operations/{id}``."""

    def parse(resp: httpx.Response) -> SandboxInfo:
        info = _model(SandboxInfo)(resp)
        if wait and resp.status_code == 202:
            raise Timeout(
                f"sandbox {info.id} is still {info.state}: the operation did not finish within the server's wait; "
                f"follow it with `podbay operation get {info.operation_id}`",
                details={"operation_id": info.operation_id, "state": str(info.state)},
            )
        return info

    return parse


def _validate(cls: type[M], fields: dict[str, Any], what: str) -> M:
    """Check a request body locally, so a bad value fails before any network round trip."""
    try:
        return cls.model_validate(fields)
    except ValidationError as exc:
        raise InvalidRequest(f"invalid {what}: {validation_message(exc.errors()[0])}") from exc


def _mount(v: Any) -> dict[str, Any]:
    """One entry of a create's ``volumes``: ``"NAME:/path[:ro]"``, a ``VolumeMount`` or its JSON shape."""
    if isinstance(v, str):
        try:
            v = parse_mount(v)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
    shape = v.model_dump(mode="json") if isinstance(v, BaseModel) else dict(v)
    return _validate(VolumeMount, shape, "volume").model_dump(mode="json")


def _none(resp: httpx.Response) -> None:
    return None


def check_id(value: str, what: str = "sandbox id") -> str:
    """Return ``value`` if it is an id (``ID_PATTERN``: 1 to 64 of ``A-Z a-z 0-9 _ -``).

    Raises ``InvalidRequest`` otherwise, before anything is sent: an empty id would otherwise reach
    the collection endpoint (``/v1/sandboxes/``) and come back as a confusing answer.
    """
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise InvalidRequest(f"invalid {what} {value!r}: expected 1 to 64 letters, digits, '_' or '-'")
    return value


def check_template_ref(ref: str) -> str:
    """Return ``ref`` if it is a template name or ``name:tag`` (``split_template_ref``'s rules). Raises
    ``InvalidRequest`` otherwise, before anything is sent, so a bad reference is the same error whether it is
    built or removed."""
    try:
        split_template_ref(ref)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"invalid template {ref!r}: {exc}") from exc
    return ref


def check_path(path: str) -> str:
    """Return ``path`` if it is an absolute guest path of at most ``PATH_MAX_CHARS`` characters without NUL.

    Raises ``InvalidRequest`` otherwise, before anything is sent.
    """
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidRequest(f"invalid path {path!r}: paths inside a sandbox must be absolute (start with /)")
    if len(path) > PATH_MAX_CHARS or "\0" in path:
        raise InvalidRequest(f"invalid path: longer than {PATH_MAX_CHARS} characters or contains NUL")
    return path


def _sandbox_path(sandbox_id: str, rest: str = "") -> str:
    # Checked and still quoted: the id comes from users, and a slash or '?' must not reach another endpoint.
    return f"/v1/sandboxes/{quote(check_id(sandbox_id), safe='')}{rest}"


def _bool(value: bool) -> str:
    return "true" if value else "false"


#: Waits (seconds) before a create is sent again after a broken or refused connection: about 7 s in all,
#: time for an API process to restart.
CREATE_RETRY_DELAYS_S: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)


def create_sandbox(
    template: str,
    *,
    memory_mib: int | None,
    vcpus: int | None,
    metadata: Mapping[str, str] | None,
    wait: bool,
    disk_mib: int | None = None,
    network: Any = None,
    volumes: Any = None,
    idempotency_key: str | None = None,
) -> Call[SandboxInfo]:
    """``POST /v1/sandboxes?wait=`` with a ``SandboxCreate`` body; 201 (or 202 with ``operation_id``).
    ``idempotency_key``: the ``Idempotency-Key`` header (None: a fresh UUID); the call is sent again after a
    broken or refused connection (``CREATE_RETRY_DELAYS_S``) with the same key.
    ``network``: an ``EgressPolicy`` or its JSON shape; None leaves the template's. ``volumes``: a sequence of
    ``"NAME:/path[:ro]"``, ``VolumeMount`` or its JSON shape (``podbay.sdk._volumes``). ``disk_mib``: a root
    disk larger than the template's (MiB)."""
    fields: dict[str, Any] = {"template": template, "memory_mib": memory_mib, "vcpus": vcpus,
                              "disk_mib": disk_mib, "metadata": dict(metadata or {})}
    if network is not None:
        fields["network"] = network.model_dump(mode="json") if isinstance(network, BaseModel) else dict(network)
    if volumes:
        fields["volumes"] = [_mount(v) for v in volumes]
    body = _validate(SandboxCreate, fields, "create request")
    # A fresh key per create, sent again on the client's own retries: a create whose answer was lost (the
    # API restarted mid-request) comes back as the sandbox it made, not as a second one.
    return Call(
        "POST",
        "/v1/sandboxes",
        _settled(wait),
        params={"wait": _bool(wait)},
        json=body.model_dump(mode="json", exclude_none=True),
        headers={"Idempotency-Key": idempotency_key or str(uuid.uuid4())},
        retry_delays_s=CREATE_RETRY_DELAYS_S,
    )


def get_sandbox(sandbox_id: str) -> Call[SandboxInfo]:
    """``GET /v1/sandboxes/{id}``."""
    return Call("GET", _sandbox_path(sandbox_id), _model(SandboxInfo))


def _sandboxes(resp: httpx.Response) -> builtins.list[SandboxInfo]:
    return _model(SandboxList)(resp).sandboxes


def list_sandboxes() -> Call[builtins.list[SandboxInfo]]:
    """``GET /v1/sandboxes`` -> the tenant's sandboxes."""
    return Call("GET", "/v1/sandboxes", _sandboxes)


def delete_sandbox(sandbox_id: str, *, wait: bool) -> Call[SandboxInfo]:
    """``DELETE /v1/sandboxes/{id}?wait=``; 200 (or 202 with ``operation_id``)."""
    return Call("DELETE", _sandbox_path(sandbox_id), _settled(wait), params={"wait": _bool(wait)})


def lifecycle_call(sandbox_id: str, verb: str, *, wait: bool) -> Call[SandboxInfo]:
    """``POST /v1/sandboxes/{id}/<verb>?wait=`` for ``pause`` and ``resume``; 200 (or 202 with ``operation_id``)."""
    return Call("POST", _sandbox_path(sandbox_id, f"/{verb}"), _settled(wait), params={"wait": _bool(wait)})


def suspend_call(sandbox_id: str, *, wait: bool) -> Call[SandboxInfo]:
    """``POST /v1/sandboxes/{id}/suspend?wait=``: snapshot, promote to object storage, free the VM; 200 when
    ``suspended`` (or 202 with ``operation_id``). No read timeout: the server bounds it."""
    return Call("POST", _sandbox_path(sandbox_id, "/suspend"), _settled(wait), params={"wait": _bool(wait)},
                long_running=True, read_timeout_s=None)


def resume_call(sandbox_id: str, *, wait: bool, fallback: bool = False) -> Call[SandboxInfo]:
    """``POST /v1/sandboxes/{id}/resume?wait=&fallback=``: a paused sandbox continues, a suspended one is
    woken on a node with room (``fallback``: an older intact snapshot when its own is corrupt)."""
    params = {"wait": _bool(wait)}
    if fallback:
        params["fallback"] = "true"
    return Call("POST", _sandbox_path(sandbox_id, "/resume"), _settled(wait), params=params,
                long_running=True, read_timeout_s=None)


_DATA_PLANE = re.compile(r"^/v1/sandboxes/[^/]+/(exec|files)")


def with_auto_resume(call: Call[T]) -> Call[T]:
    """``call`` with ``auto_resume=true`` when it is an exec or file call (a suspended or paused sandbox is
    resumed first, so the wait is unbounded on the client side); other calls unchanged."""
    if not _DATA_PLANE.match(call.path):
        return call
    return replace(call, params={**(call.params or {}), "auto_resume": "true"}, long_running=True,
                   read_timeout_s=None)


def timeout_call(sandbox_id: str, lease_s: int, on_lease_expiry: str | None) -> Call[SandboxInfo]:
    """``POST /v1/sandboxes/{id}/timeout`` {"lease_s", "on_lease_expiry"?} -> ``SandboxInfo`` with the new lease."""
    fields: dict[str, Any] = {"lease_s": lease_s}
    if on_lease_expiry is not None:
        fields["on_lease_expiry"] = on_lease_expiry
    body = _validate(LeaseUpdate, fields, "timeout request")
    return Call("POST", _sandbox_path(sandbox_id, "/timeout"), _model(SandboxInfo), json=body.model_dump(exclude_none=True))


def snapshot_call(sandbox_id: str, kind: str) -> Call[SnapshotInfo]:
    """``POST /v1/sandboxes/{id}/snapshots`` {"kind": "disk"|"full"} -> 201 ``SnapshotInfo``."""
    body = _validate(SnapshotCreate, {"kind": kind}, "snapshot request")
    return Call("POST", _sandbox_path(sandbox_id, "/snapshots"), _model(SnapshotInfo), json=body.model_dump(),
                long_running=True, read_timeout_s=None)


def list_snapshots_call(sandbox_id: str) -> Call[builtins.list[SnapshotInfo]]:
    """``GET /v1/sandboxes/{id}/snapshots`` -> the sandbox's ready snapshots, newest first."""
    return Call("GET", _sandbox_path(sandbox_id, "/snapshots"), lambda r: _model(SnapshotList)(r).snapshots)


def diff_call(sandbox_id: str, from_snapshot_id: str, to_snapshot_id: str) -> Call[SnapshotDiff]:
    """``GET /v1/sandboxes/{id}/snapshots/{a}/diff/{b}`` -> files added, changed and removed from a to b."""
    a, b = (quote(check_id(x, "snapshot id"), safe="") for x in (from_snapshot_id, to_snapshot_id))
    return Call("GET", _sandbox_path(sandbox_id, f"/snapshots/{a}/diff/{b}"), _model(SnapshotDiff),
                long_running=True, read_timeout_s=None)


def restore_call(sandbox_id: str, snapshot_id: str, volumes: bool = False) -> Call[SandboxInfo]:
    """``POST /v1/sandboxes/{id}/restore`` {"snapshot_id", "volumes"?} -> ``SandboxInfo`` (a new generation).
    ``volumes``: roll the read-write volumes back too (sent only when asked for)."""
    body = _validate(RestoreRequest, {"snapshot_id": check_id(snapshot_id, "snapshot id"), "volumes": volumes}, "restore request")
    return Call("POST", _sandbox_path(sandbox_id, "/restore"), _settled(True),
                json=body.model_dump(exclude=None if volumes else {"volumes"}),
                long_running=True, read_timeout_s=None)


def fork_call(sandbox_id: str, count: int, snapshot_id: str | None, schedules: bool = False,
              volumes: str | None = None) -> Call[ForkResult]:
    """``POST /v1/sandboxes/{id}/fork`` {"count", "snapshot_id"?, "schedules"?, "volumes"?} -> ``ForkResult``
    (one outcome per child). ``volumes``: ``readonly`` (the server's default) or ``copy``."""
    fields: dict[str, Any] = {"count": count}
    if schedules:
        fields["schedules"] = True
    if volumes is not None:
        fields["volumes"] = volumes
    if snapshot_id is not None:
        fields["snapshot_id"] = check_id(snapshot_id, "snapshot id")
    body = _validate(ForkRequest, fields, "fork request")
    # `schedules` and `volumes` are sent only when asked for, so a plain fork's body stays what older servers
    # accept.
    unasked = ({"schedules"} if not schedules else set()) | ({"volumes"} if volumes is None else set())
    return Call("POST", _sandbox_path(sandbox_id, "/fork"), _model(ForkResult),
                json=body.model_dump(exclude_none=True, exclude=unasked or None),
                long_running=True, read_timeout_s=None)


class ExecOptions(TypedDict, total=False):
    """The keyword options of every ``exec``/``exec_stream`` method.

    ``env``: extra environment variables; ``cwd``: working directory in the guest; ``user``: user name or
    uid (default root); ``stdin``: text, or UTF-8 bytes, at most 16 MiB; ``timeout_s``: kill the command
    after this many seconds (default: the server's ``PODBAY_EXEC_TIMEOUT_S``).
    """

    env: Mapping[str, str] | None
    cwd: str | None
    user: str | None
    stdin: str | bytes | None
    timeout_s: float | None


def exec_request(
    cmd: Command,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    user: str | None = None,
    stdin: str | bytes | None = None,
    timeout_s: float | None = None,
) -> ExecRequest:
    """Build an ``ExecRequest``: a ``str`` command runs through the shell, a sequence is the argv.

    ``stdin`` bytes must be UTF-8 (the API carries stdin as text), at most 16 MiB.
    Raises ``InvalidRequest`` for an empty argv, non-UTF-8 or oversized stdin, and for values the
    API model refuses (``timeout_s`` <= 0, ...).
    """
    if isinstance(stdin, bytes):
        if len(stdin) > STDIN_MAX_BYTES:
            raise InvalidRequest(f"stdin is larger than {STDIN_MAX_BYTES} bytes")
        try:
            stdin = stdin.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest("stdin must be UTF-8 text") from exc
    fields: dict[str, Any] = {"env": dict(env or {}), "cwd": cwd, "user": user, "stdin": stdin}
    fields["timeout_s"] = timeout_s
    if isinstance(cmd, str):
        fields["shell"] = cmd
    elif isinstance(cmd, Sequence) and not isinstance(cmd, bytes):
        fields["argv"] = list(cmd)
    else:
        raise InvalidRequest(f"command must be a string or a sequence of strings, not {type(cmd).__name__}")
    return _validate(ExecRequest, fields, "exec request")


def _exec_read_timeout(timeout_s: float | None) -> float | None:
    # The server answers at the latest when the command's own timeout fires; leave it room to reply.
    return None if timeout_s is None else timeout_s + 30.0


def exec_call(sandbox_id: str, req: ExecRequest) -> Call[ExecResult]:
    """``POST /v1/sandboxes/{id}/exec`` -> ``ExecResult`` (waits for the command to end)."""
    return Call(
        "POST",
        _sandbox_path(sandbox_id, "/exec"),
        _model(ExecResult),
        json=req.model_dump(mode="json", exclude_none=True),
        long_running=True,
        read_timeout_s=_exec_read_timeout(req.timeout_s),
    )


def exec_stream_call(sandbox_id: str, req: ExecRequest) -> Call[None]:
    """``POST /v1/sandboxes/{id}/exec/stream`` -> NDJSON ``ExecEvent`` lines (parsed by ``_stream``).

    No read timeout: a quiet command may write nothing for a long time, and the server ends the
    stream with ``exit`` or ``error`` when the command's timeout fires.
    """
    return Call(
        "POST",
        _sandbox_path(sandbox_id, "/exec/stream"),
        _none,
        json=req.model_dump(mode="json", exclude_none=True),
        long_running=True,
        read_timeout_s=None,
    )


def read_file(sandbox_id: str, path: str) -> Call[None]:
    """``GET /v1/sandboxes/{id}/files?path=`` -> raw bytes, read as a stream by the client."""
    return Call("GET", _sandbox_path(sandbox_id, "/files"), _none, params={"path": check_path(path)})


def format_mode(mode: int) -> str:
    """``0o644`` -> ``"0644"`` (the API's octal ``mode`` query value); ``InvalidRequest`` outside 0..0o7777."""
    if not 0 <= mode <= 0o7777:
        raise InvalidRequest(f"file mode {mode:#o} is outside 0..0o7777")
    return f"{mode:04o}"


def write_file(sandbox_id: str, path: str, content: Any, mode: int) -> Call[FileInfo]:
    """``PUT /v1/sandboxes/{id}/files?path=&mode=`` with a raw body (bytes or a chunk iterator)."""
    return Call(
        "PUT",
        _sandbox_path(sandbox_id, "/files"),
        _model(FileInfo),
        params={"path": check_path(path), "mode": format_mode(mode)},
        content=content,
    )


def stat_file(sandbox_id: str, path: str) -> Call[FileInfo]:
    """``GET /v1/sandboxes/{id}/files/stat?path=`` -> ``FileInfo``."""
    return Call("GET", _sandbox_path(sandbox_id, "/files/stat"), _model(FileInfo), params={"path": check_path(path)})


def _entries(resp: httpx.Response) -> builtins.list[FileInfo]:
    return _model(FileList)(resp).entries


def list_files(sandbox_id: str, path: str) -> Call[builtins.list[FileInfo]]:
    """``GET /v1/sandboxes/{id}/files/list?path=`` -> the directory's entries."""
    return Call("GET", _sandbox_path(sandbox_id, "/files/list"), _entries, params={"path": check_path(path)})


def mkdir(sandbox_id: str, path: str, *, parents: bool) -> Call[FileInfo]:
    """``POST /v1/sandboxes/{id}/files/mkdir?path=&parents=`` -> the directory's ``FileInfo``."""
    return Call(
        "POST",
        _sandbox_path(sandbox_id, "/files/mkdir"),
        _model(FileInfo),
        params={"path": check_path(path), "parents": _bool(parents)},
    )


def remove_file(sandbox_id: str, path: str, *, recursive: bool) -> Call[None]:
    """``DELETE /v1/sandboxes/{id}/files?path=&recursive=`` -> 204."""
    return Call(
        "DELETE",
        _sandbox_path(sandbox_id, "/files"),
        _none,
        params={"path": check_path(path), "recursive": _bool(recursive)},
    )


def get_operation(operation_id: str) -> Call[OperationInfo]:
    """``GET /v1/operations/{id}`` -> ``OperationInfo``."""
    checked = check_id(operation_id, "operation id")
    return Call("GET", f"/v1/operations/{quote(checked, safe='')}", _model(OperationInfo))


def _templates(resp: httpx.Response) -> builtins.list[TemplateDetail]:
    return _model(TemplateDetailList)(resp).templates


def list_templates() -> Call[builtins.list[TemplateDetail]]:
    """``GET /v1/templates`` -> ``{"templates": [TemplateDetail]}``, returned as the list."""
    return Call("GET", "/v1/templates", _templates)


def build_template_call(name: str, dockerfile: str, context: bytes,
                        build_args: Mapping[str, str] | None = None, *, ready_cmd: str | None = None,
                        ready_port: int | None = None, egress: Any = None, memory_mib: int | None = None,
                        vcpus: int | None = None, disk_mib: int | None = None) -> Call[None]:
    """``POST /v1/templates`` (multipart: ``name``, ``dockerfile``, ``build_args`` JSON, ``ready_cmd``,
    ``ready_port``, ``egress`` (an ``EgressPolicy`` for the RUN steps), ``memory_mib``, ``vcpus``,
    ``disk_mib`` (the template's resources; absent: the FROM template's), ``context`` tarball) -> NDJSON
    ``BuildEvent`` lines. No read timeout: a RUN step may print nothing for long. ``InvalidRequest`` before
    anything is sent when ``name`` is not a template name or ``name:tag``."""
    form = {"name": check_template_ref(name), "dockerfile": dockerfile, "build_args": json.dumps(dict(build_args or {}))}
    if ready_cmd is not None:
        form["ready_cmd"] = ready_cmd
    if ready_port is not None:
        form["ready_port"] = str(ready_port)
    if egress is not None:
        policy = egress if isinstance(egress, EgressPolicy) else _validate(EgressPolicy, egress, "egress")
        form["egress"] = policy.model_dump_json()
    for key, value in (("memory_mib", memory_mib), ("vcpus", vcpus), ("disk_mib", disk_mib)):
        if value is not None:
            form[key] = str(value)
    return Call("POST", "/v1/templates", _none,
                data=form,
                files={"context": ("context.tar.gz", context, "application/gzip")},
                long_running=True, read_timeout_s=None)


def list_builds_call(name: str) -> Call[builtins.list[BuildInfo]]:
    """``GET /v1/templates/{name}/builds`` -> ``{"builds": [BuildInfo]}``, returned as the list."""
    return Call("GET", f"/v1/templates/{quote(check_id(name, 'template'), safe='')}/builds",
                lambda resp: _model(BuildList)(resp).builds)


def delete_template_call(name: str) -> Call[None]:
    """``DELETE /v1/templates/{name}`` -> 204; ``name:tag`` removes only the tag. ``InvalidRequest`` before
    anything is sent when ``name`` is not a template name or ``name:tag``."""
    check_template_ref(name)
    return Call("DELETE", f"/v1/templates/{quote(name, safe='')}", _none)


def set_pool_call(template: str, size: int, max_size: int | None = None) -> Call[PoolInfo]:
    """``PUT /v1/pools/{template}`` with ``{size, max_size?}`` -> the pool (bounds, target, ready slots)."""
    body = _validate(PoolSet, {"size": size, "max_size": max_size}, "pool")
    return Call("PUT", f"/v1/pools/{quote(check_id(template, 'template'), safe='')}", _model(PoolInfo),
                json=body.model_dump(exclude_none=True))


def list_nodes_call() -> Call[builtins.list[NodeInfo]]:
    """``GET /v1/nodes`` -> ``{"nodes": [NodeInfo]}``, returned as the list (operator tenant only)."""
    return Call("GET", "/v1/nodes", lambda r: _model(NodeList)(r).nodes)


def list_pools_call() -> Call[builtins.list[PoolInfo]]:
    """``GET /v1/pools`` -> ``{"pools": [PoolInfo]}``, returned as the list."""
    return Call("GET", "/v1/pools", lambda r: _model(PoolList)(r).pools)


def drain_node_call(node_id: str) -> Call[DrainStarted]:
    """``POST /v1/nodes/{id}/drain`` -> ``DrainStarted`` (operator tenant only; 403 ``forbidden`` otherwise)."""
    return Call("POST", f"/v1/nodes/{quote(check_id(node_id, 'node id'), safe='')}/drain", _model(DrainStarted))


def undrain_node_call(node_id: str) -> Call[NodeUndrained]:
    """``POST /v1/nodes/{id}/undrain`` -> ``NodeUndrained`` (operator tenant only; 403 ``forbidden`` otherwise,
    409 ``invalid_state`` while its drain runs or for a lost node)."""
    return Call("POST", f"/v1/nodes/{quote(check_id(node_id, 'node id'), safe='')}/undrain", _model(NodeUndrained))
