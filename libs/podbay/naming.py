"""Names derived from ids, each rule written once: a sandbox's hostname, and what an id or name that becomes
a host path component may look like.

A sandbox id is ``sbx_`` and 20 hex digits (``podbay.outbox.new_id("sbx")``). Its guest's hostname is
``sbx-`` and the id's first 12 hex digits: ``sandbox_hostname("sbx_3f2a9c01b7d4e5f60718")`` is
``"sbx-3f2a9c01b7d4"``. The insert of every sandbox row (podbay.lifecycle.insert_sql; the warm claim picks
the id in the same statement) uses :func:`sandbox_hostname_sql`, built from the same constants.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import StringConstraints

from podbay.errors import InvalidRequest

__all__ = ["sandbox_hostname", "sandbox_hostname_sql", "HOSTNAME_PREFIX", "HOSTNAME_ID_DIGITS", "ID_RE", "SafeId",
           "COMPONENT_RE", "UnsafeName", "safe_component"]

#: Every id podbay makes (``podbay.outbox.new_id``: ``sbx_`` and 20 hex digits), a node id, a template build's
#: digest (64 hex): lowercase letters, digits, ``_`` and ``-``, at most 64, starting with a letter or digit.
#: Contracts whose ids end up in a host path, an object key or a QMP argument use :data:`SafeId`.
ID_RE = r"^[a-z0-9][a-z0-9_-]{0,63}$"
SafeId = Annotated[str, StringConstraints(pattern=ID_RE)]
#: One path component made of an id or a name (ids, template names, tags such as ``v1.2``, digests): never
#: ``.`` or ``..`` (it starts with a letter or digit), no ``/``, ``%``, NUL or other byte outside the set.
COMPONENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class UnsafeName(InvalidRequest):
    """An id or name that would become a host path component is not one (``details.value``, ``details.what``);
    contracts refuse such values first, so this means a path was about to be built from an unchecked one."""

    code = "unsafe_name"


def safe_component(value: str, what: str = "id") -> str:
    """``value`` unchanged when it is one safe path component (:data:`COMPONENT_RE`: 1 to 128 of
    ``[A-Za-z0-9_.-]``, starting with a letter or digit), for joining under a directory of podbay's. Raises
    :class:`UnsafeName` (400) otherwise: ``..``, ``a/b``, ``%2f``, NUL, empty, overlong. ``what`` names the
    value in the error (``"sandbox id"``)."""
    if not isinstance(value, str) or COMPONENT_RE.fullmatch(value) is None:
        raise UnsafeName(f"{what} {value!r} is not a safe name", details={"what": what, "value": repr(value)[:200]})
    return value

#: What every sandbox hostname starts with.
HOSTNAME_PREFIX = "sbx-"
#: The id's own part starts after ``sbx_``.
_ID_PREFIX_LEN = len("sbx_")
#: Hex digits of the id in the hostname: 48 bits, so two live sandboxes practically never share one.
HOSTNAME_ID_DIGITS = 12


def sandbox_hostname(sandbox_id: str) -> str:
    """The guest hostname of sandbox ``sandbox_id``."""
    return HOSTNAME_PREFIX + sandbox_id[_ID_PREFIX_LEN:_ID_PREFIX_LEN + HOSTNAME_ID_DIGITS]


def sandbox_hostname_sql(id_expr: str) -> str:
    """:func:`sandbox_hostname` as a PostgreSQL expression over the text expression ``id_expr`` (a column or a
    parameter, e.g. ``"slot.id"``); ``substr`` counts from 1."""
    return f"'{HOSTNAME_PREFIX}' || substr({id_expr}, {_ID_PREFIX_LEN + 1}, {HOSTNAME_ID_DIGITS})"
