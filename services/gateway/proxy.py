"""The transparent proxy: mitmproxy 11 as a library (the only module of the gateway that imports it).

mitmproxy listens in ``transparent`` mode on ``settings.gateway_proxy_port``; the node's nftables rules
redirect every TCP connection from a sandbox tap there, and mitmproxy reads the original destination with
``SO_ORIGINAL_DST``. ``connection_strategy`` is ``lazy``: no upstream connection is opened before the
gateway has decided, so a denied destination never even sees a SYN.

Hooks, per client connection (state in :class:`_Conn`, keyed by mitmproxy's client id):

* ``client_connected``: identify the sandbox (binding file + sandbox row); refuse at once when there is no
  binding, no sandbox row, or the destination is always denied (loopback, link-local, metadata, multicast,
  this node, the sandbox network).
* ``tls_clienthello``: decide by SNI + port (and the address must be the name's). Denied -> the connection is
  made a pass-through whose upstream connect is refused in ``server_connect`` (closed at once). Allowed and no
  credential nor header transform for the SNI -> pass-through, untouched. Allowed with a credential or a
  transform (the policy's ``transforms``, E2B's ``network.rules``) -> intercepted with this sandbox's own CA
  (:class:`SandboxTlsConfig`).
* ``request``: plain HTTP is decided by Host + port (denied -> 403 JSON with ``X-Podbay-Denied``). On an
  intercepted connection, the credential for host + path is checked (expired -> 403 ``credential_expired``,
  over its limit -> 429 ``credential_rate_limited``), revealed and injected. The transforms' headers for the
  host are set on both (before the credential, which wins a header they share); on an intercepted connection
  their ``${e2b.secrets.*}`` and ``${e2b.identity.tokens.*}`` placeholders are resolved first (a secret read,
  a token minted per request; :meth:`Gateway.resolve_transform`), and a plain-HTTP request whose transform
  holds one is refused (403 ``transform_requires_https``).
* ``server_connect``: the choke point: an upstream connection opens only for a connection with an allowed
  decision to its original destination; a connection that reached it undecided (raw TCP) is decided here by
  CIDR, or by the name our DNS answered this guest for the address.
* ``responseheaders``/``response``/``websocket_message``: every value injected on this connection is
  replaced by ``[podbay:redacted]`` in what goes back to the guest (bodies are buffered, never streamed,
  for that reason).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mitmproxy import certs, connection, http, options, tls
from mitmproxy.addons import core, errorcheck, next_layer, proxyserver, tlsconfig
from mitmproxy.master import Master
from mitmproxy.proxy import server_hooks

from podbay import hostca
from podbay.config import Settings
from podbay.contracts.egress import EgressPolicy

from .engine import Gateway, Peer, TransformRefused
from .metrics import CONNECTIONS, CREDENTIAL_USES, REDACTIONS
from podbay.egress_placeholders import has_placeholder
from .policy import Decision, normalise_name, transform_headers
from .shaping import (
    DENIED_HEADER,
    CredentialRow,
    credentials_for_host,
    error_body,
    format_header,
    pick_credential,
    redact,
    redact_text,
    remember_redacted,
)

__all__ = ["EgressAddon", "SandboxTlsConfig", "build_master", "upstream_bundle"]

log = logging.getLogger("podbay.gateway.proxy")


@dataclass
class _Conn:
    peer: Peer
    dst: tuple[str, int]
    verdict: Decision | None = None
    protocol: str = "tcp"
    sni: str | None = None
    intercepted: bool = False
    creds: list[CredentialRow] = field(default_factory=list)
    secrets: set[str] = field(default_factory=set)


def _policy(st: _Conn) -> EgressPolicy | None:
    return st.peer.ctx.policy if st.peer.ctx else None


def _ip(addr: str) -> str:
    return addr.removeprefix("::ffff:").split("%", 1)[0]


class EgressAddon:
    """The decisions of :mod:`podbay_gateway.engine` applied to mitmproxy's hooks."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.conns: dict[str, _Conn] = {}

    def state(self, client: connection.Client) -> _Conn | None:
        return self.conns.get(client.id)

    # --- connection -----------------------------------------------------------------------------------------

    async def client_connected(self, client: connection.Client) -> None:
        src = _ip(str(client.peername[0]))
        dst = (_ip(str(client.sockname[0])), int(client.sockname[1]))
        try:
            peer = await self.gw.identify(src)
        except Exception as exc:  # noqa: BLE001 - the database is away: refuse, never guess
            log.warning("connection from %s to %s:%s refused: %s", src, *dst, exc)
            CONNECTIONS.labels("error").inc()
            client.error = "gateway cannot identify the sandbox"
            return
        if peer.refusal is not None:
            CONNECTIONS.labels(peer.refusal.reason).inc()
            self.gw.denied(peer, "tcp", f"{dst[0]}:{dst[1]}", peer.refusal)
            client.error = peer.refusal.message
            return
        CONNECTIONS.labels("identified").inc()
        hard = self.gw.refuse_address(dst[0])
        if hard is not None:
            self.gw.denied(peer, "tcp", f"{dst[0]}:{dst[1]}", hard)
            client.error = hard.message
            return
        early = await self.gw.early_refusal(peer, *dst)
        if early is not None:
            self.gw.denied(peer, "tcp", f"{dst[0]}:{dst[1]}", early)
            client.error = early.message
            return
        self.conns[client.id] = _Conn(peer, dst)

    def client_disconnected(self, client: connection.Client) -> None:
        st = self.conns.pop(client.id, None)
        if st is not None:
            st.secrets.clear()

    async def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        st = self.state(data.context.client)
        if st is None:
            data.ignore_connection = True  # server_connect refuses it
            return
        st.protocol, st.sni = "tls", data.client_hello.sni
        decision = await self.gw.decide_named(st.peer, st.sni, *st.dst)
        st.verdict = decision
        dest = f"{st.sni or st.dst[0]}:{st.dst[1]}"
        if not decision.allowed:
            self.gw.denied(st.peer, "tls", dest, decision, detail={"address": st.dst[0]})
            data.ignore_connection = True  # no interception; server_connect closes it at once
            return
        try:
            creds = credentials_for_host(await self.gw.credentials(st.peer), st.sni) if st.sni else []
        except Exception as exc:  # noqa: BLE001 - without the credential list we cannot know: refuse
            log.warning("credentials not readable, refusing %s: %s", dest, exc)
            st.verdict = Decision.deny("error", "the gateway cannot read its credential store")
            data.ignore_connection = True
            return
        self.gw.allowed("tls", decision)
        if not creds and not transform_headers(_policy(st), st.sni):
            data.ignore_connection = True  # allowed, nothing to inject: bytes pass untouched
            return
        st.creds, st.intercepted = creds, True  # SandboxTlsConfig presents a certificate of this sandbox's CA

    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        st = self.state(data.client)
        if st is None:
            data.server.error = "connection not identified"
            return
        address = data.server.address
        if address is None or (_ip(str(address[0])), int(address[1])) != st.dst:
            data.server.error = "the gateway only connects to the original destination"
            return
        if st.verdict is None:  # neither TLS nor HTTP reached a decision: raw TCP
            st.verdict = await self.gw.decide_raw(st.peer, *st.dst)
            if st.verdict.allowed:
                self.gw.allowed("tcp", st.verdict)
            else:
                self.gw.denied(st.peer, "tcp", f"{st.dst[0]}:{st.dst[1]}", st.verdict)
        if not st.verdict.allowed:
            data.server.error = st.verdict.message

    # --- HTTP -----------------------------------------------------------------------------------------------

    async def request(self, flow: http.HTTPFlow) -> None:
        st = self.state(flow.client_conn)
        if st is None:
            flow.response = _refusal(403, "egress_denied", "connection not identified")
            return
        if st.intercepted:
            await self._inject(flow, st)
            return
        # Plain HTTP (or HTTP inside TLS we pass through, which never reaches here): by Host + port.
        host = flow.request.host_header or ""
        decision = await self.gw.decide_named(st.peer, host, *st.dst)
        dest = f"{host or st.dst[0]}:{st.dst[1]}"
        if not decision.allowed:
            self.gw.denied(st.peer, "http", dest, decision, detail={"method": flow.request.method,
                                                                    "path": flow.request.path[:256]})
            flow.response = _refusal(403, "egress_denied", decision.message)
            return
        self.gw.allowed("http", decision)
        st.protocol, st.verdict = "http", decision
        headers = transform_headers(_policy(st), host)
        if any(has_placeholder(v) for v in headers.values()):
            # A secret or an identity token goes out only inside TLS (as a credential does): never in clear text.
            flow.response = _refusal(403, "transform_requires_https",
                                     f"the rules for {host} put a secret or an identity token in a header: "
                                     "send this request over HTTPS")
            return
        flow.request.headers.update(headers)

    async def _inject(self, flow: http.HTTPFlow, st: _Conn) -> None:
        host = (st.sni or "").lower()
        path = flow.request.path
        named = normalise_name(flow.request.host_header)
        if named is not None and named != normalise_name(host):
            # The credential was chosen for the SNI (the name the upstream certificate is verified against);
            # a request naming another host on that connection gets nothing injected, and is refused.
            flow.response = _refusal(421, "misdirected_request",
                                     f"request for {named} on a connection to {host}")
            return
        try:
            headers, revealed = await self.gw.resolve_transform(st.peer, transform_headers(_policy(st), host))
        except TransformRefused as exc:
            log.info("transform refused sandbox=%s host=%s reason=%s", st.peer.sandbox_id, host, exc.code)
            flow.response = _refusal(exc.status, exc.code, exc.message)
            return
        except Exception as exc:  # noqa: BLE001 - fail closed, and say nothing about a value
            log.error("transform not resolvable for %s: %s", host, type(exc).__name__)
            flow.response = _refusal(503, "credential_unavailable", "the credential store did not answer")
            return
        flow.request.headers.update(headers)
        remember_redacted(st.secrets, revealed)  # redacted in whatever comes back, as a credential's value
        try:
            # Read per request, so a credential deleted or changed applies to the next request on a
            # kept-alive connection too.
            st.creds = credentials_for_host(await self.gw.credentials(st.peer), host)
        except Exception as exc:  # noqa: BLE001 - fail closed
            log.error("credentials not readable: %s", exc)
            flow.response = _refusal(503, "credential_unavailable", "the credential store did not answer")
            return
        row = pick_credential(st.creds, host, path)
        if row is None:
            return  # allowed destination, no credential for this path: forwarded as is
        try:
            verdict = await self.gw.use(row, st.peer, host=host, method=flow.request.method, path=path[:256])
        except Exception as exc:  # noqa: BLE001 - fail closed
            CREDENTIAL_USES.labels("error").inc()
            log.error("credential %s not usable: %s", row.id, exc)
            flow.response = _refusal(503, "credential_unavailable", "the credential store did not answer")
            return
        CREDENTIAL_USES.labels(verdict.code).inc()
        if not verdict.allowed:
            status = 429 if verdict.code == "credential_rate_limited" else 403
            log.info("credential refused sandbox=%s credential=%s host=%s reason=%s", st.peer.sandbox_id, row.id,
                     host, verdict.code)
            flow.response = _refusal(status, verdict.code, verdict.message)
            return
        try:
            value = await self.gw.reveal(row)
            flow.request.headers[row.header] = format_header(row.format, value)
        except Exception as exc:  # noqa: BLE001 - fail closed, and say nothing about the value
            log.error("credential %s could not be revealed: %s", row.id, type(exc).__name__)
            flow.response = _refusal(503, "credential_unavailable", f"credential {row.name} could not be read")
            return
        st.secrets.add(value)
        log.info("credential used sandbox=%s credential=%s host=%s method=%s path=%s", st.peer.sandbox_id, row.id,
                 host, flow.request.method, path[:256])

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        st = self.state(flow.client_conn)
        if st is None or not st.secrets or flow.response is None:
            return
        flow.response.stream = False  # redaction needs the whole body
        for key in list(flow.response.headers.keys()):
            values = flow.response.headers.get_all(key)
            clean = []
            for v in values:
                new, n = redact_text(v, st.secrets)
                clean.append(new)
                REDACTIONS.inc(n)
            flow.response.headers.set_all(key, clean)

    def response(self, flow: http.HTTPFlow) -> None:
        st = self.state(flow.client_conn)
        if st is None or not st.secrets or flow.response is None:
            return
        try:
            body = flow.response.get_content(strict=True) or b""
            new, n = redact(body, st.secrets)
            if n:
                flow.response.set_content(new)
        except ValueError:  # an encoding we cannot decode: redact the raw bytes
            new, n = redact(flow.response.raw_content or b"", st.secrets)
            if n:
                flow.response.raw_content = new
        REDACTIONS.inc(n)

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        st = self.state(flow.client_conn)
        if st is None or not st.secrets or flow.websocket is None or not flow.websocket.messages:
            return
        msg = flow.websocket.messages[-1]
        if not msg.from_client:
            new, n = redact(msg.content, st.secrets)
            if n:
                msg.content = new
                REDACTIONS.inc(n)


