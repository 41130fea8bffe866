"""The soak's view of a stack's service processes (tests/bench/soak.py): which pids, and their memory over
time. RSS for each process; PostgreSQL as the PSS of the postmaster and its backends (their RSS would count
the shared buffers once per backend).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["find_pids", "stack_pids", "RssLog", "print_rss_table", "rss_mib", "tree_pss_mib"]

SERVICES = ("podbay-api", "podbay-scheduler", "podbay-nodeagent", "podbay-snapshotter", "podbay-warmpool",
            "podbay-gateway", "nats-server", "postgres", "weed")


def find_pids(explicit: list[str]) -> dict[str, int]:
    """Service name -> pid of a stack that is already up: from ``explicit`` ``NAME=PID`` items when given, else
    the pids ``podbay status --json`` reports, else every process whose command line names a podbay service
    (all stacks on the host)."""
    if explicit:
        return {name: int(pid) for name, _, pid in (item.partition("=") for item in explicit)}
    exe = Path(sys.executable).with_name("podbay")
    try:
        st = subprocess.run([str(exe), "status", "--json"], capture_output=True, text=True, timeout=30)
        found = {str(p["name"]): int(p["pid"]) for p in json.loads(st.stdout or "[]") if p.get("pid")}
        if found:
            return found
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            words = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split()
        except OSError:
            continue
        for name in SERVICES:
            if words and any(Path(w).name == name for w in words[:2]):
                found[f"{name}.{proc.name}"] = int(proc.name)
    return found


def stack_pids(stack: Any) -> dict[str, int]:
    """Part name -> pid of an own stack's servers and services (``s3`` named ``weed``)."""
    out = {}
    for name in stack.part_names():
        if (pid := stack.pid(name)) is not None:
            out["weed" if name == "s3" else name.replace("@", "_")] = pid
    return out


class RssLog:
    """Samples of every service process's RSS; :meth:`metrics` gives them minutes from ``t0`` (the start of
    the load, so a sample before the setup has a negative offset)."""

    def __init__(self, pids: Callable[[], dict[str, int]]) -> None:
        self.pids = pids
        self.t0 = time.monotonic()
        self.samples: dict[str, list[tuple[float, float]]] = {}  # name -> [(monotonic s, MiB)]

    def sample(self) -> None:
        now = time.monotonic()
        for name, pid in self.pids().items():
            mib = tree_pss_mib(pid) if name.startswith("postgres") else rss_mib(pid)
            if mib is not None:
                self.samples.setdefault(name, []).append((now, round(mib, 1)))

    def metrics(self) -> dict[str, dict[str, Any]]:
        """``rss_<name>_MiB``: ``value`` (the last sample), ``start`` (the first at or after the load's start,
        else the first), ``max`` and ``samples`` ``[{"min", "MiB"}]``."""
        out = {}
        for name, raw in sorted(self.samples.items()):
            s = [{"min": round((t - self.t0) / 60, 2), "MiB": mib} for t, mib in raw]
            start = next((x["MiB"] for x in s if x["min"] >= 0), s[0]["MiB"])
            out[f"rss_{name}_MiB"] = {"value": s[-1]["MiB"], "start": start, "max": max(x["MiB"] for x in s),
                                      "samples": s}
        return out


def print_rss_table(rss_metrics: dict[str, dict[str, Any]]) -> None:
    """One row per process, one column per sample (minutes from the start of the load)."""
    from rich.console import Console
    from rich.table import Column, Table

    if not rss_metrics:
        return
    minutes = sorted({x["min"] for m in rss_metrics.values() for x in m["samples"]})
    heads = [f"{m:g} min" for m in minutes]
    heads[0] = "before setup" if minutes[0] < 0 else heads[0]
    heads[-1] = f"end ({heads[-1]})"
    table = Table(Column("RSS MiB", no_wrap=True), *heads, "end - start",
                  title="service RSS (MiB; minutes from the start of the load)")
    for name, m in rss_metrics.items():
        by_min = {x["min"]: x["MiB"] for x in m["samples"]}  # a process that was gone at a sample has a gap
        table.add_row(name[len("rss_"):-len("_MiB")], *(f"{by_min[t]:.0f}" if t in by_min else "" for t in minutes),
                      f"{m['value'] - m['start']:+.0f}")
    Console().print(table)


def rss_mib(pid: int) -> float | None:
    """``VmRSS`` of ``pid`` in MiB (None when the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def pss_mib(pid: int) -> float | None:
    """``Pss`` of ``pid`` in MiB from ``smaps_rollup`` (None when the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def tree_pss_mib(pid: int) -> float | None:
    """PSS of ``pid`` plus all its descendants in MiB: shared pages are split among the processes that map
    them, so a tree's sum counts each page once (PostgreSQL's shared buffers)."""
    children: dict[int, list[int]] = defaultdict(list)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            # The command name may hold spaces and parentheses: the ppid is the 2nd field after the last ")".
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children[ppid].append(int(proc.name))
    own = pss_mib(pid)
    if own is None:
        return None
    total, todo = own, list(children[pid])
    while todo:
        p = todo.pop()
        total += pss_mib(p) or 0.0
        todo += children[p]
    return total
