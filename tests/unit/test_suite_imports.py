"""The suite imports each service by its package name (``podbay_api``, ``podbay_nodeagent``, ...), never by its
source path (``services.api``): the same file under two module names runs twice, and its Prometheus metrics
are registered twice, which fails the whole run's collection as soon as both names meet in one process."""

from __future__ import annotations

import re
from pathlib import Path

_BY_PATH = re.compile(r"^\s*(from|import)\s+services\.", re.M)


def test_no_test_imports_a_service_by_its_source_path() -> None:
    root = Path(__file__).resolve().parents[1]
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py") if _BY_PATH.search(p.read_text())]
    assert offenders == [], f"import podbay_api/podbay_nodeagent/... instead of services.*: {offenders}"
