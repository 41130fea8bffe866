"""Placeholders in the header values of a sandbox's ``network.rules`` transforms (E2B's syntax; its egress proxy
reads them the same way): ``${e2b.secrets.<name>}`` is a secret's value (an E2B secret, a podbay credential,
read from the credential store) and ``${e2b.identity.tokens.<name>}`` a workload identity token minted for this
request (:mod:`podbay.oidc`). Only the values of the sandbox's own rules are read for placeholders, never a
header the guest sent: a guest that writes a placeholder itself gets it forwarded as literal text.

Parsing, left to right: a placeholder runs from its prefix to the next ``}``; one that is not closed, is empty,
or holds another placeholder's prefix is malformed (the whole value is refused). A secret's name is trimmed,
must be 1-128 of ``[A-Za-z0-9_-]`` and is compared lower-case (E2B's canonical form); a token's name is taken
as written. Text outside placeholders is opaque.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["Placeholder", "MalformedPlaceholder", "parse", "has_placeholder", "substitute", "SECRET", "TOKEN"]

TOKEN = "${e2b.identity.tokens."
SECRET = "${e2b.secrets."
_SECRET_NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class MalformedPlaceholder(ValueError):
    """A rule's header value holds a placeholder that does not parse (the message never quotes the value)."""


@dataclass(frozen=True)
class Placeholder:
    """``kind`` and ``name`` of one placeholder and its half-open span ``[start, end)`` in the value."""

    kind: Literal["secret", "token"]
    name: str
    start: int
    end: int


def _next(value: str) -> tuple[int, Literal["secret", "token"], str]:
    t, s = value.find(TOKEN), value.find(SECRET)
    if t < 0 and s < 0:
        return -1, "token", ""
    if s < 0 or (0 <= t < s):
        return t, "token", TOKEN
    return s, "secret", SECRET


def has_placeholder(value: str) -> bool:
    """Whether ``value`` holds either prefix (cheap test before :func:`parse`)."""
    return TOKEN in value or SECRET in value


def parse(value: str) -> list[Placeholder]:
    """The placeholders of ``value`` in order; :class:`MalformedPlaceholder` as described in the module."""
    out: list[Placeholder] = []
    cursor = 0
    while cursor < len(value):
        rel, kind, prefix = _next(value[cursor:])
        if rel < 0:
            break
        start = cursor + rel
        name_start = start + len(prefix)
        close = value.find("}", name_start)
        if close < 0:
            raise MalformedPlaceholder("a placeholder is not closed")
        name = value[name_start:close]
        if not name or _next(name)[0] >= 0:
            raise MalformedPlaceholder("a placeholder is empty or nested")
        if kind == "secret":
            name = name.strip()
            if not _SECRET_NAME.match(name):
                raise MalformedPlaceholder("a secret placeholder does not name a secret")
            name = name.lower()
        out.append(Placeholder(kind, name, start, close + 1))
        cursor = close + 1
    return out


def substitute(value: str, found: list[Placeholder], values: dict[tuple[str, str], str]) -> str:
    """``value`` with each placeholder of ``found`` replaced by ``values[(kind, name)]``."""
    parts: list[str] = []
    at = 0
    for p in found:
        parts += [value[at:p.start], values[(p.kind, p.name)]]
        at = p.end
    parts.append(value[at:])
    return "".join(parts)