def _refusal(status: int, code: str, message: str) -> http.Response:
    return http.Response.make(status, error_body(code, message),
                              {"Content-Type": "application/json", DENIED_HEADER: code, "Connection": "close"})


class SandboxTlsConfig(tlsconfig.TlsConfig):
    """mitmproxy's TLS configuration, with the client-side certificate signed by the connecting sandbox's own
    CA (the binding's ``ca_path``; one certificate store per sandbox generation) instead of a global CA."""

    def __init__(self, addon: EgressAddon, dhparam: Path) -> None:
        super().__init__()
        self._addon = addon
        self._dhparam = dhparam
        self._stores: dict[tuple[str, int, str], certs.CertStore] = {}

    def _store(self, st: _Conn) -> certs.CertStore:
        b = st.peer.binding
        assert b is not None
        key = (b.sandbox_id, b.generation, b.ca_path)
        store = self._stores.get(key)
        if store is None:
            if len(self._stores) > 1024:
                self._stores.clear()
            store = certs.CertStore.from_files(Path(b.ca_path), self._dhparam)
            self._stores[key] = store
        return store

    def tls_start_client(self, tls_start: tls.TlsData) -> None:
        st = self._addon.state(tls_start.context.client)
        if st is None or st.peer.binding is None or not st.intercepted:
            raise RuntimeError("no sandbox CA for this connection")  # never fall back to a shared CA
        # Synchronous hook: nothing else runs between setting the store and the parent reading it.
        self.certstore = self._store(st)
        super().tls_start_client(tls_start)


