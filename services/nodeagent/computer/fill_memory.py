"""What credential fills put into each sandbox's page, as this node remembers it for the CDP redaction and the
screenshot masks (docs/credentials.md "Browser fill"), and how it is re-armed on whichever node serves the
sandbox next.

The durable record is the fill's own ``credential.fill`` audit row with decision ``allow`` (sandbox, credential
id as ``target``, ``detail.selector``, ``detail.origin``; written by :mod:`.computer_fill` before it types). A
sandbox's filled set is the allowed fills of the sandbox and of its ancestors (``sandboxes.parent_sandbox_id``):
a fork child, or a sandbox created from another's snapshot, restores its parent's page memory, so it holds what
was typed there. The ancestors' fills are taken whole, not cut at the snapshot's time, so a fill typed just
before a snapshot whose audit row commits just after it is still covered; a child thereby also redacts values
typed into its parent after the fork, which it never held (harmless). A rollback keeps the sandbox's id, hence
its fills. No value is ever stored: PostgreSQL has the credential's id and the selector, and the value is
revealed from the credential store the way the fill reveals it.

In memory, per sandbox on this node: the values (for :meth:`FillMemory.values`, read by the redaction at each
relayed message) and the selectors (screenshot masks). :meth:`FillMemory.arm` loads the record once per stay
of the sandbox on this node, lazily, before the first relayed WebSocket and the first screenshot: after a wake,
a migration in, a fork child's start, a rollback's restore or a node agent restart the node therefore masks and
redacts from the first message on, whatever path brought the sandbox here. :meth:`FillMemory.forget` (the
manager's ``on_leave`` hook) drops it all when the sandbox leaves the node; a load in flight then lands nowhere.

Failures: a credential deleted since the fill (its value destroyed) or unreadable in its backend cannot be
redacted; it is skipped with a warning (its selector is still masked). A store or database that cannot be
reached raises :class:`~podbay.errors.Unavailable` (retryable) and arms nothing, so the caller refuses the
CDP connection or the screenshot rather than serve it unredacted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
import asyncpg

from podbay.config import Settings
from podbay.credentials import CredentialUnreadable, Sealed, open_store
from podbay.errors import StorageError, Unavailable

__all__ = ["Filled", "FillMemory", "FILLED_SQL", "PgFillRecord"]

log = logging.getLogger("podbay.nodeagent.fill_memory")


@dataclass
class Filled:
    """A sandbox's filled set: the values (plain text, memory only) and the CSS selectors typed into."""

    values: set[str] = field(default_factory=set)
    selectors: set[str] = field(default_factory=set)


#: ``$1`` a sandbox id -> one row per (credential, selector) filled into it or into one of its ancestors, with
#: what revealing the value needs. ``UNION`` (not ``UNION ALL``) stops at a cycle of parents.
FILLED_SQL = """
WITH RECURSIVE line(id, parent) AS (
    SELECT id, parent_sandbox_id FROM sandboxes WHERE id = $1
  UNION
    SELECT s.id, s.parent_sandbox_id FROM sandboxes s JOIN line ON s.id = line.parent
)
SELECT DISTINCT c.id, c.tenant_id, c.backend, c.ciphertext, c.secret_ref, c.deleted_at IS NOT NULL AS deleted,
       a.detail->>'selector' AS selector
FROM line
JOIN audit_log a ON a.sandbox_id = line.id AND a.action = 'credential.fill' AND a.decision = 'allow'
JOIN credentials c ON c.id = a.target AND c.tenant_id = a.tenant_id
"""


