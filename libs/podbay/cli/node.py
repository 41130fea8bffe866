"""``podbay node list``: the nodes as the control plane sees them (operator tenant only)."""

from __future__ import annotations

import typer

from podbay.cli._common import client, handle_errors, print_json, print_table

__all__ = ["app"]

app = typer.Typer(help="Nodes: state, liveness, capacity and load.", no_args_is_help=True)


def _age(seconds: float | None) -> str:
    return "expired" if seconds is None else f"{seconds:.1f}s"


@app.command("list")
@handle_errors
def list_(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Every node: state (ready, draining, drained, lost), whether new sandboxes go there, heartbeat age,
    vCPUs and memory (used/capacity, free), running and paused sandboxes, ready warm slots."""
    nodes = client(ctx).list_nodes()
    if as_json:
        print_json(nodes)
        return
    rows = [(n.id, n.state, "yes" if n.schedulable else "no", _age(n.heartbeat_age_s), n.accel,
             f"{n.used.vcpus}/{n.capacity.vcpus}", f"{n.used.memory_mib}/{n.capacity.memory_mib}",
             n.free.memory_mib, n.running, n.paused, n.warm_slots) for n in nodes]
    print_table(["NODE", "STATE", "SCHEDULABLE", "HEARTBEAT", "ACCEL", "VCPUS", "MEMORY MIB", "FREE MIB", "RUNNING",
                 "PAUSED", "WARM"], rows)
