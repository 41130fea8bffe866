"""Credential fill: a stored credential typed into the sandbox browser's page from outside the guest
(docs/credentials.md "Browser fill", docs/computer-use.md).

``POST /internal/v1/sandboxes/{id}/computer/fill`` ``{"credential": NAME, "selector": CSS}``, in order:

1. the credential: the sandbox's tenant's live credential of that name (404 ``credential_not_found``), in
   scope for this sandbox and its template (403 ``credential_out_of_scope``), not expired (403
   ``credential_expired``);
2. the page's origin: the URL of the current entry of the page's navigation history, as the browser (not the
   page's script) reports it (``Page.getNavigationHistory``); its host must match one of the credential's
   hosts, exactly or by ``*.`` wildcard as in egress rules (403 ``origin_not_allowed``);
3. the field: ``DOM.querySelector`` in the page's main document (422 ``selector_not_found``, or
   ``invalid_selector`` when the browser refuses the CSS), focused with ``DOM.focus``;
4. only then the value is revealed (:mod:`podbay.credentials`) and typed with ``Input.insertText``.

Every outcome is one ``credential.fill`` audit row (``allow`` or ``deny`` with the reason; detail: credential
name, origin, selector; never the value), written with :func:`podbay.audit.record`. A refusal types nothing.

From the first fill on, the node remembers the value for the sandbox (:mod:`.fill_memory`: in memory while the
sandbox is on this node, re-armed from the ``allow`` audit rows of the sandbox and its ancestors wherever it runs
next) and :meth:`Filler.redactor` replaces it (and its JSON-escaped spelling) by ``[redacted by podbay]`` in
every CDP message relayed to the agent through the ports proxy, for connections opened before or after the
fill; the API's screenshots mask the sandbox's password fields and the fields fills typed into
(:mod:`.computer`), and so do the screenshots the agent takes over CDP (:mod:`.cdp_mask`). The ``allow`` row is written after the checks and before the value is revealed and typed,
so no value reaches a page without its record (a typing that then fails leaves an ``allow`` row: redaction of a
value that is not there costs nothing). The value is in the page's memory from then on (the trust model in
docs/credentials.md says what that means).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import asyncpg
from fastapi import FastAPI, Request

from podbay import audit
from podbay.contracts.computer import FillRequest, FillResult
from podbay.contracts.egress import name_matches
from podbay.credentials import Sealed, open_store
from podbay.errors import Forbidden, GuestError, NotFound, PodbayError, Unavailable, Unprocessable

from .cdp_mask import RelayFilter, ScreenshotMasker
from .computer import Computer

if TYPE_CHECKING:
    from ..ops.sandboxes import SandboxManager

__all__ = ["Filler", "add_fill_route", "REDACTED", "origin_host_allowed"]

log = logging.getLogger("podbay.nodeagent.computer_fill")

REDACTED = "[redacted by podbay]"


class CredentialNotFound(NotFound):
    code = "credential_not_found"


class CredentialOutOfScope(Forbidden):
    code = "credential_out_of_scope"


class CredentialExpired(Forbidden):
    code = "credential_expired"


class OriginNotAllowed(Forbidden):
    code = "origin_not_allowed"


class SelectorNotFound(Unprocessable):
    code = "selector_not_found"


class InvalidSelector(Unprocessable):
    code = "invalid_selector"


def origin_host_allowed(hosts: list[str], url: str) -> tuple[str, bool]:
    """``(origin, allowed)`` of a page URL against a credential's hosts (exact, or ``*.suffix`` for names
    strictly below ``suffix``, case-insensitive: :func:`~podbay.contracts.egress.name_matches`, the gateway's
    rule). Only http(s) pages qualify."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return parts.scheme + ":" if parts.scheme else "", False
    host = parts.hostname.lower().rstrip(".")
    origin = f"{parts.scheme}://{parts.netloc.rpartition('@')[2].lower()}"
    return origin, any(name_matches(pattern, host) for pattern in hosts)


