"""Running code in a sandbox's code interpreter (the ``code-interpreter`` template, docs/code-interpreter.md):
the request builder and the parser of its streamed answer, shared by the sync and async clients.

The server in the guest (templates/code-interpreter/server.py) listens on port 49999 and speaks E2B's
code-interpreter protocol; the SDK reaches it through the API's port edge in its path form
(``/ports/49999-{sandbox id}/execute``), opened by the tenant's API key (the edge drops the key before the
request reaches the guest). The answer is NDJSON, one output a line (``stdout``, ``stderr``, ``result``,
``error``, ``number_of_executions``, ``keepalive``, ``end_of_execution``), which :func:`apply_line` folds into a
:class:`CodeExecution`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from podbay.errors import InvalidRequest, PodbayError
from podbay.sdk._calls import Call, check_id

__all__ = ["CODE_INTERPRETER_PORT", "CodeError", "CodeExecution", "CodeResult", "OutputHandler", "apply_line",
           "run_code_call"]

#: The guest port of the code-interpreter server (E2B's ``JUPYTER_PORT``).
CODE_INTERPRETER_PORT = 49999
#: Seconds beyond ``timeout`` the client waits for the server's own interrupt to be reported.
_TIMEOUT_GRACE_S = 30.0

OutputHandler = Callable[[Any], Any]


class CodeResult(BaseModel):
    """One rich output (a Jupyter MIME bundle): ``is_main_result`` for the cell's value, else a ``display()``.
    ``png``/``jpeg`` are base64; ``json`` is the ``application/json`` value (attribute ``json_value``); MIME
    types without a field of their own are in ``extra``."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    is_main_result: bool = False
    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    png: str | None = None
    jpeg: str | None = None
    pdf: str | None = None
    latex: str | None = None
    json_value: Any = Field(None, alias="json")
    javascript: str | None = None
    data: Any = None
    chart: Any = None
    extra: dict[str, Any] | None = None

    def formats(self) -> list[str]:
        """The kinds this result carries (``text``, ``png``, ``json``, ... and ``extra``'s MIME types)."""
        names = [n for n in ("text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex") if getattr(self, n)]
        if self.json_value is not None:
            names.append("json")
        names += [n for n in ("javascript", "data", "chart") if getattr(self, n)]
        return names + list(self.extra or {})


class CodeError(BaseModel):
    """The exception the code raised: ``name`` (``ValueError``), ``value`` (its message) and ``traceback``
    (as the kernel formats it, ANSI colours included). ``TimeoutError`` when ``timeout`` interrupted it."""

    name: str
    value: str
    traceback: str = ""


class CodeExecution(BaseModel):
    """What one ``run_code`` produced: ``results`` in order, ``stdout``/``stderr`` chunks as they came,
    ``error`` (``None`` when the code ran through) and the kernel's ``execution_count``."""

    results: list[CodeResult] = Field(default_factory=list)
    stdout: list[str] = Field(default_factory=list)
    stderr: list[str] = Field(default_factory=list)
    error: CodeError | None = None
    execution_count: int | None = None

    @property
    def text(self) -> str | None:
        """The text of the main result (the value of the last expression), if any."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None


def run_code_call(sandbox_id: str, code: str, *, language: str | None = None, context: Any = None,
                  env: Mapping[str, str] | None = None, timeout: float | None = None) -> Call[None]:
    """``POST /ports/49999-{id}/execute`` with E2B's body (``code``, ``language`` or ``context_id``,
    ``env_vars``) plus ``timeout`` (seconds; the server interrupts the kernel then). ``context``: a context id
    or anything with an ``id`` (E2B's ``Context``). Raises ``InvalidRequest`` for both ``language`` and
    ``context``, a bad id, or a timeout that is not positive."""
    if not isinstance(code, str):
        raise InvalidRequest("code must be a string")
    context_id = getattr(context, "id", context)
    if context_id is not None and language is not None:
        raise InvalidRequest("give language or context, not both")
    if context_id is not None and not isinstance(context_id, str):
        raise InvalidRequest(f"context must be a context id or have an id, not {context!r}")
    if timeout is not None and not timeout > 0:
        raise InvalidRequest(f"timeout must be positive seconds, not {timeout!r}")
    body: dict[str, Any] = {"code": code}
    if language is not None:
        body["language"] = language
    if context_id is not None:
        body["context_id"] = context_id
    if env:
        body["env_vars"] = {str(k): str(v) for k, v in env.items()}
    if timeout is not None:
        body["timeout"] = float(timeout)
    label = check_id(sandbox_id).replace("_", "-")  # the edge's host-label spelling (docs/ports)

    def no_body(resp: httpx.Response) -> None:
        return None

    return Call("POST", f"/ports/{CODE_INTERPRETER_PORT}-{label}/execute", no_body, json=body, long_running=True,
                read_timeout_s=None if timeout is None else float(timeout) + _TIMEOUT_GRACE_S)


def apply_line(execution: CodeExecution, line: str, *, on_stdout: OutputHandler | None = None,
               on_stderr: OutputHandler | None = None, on_result: OutputHandler | None = None,
               on_error: OutputHandler | None = None) -> tuple[bool, Any]:
    """Fold one NDJSON ``line`` of the answer into ``execution`` and call the matching handler (``on_stdout``
    and ``on_stderr`` get the text, ``on_result`` a :class:`CodeResult`, ``on_error`` a :class:`CodeError`).
    Returns ``(ended, what the handler returned)``: ``ended`` on ``end_of_execution``; the second item is
    awaited by the asyncio client when it is awaitable. Blank lines, ``keepalive`` and unknown kinds are
    skipped (newer servers may add some). Raises ``PodbayError`` for a line that is not a JSON object."""
    if not line.strip():
        return False, None
    try:
        item = json.loads(line)
    except ValueError as exc:
        raise PodbayError(f"unexpected line from the code interpreter: {line[:200]!r}") from exc
    if not isinstance(item, dict):
        raise PodbayError(f"unexpected line from the code interpreter: {line[:200]!r}")
    kind = item.get("type")
    if kind == "end_of_execution":
        return True, None
    if kind == "stdout" or kind == "stderr":
        text = str(item.get("text") or "")
        (execution.stdout if kind == "stdout" else execution.stderr).append(text)
        handler = on_stdout if kind == "stdout" else on_stderr
        return False, handler(text) if handler else None
    if kind == "result":
        result = CodeResult.model_validate(item)
        execution.results.append(result)
        return False, on_result(result) if on_result else None
    if kind == "error":
        error = CodeError(name=str(item.get("name", "")), value=str(item.get("value", "")),
                          traceback=str(item.get("traceback", "")))
        execution.error = error
        return False, on_error(error) if on_error else None
    if kind == "number_of_executions" and isinstance(item.get("execution_count"), int):
        execution.execution_count = item["execution_count"]
    return False, None
