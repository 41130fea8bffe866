"""``podbay pool set|list``: warm pools of prepared sandboxes per template (docs/DESIGN.md §5)."""

from __future__ import annotations

import typer

from podbay.cli._common import JsonFlag, client, handle_errors, print_rows

__all__ = ["app"]

app = typer.Typer(help="Warm pools: prepared sandboxes that make creation a claim and a resume.",
                  no_args_is_help=True)


@app.command("set")
@handle_errors
def set_(
    ctx: typer.Context,
    template: str = typer.Argument(..., metavar="TEMPLATE"),
    size: int = typer.Option(..., "--size", min=0, help="Slots kept whatever the demand; 0 ends the pool."),
    max_size: int | None = typer.Option(None, "--max", min=0, help="Grow up to this with demand (default SIZE)."),
) -> None:
    """Keep SIZE warm slots of TEMPLATE (up to --max when recent demand asks for more)."""
    p = client(ctx).set_pool(template, size, max_size)
    # The warm-pool service recomputes targets on the change a moment later: the target shown is the one
    # in force when the bounds were written, so it is labelled as such.
    print(f"{p.template}: size {p.size}, max {p.max_size} (target now {p.target}, ready {p.ready}; "
          "targets follow the new bounds within seconds)")


@app.command("list")
@handle_errors
def list_(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Every pool, one line per node: target, ready, preparing, claimed and failing (recent window)."""
    pools = client(ctx).list_pools()
    rows = []
    for p in pools:
        for n in p.nodes or []:
            rows.append((p.template, f"{p.size}-{p.max_size}", n.node_id, n.target, n.ready, n.preparing, n.claimed,
                         n.failing))
        if not p.nodes:
            rows.append((p.template, f"{p.size}-{p.max_size}", "-", 0, 0, 0, 0, 0))
    print_rows(pools, as_json, ["TEMPLATE", "SIZE", "NODE", "TARGET", "READY", "PREPARING", "CLAIMED", "FAILING"], rows)
