"""Ids and names that become host path components: what they may look like, written once.

Part of the client package (contracts use :data:`SafeId`), so it needs nothing but pydantic and
:mod:`podbay.errors`. :mod:`podbay.naming` re-exports these names for server code.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import StringConstraints

from podbay.errors import InvalidRequest

__all__ = ["ID_RE", "SafeId", "COMPONENT_RE", "UnsafeName", "safe_component"]

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