class Filler:
    """Credential fill for this node's sandboxes, and redaction of filled values (module docstring)."""

    def __init__(self, manager: SandboxManager, computer: Computer) -> None:
        self.m = manager
        self.computer = computer
        self.fills = computer.fills

    async def redactor(self, sandbox_id: str) -> Callable[[str | bytes], str | bytes]:
        """A transform for CDP messages to the agent of ``sandbox_id``, once the sandbox's filled set is armed on
        this node (:meth:`.FillMemory.arm`; ``Unavailable`` when it cannot be, and the proxy refuses the
        connection). It reads the filled values at each message, so a fill during a connection is redacted from
        then on."""
        await self.fills.arm(sandbox_id)

        def redact(data: str | bytes) -> str | bytes:
            values = self.fills.values(sandbox_id)
            if not values or not isinstance(data, str):
                return data
            for v in values:
                for spelling in {v, json.dumps(v)[1:-1]}:
                    if spelling in data:
                        data = data.replace(spelling, REDACTED)
            return data
        return redact

    async def relay_filter(self, sandbox_id: str) -> RelayFilter:
        """The transforms of one WebSocket relayed to ``sandbox_id``'s guest by the ports proxy: the agent's
        screenshots masked after a fill (:class:`.cdp_mask.ScreenshotMasker`), then every message to the agent
        redacted (:meth:`redactor`, which arms the sandbox's filled set: ``Unavailable`` when it cannot be)."""
        redact = await self.redactor(sandbox_id)
        masker = ScreenshotMasker(lambda: self.fills.selectors(sandbox_id))

        def to_client(data: str | bytes) -> str | bytes | None:
            masked = masker.to_client(data)
            return None if masked is None else redact(masked)
        return RelayFilter(to_upstream=masker.to_upstream, to_client=to_client)

    async def _audit(self, tenant_id: str, sandbox_id: str, cred_id: str | None, decision: str,
                     detail: dict[str, Any]) -> int:
        try:
            async with self.m.pool.acquire() as conn, conn.transaction():
                return await audit.record(conn, tenant_id=tenant_id, actor=f"node:{self.m.node_id}",
                                          action="credential.fill", target=cred_id, sandbox_id=sandbox_id,
                                          decision=decision, detail=detail)
        except (asyncpg.PostgresError, OSError) as exc:
            raise Unavailable(f"cannot write the fill's audit row: {exc}") from exc

    async def fill(self, sandbox_id: str, generation: int | None, body: FillRequest) -> FillResult:
        """Check, type and audit one fill (module docstring); raises the refusal's error after auditing it."""
        self.m.channel(sandbox_id, generation)
        try:
            # A credential's scope names templates as their owners named them (templates.alias), not by key.
            sbx = await self.m.pool.fetchrow(
                "SELECT s.tenant_id, coalesce(t.alias, s.template) AS template FROM sandboxes s"
                " LEFT JOIN templates t ON t.name = s.template WHERE s.id = $1", sandbox_id)
            cred = None if sbx is None else await self.m.pool.fetchrow(
                "SELECT id, hosts, expires_at, scope_sandboxes, scope_templates, backend, ciphertext, secret_ref"
                " FROM credentials WHERE tenant_id = $1 AND name = $2 AND deleted_at IS NULL",
                sbx["tenant_id"], body.credential)
        except (asyncpg.PostgresError, OSError) as exc:
            raise Unavailable(f"cannot read the credential: {exc}") from exc
        if sbx is None:
            raise NotFound(f"sandbox {sandbox_id} has no row")
        detail: dict[str, Any] = {"credential": body.credential, "selector": body.selector}
        tenant = str(sbx["tenant_id"])

        async def refuse(exc: PodbayError, reason: str, cred_id: str | None) -> PodbayError:
            exc.details.update({"credential": body.credential})
            await self._audit(tenant, sandbox_id, cred_id, "deny", {**detail, "reason": reason})
            return exc

        if cred is None:
            raise await refuse(CredentialNotFound(f"no credential named {body.credential!r}"), "credential_not_found",
                               None)
        cid = str(cred["id"])
        if (cred["scope_sandboxes"] is not None and sandbox_id not in cred["scope_sandboxes"]) or (
                cred["scope_templates"] is not None and sbx["template"] not in cred["scope_templates"]):
            raise await refuse(CredentialOutOfScope(f"credential {body.credential!r} is not in scope for sandbox "
                                                    f"{sandbox_id}"), "credential_out_of_scope", cid)
        if cred["expires_at"] is not None and cred["expires_at"] <= datetime.now(UTC):
            raise await refuse(CredentialExpired(f"credential {body.credential!r} expired at "
                                                 f"{cred['expires_at'].isoformat()}"), "credential_expired", cid)
        async with self.computer.page(sandbox_id, generation) as cdp:
            hist = await cdp.call("Page.getNavigationHistory")
            entries = hist.get("entries") or []
            idx = hist.get("currentIndex")
            url = str(entries[idx].get("url", "")) if isinstance(idx, int) and 0 <= idx < len(entries) else ""
            origin, allowed = origin_host_allowed(list(cred["hosts"]), url)
            detail["origin"] = origin
            if not allowed:
                raise await refuse(OriginNotAllowed(f"the page's origin {origin or '(none)'} is not one of credential "
                                                    f"{body.credential!r}'s hosts", details={"origin": origin}),
                                   "origin_not_allowed", cid)
            root = (await cdp.call("DOM.getDocument", {"depth": 0})).get("root", {}).get("nodeId")
            try:
                node = (await cdp.call("DOM.querySelector", {"nodeId": root, "selector": body.selector})).get("nodeId")
            except GuestError as exc:
                raise await refuse(InvalidSelector(f"the browser refused the selector: {exc.message}"),
                                   "invalid_selector", cid) from exc
            if not node:
                raise await refuse(SelectorNotFound(f"no element matches {body.selector!r} on {origin}"),
                                   "selector_not_found", cid)
            await cdp.call("DOM.focus", {"nodeId": node})
            # The durable record first (.fill_memory re-arms the redaction from it after a wake, a migration,
            # a fork or a restart): no value is typed that it would not know of.
            aid = await self._audit(tenant, sandbox_id, cid, "allow", detail)
            try:
                value = await open_store(self.m.settings, cred["backend"]).reveal(
                    cid, tenant, Sealed(cred["backend"], cred["ciphertext"], cred["secret_ref"]))
            except ValueError as exc:
                raise Unavailable(f"the credential store is not configured on this node: {exc}") from exc
            # Remembered before typing: a CDP client's view of the page is redacted from the first echo, and
            # screenshots mask the field.
            self.fills.add(sandbox_id, value, body.selector)
            await cdp.call("Input.insertText", {"text": value})
        log.info("sandbox=%s credential %s filled into %s on %s (audit %d)", sandbox_id, body.credential,
                 body.selector[:80], origin, aid)
        return FillResult(credential=body.credential, origin=origin, selector=body.selector, audit_id=aid)

    def forget(self, sandbox_id: str) -> None:
        """Drop what was filled for a sandbox (it is gone from this node): the manager's ``on_leave`` hook.
        Wherever it runs next, the node re-arms from the durable record (:mod:`.fill_memory`)."""
        self.fills.forget(sandbox_id)


def add_fill_route(app: FastAPI, manager: SandboxManager, computer: Computer) -> Filler:
    """Mount ``POST /internal/v1/sandboxes/{id}/computer/fill`` on the data-plane app; the manager forgets a
    sandbox's filled values and masks when it leaves the node (deleted, suspended, moved away, failed), and the
    node it runs on next re-arms them from the record."""
    filler = Filler(manager, computer)
    manager.on_leave.append(filler.forget)

    @app.post("/internal/v1/sandboxes/{sandbox_id}/computer/fill")
    async def fill(sandbox_id: str, body: FillRequest, request: Request) -> FillResult:
        g = request.headers.get("x-podbay-generation")
        return await filler.fill(sandbox_id, int(g) if g and g.isdigit() else None, body)

    return filler
