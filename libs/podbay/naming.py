"""Names derived from ids, each rule written once: a sandbox's hostname, and what an id or name that becomes
a host path component may look like.

A sandbox id is ``sbx_`` and 20 hex digits (``podbay.outbox.new_id("sbx")``). Its guest's hostname is
``sbx-`` and the id's first 12 hex digits: ``sandbox_hostname("sbx_3f2a9c01b7d4e5f60718")`` is
``"sbx-3f2a9c01b7d4"``. The insert of every sandbox row (podbay.lifecycle.insert_sql; the warm claim picks
the id in the same statement) uses :func:`sandbox_hostname_sql`, built from the same constants.
"""

from __future__ import annotations

from podbay.contracts.ids import COMPONENT_RE, ID_RE, SafeId, UnsafeName, safe_component

__all__ = ["sandbox_hostname", "sandbox_hostname_sql", "HOSTNAME_PREFIX", "HOSTNAME_ID_DIGITS", "ID_RE", "SafeId",
           "COMPONENT_RE", "UnsafeName", "safe_component"]

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
