"""podbay API keys in the shape E2B's SDKs expect (docs/e2b.md "API keys").

A podbay key is ``pb_<prefix>_<secret>`` (8 and 40 hex digits). Some E2B SDK versions check that a key is
``e2b_`` followed by hex digits; the alias ``e2b_<prefix><secret>`` (48 hex digits) names the same key, and
the API accepts either form wherever it accepts a key.
"""

from __future__ import annotations

import re

__all__ = ["to_e2b_key", "from_e2b_key"]

_PODBAY = re.compile(r"^pb_([0-9a-f]{8})_([0-9a-f]{40})$")
_ALIAS = re.compile(r"^e2b_([0-9a-f]{8})([0-9a-f]{40})$")


def to_e2b_key(key: str) -> str:
    """``pb_<prefix>_<secret>`` -> ``e2b_<prefix><secret>``; a key of another shape is returned as it is."""
    m = _PODBAY.match(key)
    return f"e2b_{m.group(1)}{m.group(2)}" if m else key


def from_e2b_key(key: str) -> str:
    """``e2b_<prefix><secret>`` -> ``pb_<prefix>_<secret>``; a key of another shape is returned as it is."""
    m = _ALIAS.match(key)
    return f"pb_{m.group(1)}_{m.group(2)}" if m else key
