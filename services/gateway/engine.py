"""The gateway's decisions, independent of the proxy library: identify the sandbox behind a source address,
decide a destination, record denials, look up and reveal credentials.

The mitmproxy adapter (:mod:`.proxy`) and the DNS server (:mod:`.dns`) both call this; neither holds state of
its own about sandboxes. Per connection or query, :meth:`Gateway.identify` reads the binding file and the
sandbox's row afresh, so a policy change in the database applies to the next connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from podbay.config import Settings
from podbay.contracts.egress import NetBinding
from podbay.credentials import Sealed, open_store
from podbay.egress_ranges import parse_cidrs
from podbay.oidc import KeyCache, mint
from podbay.outbox import Relay
from podbay.stacknet import gateway_denied_cidr

from .identity import DnsMemory, node_addresses, read_binding
from .metrics import DECISIONS, PLACEHOLDERS
from podbay.egress_placeholders import MalformedPlaceholder, has_placeholder, parse, substitute
from .policy import Decision, always_denied, decide, decide_name, normalise_name
from .resolve import Resolver
from .shaping import CredentialRow, TokenBuckets
from .store import GatewayStore, SandboxContext, UseVerdict

__all__ = ["Peer", "Gateway", "TransformRefused"]

log = logging.getLogger("podbay.gateway")


@dataclass(frozen=True)
class Peer:
    """An identified source: the guest address, its binding and (when the sandbox row exists) its context.
    ``refusal`` is set when the peer must be refused outright (no binding, no sandbox row)."""

    guest: str
    binding: NetBinding | None
    ctx: SandboxContext | None
    refusal: Decision | None = None

    @property
    def sandbox_id(self) -> str | None:
        return self.binding.sandbox_id if self.binding else None


class TransformRefused(Exception):
    """A rule's header could not be resolved: the request is refused with ``status`` and ``code`` (the message
    names the header and the placeholder's name, never a value)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class Gateway:
    """Shared by every connection and query of one gateway process."""

    def __init__(self, settings: Settings, store: GatewayStore, relay: Relay | None, *,
                 resolver: Resolver | None = None, memory: DnsMemory | None = None) -> None:
        self.settings = settings
        self.store = store
        self.relay = relay
        self.resolver = resolver or Resolver(settings.gateway_hosts_file)
        self.memory = memory or DnsMemory()
        self._sandbox_cidr = gateway_denied_cidr(settings)
        #: Always-denied ranges the operator opened (never a tenant): PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS.
        self.operator_allow = parse_cidrs(settings.egress_operator_allow_cidrs)
        #: DNS queries per guest address (services/gateway/dnsserver.py).
        self.dns_buckets = TokenBuckets(settings.gateway_dns_rate_per_s, settings.gateway_dns_burst)
        self.own_addrs: set[str] = set()  # filled by refresh_own_addresses() before serving
        self._generations: dict[str, tuple[str, int]] = {}
        self._dns_denials: dict[tuple[str, str], float] = {}  # (sandbox, name) -> monotonic s of last audit
        self._tasks: set[asyncio.Task[Any]] = set()
        self._keys: KeyCache | None = None  # workload identity signing key, read on first use

    # --- identity ------------------------------------------------------------------------------------------

    async def identify(self, src_ip: str) -> Peer:
        """Binding file of ``src_ip``, then the sandbox row. Never raises for a bad peer: see ``refusal``."""
        guest = src_ip.removeprefix("::ffff:")
        binding = read_binding(self.settings.data_dir, self.settings.node_id, guest)
        if binding is None:
            return Peer(guest, None, None, Decision.deny("no_binding", f"{guest} is not a sandbox of this node"))
        seen = self._generations.get(guest)
        if seen != (binding.sandbox_id, binding.generation):
            # A new sandbox or generation on this address: what our DNS told the old one means nothing now.
            self.memory.forget(guest)
            self._generations[guest] = (binding.sandbox_id, binding.generation)
        ctx = await self.store.sandbox(binding.sandbox_id)
        if ctx is None:
            return Peer(guest, binding, None, Decision.deny("no_sandbox", f"sandbox {binding.sandbox_id} has no "
                                                                          "record (a warm slot not yet claimed)"))
        return Peer(guest, binding, ctx)

    def _own(self) -> set[str]:
        return self.own_addrs

    async def refresh_own_addresses(self) -> None:
        """Re-read this host's addresses. In a worker thread: pyroute2's synchronous API does not work from
        inside a running event loop (it silently sees nothing there)."""
        self.own_addrs = await asyncio.to_thread(node_addresses)

    async def watch_own_addresses(self, stop: asyncio.Event, every_s: float = 5.0) -> None:
        """Keep :attr:`own_addrs` current (interfaces and addresses come and go) until ``stop``."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=every_s)
            except TimeoutError:
                pass
            try:
                await self.refresh_own_addresses()
            except Exception as exc:  # noqa: BLE001 - keep the last known set
                log.warning("node addresses not refreshed: %s", exc)

    # --- decisions -----------------------------------------------------------------------------------------

    def refuse_address(self, addr: str) -> Decision | None:
        """The always-denied check alone (before anything is known about the connection's protocol)."""
        return always_denied(addr, own_addrs=self._own(), sandbox_cidr=self._sandbox_cidr,
                             operator_allow=self.operator_allow)

    def reachable(self, addrs: list[str]) -> list[str]:
        """The addresses of ``addrs`` a sandbox may connect to at all (:meth:`refuse_address` is None). The DNS
        server answers with these only: a name that leads into a private range (DNS rebinding, internal names
        of the node's network) does not lead a guest there, nor tell it what is there."""
        return [a for a in addrs if self.refuse_address(a) is None]

    async def decide_named(self, peer: Peer, name: str | None, addr: str, port: int) -> Decision:
        """A TLS (SNI) or HTTP (Host) connection: the name must be allowed and ``addr`` must be one of its
        addresses (what our DNS answered this guest, else a fresh resolution). Without a name, by address."""
        policy = peer.ctx.policy if peer.ctx else None
        norm = normalise_name(name)
        if norm is None:
            return await self.decide_raw(peer, addr, port)
        addrs = self.memory.addrs_of(peer.guest, norm)
        if addr not in addrs:
            addrs = addrs + await self.resolver.resolve(norm)
        return decide(policy, name=norm, addr=addr, port=port, name_addrs=addrs, own_addrs=self._own(),
                      sandbox_cidr=self._sandbox_cidr, operator_allow=self.operator_allow)

    async def decide_raw(self, peer: Peer, addr: str, port: int) -> Decision:
        """Other TCP: by CIDR rules, or by the name our DNS answered this guest with ``addr``."""
        policy = peer.ctx.policy if peer.ctx else None
        name = self.memory.name_of(peer.guest, addr)
        return decide(policy, name=name, addr=addr, port=port, name_addrs=None, own_addrs=self._own(),
                      sandbox_cidr=self._sandbox_cidr, operator_allow=self.operator_allow)

    async def early_refusal(self, peer: Peer, addr: str, port: int) -> Decision | None:
        """A denial that holds whatever the guest sends next, so the connection can be closed before it sends
        anything (fast failure for clients that wait for the server to speak): there is no policy, or the
        address-level decision denies and no domain rule could allow this port by name. ``None`` when a name (SNI, Host) may still decide."""
        raw = await self.decide_raw(peer, addr, port)
        if raw.allowed:
            return None
        if peer.ctx is None or peer.ctx.policy is None:
            return raw
        if any(r.domain is not None and (not r.ports or port in r.ports) for r in peer.ctx.policy.allow):
            return None
        return raw

    def decide_dns(self, peer: Peer, name: str) -> Decision:
        """May this guest learn ``name``'s addresses?"""
        return decide_name(peer.ctx.policy if peer.ctx else None, name)

    # --- denials -------------------------------------------------------------------------------------------

    def denied(self, peer: Peer, protocol: str, destination: str, decision: Decision, *,
               detail: dict[str, Any] | None = None) -> None:
        """Log, count and (in the background, so the refusal itself never waits for the database) audit a
        denial with its egress event. DNS denials are audited at most once a minute per sandbox and name."""
        DECISIONS.labels(protocol, decision.reason).inc()
        log.info("egress deny sandbox=%s guest=%s proto=%s dest=%s reason=%s msg=%r", peer.sandbox_id or "-",
                 peer.guest, protocol, destination, decision.reason, decision.message)
        if peer.sandbox_id is None:
            return  # no sandbox to attribute the row to: the log line is the record
        if protocol == "dns":
            key, now = (peer.sandbox_id, destination), time.monotonic()
            if now - self._dns_denials.get(key, -1e9) < 60.0:
                return
            self._dns_denials[key] = now
            if len(self._dns_denials) > 100_000:
                self._dns_denials.clear()
        tenant = peer.ctx.tenant_id if peer.ctx else None
        self.spawn(self._audit_denial(tenant, peer.sandbox_id, protocol, destination, decision, detail))

    async def _audit_denial(self, tenant: str | None, sandbox_id: str, protocol: str, destination: str,
                            decision: Decision, detail: dict[str, Any] | None) -> None:
        try:
            await self.store.record_denial(tenant_id=tenant, sandbox_id=sandbox_id, destination=destination,
                                           reason=decision.reason, message=decision.message,
                                           detail={"protocol": protocol, **(detail or {})})
        except Exception as exc:  # noqa: BLE001 - the refusal stands; the log line above is the record
            log.error("egress denial not audited sandbox=%s dest=%s: %s", sandbox_id, destination, exc)
            return
        self.kick()

    def allowed(self, protocol: str, decision: Decision) -> None:
        """Count an allowed decision."""
        DECISIONS.labels(protocol, decision.reason).inc()

    # --- credentials ---------------------------------------------------------------------------------------

    async def credentials(self, peer: Peer) -> list[CredentialRow]:
        """The credentials in scope for this peer (empty without a sandbox row)."""
        return await self.store.credentials(peer.ctx) if peer.ctx else []

    async def reveal(self, row: CredentialRow) -> str:
        """The value of ``row``, read from its backend now (never cached)."""
        store = open_store(self.settings, row.backend)
        return await store.reveal(row.id, row.tenant_id, Sealed(row.backend, row.ciphertext, row.secret_ref))

    async def resolve_transform(self, peer: Peer, headers: dict[str, str]) -> tuple[dict[str, str], set[str]]:
        """``headers`` of the sandbox's rules (:func:`.policy.transform_headers`) with their placeholders
        (:mod:`podbay.egress_placeholders`) resolved: a secret read from the credential store now, a workload identity token
        minted now for the audience of the sandbox's ``iam.tokens`` entry. Returns the headers and every value
        put in (for redaction). :class:`TransformRefused` (403) for a malformed placeholder, an unknown or
        expired secret, or a token name the sandbox did not register; store errors pass through."""
        ctx = peer.ctx
        out: dict[str, str] = {}
        revealed: set[str] = set()
        for name, value in headers.items():
            if not has_placeholder(value):
                out[name] = value
                continue
            if ctx is None:
                raise TransformRefused(403, "transform_unresolved", f"header {name}: no sandbox to resolve it for")
            try:
                found = parse(value)
            except MalformedPlaceholder as exc:
                raise TransformRefused(403, "transform_malformed", f"header {name}: {exc}") from exc
            values: dict[tuple[str, str], str] = {}
            for p in found:
                if (p.kind, p.name) in values:
                    continue
                if p.kind == "secret":
                    row = await self.store.secret(ctx.tenant_id, p.name)
                    if row is None:
                        PLACEHOLDERS.labels("secret", "secret_not_found").inc()
                        raise TransformRefused(403, "secret_not_found",
                                               f"header {name}: secret {p.name} does not exist")
                    if row.expires_at is not None and row.expires_at <= datetime.now(UTC):
                        PLACEHOLDERS.labels("secret", "credential_expired").inc()
                        raise TransformRefused(403, "credential_expired", f"header {name}: secret {p.name} expired")
                    values[(p.kind, p.name)] = await self.reveal(row)
                    PLACEHOLDERS.labels("secret", "resolved").inc()
                else:
                    spec = ctx.iam_tokens.get(p.name)
                    if spec is None:
                        PLACEHOLDERS.labels("token", "identity_token_not_registered").inc()
                        raise TransformRefused(403, "identity_token_not_registered",
                                               f"header {name}: workload identity token {p.name!r} is not in the "
                                               "sandbox's iam.tokens")
                    if self._keys is None:
                        self._keys = KeyCache(self.store.pool, self.settings)
                    key = await self._keys.get()
                    values[(p.kind, p.name)] = mint(key, self.settings, tenant_id=ctx.tenant_id,
                                                    sandbox_id=ctx.sandbox_id, audience=str(spec["audience"]))
                    PLACEHOLDERS.labels("token", "resolved").inc()
                    log.info("identity token minted sandbox=%s token=%s aud=%s kid=%s", ctx.sandbox_id, p.name,
                             spec["audience"], key.kid)
            revealed.update(values.values())
            out[name] = substitute(value, found, values)
        return out, revealed

    async def use(self, row: CredentialRow, peer: Peer, *, host: str, method: str, path: str) -> UseVerdict:
        """Record (and decide) one use of ``row``; kicks the relay for its event."""
        verdict = await self.store.use_credential(row, sandbox_id=peer.sandbox_id or "", host=host,
                                                  method=method, path=path)
        self.kick()
        return verdict

    # --- housekeeping --------------------------------------------------------------------------------------

    def kick(self) -> None:
        if self.relay is not None:
            self.relay.kick()

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait for background audit writes (graceful shutdown)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
