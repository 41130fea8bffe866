"""``podbay node list``, ``podbay node drain`` and ``podbay node undrain``: the nodes as the control plane sees
them, moving every sandbox off one before maintenance, and taking it back into placement after (operator tenant
only)."""

from __future__ import annotations

import time

import typer

from podbay.cli._common import JsonFlag, client, fail, handle_errors, print_json, print_rows

__all__ = ["app"]

app = typer.Typer(help="Nodes: state, liveness, capacity and load; drain one before maintenance.", no_args_is_help=True)


def _age(seconds: float | None) -> str:
    return "expired" if seconds is None else f"{seconds:.1f}s"


@app.command("list")
@handle_errors
def list_(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Every node: state (ready, draining, drained, lost), whether new sandboxes go there, heartbeat age,
    vCPUs and nominal memory (used/capacity, free), the measured room for new sandboxes (MiB, what admission
    uses; "-" when the node is not live), running and paused sandboxes, ready warm slots."""
    nodes = client(ctx).list_nodes()
    rows = ((n.id, n.state, "yes" if n.schedulable else "no", _age(n.heartbeat_age_s), n.accel,
             f"{n.used.vcpus}/{n.capacity.vcpus}", f"{n.used.memory_mib}/{n.capacity.memory_mib}",
             n.free.memory_mib, n.memory.room_mib if n.memory else "-", n.running, n.paused, n.warm_slots)
            for n in nodes)
    print_rows(nodes, as_json, ["NODE", "STATE", "SCHEDULABLE", "HEARTBEAT", "ACCEL", "VCPUS", "MEMORY MIB", "FREE MIB", "ROOM MIB",
                 "RUNNING", "PAUSED", "WARM"], rows)


@app.command("drain")
@handle_errors
def drain(
    ctx: typer.Context,
    node_id: str = typer.Argument(..., metavar="NODE"),
    no_wait: bool = typer.Option(False, "--no-wait", help="Print the operation id and return at once."),
    timeout: float = typer.Option(3600.0, "--timeout", min=1, help="Seconds to wait for the drain."),
    as_json: bool = typer.Option(False, "--json", help="Print the final operation as JSON."),
) -> None:
    """Mark NODE draining (no new sandboxes), live-migrate its running sandboxes and move its paused ones to
    other nodes, then mark it drained. A sandbox that cannot move keeps running on NODE and the drain ends
    with drain_incomplete (exit 1)."""
    c = client(ctx)
    started = c.drain_node(node_id)
    if no_wait:
        print(started.operation_id)
        return
    deadline = time.monotonic() + timeout
    shown = ""
    while True:
        op = c.get_operation(started.operation_id)
        prog = op.progress or {}
        line = f"{node_id}: {prog.get('moved', 0)}/{prog.get('total', '?')} moved"
        if line != shown and not as_json:
            print(line, flush=True)
            shown = line
        if op.state in ("succeeded", "failed"):
            break
        if time.monotonic() > deadline:
            fail(f"the drain of {node_id} is still running after {timeout:.0f} s (operation "
                 f"{started.operation_id})", "timeout", 1)
        time.sleep(1.0)
    if as_json:
        print_json(op)
    else:
        for m in prog.get("moves", []):
            print(f"  {m['sandbox_id']} -> {m['destination']}: downtime {m.get('downtime_ms')} ms, "
                  f"total {m.get('total_ms')} ms")
    if op.state == "failed":
        err = op.error or {}
        fail(err.get("message", "the drain failed"), err.get("code", "drain_incomplete"), 1)
    if not as_json:
        print(f"{node_id}: drained")


@app.command("undrain")
@handle_errors
def undrain(ctx: typer.Context, node_id: str = typer.Argument(..., metavar="NODE")) -> None:
    """Take NODE back into placement (ready) after maintenance, or after a drain that ended with
    drain_incomplete and left it draining. Refused while its drain still runs, and for a lost node."""
    done = client(ctx).undrain_node(node_id)
    print(f"{node_id}: ready" + ("" if done.previous != "ready" else " (it was)"))
