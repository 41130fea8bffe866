"""podbay's code-interpreter server: Jupyter kernels behind the HTTP protocol of E2B's code-interpreter SDKs.

It runs inside the ``code-interpreter`` template (templates/code-interpreter/Dockerfile) on guest port 49999 and
is reached through podbay's port edge (the ``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` headers or a port URL). The
wire format is the one E2B's open-source SDKs parse (github.com/e2b-dev/code-interpreter, ``python/
e2b_code_interpreter/models.py`` and ``js/src/messaging.ts``); the implementation is podbay's own: kernels are
started with ``jupyter_client`` directly (no Jupyter server), one kernel per context.

Routes:

- ``GET /health`` → ``"OK"``.
- ``POST /execute`` body ``{"code": str, "context_id"?: str, "language"?: str, "env_vars"?: {str: str},
  "timeout"?: float}`` → ``200`` ``application/x-ndjson``, one JSON object a line, in the order the kernel
  produced them:
  ``{"type": "number_of_executions", "execution_count": int}``,
  ``{"type": "stdout"|"stderr", "text": str, "timestamp": ISO 8601}``,
  ``{"type": "result", "is_main_result": bool, "text"?, "html"?, "markdown"?, "svg"?, "png"? (base64),
  "jpeg"?, "pdf"?, "latex"?, "json"?, "javascript"?, "data"?, "chart"?, "extra"?: {mime: value}}``,
  ``{"type": "error", "name": str, "value": str, "traceback": str}``,
  ``{"type": "keepalive"}`` every 5 s of silence (so a vanished client is noticed: the kernel is then
  interrupted), and last ``{"type": "end_of_execution"}``. ``context_id`` and ``language`` together → ``400``;
  an unknown context → ``404``. ``timeout`` (seconds, podbay's addition; E2B's SDKs bound the request instead)
  interrupts the kernel when it passes and reports ``error`` ``TimeoutError``. ``env_vars`` hold for this one
  execution and are removed after it. The header ``x-podbay-sandbox-env`` (a JSON object, set by podbay's port
  edge from the sandbox's create-time environment, E2B's ``envs``) is the context's lasting environment: set in
  its kernel before its first execution, as E2B's server does with envd's ``/envs``, and what ``env_vars`` fall
  back to afterwards.
- ``POST /contexts`` ``{"language"?: "python"|"bash", "cwd"?: str}`` → ``{"id", "language", "cwd"}`` (a new
  kernel started in ``cwd``, default ``/home/user``); ``GET /contexts`` → the list;
  ``POST /contexts/{id}/restart`` (a fresh kernel, same id, language and cwd); ``DELETE /contexts/{id}``.
  Errors are plain text with ``400``/``404``/``500``, as E2B's server answers.

Start: ``python3 server.py --host 0.0.0.0 --port 49999``. The port opens only after the default Python kernel
answers, so a readiness check on it (the template build's ``--ready-port``) means code runs at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import re
import shlex
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel
from jupyter_client.manager import AsyncKernelManager
from pydantic import BaseModel, Field

log = logging.getLogger("code-interpreter")

DEFAULT_CWD = os.environ.get("CODE_INTERPRETER_CWD", "/home/user")
#: Seconds of silence after which a ``keepalive`` line is written: a write is how a vanished client shows.
KEEPALIVE_S = 5.0
#: How long a starting kernel may take to answer (TCG guests are slow; the first import compiles nothing).
KERNEL_READY_S = 300.0
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"
#: Modules the default Python kernel imports at start (comma-separated; empty: none), without binding a name:
#: in the template this happens before its snapshot, so the first plot in a sandbox does not pay for importing
#: (and, for matplotlib, building its font cache) under emulation. Missing modules are skipped.
PRELOAD = os.environ.get("CODE_INTERPRETER_PRELOAD", "numpy,pandas,matplotlib.pyplot")
#: Seconds the port waits for the preload before it opens anyway (the import then goes on in the kernel, and a
#: first execution waits behind it): the template build gives the start command 300 s in all.
PRELOAD_WAIT_S = float(os.environ.get("CODE_INTERPRETER_PRELOAD_WAIT_S", "90"))

#: Run silently in every Python kernel as it starts: IPython gets a formatter for E2B's ``e2b/data`` MIME type
#: (the ``data`` of a result: a pandas DataFrame as ``{column: [values]}``, timestamps in ISO 8601), the shape
#: E2B's SDKs read into ``Result.data``. pandas is not imported for it: a DataFrame exists only once the code
#: imported pandas. Binds no name in the user's namespace.
PYTHON_SETUP = """
def _pb_setup():
    import sys
    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class DataFormatter(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict, str)

        def __call__(self, obj):
            pandas = sys.modules.get("pandas")
            if pandas is None or not isinstance(obj, pandas.DataFrame):
                return super().__call__(obj)
            return {str(k): [v.isoformat() if isinstance(v, pandas.Timestamp) else v for v in col]
                    for k, col in obj.to_dict(orient="list").items()}

    ip = get_ipython()
    ip.display_formatter.formatters["e2b/data"] = DataFormatter(parent=ip.display_formatter)
