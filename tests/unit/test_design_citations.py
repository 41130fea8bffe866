"""The design document is in the repository, and every file cites it by its path there.

Code comments, docstrings, docs and tests cite "docs/DESIGN.md §N". A citation of the bare file name points
at no file a reader of the repository has, so it fails here, as does a section number the document lacks.
Pure file checks: the files git knows (tracked, or new and not ignored), or a walk of the tree without git.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / ("DESIGN" + ".md")

# Spelled in parts so that this file holds no citation of its own.
_NAME = re.escape("DESIGN" + ".md")
#: Any mention of the file name, and the one accepted form: the repository path, not part of a longer path.
_MENTION = re.compile(_NAME.encode())
_CITATION = re.compile(rb"(?<![\w./-])docs/" + _NAME.encode())
#: The sections a citation names: "docs/DESIGN.md §4", "(docs/DESIGN.md §1, §6)", "§3 and §5".
_SECTIONS = re.compile(rb"docs/" + _NAME.encode() + rb"((?:(?:,\s*|\s+and\s+|\s+)\xc2\xa7\d+)+)")
_SECTION_NUMBER = re.compile(rb"\xc2\xa7(\d+)")

#: Folders that are not the project's files: environments, caches, build output.
_SKIP_DIRS = {".git", ".venv", ".venv-gateway", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache",
              ".mypy_cache", "build", "dist", ".podbay", "node_modules"}


def _repository_files() -> list[Path]:
    """Every file of the repository: git's view when there is one, else a walk that skips the folders above."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout
        names = [n for n in out.decode().split("\0") if n]
        return [ROOT / n for n in names if (ROOT / n).is_file()]
    except (OSError, subprocess.SubprocessError):
        files: list[Path] = []
        for top, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
            files.extend(Path(top) / n for n in names)
        return files


def _mentions() -> dict[Path, bytes]:
    """The files that mention the design document's name, with their content."""
    found: dict[Path, bytes] = {}
    for path in _repository_files():
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if _MENTION.search(data):
            found[path] = data
    return found


def test_the_design_document_is_in_docs() -> None:
    assert DOC.is_file(), f"{DOC.relative_to(ROOT)} is missing: comments across the repository cite it"
    headings = re.findall(r"^## (\d+)\. ", DOC.read_text(), re.M)
    assert headings == [str(n) for n in range(1, len(headings) + 1)] and len(headings) >= 8, headings


def test_every_citation_names_the_document_by_its_repository_path() -> None:
    bad: list[str] = []
    for path, data in _mentions().items():
        for number, line in enumerate(data.splitlines(), 1):
            mentions = len(_MENTION.findall(line))
            if mentions != len(_CITATION.findall(line)):
                bad.append(f"{path.relative_to(ROOT)}:{number}: {line.decode(errors='replace').strip()}")
    assert not bad, "cite the design document as docs/DESIGN" ".md:\n" + "\n".join(bad)


def test_every_cited_section_exists() -> None:
    sections = set(re.findall(r"^## (\d+)\. ", DOC.read_text(), re.M))
    bad: list[str] = []
    for path, data in _mentions().items():
        for number, line in enumerate(data.splitlines(), 1):
            for chain in _SECTIONS.findall(line):
                missing = [n.decode() for n in _SECTION_NUMBER.findall(chain) if n.decode() not in sections]
                if missing:
                    bad.append(f"{path.relative_to(ROOT)}:{number}: section {', '.join(missing)}")
    assert not bad, "cited sections the design document does not have:\n" + "\n".join(bad)