class PgFillRecord:
    """Loads a sandbox's filled set from PostgreSQL (:data:`FILLED_SQL`) and the credential store."""

    def __init__(self, pool: asyncpg.Pool, settings: Settings) -> None:
        self.pool = pool
        self.settings = settings

    async def load(self, sandbox_id: str) -> Filled:
        """The sandbox's :class:`Filled`; :class:`Unavailable` when PostgreSQL or a store cannot be reached."""
        try:
            rows = await self.pool.fetch(FILLED_SQL, sandbox_id)
        except (asyncpg.PostgresError, OSError) as exc:
            raise Unavailable(f"cannot read sandbox {sandbox_id}'s credential fills: {exc}") from exc
        out = Filled()
        revealed: set[str] = set()
        for r in rows:
            if r["selector"]:
                out.selectors.add(str(r["selector"]))
            cid = str(r["id"])
            if cid in revealed:
                continue
            revealed.add(cid)
            if r["deleted"]:
                log.warning("sandbox=%s credential %s was filled but is deleted: its value is not redacted",
                            sandbox_id, cid)
                continue
            try:
                out.values.add(await open_store(self.settings, r["backend"]).reveal(
                    cid, str(r["tenant_id"]), Sealed(r["backend"], r["ciphertext"], r["secret_ref"])))
            except CredentialUnreadable as exc:
                log.warning("sandbox=%s credential %s was filled but cannot be read (%s): its value is not "
                            "redacted", sandbox_id, cid, exc.code)
            except (StorageError, ValueError) as exc:
                raise Unavailable(f"cannot reveal credential {cid} to redact it: {exc}") from exc
        return out


class FillMemory:
    """This node's filled sets, per sandbox, re-armed from the durable record (module docstring).

    ``load`` is :meth:`PgFillRecord.load` in the node agent, a fake in unit tests.
    """

    def __init__(self, load: Callable[[str], Awaitable[Filled]]) -> None:
        self._load = load
        self._filled: dict[str, Filled] = {}
        self._armed: set[str] = set()
        self._arming: dict[str, asyncio.Future[Filled]] = {}

    def add(self, sandbox_id: str, value: str, selector: str) -> None:
        """Remember one fill (before it types: the redaction covers its first echo)."""
        f = self._filled.setdefault(sandbox_id, Filled())
        f.values.add(value)
        f.selectors.add(selector)

    def values(self, sandbox_id: str) -> set[str]:
        """The values to redact from the sandbox's CDP messages (empty: nothing was filled)."""
        f = self._filled.get(sandbox_id)
        return f.values if f is not None else set()

    def selectors(self, sandbox_id: str) -> set[str] | None:
        """The fields to mask in the sandbox's screenshots, or None when nothing was filled (no masking)."""
        f = self._filled.get(sandbox_id)
        return f.selectors if f is not None and (f.values or f.selectors) else None

    def armed(self, sandbox_id: str) -> bool:
        return sandbox_id in self._armed

    async def arm(self, sandbox_id: str) -> None:
        """Load the sandbox's record once per stay on this node (concurrent callers share one load); raises
        :class:`Unavailable` (and stays unarmed, so the next call tries again)."""
        if sandbox_id in self._armed:
            return
        fut = self._arming.get(sandbox_id)
        if fut is None:
            fut = asyncio.ensure_future(self._load(sandbox_id))
            self._arming[sandbox_id] = fut
            fut.add_done_callback(partial(self._landed, sandbox_id))
        await asyncio.shield(fut)

    def _landed(self, sandbox_id: str, fut: asyncio.Future[Filled]) -> None:
        if self._arming.get(sandbox_id) is not fut:
            if not fut.cancelled():
                fut.exception()  # forgotten meanwhile: retrieved, and nothing is kept
            return
        del self._arming[sandbox_id]
        if fut.cancelled() or fut.exception() is not None:
            return
        got = fut.result()
        f = self._filled.setdefault(sandbox_id, Filled())
        f.values |= got.values
        f.selectors |= got.selectors
        if not f.values and not f.selectors:
            del self._filled[sandbox_id]
        self._armed.add(sandbox_id)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox left this node: drop its values and selectors (and a load in flight lands nowhere)."""
        self._filled.pop(sandbox_id, None)
        self._armed.discard(sandbox_id)
        self._arming.pop(sandbox_id, None)
