"""Regenerate the settings table of docs/operations.md from podbay.config.Settings.

Run ``.venv/bin/python scripts/gen_config_docs.py`` after adding or changing a setting; a test fails while the
committed table differs from the settings. The table sits between the two ``config-table`` marker comments.
"""

from __future__ import annotations

import sys
from pathlib import Path

from podbay.config import Settings

DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
BEGIN, END = "<!-- config-table: begin (scripts/gen_config_docs.py) -->", "<!-- config-table: end -->"
# Defaults computed on the machine: say what they are rather than this machine's value.
FACTORY_DEFAULTS = {"data_dir": "`$XDG_DATA_HOME/podbay` (`~/.local/share/podbay`)",
                    "cache_dir": "`$XDG_CACHE_HOME/podbay` (`~/.cache/podbay`)"}


def table() -> str:
    """The markdown table: variable and TOML key, default, meaning."""
    rows = ["| variable / TOML key | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        if field.default_factory is not None:
            default = FACTORY_DEFAULTS.get(name, "computed")
        elif field.default in (None, ""):
            default = "unset"
        else:
            default = f"`{field.default}`"
        meaning = (field.description or "").replace("|", "\\|")
        rows.append(f"| `PODBAY_{name.upper()}` / `{name}` | {default} | {meaning} |")
    return "\n".join(rows)


def render(doc: str) -> str:
    """``doc`` with the text between the markers replaced by the current table."""
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


if __name__ == "__main__":
    DOC.write_text(render(DOC.read_text()))
    print(f"updated {DOC.relative_to(Path.cwd()) if DOC.is_relative_to(Path.cwd()) else DOC}", file=sys.stderr)
