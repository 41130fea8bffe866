"""The soak's books (tests/bench/soak.py): the operation mix, our sandboxes and the snapshots they listed,
error kinds, and the RSS of service processes. Pure bookkeeping, no HTTP, so it is testable without a stack.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["OPS", "DEFAULT_MIX", "STABLE", "parse_mix", "pick_op", "error_key", "Box", "Snap", "Books",
           "snapshot_losses"]

#: Each operation of the mix and the states (as the soak last saw them) it applies to.
OPS: dict[str, frozenset[str]] = {
    "exec": frozenset({"running"}),
    "pause": frozenset({"running"}),
    "resume": frozenset({"paused"}),
    "snapshot_disk": frozenset({"running", "paused"}),
    "snapshot_full": frozenset({"running", "paused"}),
    "suspend": frozenset({"running", "paused"}),
    "resume_s3": frozenset({"suspended"}),  # a suspended sandbox woken from object storage
    "fork": frozenset({"running", "paused"}),
    "delete": frozenset({"running", "paused", "suspended"}),  # the next tick re-creates to keep N
}
#: Weights, relative among the operations a sandbox's state allows: a running sandbox gets exec 39%, pause 16%,
#: disk snapshot 13%, full snapshot 8%, suspend 7%, fork 7%, delete 11%; a paused one resume 54%; a suspended
#: one resume from S3 83%, so few sandboxes stay paused or suspended for long.
DEFAULT_MIX = "exec=30,pause=12,resume=40,snapshot_disk=10,snapshot_full=6,suspend=5,resume_s3=40,fork=5,delete=8"
#: States a sandbox rests in between operations; anything else is on its way somewhere.
STABLE = frozenset({"running", "paused", "suspended"})


def parse_mix(text: str) -> dict[str, float]:
    """``"exec=30,pause=12"`` -> ``{"exec": 30.0, "pause": 12.0}``; operations left out get weight 0.
    Raises ``ValueError`` for an unknown operation, a negative weight or a mix with nothing to do."""
    out = {op: 0.0 for op in OPS}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in OPS:
            raise ValueError(f"bad mix item {item!r}: give op=weight with op one of {', '.join(OPS)}")
        weight = float(value)
        if weight < 0:
            raise ValueError(f"negative weight for {name}")
        out[name] = weight
    if not any(out[op] for op in OPS if "running" in OPS[op]):
        raise ValueError("the mix has no operation for a running sandbox")
    return out


def pick_op(state: str, mix: dict[str, float], rng: random.Random) -> str | None:
    """An operation for a sandbox in ``state``, drawn by weight among those the state allows (None: none)."""
    ops = [op for op, states in OPS.items() if state in states and mix.get(op, 0) > 0]
    if not ops:
        return None
    return rng.choices(ops, [mix[op] for op in ops])[0]


def error_key(op: str, status: int | str, code: str | None) -> str:
    """The kind an error is counted under: ``<op>_<HTTP status or what went wrong>_<error code>``, e.g.
    ``pause_409_invalid_state``, ``exec_noanswer_ReadTimeout``, ``suspend_opfailed_promotion_failed``."""
    return f"{op}_{status}_{code or 'none'}"


@dataclass
class Snap:
    """A snapshot as last listed: its kind, creation time (ISO 8601, sorts by time) and promotion state."""

    kind: str
    created_at: str
    promotion: str | None = None


@dataclass
class Box:
    """One of our sandboxes: its state as last seen and the snapshots it listed last time we asked."""

    id: str
    state: str
    snaps: dict[str, Snap] = field(default_factory=dict)
    #: A suspend succeeded since the last listing: its node-local (unpromoted) snapshots go by design.
    suspended_since_list: bool = False


def snapshot_losses(known: dict[str, Snap], listed: dict[str, Snap], keep: dict[str, int],
                    suspended: bool) -> tuple[list[str], int, int]:
    """Compare the snapshots a sandbox listed before (``known``) with those it lists now.

    A known snapshot that is no longer listed is explained by retention when at least ``keep[kind]`` newer
    ones of its kind were seen, listed now or at the last listing (the node keeps the newest K disk and M full
    snapshots, and may reclaim this one as soon as those exist, even if a suspend drops the newer, unpromoted
    ones before this listing), or by a suspend since the last listing when it was not promoted (a suspend
    frees the node's local copies). Each vanished snapshot needs its own explanation. Anything else is lost.
    Returns ``(lost ids, retired by retention, dropped by a suspend)``.
    """
    lost: list[str] = []
    retired = dropped = 0
    seen = {**known, **listed}
    for sid, snap in known.items():
        if sid in listed:
            continue
        newer = sum(1 for s in seen.values() if s.kind == snap.kind and s.created_at > snap.created_at)
        if newer >= keep.get(snap.kind, 1):
            retired += 1
        elif suspended and snap.promotion != "promoted":
            dropped += 1
        else:
            lost.append(sid)
    return lost, retired, dropped


@dataclass
class Books:
    """Counts of the whole run. ``errors`` maps :func:`error_key` kinds to counts; ``examples`` keeps the
    first few error texts; ``made`` every sandbox id the run created (fork children too), ``deleted`` those it
    deleted itself; ``lost`` ours that failed or vanished without our delete; ``lost_snapshots`` snapshot
    ids listed before that vanished unexplained (:func:`snapshot_losses`)."""

    samples: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    examples: list[str] = field(default_factory=list)
    slow: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # 202 answers followed, per op
    made: set[str] = field(default_factory=set)
    deleted: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)
    lost_snapshots: set[str] = field(default_factory=set)
    retired_snapshots: int = 0
    suspend_dropped_snapshots: int = 0
    state_drift: int = 0  # the stack changed a sandbox's state on its own (e.g. paused it for memory)
    started: int = 0
    ok: int = 0
    failed: int = 0

    def error(self, op: str, status: int | str, code: str | None, text: str) -> None:
        """Count one error of ``op`` and keep its text among the first 30."""
        self.errors[error_key(op, status, code)] += 1
        if len(self.examples) < 30:
            self.examples.append(f"{op}: {text}")
