"""Microbenchmark: bytes read and hashed to build a promotion manifest of a disk snapshot, with and without
chunk-hash reuse from the previous promoted snapshot (libs/podbay/promotion.py ``known_hashes``).

A ``--size-gib`` disk fully written with random bytes on a loop-mounted btrfs (root, btrfs-progs), then
snapshots as reflinks: the first hashed whole, one unchanged, one with 1 MiB written. Prints a table and JSON.

    .venv/bin/python -m tests.bench.promotion_reuse --size-gib 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from podbay.promotion import build_manifest
from podbay.reflink import reflink_or_copy
from tests.btrfs_loop import btrfs_dir

MIB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--chunk-kib", type=int, default=256)
    args = ap.parse_args()
    size, cs = int(args.size_gib * 1024) * MIB, args.chunk_kib << 10
    rows = []
    with tempfile.TemporaryDirectory() as tmp, btrfs_dir(Path(tmp), int(args.size_gib * 1024) * 2 + 512) as fs:
        disk = fs / "disk.img"
        with open(disk, "wb") as f:
            for _ in range(size // (64 * MIB)):
                f.write(os.urandom(64 * MIB))
        prev_manifest = None
        prev_dir: Path | None = None
        for name, change in (("first (no previous)", 0), ("unchanged", 0), ("1 MiB changed", MIB)):
            if change:
                fd = os.open(disk, os.O_WRONLY)
                os.pwrite(fd, os.urandom(change), size // 3 + 12345)
                os.close(fd)
            d = fs / f"snap{len(rows)}"
            d.mkdir()
            reflink_or_copy(disk, d / "disk.img")
            stats: dict[str, int] = {}
            t = time.perf_counter()
            manifest, _ = build_manifest(d, cs, previous=(prev_dir, prev_manifest) if prev_dir and prev_manifest
                                         else None, stats=stats)
            rows.append({"case": name, "hashed_bytes": stats.get("hashed", 0), "reused_bytes": stats.get("reused", 0),
                         "seconds": round(time.perf_counter() - t, 3)})
            prev_manifest, prev_dir = manifest, d
            if name.startswith("first"):
                # Without reuse, every later promotion hashed the whole image as the first did.
                rows[-1]["note"] = "what every promotion cost before"
    print(f"{'case':22} {'hashed MiB':>11} {'reused MiB':>11} {'seconds':>8}")
    for r in rows:
        print(f"{r['case']:22} {r['hashed_bytes'] / MIB:11.2f} {r['reused_bytes'] / MIB:11.2f} {r['seconds']:8.3f}")
    print(json.dumps({"size_bytes": size, "chunk_bytes": cs, "rows": rows}))


if __name__ == "__main__":
    main()
