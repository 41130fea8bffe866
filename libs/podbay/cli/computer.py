"""``podbay computer screenshot|mouse|type|keys|fill|cdp``: a sandbox's browser (docs/computer-use.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from podbay.cli._common import client, handle_errors, print_json

__all__ = ["app"]

app = typer.Typer(help="Drive a sandbox's browser (templates with one, e.g. browser): screenshots, mouse, "
                  "keyboard, CDP.", no_args_is_help=True)

ID = typer.Argument(..., metavar="ID")


@app.command("screenshot")
@handle_errors
def screenshot(ctx: typer.Context, sandbox_id: str = ID,
               out: Path = typer.Option(..., "-o", "--output", help="PNG file to write ('-': stdout).")) -> None:
    """Save a PNG of the browser page's viewport."""
    png = client(ctx).screenshot(sandbox_id)
    if str(out) == "-":
        sys.stdout.buffer.write(png)
        return
    out.write_bytes(png)
    print(f"{out}: {len(png)} bytes")


@app.command("mouse")
@handle_errors
def mouse(
    ctx: typer.Context,
    sandbox_id: str = ID,
    action: str = typer.Argument(..., metavar="ACTION", help="move, click, drag or scroll."),
    x: float = typer.Argument(..., metavar="X"),
    y: float = typer.Argument(..., metavar="Y"),
    button: str = typer.Option("left", "--button", help="left, right or middle."),
    clicks: int = typer.Option(1, "--clicks", help="2 for a double click."),
    to: tuple[float, float] | None = typer.Option(None, "--to", help="X Y where a drag ends."),
    delta: tuple[float, float] | None = typer.Option(None, "--delta", help="DX DY of a scroll, CSS pixels."),
) -> None:
    """Move, click, drag (--to X Y) or scroll (--delta DX DY) at X Y (CSS pixels of the page)."""
    kw: dict[str, object] = {"button": button, "clicks": clicks}
    if to is not None:
        kw |= {"to_x": to[0], "to_y": to[1]}
    if delta is not None:
        kw |= {"delta_x": delta[0], "delta_y": delta[1]}
    print(client(ctx).mouse(sandbox_id, action, x, y, **kw).events, "events")


@app.command("type")
@handle_errors
def type_(ctx: typer.Context, sandbox_id: str = ID, text: str = typer.Argument(..., metavar="TEXT")) -> None:
    """Type TEXT at the page's focus."""
    client(ctx).keyboard(sandbox_id, text=text)


@app.command("keys")
@handle_errors
def keys(ctx: typer.Context, sandbox_id: str = ID,
         names: list[str] = typer.Argument(..., metavar="KEY...", help="Enter, Tab, Control+a, ...")) -> None:
    """Press keys in turn (DOM key names, modifiers joined with +)."""
    client(ctx).keyboard(sandbox_id, keys=names)


@app.command("fill")
@handle_errors
def fill(ctx: typer.Context, sandbox_id: str = ID,
         credential: str = typer.Argument(..., metavar="CREDENTIAL", help="A stored credential's name."),
         selector: str = typer.Argument(..., metavar="SELECTOR", help="CSS selector of the field.")) -> None:
    """Type a stored credential into a field of the page, if the page's origin is one of its hosts (checked
    outside the guest; the value is never shown)."""
    res = client(ctx).fill(sandbox_id, credential, selector)
    print(f"filled {res.credential} into {res.selector} on {res.origin} (audit {res.audit_id})")


@app.command("cdp")
@handle_errors
def cdp(ctx: typer.Context, sandbox_id: str = ID,
        as_json: bool = typer.Option(False, "--json", help="Print JSON (url, ws_url, token, port, browser).")) -> None:
    """Print the browser's CDP WebSocket URL (token included), for connect_over_cdp."""
    info = client(ctx).cdp(sandbox_id)
    if as_json:
        print_json(info)
        return
    print(info.url)
