"""Pressure stall information (``/proc/pressure/*``): how much of the time tasks waited for a resource.

The node agent puts its CPU figure in its heartbeat (placement avoids a node above ``node_cpu_pressure_max``)
and in ``podbay_node_cpu_pressure``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["cpu_pressure", "cpu_saturated", "parse_some", "parse_some_avg10"]

CPU = Path("/proc/pressure/cpu")


def parse_some(text: str, key: str = "avg10") -> float | None:
    """The ``some <key>`` figure (percent, 0-100; ``key`` avg10, avg60 or avg300) of a pressure file's text;
    None when absent."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "some":
            for f in fields[1:]:
                name, _, value = f.partition("=")
                if name == key:
                    try:
                        return float(value)
                    except ValueError:
                        return None
    return None


def parse_some_avg10(text: str) -> float | None:
    """``some avg10`` of a pressure file's text (:func:`parse_some`)."""
    return parse_some(text, "avg10")


def cpu_pressure(path: Path = CPU) -> tuple[float, float] | None:
    """The host's CPU pressure, ``(some avg10, some avg60)`` percent: the share of the last 10 s (60 s) in which
    at least one runnable task waited for a CPU. None where the kernel has no PSI (``CONFIG_PSI`` off, or
    ``psi=0``)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    a10, a60 = parse_some(text, "avg10"), parse_some(text, "avg60")
    return None if a10 is None or a60 is None else (a10, a60)


def cpu_saturated(pressure: tuple[float, float] | None, threshold: float) -> bool:
    """Whether a node with ``pressure`` (:func:`cpu_pressure`) is too busy to take sandboxes: both the 10 s and
    the 60 s figure above ``threshold`` percent (sustained, not a build's burst); never when ``threshold`` is 0
    or the kernel has no PSI."""
    return threshold > 0 and pressure is not None and min(pressure) > threshold
