"""The suite's layout: pytest's default (prepend) import mode imports every test module by its basename, so
two test files of one name in different directories break collection of the whole run (``import file
mismatch``), which a run of one directory alone does not show."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"test modules sharing a basename (rename one): {shared}"
