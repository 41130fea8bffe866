"""What every CLI command shares: the global options, the SDK client, output and error handling.

Exit codes: 0 success; 2 usage errors and API 4xx answers; 1 anything else (5xx, network, local I/O).
``podbay exec`` and ``podbay template build`` pass their command's exit code through instead.
Errors print one line on stderr, ``error: <message> (<code>)``, never a traceback; usage errors too
(``error: invalid value for '--vcpus': 'abc' is not a valid integer (usage)``, exit 2), through
``OneLineErrorsGroup``, the root command's class. ``--help`` output is typer's own.
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar

import typer
import typer.core
from pydantic import BaseModel, ValidationError
from typer.exceptions import TyperException
from rich.console import Console
from rich.table import Table

from podbay.clientconfig import config_path, load_client_config
from podbay.errors import PodbayError, Unauthorized
from podbay.sdk import Client
from podbay.sdk._http import UNREACHABLE

__all__ = [
    "with_progress",
    "OneLineErrorsGroup",
    "usage_message",
    "CliState",
    "state",
    "client",
    "require_key",
    "handle_errors",
    "fail",
    "exit_code_for",
    "console",
    "print_json",
    "print_record",
    "print_table",
    "print_one",
    "print_rows",
    "print_accepted",
    "parse_pairs",
    "JsonFlag",
    "IdArg",
    "NoWaitFlag",
]

P = ParamSpec("P")
R = TypeVar("R")

# The parameters most commands share, declared once (typer copies the Annotated info for each command).
#: ``--json``: print the answer as JSON instead of a table, a record or a line.
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON.")]
#: The id of the sandbox (or operation, webhook) a command acts on, shown as ``ID``.
IdArg = Annotated[str, typer.Argument(metavar="ID")]
#: ``--no-wait``: return once the API accepted the operation (see :func:`print_accepted`).
NoWaitFlag = Annotated[bool, typer.Option("--no-wait", help="Return at once; the operation id goes to stderr.")]


@dataclass
class CliState:
    """The global options (``--api-url``, ``--api-key``) and the client built from them, once."""

    api_url: str | None = None
    api_key: str | None = None
    _client: Client | None = field(default=None, repr=False)


def state(ctx: typer.Context) -> CliState:
    """The ``CliState`` the root callback stored (a fresh one when a command runs on its own)."""
    root = ctx.find_root()
    if not isinstance(root.obj, CliState):
        root.obj = CliState()
    return root.obj


def client(ctx: typer.Context) -> Client:
    """The SDK client for this invocation; closed when the command line finishes."""
    st = state(ctx)
    if st._client is None:
        require_key(st)
        st._client = Client(st.api_url, st.api_key)
        ctx.find_root().call_on_close(st._client.close)
    return st._client


def require_key(st: CliState) -> None:
    """Raise ``Unauthorized`` naming the places looked in when no API key is configured for ``st``."""
    if not load_client_config(st.api_url, st.api_key).api_key:
        # Said here, where the places looked in are known; the API could only say that no key came.
        path = config_path()
        raise Unauthorized(f"no API key: pass --api-key, set PODBAY_API_KEY, or run `podbay up`, which writes "
                           f"{path}" + ("" if path.exists() else f" ({path} does not exist)"))


def exit_code_for(exc: PodbayError) -> int:
    """2 for errors the caller can fix (HTTP 4xx), 1 for the rest."""
    return 2 if 400 <= exc.http_status < 500 else 1


def fail(message: str, code: str, exit_code: int) -> NoReturn:
    """Print ``error: <message> (<code>)`` on stderr and exit with ``exit_code``."""
    first_line = " ".join(message.split()) or "failed"
    print(f"error: {first_line} ({code})", file=sys.stderr, flush=True)
    raise typer.Exit(exit_code)


#: What a pydantic parsing error of a typed option means, said the way a person would.
_NOT_A = {"int_parsing": "a valid integer", "float_parsing": "a valid number", "bool_parsing": "a valid boolean"}


def usage_message(exc: TyperException) -> str:
    """The one-line text of a click/typer usage error, without its ``Usage:``/``Try`` lines.

    ``Invalid value for '--vcpus': Input should be a valid integer, ...`` (typer's pydantic wording)
    becomes ``invalid value for '--vcpus': 'abc' is not a valid integer``.
    """
    cause = exc.__cause__
    if isinstance(exc, typer.BadParameter) and isinstance(cause, ValidationError) and cause.errors():
        first = cause.errors()[0]
        wanted = _NOT_A.get(first["type"])
        exc.message = f"{first.get('input')!r} is not {wanted}" if wanted else first["msg"]
    format_message = getattr(exc, "format_message", None)
    text = " ".join(str(format_message() if callable(format_message) else exc.message).split()).rstrip(".")
    # Lower-case the opening word ("Invalid", "Missing", "No such"), never a name such as 'ID'.
    if len(text) > 1 and text[0].isupper() and text[1].islower():
        text = text[0].lower() + text[1:]
    return text or "invalid usage"


class OneLineErrorsGroup(typer.core.TyperGroup):
    """The root group: runs the command line as typer does, but prints usage errors as one line.

    Typer would print a boxed ``Usage/Try/Error`` block; scripts and people reading logs get
    ``error: <message> (usage)`` and exit 2 instead. The help a group prints when called without a
    command (``no_args_is_help``) is kept.
    """

    def main(  # type: ignore[override]  # click's main takes more keyword arguments than this override names
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            # Not standalone, so typer hands click's exceptions to us instead of printing them boxed.
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except TyperException as exc:
            if not standalone_mode:
                raise
            code = getattr(exc, "exit_code", 1)
            if type(exc).__name__ != "NoArgsIsHelpError":  # that one has printed the help already
                kind = "usage" if code == 2 else "error"  # click's UsageError family exits 2
                print(f"error: {usage_message(exc)} ({kind})", file=sys.stderr, flush=True)
            sys.exit(code)
        except typer.Abort:
            if not standalone_mode:
                raise
            print("error: aborted (aborted)", file=sys.stderr, flush=True)
            sys.exit(1)
        if not standalone_mode:
            return rv
        # Non-standalone typer returns an Exit's code, or the command's value (None for every command here).
        sys.exit(rv if isinstance(rv, int) else 0)


def handle_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a command so that errors end it with one line on stderr instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, TyperException):  # typer's own exits and usage errors
            raise
        except PodbayError as exc:
            message = exc.message
            if exc.code == "unavailable" and message.startswith(UNREACHABLE):
                message += "; is a stack running? `podbay status` tells, `podbay up` starts one"
            fail(message, exc.code, exit_code_for(exc))
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        except BrokenPipeError:
            # The reader went away (``| head``): stop quietly, as other Unix tools do.
            raise typer.Exit(1) from None
        except OSError as exc:
            fail(str(exc), "os_error", 1)
        except Exception as exc:  # the promise is "never a traceback"
            fail(f"{type(exc).__name__}: {exc}", "internal", 1)

    return wrapper


def console() -> Console:
    """A rich console on stdout; wide when not a terminal, so ids in tables are never cut."""
    out = sys.stdout
    width = None if out.isatty() else max(shutil.get_terminal_size().columns, 200)
    return Console(file=out, width=width, highlight=False, soft_wrap=False)


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def print_json(value: Any) -> None:
    """Print a model, a list of models or plain data as indented JSON on stdout."""
    print(json.dumps(_plain(value), indent=2, sort_keys=False, default=str))


def print_record(model: BaseModel, shown: Mapping[str, str] | None = None) -> None:
    """Print one model as ``field  value`` lines (a borderless two-column table).

    ``shown`` replaces the display of some fields (``{"mode": "0644"}``), keeping the model's field order.
    """
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in model.model_dump(mode="json").items():
        if shown is not None and key in shown:
            table.add_row(key, shown[key])
            continue
        text = "" if value is None else json.dumps(value) if isinstance(value, dict | list) else str(value)
        table.add_row(key, text)
    console().print(table)


def print_table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """Print rows under upper-case column headers; ``None`` shows as ``-``."""
    table = Table(box=None, pad_edge=False, show_edge=False)
    for name in columns:
        table.add_column(name.upper(), no_wrap=True)
    for row in rows:
        table.add_row(*("-" if v is None else str(v) for v in row))
    console().print(table)


def print_one(model: BaseModel, as_json: bool, shown: Mapping[str, str] | None = None) -> None:
    """Print one model as JSON (``--json``) or as a record (see :func:`print_record` for ``shown``)."""
    if as_json:
        print_json(model)
    else:
        print_record(model, shown)


def print_rows(value: Any, as_json: bool, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """Print ``value`` (a list of models) as JSON with ``--json``, else ``rows`` under ``columns``.

    ``rows`` is read only for the table: a generator over ``value`` is not run when JSON is asked for.
    """
    if as_json:
        print_json(value)
    else:
        print_table(columns, rows)


def print_accepted(info: Any, no_wait: bool) -> None:
    """Print ``info.id`` on stdout and, with ``--no-wait``, ``operation <info.operation_id>`` on stderr (the
    operation to follow with ``podbay operation get``), so that ``ID=$(podbay ...)`` still works."""
    print(info.id)
    if no_wait and info.operation_id:
        print(f"operation {info.operation_id}", file=sys.stderr)


def with_progress(what: str, fn: Callable[[], R]) -> R:
    """Run the blocking ``fn`` while a terminal on stderr shows ``what`` and the seconds elapsed (long
    transfers such as suspend and resume); without a terminal it just runs ``fn``."""
    if not sys.stderr.isatty():
        return fn()
    import concurrent.futures
    import time

    err = Console(file=sys.stderr, highlight=False)
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool, err.status(what) as status:
        fut = pool.submit(fn)
        while True:
            try:
                return fut.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                status.update(f"{what} ({time.monotonic() - t0:.0f} s)")


def parse_pairs(values: Sequence[str], option: str) -> dict[str, str]:
    """``["K=V", ...]`` -> ``{"K": "V"}``; ``typer.BadParameter`` (exit 2) for an item without ``=``."""
    out: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=option)
        out[key] = value
    return out
