"""``podbay events`` (the tenant's lifecycle events) and ``podbay webhook add|list|rm``.

``podbay events`` prints one line per event: ``<seq> <time> <sandbox> <type> <state>`` (``--json``: the
event as one JSON object per line). ``--resume NAME`` keeps the last position under the podbay config
directory (``<config dir>/events/NAME.pos``): a follower started again with the same name continues after
the last event it printed. The position is written after the line is printed and flushed.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import typer

from podbay.cli._common import IdArg, JsonFlag, client, handle_errors, print_json, print_rows
from podbay.clientconfig import config_path
from podbay.contracts.events import EVENT_TYPE_PATTERN, EVENT_TYPES, EventOut
from podbay.errors import InvalidRequest

__all__ = ["events", "webhook_app", "position_file", "read_position", "write_position"]

webhook_app = typer.Typer(help="Webhooks: signed POSTs of your tenant's lifecycle events.", no_args_is_help=True)

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def note_unknown_types(types: list[str]) -> None:
    """A note on stderr for each type podbay does not emit (``EventType``'s values): the API accepts any well-formed
    type, for types to come, so a typo would otherwise match nothing without a word. A malformed type gets no
    note: the request is refused with its own error."""
    for t in types:
        if t not in EVENT_TYPES and re.fullmatch(EVENT_TYPE_PATTERN, t):
            print(f"note: podbay emits no event of type {t!r}, so it matches nothing (types: "
                  f"{', '.join(EVENT_TYPES)})", file=sys.stderr)


def position_file(name: str) -> Path:
    """Where ``--resume NAME`` keeps its position; ``InvalidRequest`` for a name that is not a plain word."""
    if not _NAME.match(name):
        raise InvalidRequest(f"invalid --resume name {name!r}: expected 1 to 64 letters, digits, '_' or '-'")
    return config_path().parent / "events" / f"{name}.pos"


def read_position(path: Path) -> int | None:
    """The stored position, ``None`` when there is none yet; ``InvalidRequest`` for a damaged file."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"cannot read the position file {path}: {exc}") from None
    if not text.isdigit():
        raise InvalidRequest(f"the position file {path} does not hold a stream position")
    return int(text)


def write_position(path: Path, seq: int) -> None:
    """Store ``seq`` atomically (write a temporary file, then rename over the old one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{seq}\n", encoding="ascii")
    os.replace(tmp, path)


def _line(e: EventOut) -> str:
    at = e.at.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return f"{e.seq}\t{at}\t{e.sandbox_id or '-'}\t{e.type}\t{e.state or '-'}"


@handle_errors
def events(
    ctx: typer.Context,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep running and print new events as they come."),
    sandbox: list[str] = typer.Option([], "--sandbox", help="Only this sandbox's events; repeatable."),
    types: list[str] = typer.Option([], "--type", help="Only this event type (created, paused, ...); repeatable."),
    after: int | None = typer.Option(None, "--after", min=0, help="Start after this position (an event's seq)."),
    resume: str | None = typer.Option(None, "--resume", metavar="NAME",
                                      help="Continue after the position stored under NAME, and keep it updated."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
) -> None:
    """The tenant's lifecycle events in order, one line each: SEQ TIME SANDBOX TYPE STATE."""
    note_unknown_types(types)
    pos_file = position_file(resume) if resume else None
    if after is None and pos_file is not None:
        after = read_position(pos_file)
    for e in client(ctx).events(sandbox=sandbox or None, types=types or None, after=after, follow=follow):
        sys.stdout.write((e.model_dump_json() if as_json else _line(e)) + "\n")
        sys.stdout.flush()
        if pos_file is not None:
            write_position(pos_file, e.seq)


@webhook_app.command("add")
@handle_errors
def webhook_add(
    ctx: typer.Context,
    url: str = typer.Argument(..., metavar="URL"),
    types: list[str] = typer.Option([], "--type", help="Only this event type; repeatable (default: all)."),
    as_json: JsonFlag = False,
) -> None:
    """Add a webhook; prints its id and signing secret (shown only now)."""
    note_unknown_types(types)
    hook = client(ctx).webhooks.create(url, types)
    if as_json:
        print_json(hook)
        return
    print(f"id\t{hook.id}\nsecret\t{hook.secret}")
    print("keep the secret: it signs every delivery (Podbay-Signature) and is not shown again", file=sys.stderr)


@webhook_app.command("list")
@handle_errors
def webhook_list(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Your webhooks and how their last delivery went."""
    hooks = client(ctx).webhooks.list()
    print_rows(hooks, as_json, ["id", "url", "types", "delivered", "failed", "last_status", "attempts", "last_error"],
               ((h.id, h.url, ",".join(h.types) or "*", h.deliveries, h.failures, h.last_status, h.last_attempts,
                 h.last_error) for h in hooks))


@webhook_app.command("rm")
@handle_errors
def webhook_rm(ctx: typer.Context, webhook_id: IdArg) -> None:
    """Delete a webhook."""
    client(ctx).webhooks.delete(webhook_id)
    print(webhook_id)