_pb_setup()
del _pb_setup
"""

#: Seconds the wall clock may move ahead of the monotonic one between two looks before this server counts itself
#: restored from a snapshot (guestd sets the time after a restore; the monotonic clock goes on from the snapshot).
RESTORE_JUMP_S = 5.0
#: Run silently in the default Python kernel after a restore: under emulation (TCG) a restored VM translates
#: every code path anew on its first use, so a sandbox from a warm slot paid that on its first execution;
#: done while the slot waits, it is paid before anyone asks (docs/code-interpreter.md, "Figures").
WARMUP_CODE = "1 + 1"


def restored(before: tuple[float, float], now: tuple[float, float], jump_s: float = RESTORE_JUMP_S) -> bool:
    """Whether the VM was restored between two looks at ``(wall clock, monotonic clock)`` (seconds): the wall
    clock moved ``jump_s`` or more further than the monotonic one."""
    return (now[0] - before[0]) - (now[1] - before[1]) >= jump_s


#: Kernels this server starts, by language: the Python modules that are the kernels (``-f`` connection file).
KERNEL_MODULES = {"python": "ipykernel_launcher", "bash": "bash_kernel"}
LANGUAGE_ALIASES = {"py": "python", "python3": "python", "ipython": "python", "sh": "bash", "shell": "bash"}
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Request header with the sandbox's create-time environment (JSON object), added by podbay's port edge.
SANDBOX_ENV_HEADER = "x-podbay-sandbox-env"

#: MIME type → the field of E2B's ``Result`` it fills (template/server/api/models/result.py in E2B's repository).
MIME_FIELDS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
    "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
    "application/json": "json", "application/javascript": "javascript", "e2b/data": "data",
    "e2b/chart": "chart",
}


def normalize_language(language: str | None) -> str:
    """E2B's rule (lower case, trimmed, ``python`` when empty) plus podbay's aliases."""
    lang = (language or "python").strip().lower() or "python"
    return LANGUAGE_ALIASES.get(lang, lang)


def shape_result(data: dict[str, Any], is_main_result: bool) -> dict[str, Any]:
    """A Jupyter MIME bundle (``display_data``/``execute_result`` content ``data``) as E2B's ``result`` line:
    known MIME types become named fields, the rest go to ``extra``; a quoted ``text/plain`` (a ``str``'s repr)
    loses its quotes, as E2B's server does. Fields without a value are left out."""
    out: dict[str, Any] = {"type": "result", "is_main_result": is_main_result}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            out[field] = value
    text = out.get("text")
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        out["text"] = text[1:-1]
    if extra:
        out["extra"] = extra
    return out


def env_code(language: str, env: dict[str, str], lasting: dict[str, str] | None = None) -> tuple[str, str]:
    """(code that sets ``env`` in a kernel of ``language``, code that undoes it afterwards). Python restores
    the values the variables had; Bash sets those of ``lasting`` (the context's create-time environment) back
    and unsets the others (as E2B's server does)."""
    if language == "python":
        keys = json.dumps(sorted(env))
        return (f"import os as _pb_os\n_pb_os._podbay_saved_env = {{k: _pb_os.environ.get(k) for k in {keys}}}\n"
                f"_pb_os.environ.update({json.dumps(env)})\ndel _pb_os",
                "import os as _pb_os\nfor _pb_k, _pb_v in _pb_os.__dict__.pop('_podbay_saved_env', {}).items():\n"
                "    _pb_os.environ.pop(_pb_k, None) if _pb_v is None else _pb_os.environ.__setitem__(_pb_k, _pb_v)\n"
                "del _pb_os")
    set_ = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
    lasting = lasting or {}
    undo = [f"export {k}={shlex.quote(lasting[k])}" for k in env if k in lasting]
    gone = [k for k in env if k not in lasting]
    if gone:
        undo.append("unset " + " ".join(gone))
    return set_, "\n".join(undo)


def lasting_env_code(language: str, env: dict[str, str]) -> str:
    """Code that sets ``env`` in a kernel of ``language`` for good (the sandbox's create-time environment)."""
    if language == "python":
        return f"import os as _pb_os\n_pb_os.environ.update({json.dumps(env)})\ndel _pb_os"
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())


