"""Names derived from ids, each rule written once: a sandbox's hostname, and what an id or name that becomes
a host path component may look like.

A sandbox id is ``sbx_`` and 20 hex digits (``podbay.outbox.new_id("sbx")``). Its guest's hostname is
``sbx-`` and the id's first 12 hex digits: ``sandbox_hostname("sbx_3f2a9c01b7d4e5f60718")`` is
``"sbx-3f2a9c01b7d4"``. The insert of every sandbox row (podbay.lifecycle.insert_sql; the warm claim picks
the id in the same statement) uses :func:`sandbox_hostname_sql`, built from the same constants.

On E2B's surface (its REST API, envd and port host names) a sandbox id is spelled ``sbx-`` + the same hex
(:func:`e2b_sandbox_id`): E2B's SDKs put the id into a host name, ``{port}-{sandboxID}.{domain}``
(``ConnectionConfig.get_host`` of the ``e2b`` SDK), where ``_`` is not a letter-digit-hyphen label character
(RFC 1123 §2.1; OpenSSL lets a certificate's ``*`` stand for none of it). :func:`sandbox_id_from_e2b` takes
either spelling back to the stored id and refuses every other (upper case, percent-encoded, extra characters).
"""

from __future__ import annotations

import re

from podbay.contracts.ids import COMPONENT_RE, ID_RE, SafeId, UnsafeName, safe_component

__all__ = ["sandbox_hostname", "sandbox_hostname_sql", "HOSTNAME_PREFIX", "HOSTNAME_ID_DIGITS", "ID_RE", "SafeId",
           "COMPONENT_RE", "UnsafeName", "safe_component", "e2b_sandbox_id", "sandbox_id_from_e2b", "E2B_SANDBOX_ID_RE"]

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


#: A sandbox id as E2B's surface takes it: ``sbx``, ``-`` (E2B's spelling) or ``_`` (podbay's), 1 to 48 lower-case
#: letters or digits (podbay makes hex). 48 keeps ``{port}-{id}`` within a 63-character host label (RFC 1035
#: §2.3.4).
E2B_SANDBOX_ID_RE = re.compile(r"sbx[-_]([0-9a-z]{1,48})")


def e2b_sandbox_id(sandbox_id: str) -> str:
    """The E2B spelling of podbay sandbox id ``sandbox_id``: ``sbx_3f2a...`` -> ``sbx-3f2a...`` (a valid host
    label); an id of another shape is returned as it is."""
    m = E2B_SANDBOX_ID_RE.fullmatch(sandbox_id)
    return f"sbx-{m.group(1)}" if m else sandbox_id


def sandbox_id_from_e2b(value: str) -> str | None:
    """The podbay sandbox id (``sbx_...``) that ``value``, in either spelling of :data:`E2B_SANDBOX_ID_RE`,
    names; None for anything else (upper case, percent signs, other prefixes, extra characters)."""
    m = E2B_SANDBOX_ID_RE.fullmatch(value)
    return f"sbx_{m.group(1)}" if m else None
