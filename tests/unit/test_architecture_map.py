"""docs/ARCHITECTURE.md stays a map a newcomer reads in one sitting, and every section the code cites through
it (the map's file name, then the section's name in double quotes) can be found from it: a heading of its
own or a row of its index."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAP = ROOT / "docs" / "ARCHITECTURE.md"
# Spelled in parts so that this file holds no citation of its own.
_CITED = re.compile(r"ARCHITECTURE" + r'\.md,? "([^"]+)"')


def test_the_map_is_short() -> None:
    assert len(MAP.read_text().splitlines()) <= 500


def test_every_cited_section_is_found_from_the_map() -> None:
    text = MAP.read_text()
    findable = set(re.findall(r"(?m)^#+ (.+)$", text)) | set(re.findall(r"(?m)^\| ([^|]+?) \| \[", text))
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    missing: dict[str, str] = {}
    for name in names:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".sql", ".sh", ".ts", ".tsx", ".toml", ".yaml"} or not path.is_file() \
                or path == MAP:
            continue
        for cited in (" ".join(c.split()) for c in _CITED.findall(path.read_text(errors="replace"))):
            if not any(cited == f or f"\"{cited}\"" in f or f.startswith(cited) for f in findable):
                missing[cited] = name
    assert not missing, f"cited but not on the map or its index: {missing}"
    # the pages the index points at exist
    for page in set(re.findall(r"\]\((architecture/[a-z-]+\.md)\)", text)):
        assert (MAP.parent / page).is_file(), page