def upstream_bundle(extra: Path | None, work_dir: Path) -> Path:
    """The CA bundle file for upstream verification, in ``work_dir``: what the host trusts (its OpenSSL bundle,
    which on a network that inspects TLS holds that network's CA; certifi's roots without one) plus ``extra``
    (``GATEWAY_UPSTREAM_CA``). Always set: mitmproxy's default is certifi's roots alone."""
    bundle = work_dir / "upstream-ca.pem"
    bundle.write_bytes(hostca.upstream_bundle(extra))
    return bundle


def build_master(settings: Settings, gw: Gateway, listen_host: str = "0.0.0.0") -> tuple[Master, EgressAddon, Path]:
    """A mitmproxy master with only the addons the gateway needs (no scripting, no console, no flow
    storage), in transparent mode on ``listen_host:settings.gateway_proxy_port``, plus its private work
    directory (mitmproxy's confdir, DH parameters, the upstream CA bundle; the caller removes it after the
    master stopped). Call in a running loop."""
    if settings.log_level.upper() != "DEBUG":
        # mitmproxy logs every client and server connect at INFO; our own decision lines say what matters.
        logging.getLogger("mitmproxy").setLevel(logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="podbay-gateway-"))
    os.chmod(work, 0o700)
    opts = options.Options()
    master = Master(opts)
    addon = EgressAddon(gw)
    tlscfg = SandboxTlsConfig(addon, work / "dhparam.pem")
    master.addons.add(core.Core(), proxyserver.Proxyserver(), next_layer.NextLayer(), tlscfg,
                      errorcheck.ErrorCheck(), addon)
    bundle = upstream_bundle(settings.gateway_upstream_ca, work)
    opts.update(
        mode=[f"transparent@{listen_host}:{settings.gateway_proxy_port}"],
        confdir=str(work),  # mitmproxy's own default CA lands here; it never signs for a sandbox
        connection_strategy="lazy",
        ssl_insecure=False,
        ssl_verify_upstream_trusted_ca=str(bundle),
        stream_large_bodies=None,
        rawtcp=True,
        upstream_cert=False,
    )
    return master, addon, work
