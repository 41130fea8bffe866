"""The envd protocol (E2B's in-sandbox API) on the node's data plane, translated onto the guest channel.

Mounted by the data plane at ``/internal/e2b/{sandbox_id}/``, behind the internal token and generation
fencing like every data-plane route; the API proxies E2B SDK traffic here (services/api/edge/envd.py).

    /process.Process/{List,Connect,Start,Update,StreamInput,SendInput,SendSignal,CloseStdin}   Connect RPC
    /filesystem.Filesystem/{Stat,MakeDir,Move,ListDir,Remove,WatchDir,CreateWatcher,...}       Connect RPC
    /health, /files                                                                            plain HTTP

Connect RPC (JSON and binary codecs, unary and server streaming) is served by the ``connectrpc`` package
from the .proto files in ``proto/`` (regenerate with ``scripts/gen_envd.sh``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from connectrpc.request import RequestContext
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from podbay.channel.client import GuestChannel
from podbay.contracts.templates import ImageConfig
from podbay.errors import NotFound

from .files import download, error_response, health, upload
from .filesystem import FilesystemService
from .process import ProcessService, ProcessTable, close_tables
from .proto.filesystem.filesystem_connect import FilesystemASGIApplication
from .proto.process.process_connect import ProcessASGIApplication

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

    from ..build.defaults import ExecDefaults
    from ..ops.sandboxes import SandboxManager

__all__ = ["EnvdApp", "SANDBOX_HEADER", "PREFIX"]

PREFIX = "/internal/e2b"
# Set by the dispatcher from the path; envd handlers read it like any header.
SANDBOX_HEADER = "x-podbay-sandbox-id"
_GENERATION_HEADER = "x-podbay-generation"


class EnvdApp:
    """ASGI app for ``/internal/e2b/{sandbox_id}/<envd path>``: routes to the process and filesystem
    Connect services or the plain HTTP routes, with the sandbox id passed as ``SANDBOX_HEADER``."""

    def __init__(self, manager: SandboxManager, defaults: ExecDefaults | None = None) -> None:
        self.manager = manager
        self.defaults = defaults
        self.tables: dict[str, ProcessTable] = {}
        self.filesystem = FilesystemService(self._fs_channel)
        self._process_app = ProcessASGIApplication(ProcessService(
            self._proc_channel, self._template_config if defaults is not None else None))
        self._fs_app = FilesystemASGIApplication(self.filesystem)
        self._http_app = Starlette(routes=[
            Route("/health", health, methods=["GET"]),
            Route("/files", functools.partial(download, channel_for=self._http_channel), methods=["GET"]),
            Route("/files", functools.partial(upload, channel_for=self._http_channel, changed=self._uploaded),
                  methods=["POST"]),
        ])

    def _channel(self, sandbox_id: str, generation: str | None) -> GuestChannel:
        try:
            return self.manager.channel(sandbox_id, int(generation) if generation and generation.isdigit() else None)
        except NotFound:
            self.tables.pop(sandbox_id, None)
            raise

    def _proc_channel(self, ctx: RequestContext[Any, Any]) -> tuple[GuestChannel, ProcessTable]:
        headers = ctx.request_headers
        sandbox_id = headers.get(SANDBOX_HEADER, "")
        ch = self._channel(sandbox_id, headers.get(_GENERATION_HEADER))
        for gone in [s for s in self.tables if s not in self.manager.vms]:
            close_tables({gone: self.tables.pop(gone)})  # deleted sandboxes leave nothing behind
        return ch, self.tables.setdefault(sandbox_id, ProcessTable())

    async def _template_config(self, ctx: RequestContext[Any, Any]) -> ImageConfig | None:
        """The sandbox's template config (a built template's WORKDIR, USER, ENV), None for built-in ones."""
        assert self.defaults is not None
        return await self.defaults.get(ctx.request_headers.get(SANDBOX_HEADER, ""))

    def _fs_channel(self, ctx: RequestContext[Any, Any]) -> tuple[str, GuestChannel]:
        headers = ctx.request_headers
        sandbox_id = headers.get(SANDBOX_HEADER, "")
        return sandbox_id, self._channel(sandbox_id, headers.get(_GENERATION_HEADER))

    def _uploaded(self, request: Request, path: str) -> None:
        self.filesystem.note_change(request.headers.get(SANDBOX_HEADER, ""), path)

    def _http_channel(self, request: Request) -> GuestChannel:
        return self._channel(request.headers.get(SANDBOX_HEADER, ""), request.headers.get(_GENERATION_HEADER))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        path = path.removeprefix(PREFIX)
        sandbox_id, _, rest = path.lstrip("/").partition("/")
        if not sandbox_id:
            await error_response(404, "no sandbox in the path")(scope, receive, send)
            return
        rest = "/" + rest
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != SANDBOX_HEADER.encode()]
        headers.append((SANDBOX_HEADER.encode(), sandbox_id.encode()))
        inner = dict(scope, path=rest, raw_path=rest.encode(), root_path="", headers=headers)
        target: ASGIApp
        if rest.startswith("/process.Process/"):
            target = self._process_app
        elif rest.startswith("/filesystem.Filesystem/"):
            target = self._fs_app
        else:
            target = self._http_app
        await target(inner, receive, send)

    def close(self) -> None:
        """Stop the pumps and watchers this node runs for envd clients (guest processes keep running)."""
        close_tables(self.tables)
        self.filesystem.close()