def parse_sandbox_env(raw: str | None) -> dict[str, str]:
    """The create-time environment of :data:`SANDBOX_ENV_HEADER` (a JSON object of strings); names that are
    not variable names, and a header that does not parse, are left out (it is podbay's, not the caller's)."""
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str) and ENV_NAME.match(k)}


def _timestamp(msg: dict[str, Any]) -> str:
    date = msg.get("header", {}).get("date")
    if isinstance(date, datetime.datetime):
        return date.isoformat()
    return str(date) if date else datetime.datetime.now(datetime.UTC).isoformat()


class _Specs(KernelSpecManager):
    """The kernels of :data:`KERNEL_MODULES`, run by this server's own interpreter: no kernelspec directories
    have to be installed (or trusted) for them."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        # jupyter_client looks up its default name ("python3") once while the manager is being made.
        module = KERNEL_MODULES.get(LANGUAGE_ALIASES.get(kernel_name, kernel_name))
        if module is None:
            raise NoSuchKernel(kernel_name)
        return KernelSpec(argv=[sys.executable, "-m", module, "-f", "{connection_file}"], display_name=kernel_name,
                          language=kernel_name, interrupt_mode="signal")


_SPECS = _Specs()


class Context:
    """One kernel: its id (the context id), language and working directory, and the executions waiting for
    its IOPub messages (by the request's ``msg_id``). One execution at a time (``lock``)."""

    def __init__(self, language: str, cwd: str) -> None:
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.km = AsyncKernelManager(kernel_name=language, kernel_spec_manager=_SPECS)
        self.kc: Any = None
        self.lock = asyncio.Lock()
        self.waiting: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self.reader: asyncio.Task[None] | None = None
        self.cleanup: str | None = None
        #: the sandbox's create-time environment, once set in this kernel (None: not yet)
        self.lasting: dict[str, str] | None = None

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def start(self) -> None:
        os.makedirs(self.cwd, exist_ok=True)
        env = {**os.environ}
        env.setdefault("MPLBACKEND", INLINE_BACKEND)
        await self.km.start_kernel(cwd=self.cwd, env=env)
        await self._connect()

    async def _connect(self) -> None:
        self.kc = self.km.client()
        # No heartbeat channel: a paused or snapshotted guest would read as a dead kernel after it resumes.
        self.kc.start_channels(hb=False)
        await self.kc.wait_for_ready(timeout=KERNEL_READY_S)
        self.reader = asyncio.create_task(self._read())
        if self.language == "python":
            await self._silent(PYTHON_SETUP)

    async def _read(self) -> None:
        """Route every IOPub message to the execution that asked for it (its parent's ``msg_id``)."""
        while True:
            msg = await self.kc.get_iopub_msg()
            queue = self.waiting.get(msg.get("parent_header", {}).get("msg_id", ""))
            if queue is not None:
                queue.put_nowait(msg)

    async def _disconnect(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(BaseException):
                await self.reader
            self.reader = None
        if self.kc is not None:
            self.kc.stop_channels()
        for queue in self.waiting.values():
            queue.put_nowait({"msg_type": "_restarted"})

    async def restart(self) -> None:
        self.lasting = None
        self.cleanup = None
        await self._disconnect()
        await self.km.restart_kernel(now=True)
        await self._connect()

    async def shutdown(self) -> None:
        await self._disconnect()
        with contextlib.suppress(Exception):
            await self.km.shutdown_kernel(now=True)

    async def _silent(self, code: str, timeout_s: float = KERNEL_READY_S) -> None:
        """Run ``code`` without output or history and wait until the kernel is idle again."""
        msg_id = self.kc.execute(code, silent=True, store_history=False, allow_stdin=False)
        queue = self.waiting[msg_id] = asyncio.Queue()
        try:
            while True:
                msg = await asyncio.wait_for(queue.get(), timeout_s)
                if msg["msg_type"] == "_restarted" or (
                        msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle"):
                    return
        finally:
            self.waiting.pop(msg_id, None)

    async def _interrupt_and_wait(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        await self.km.interrupt_kernel()
        while True:
            msg = await asyncio.wait_for(queue.get(), 60)
            if msg["msg_type"] == "_restarted" or (
                    msg["msg_type"] == "status" and msg.get("content", {}).get("execution_state") == "idle"):
                return

    async def execute(self, code: str, env: dict[str, str], timeout_s: float | None,
                      lasting: dict[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
        """The output lines of one execution (module docstring), ``end_of_execution`` excluded. ``lasting``:
        the sandbox's create-time environment, set in the kernel before its first execution."""
        async with self.lock:
            if self.cleanup:
                code_after, self.cleanup = self.cleanup, None
                await self._silent(code_after)
            if self.lasting is None:
                self.lasting = dict(lasting or {})
                if self.lasting:
                    await self._silent(lasting_env_code(self.language, self.lasting))
            if env:
                set_env, self.cleanup = env_code(self.language, env, self.lasting)
                await self._silent(set_env)
            # stop_on_error=False: executions here run one at a time, so there is no queue of later cells to
            # drop after an error; with True the kernel aborts a request that arrives just after an error
            # (an interrupt's KeyboardInterrupt included), which would fail the next execution for no reason.
            msg_id = self.kc.execute(code, store_history=True, allow_stdin=False, stop_on_error=False)
            queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
            self.waiting[msg_id] = queue
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s if timeout_s else None
            timed_out = errored = started = False
            try:
                while True:
                    wait = KEEPALIVE_S
                    if deadline is not None and not timed_out:
                        wait = max(0.0, min(wait, deadline - loop.time()))
                    try:
                        msg = await asyncio.wait_for(queue.get(), wait)
                    except TimeoutError:
                        if deadline is not None and not timed_out and loop.time() >= deadline:
                            timed_out = True
                            await self.km.interrupt_kernel()
                            continue
                        if not await self.km.is_alive():
                            yield {"type": "error", "name": "DeadKernelError",
                                   "value": "The kernel died; restart the context", "traceback": ""}
                            return
                        yield {"type": "keepalive"}
                        continue
                    kind, content = msg["msg_type"], msg.get("content", {})
                    if kind == "_restarted":
                        yield {"type": "error", "name": "ContextRestarting", "value": "Context was restarted",
                               "traceback": ""}
                        return
                    if kind == "status" and content.get("execution_state") == "idle":
                        if not started:
                            # Idle without the input ever announced: the kernel aborted the request (it came
                            # while an earlier error stopped the queue).
                            yield {"type": "error", "name": "ExecutionAborted", "value": "Execution was aborted",
                                   "traceback": ""}
                        return
                    if kind == "execute_input":
                        started = True
                        yield {"type": "number_of_executions", "execution_count": content["execution_count"]}
                    elif kind == "stream":
                        name = "stderr" if content.get("name") == "stderr" else "stdout"
                        yield {"type": name, "text": content.get("text", ""), "timestamp": _timestamp(msg)}
                    elif kind in ("display_data", "execute_result"):
                        yield shape_result(dict(content.get("data", {})), kind == "execute_result")
                    elif kind == "error" and not errored:
                        errored = True
                        if timed_out:
                            yield {"type": "error", "name": "TimeoutError",
                                   "value": f"Execution timed out after {timeout_s:g} s; the kernel was interrupted",
                                   "traceback": "\n".join(content.get("traceback", []))}
                        else:
                            yield {"type": "error", "name": content.get("ename", ""),
                                   "value": content.get("evalue", ""),
                                   "traceback": "\n".join(content.get("traceback", []))}
            except (asyncio.CancelledError, GeneratorExit):
                # The client went away (or the request was cancelled): stop the code so that the context is
                # free for the next execution, as E2B's server does, and hold the context until the kernel is
                # idle: a request sent while the interrupt's error is handled would be aborted by the kernel.
                with contextlib.suppress(BaseException):
                    await asyncio.shield(self._interrupt_and_wait(queue))
                raise
            finally:
                self.waiting.pop(msg_id, None)


class ExecuteRequest(BaseModel):
    code: str = Field(description="Code to run")
    context_id: str | None = Field(None, description="Context to run it in (exclusive with language)")
    language: str | None = Field(None, description="Language's default context to run it in")
    env_vars: dict[str, str] | None = Field(None, description="Environment for this execution only")
    timeout: float | None = Field(None, gt=0, description="Seconds until the kernel is interrupted")


class CreateContext(BaseModel):
    language: str | None = Field(None, description="python (default) or bash")
    cwd: str | None = Field(None, description="Working directory of the kernel, default /home/user")


class Server:
    """The contexts by id, and each language's default context (Python's made at start)."""

    def __init__(self, cwd: str) -> None:
        self.cwd = cwd
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}
        self.default_lock = asyncio.Lock()

    async def create(self, language: str, cwd: str) -> Context:
        if language not in KERNEL_MODULES:
            raise ValueError(f"language {language!r} is not available here (one of {', '.join(KERNEL_MODULES)})")
        ctx = Context(language, cwd)
        await ctx.start()
        self.contexts[ctx.id] = ctx
        return ctx

    async def default(self, language: str) -> Context:
        async with self.default_lock:
            ctx = self.contexts.get(self.defaults.get(language, ""))
            if ctx is None:
                ctx = await self.create(language, self.cwd)
                self.defaults[language] = ctx.id
            return ctx

    async def preload(self, modules: str) -> None:
        """Import ``modules`` (comma-separated) in the default Python kernel, binding no name."""
        names = [m.strip() for m in modules.split(",") if m.strip()]
        if names:
            ctx = await self.default("python")
            await ctx._silent("import importlib as _pb_il\n"
                              f"for _pb_m in {names!r}:\n"
                              "    try:\n        _pb_il.import_module(_pb_m)\n"
                              "    except ImportError:\n        pass\n"
                              "del _pb_il, _pb_m", timeout_s=1800)

    async def warm_after_restore(self, port: int, poll_s: float = 1.0) -> None:
        """Watch the clocks; after each restore (:func:`restored`), run :data:`WARMUP_CODE` silently in the
        default Python kernel (no output, no history, the execution count unchanged) unless an execution holds
        it, and ask this server's own ``/health``, so that the paths of a first execution are translated
        before a client's request needs them."""
        before = (time.time(), time.monotonic())
        while True:
            await asyncio.sleep(poll_s)
            now = (time.time(), time.monotonic())
            jumped, before = restored(before, now), now
            if not jumped:
                continue
            log.info("restored: warming the default python context")
            with contextlib.suppress(Exception):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /health HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
                await writer.drain()
                await reader.read()
                writer.close()
            ctx = self.contexts.get(self.defaults.get("python", ""))
            if ctx is not None and not ctx.lock.locked():
                with contextlib.suppress(Exception):
                    async with ctx.lock:
                        await ctx._silent(WARMUP_CODE, timeout_s=120)

    async def close(self) -> None:
        for ctx in list(self.contexts.values()):
            await ctx.shutdown()


def make_app(cwd: str = DEFAULT_CWD, port: int = 49999) -> FastAPI:
    state = Server(cwd)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.default("python")
        preload = asyncio.create_task(state.preload(PRELOAD))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(preload), PRELOAD_WAIT_S)
        log.info("default python context ready (preload %s)", "done" if preload.done() else "still running")
        warm = asyncio.create_task(state.warm_after_restore(port))
        try:
            yield
        finally:
            warm.cancel()
            preload.cancel()
            await state.close()

    app = FastAPI(title="podbay code interpreter", lifespan=lifespan)

    @app.get("/health")
    async def health() -> str:
        return "OK"

    @app.post("/execute", response_model=None)
    async def execute(req: ExecuteRequest, request: Request) -> StreamingResponse | PlainTextResponse:
        if req.context_id and req.language:
            return PlainTextResponse("Only one of context_id or language can be provided", status_code=400)
        bad = [k for k in (req.env_vars or {}) if not ENV_NAME.match(k)]
        if bad:
            return PlainTextResponse(f"Invalid environment variable name(s): {', '.join(bad)}", status_code=400)
        if req.context_id:
            ctx = state.contexts.get(req.context_id)
            if ctx is None:
                return PlainTextResponse(f"Context {req.context_id} not found", status_code=404)
        else:
            try:
                ctx = await state.default(normalize_language(req.language))
            except ValueError as exc:
                return PlainTextResponse(str(exc), status_code=400)

        async def lines() -> AsyncIterator[str]:
            lasting = parse_sandbox_env(request.headers.get(SANDBOX_ENV_HEADER))
            async for item in ctx.execute(req.code, req.env_vars or {}, req.timeout, lasting):
                yield json.dumps(item) + "\n"
            yield '{"type": "end_of_execution"}\n'

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/contexts", response_model=None)
    async def create_context(req: CreateContext) -> dict[str, str] | PlainTextResponse:
        try:
            ctx = await state.create(normalize_language(req.language), req.cwd or cwd)
        except ValueError as exc:
            return PlainTextResponse(str(exc), status_code=400)
        except OSError as exc:
            return PlainTextResponse(f"Failed to create context: {exc}", status_code=500)
        return ctx.describe()

    @app.get("/contexts")
    async def list_contexts() -> list[dict[str, str]]:
        return [c.describe() for c in state.contexts.values()]

    @app.post("/contexts/{context_id}/restart", response_model=None)
    async def restart_context(context_id: str) -> PlainTextResponse | None:
        ctx = state.contexts.get(context_id)
        if ctx is None:
            return PlainTextResponse(f"Context {context_id} not found", status_code=404)
        await ctx.restart()
        return None

    @app.delete("/contexts/{context_id}", response_model=None)
    async def delete_context(context_id: str) -> PlainTextResponse | None:
        ctx = state.contexts.pop(context_id, None)
        if ctx is None:
            return PlainTextResponse(f"Context {context_id} not found", status_code=404)
        for lang, cid in list(state.defaults.items()):
            if cid == context_id:
                del state.defaults[lang]
        await ctx.shutdown()
        return None

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="podbay's code-interpreter server (E2B's protocol)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=49999)
    p.add_argument("--cwd", default=DEFAULT_CWD, help="default contexts' working directory")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    # One worker: the contexts are this process's kernels. Long keep-alive: SDKs reuse their connection.
    uvicorn.run(make_app(args.cwd, args.port), host=args.host, port=args.port, log_level="warning", timeout_keep_alive=640)


if __name__ == "__main__":
    main()
