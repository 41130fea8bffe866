"""The tools and resources of ``podbay mcp``: thin wrappers over the async SDK, shaped for a model.

Each tool is an async method of ``SandboxTools`` whose parameters carry JSON-schema descriptions
(``Annotated[..., Field(description=...)]``); ``podbay.cli.mcp_server`` registers them with the MCP server
under the names in ``TOOL_NAMES`` and turns a ``podbay.errors.PodbayError`` into an MCP tool error. This
module imports nothing of the ``mcp`` package, so its argument mapping is testable without it.

Results are JSON objects (``dict``): the API's models dumped as JSON, plus notes where this layer shortened
something (exec output, file contents), since a model's context is small and an API answer may not be.

Errors: every tool raises what the SDK raises (``podbay.errors.PodbayError`` subclasses, carrying the API's
``code`` and ``message``), and ``InvalidRequest`` for arguments this layer refuses (bad base64, unknown
encoding).
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import IO, Annotated, Any, Literal, cast

from pydantic import BaseModel, Field

from podbay.errors import InvalidRequest
from podbay.sdk import AsyncClient

__all__ = [
    "SandboxTools",
    "TOOL_NAMES",
    "DEFAULT_MAX_OUTPUT_CHARS",
    "DEFAULT_MAX_READ_BYTES",
    "truncate_output",
    "FILE_RESOURCE",
    "SANDBOXES_RESOURCE",
]

#: Characters of stdout and of stderr an ``exec`` result keeps by default (each).
DEFAULT_MAX_OUTPUT_CHARS = 20_000
#: Bytes of a file ``read_file`` returns by default.
DEFAULT_MAX_READ_BYTES = 256 * 1024
#: The bound a caller may raise those to: past it a result is too large for any model's context.
_MAX_OUTPUT_CHARS_CAP = 1_000_000
_MAX_READ_BYTES_CAP = 8 * 1024 * 1024

#: The resource template of a sandbox file: ``podbay://sandboxes/sbx_1/files/etc/hostname`` is
#: ``/etc/hostname`` in sandbox ``sbx_1`` (``{+path}``: the path keeps its slashes).
FILE_RESOURCE = "podbay://sandboxes/{sandbox_id}/files/{+path}"
#: The static resource listing the tenant's sandboxes.
SANDBOXES_RESOURCE = "podbay://sandboxes"

SandboxId = Annotated[str, Field(description="The sandbox id, e.g. 'sbx_0123abcd' (from sandbox_create or "
                                 "sandbox_list).", min_length=1, max_length=64)]
GuestPath = Annotated[str, Field(description="An absolute path inside the sandbox, e.g. '/home/user/app.py'.",
                                 min_length=1, max_length=4096)]


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_none=True)


def truncate_output(text: str, limit: int) -> tuple[str, str | None]:
    """``text`` cut to at most ``limit`` characters (plus a marker line), and a note saying what was cut
    (``None`` when nothing was).

    Keeps the first quarter and the last three quarters of the budget: a command's end (its error, its
    summary) matters most, its start says what it was doing."""
    if len(text) <= limit:
        return text, None
    head = limit // 4
    tail = limit - head
    dropped = len(text) - head - tail
    marker = f"\n[... {dropped} characters cut ...]\n"
    return text[:head] + marker + text[len(text) - tail:], f"{dropped} of {len(text)} characters cut from the middle"


class _Enough(Exception):
    """Raised by ``_BoundedSink`` to stop a download once it holds what the caller asked for."""


class _BoundedSink(io.RawIOBase):
    """A binary sink keeping the first ``limit`` bytes; the write that goes past them raises ``_Enough``, so
    the download stops there (the SDK closes the response)."""

    def __init__(self, limit: int) -> None:
        self.buf = bytearray()
        self.limit = limit
        self.more = False

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        room = self.limit - len(self.buf)
        data = bytes(b)
        self.buf += data[:room]
        if len(data) > room:
            self.more = True
            raise _Enough
        return len(data)


class SandboxTools:
    """The MCP tools over one ``AsyncClient`` (whose API key sets the tenant: the API enforces the scope).

    Every method is one tool; its docstring is the tool's description (what the model reads)."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    async def sandbox_create(
        self,
        template: Annotated[str, Field(description="Template name ('base' has python3, git, curl), or "
                                       "name:tag.")] = "base",
        memory_mib: Annotated[int | None, Field(description="Memory in MiB; absent: the template's.",
                                                ge=128, le=16384)] = None,
        vcpus: Annotated[int | None, Field(description="vCPUs; absent: the template's.", ge=1, le=16)] = None,
        disk_mib: Annotated[int | None, Field(description="Root disk in MiB, at least the template's.", ge=1)] = None,
        metadata: Annotated[dict[str, str] | None, Field(description="Labels to attach (up to 64).")] = None,
        timeout_s: Annotated[int | None, Field(description="Lease in seconds (10 to 30 days): when it runs out "
                                               "and the sandbox is idle, on_lease_expiry happens. Absent: the "
                                               "server's default.", ge=10, le=30 * 86400)] = None,
        on_lease_expiry: Annotated[Literal["pause", "delete"] | None,
                                   Field(description="What the lease's end does (default: pause).")] = None,
    ) -> dict[str, Any]:
        """Create a sandbox (a microVM) from a template and wait until it runs. Returns its id, state and
        template. Environment variables are given per command, to exec."""
        info = await self.client.create_sandbox(template, memory_mib=memory_mib, vcpus=vcpus, disk_mib=disk_mib,
                                                metadata=metadata)
        if timeout_s is not None or on_lease_expiry is not None:
            # The SDK's create does not carry the lease; renewing it right away sets it from now.
            info = await self.client.set_timeout(info.id, timeout_s or 300, on_lease_expiry)
        return _dump(info)

    async def sandbox_list(self) -> dict[str, Any]:
        """List this key's sandboxes (id, template, state, created_at, metadata)."""
        return {"sandboxes": [_dump(s) for s in await self.client.list_sandboxes()]}

    async def sandbox_get(self, sandbox_id: SandboxId) -> dict[str, Any]:
        """Get one sandbox: state (running, paused, suspended, ...), template, node, lease, metadata."""
        return _dump(await self.client.get_sandbox(sandbox_id))

    async def exec(
        self,
        sandbox_id: SandboxId,
        command: Annotated[str | list[str], Field(description="A shell command line (a string, run by /bin/sh "
                                                  "-c) or an argv list run without a shell, e.g. "
                                                  "['python3', '-c', 'print(1)'].")],
        cwd: Annotated[str | None, Field(description="Working directory in the sandbox.")] = None,
        env: Annotated[dict[str, str] | None, Field(description="Extra environment variables.")] = None,
        timeout_s: Annotated[float | None, Field(description="Kill the command after this many seconds "
                                                 "(default: the server's exec timeout).", gt=0)] = None,
        stdin: Annotated[str | None, Field(description="Text given to the command on stdin.")] = None,
        max_output_chars: Annotated[int, Field(description="Characters of stdout and of stderr to return "
                                               "(each); the middle of longer output is cut, with a note.",
                                               ge=100, le=_MAX_OUTPUT_CHARS_CAP)] = DEFAULT_MAX_OUTPUT_CHARS,
    ) -> dict[str, Any]:
        """Run a command in a sandbox and wait for it to end. Returns stdout, stderr, exit_code (-N: killed by
        signal N), timed_out and duration_ms; long output is cut in the middle and a 'notes' list says so."""
        r = await self.client.exec(sandbox_id, command, cwd=cwd, env=env, timeout_s=timeout_s, stdin=stdin)
        stdout, out_note = truncate_output(r.stdout, max_output_chars)
        stderr, err_note = truncate_output(r.stderr, max_output_chars)
        result: dict[str, Any] = {"stdout": stdout, "stderr": stderr, "exit_code": r.exit_code,
                                  "timed_out": r.timed_out, "duration_ms": r.duration_ms}
        notes = [f"{name}: {note}" for name, note in (("stdout", out_note), ("stderr", err_note)) if note]
        if r.output_truncated:
            notes.append("the server kept only the first 16 MiB of stdout or stderr")
        if notes:
            result["notes"] = notes
        return result

    async def read_file(
        self,
        sandbox_id: SandboxId,
        path: GuestPath,
        encoding: Annotated[Literal["utf-8", "base64"] | None,
                            Field(description="'utf-8' for text, 'base64' for bytes; absent: text when the "
                                  "content is UTF-8, base64 otherwise.")] = None,
        max_bytes: Annotated[int, Field(description="Bytes to read at most; a longer file is cut, with a note.",
                                        ge=1, le=_MAX_READ_BYTES_CAP)] = DEFAULT_MAX_READ_BYTES,
    ) -> dict[str, Any]:
        """Read a file from a sandbox. Returns content, encoding ('utf-8' or 'base64'), and truncated=true
        when the file is longer than max_bytes."""
        data, more = await self._read(sandbox_id, path, max_bytes)
        content, used = _encode(data, encoding, cut=more)
        result: dict[str, Any] = {"path": path, "content": content, "encoding": used, "truncated": more}
        if more:
            result["notes"] = [f"only the first {max_bytes} bytes were read"]
        return result

    async def _read(self, sandbox_id: str, path: str, limit: int) -> tuple[bytes, bool]:
        sink = _BoundedSink(limit)
        try:
            await self.client.read_file_into(sandbox_id, path, cast(IO[bytes], sink))
        except _Enough:
            pass
        return bytes(sink.buf), sink.more

    async def write_file(
        self,
        sandbox_id: SandboxId,
        path: GuestPath,
        content: Annotated[str, Field(description="The file's whole new content.")],
        encoding: Annotated[Literal["utf-8", "base64"], Field(description="How content is given: text, or "
                                                              "base64 for bytes.")] = "utf-8",
        mode: Annotated[int, Field(description="Permission bits, e.g. 420 (0o644) or 493 (0o755).",
                                   ge=0, le=0o7777)] = 0o644,
    ) -> dict[str, Any]:
        """Write (create or replace) a file in a sandbox; parent directories are created. Returns its info
        (path, size, mode)."""
        if encoding == "base64":
            try:
                data = base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise InvalidRequest(f"content is not valid base64: {exc}") from exc
        else:
            data = content.encode("utf-8")
        return _dump(await self.client.write_file(sandbox_id, path, data, mode=mode))

    async def list_files(self, sandbox_id: SandboxId, path: GuestPath) -> dict[str, Any]:
        """List a directory in a sandbox: each entry's name, path, type (file, dir, symlink, other), size."""
        return {"path": path, "entries": [_dump(f) for f in await self.client.list_files(sandbox_id, path)]}

    async def snapshot_create(
        self,
        sandbox_id: SandboxId,
        kind: Annotated[Literal["full", "disk"], Field(description="'full': memory and disk (processes keep "
                                                       "running after a rollback or fork); 'disk': the disk "
                                                       "only.")] = "full",
    ) -> dict[str, Any]:
        """Take a snapshot of a running or paused sandbox now; returns it (id, kind, state) once ready."""
        return _dump(await self.client.snapshot_sandbox(sandbox_id, kind))

    async def snapshot_list(self, sandbox_id: SandboxId) -> dict[str, Any]:
        """List a sandbox's ready snapshots, newest first."""
        return {"snapshots": [_dump(s) for s in await self.client.list_snapshots(sandbox_id)]}

    async def fork(
        self,
        sandbox_id: SandboxId,
        count: Annotated[int, Field(description="How many children to start.", ge=1, le=16)] = 1,
        snapshot_id: Annotated[str | None, Field(description="Fork from this snapshot of the sandbox; absent: "
                                                 "from a new full snapshot taken now.")] = None,
    ) -> dict[str, Any]:
        """Fork a sandbox: start count new sandboxes whose memory and disk are copies of it (or of one of its
        snapshots). Returns the snapshot used and each child's sandbox_id and state."""
        return _dump(await self.client.fork_sandbox(sandbox_id, count, snapshot_id))

    async def rollback(
        self,
        sandbox_id: SandboxId,
        snapshot_id: Annotated[str, Field(description="One of the sandbox's snapshots (snapshot_list).")],
    ) -> dict[str, Any]:
        """Roll a sandbox back to one of its snapshots (same id; disk, and memory for a full snapshot, as they
        were then). Returns the sandbox."""
        return _dump(await self.client.restore_sandbox(sandbox_id, snapshot_id))

    async def pause(self, sandbox_id: SandboxId) -> dict[str, Any]:
        """Pause a running sandbox (its VM is frozen and costs no CPU); resume continues it where it was."""
        return _dump(await self.client.pause_sandbox(sandbox_id))

    async def resume(self, sandbox_id: SandboxId) -> dict[str, Any]:
        """Resume a paused or suspended sandbox."""
        return _dump(await self.client.resume_sandbox(sandbox_id))

    async def kill(self, sandbox_id: SandboxId) -> dict[str, Any]:
        """Delete a sandbox and its VM for good (its snapshots go with it)."""
        return _dump(await self.client.delete_sandbox(sandbox_id))

    async def port_url(
        self,
        sandbox_id: SandboxId,
        port: Annotated[int, Field(description="A TCP port a server listens on inside the sandbox.",
                                   ge=1, le=65535)],
    ) -> dict[str, Any]:
        """The preview URL of a port of a sandbox (e.g. a web server on 8000), with the access token to send
        as the header named in 'header' (or once as ?podbay_token=) unless the port is public."""
        return _dump(await self.client.port_url(sandbox_id, port))

    # resources

    async def file_resource(self, sandbox_id: str, path: str) -> str | bytes:
        """A sandbox file's content (``path`` without its leading slash): text when it is UTF-8, bytes
        otherwise; at most ``DEFAULT_MAX_READ_BYTES`` bytes (``read_file`` reads more)."""
        data, _ = await self._read(sandbox_id, "/" + path.lstrip("/"), DEFAULT_MAX_READ_BYTES)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return data

    async def sandboxes_resource(self) -> dict[str, Any]:
        """The tenant's sandboxes (as ``sandbox_list``)."""
        return await self.sandbox_list()


def _encode(data: bytes, encoding: str | None, *, cut: bool) -> tuple[str, str]:
    """``(content, encoding)`` of ``data``: UTF-8 text when asked for or when it decodes (a cut file may end
    inside a character: that partial character is dropped), else base64."""
    if encoding != "base64":
        try:
            return data.decode("utf-8"), "utf-8"
        except UnicodeDecodeError as exc:
            if cut and exc.start >= len(data) - 3:
                return data[:exc.start].decode("utf-8"), "utf-8"
            if encoding == "utf-8":
                raise InvalidRequest(f"the file is not UTF-8 text (byte {exc.start}); read it as base64") from exc
    return base64.b64encode(data).decode("ascii"), "base64"


#: The tools, in the order they are listed (each a method of ``SandboxTools`` of the same name).
TOOL_NAMES = (
    "sandbox_create", "sandbox_list", "sandbox_get", "exec", "read_file", "write_file", "list_files",
    "snapshot_create", "snapshot_list", "fork", "rollback", "pause", "resume", "kill", "port_url",
)
