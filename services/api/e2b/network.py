"""E2B's sandbox network options mapped onto podbay's egress policy (docs/e2b.md "Network"; the gateway
enforces it, docs/egress.md).

E2B: the internet is open unless ``allow_internet_access`` is false (the same as ``denyOut: ["0.0.0.0/0"]``);
``denyOut`` lists CIDRs or addresses; ``allowOut`` lists CIDRs, addresses or domains (``*.`` wildcards) and
wins over ``denyOut``. podbay: nothing is allowed unless an ``allow`` rule matches, and a matching ``deny``
rule wins. The mapping:

* nothing asked at create -> None (the template's policy applies, as for any podbay sandbox);
* internet open, no ``denyOut`` -> allow everything (``0.0.0.0/0``, ``::/0``);
* ``denyOut`` covering everything (``0.0.0.0/0``, or the internet closed) -> allow only ``allowOut``;
* otherwise -> allow everything, deny ``denyOut`` minus the ``allowOut`` networks inside it (an allowed
  *domain* inside a denied network stays denied: podbay's policy cannot express that exception).

``rules`` (``{host: [{"transform": {"headers": {...}}}]}``) become the policy's header ``transforms``, which the
gateway sets on HTTP and (intercepted) HTTPS requests to that host, with ``transform_match`` ``most_specific``
(only the most specific matching host's rules apply, never merged, as in E2B); a rule allows nothing by
itself, as in E2B. A host is a domain (exact or ``*.``); an address or network there is refused (400: the gateway matches
requests by name). ``dnsServers`` (IPv4 addresses, at most 10; E2B's default ``8.8.8.8`` when left out)
are allowed like ``allowOut`` addresses when ``allowOut`` names a domain, as E2B does; they change nothing
else (the guest resolves through podbay's gateway). ``egressProxy`` (a SOCKS5 proxy of the user's) is
refused with 400: podbay does not tunnel egress.

Ingress options (checked here, applied by the port edge, services/api/edge/ports.py): ``maskRequestHost``
(``host[:port]`` with ``${PORT}`` for the port) is the ``Host`` header a request through E2B's hosts reaches
the sandbox's port with, as E2B's proxy sends it; ``httpsPorts`` (ports whose server speaks TLS) is refused
with 400 unless empty: podbay's edge reaches a sandbox's ports over plain HTTP. A ``network`` key E2B's API
does not define is refused with 400, so that nothing asked for is silently left undone.

A rule's header value may hold placeholders (podbay.egress_placeholders): ``${e2b.secrets.<name>}`` (a secret
of the Secrets API, read by the gateway from the credential store) and ``${e2b.identity.tokens.<name>}`` (a
workload identity token of the sandbox's ``iam.tokens``, minted by the gateway per request; podbay.oidc). They
are resolved at the gateway, on HTTPS only, and never reach the guest. A malformed placeholder, or a token
name the sandbox's ``iam.tokens`` does not define, is refused with 400 here. ``iam.tokens`` is checked as E2B
checks it (:func:`iam_tokens`: at most 5, a name without braces or control characters, an audience,
``tokenType`` ``JWT-SVID``). The network configuration as given is kept (``e2b_sandboxes.network``) for
``get_info``, which returns it as E2B does (:func:`network_info`).

    PUT /e2b/sandboxes/{id}/network   204   E2B's SandboxNetworkUpdateConfig; omitted fields are cleared,
                                            other keys refused (400)
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Response
from pydantic import ConfigDict, Field, ValidationError

from podbay import oidc
from podbay.contracts.egress import EgressPolicy, EgressRule, HeaderTransform
from podbay.egress_placeholders import MalformedPlaceholder, parse
from podbay.errors import InvalidRequest

from ..services import network as podbay_network
from ..services.sandbox_lookup import e2b_iam_tokens, store_e2b_network
from ..core.context import ApiContext
from ..core.deps import ctx_dep
from .common import WhoDep, _Body, _E2bRoute, _row

__all__ = ["router", "egress_policy", "NetworkUpdate", "mask_request_host", "NETWORK_KEYS", "iam_tokens",
           "check_placeholders", "network_info", "store_network"]

#: The keys of E2B's ``SandboxNetworkConfig`` (at create); others are refused.
NETWORK_KEYS = frozenset({"allowPublicTraffic", "allowOut", "denyOut", "dnsServers", "egressProxy",
                          "maskRequestHost", "httpsPorts", "rules"})
# A host name or [IPv6 address], optionally with a port, once ${PORT} is replaced.
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(:[0-9]{1,5})?$")

_EVERYTHING = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))
E2B_DEFAULT_DNS = ["8.8.8.8"]  # what E2B opens for a domain allowOut when dnsServers is left out
MAX_DNS_SERVERS = 10

router = APIRouter(prefix="/e2b", route_class=_E2bRoute, include_in_schema=False)
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]


class NetworkUpdate(_Body):
    """E2B's ``SandboxNetworkUpdateConfig``; other keys are kept (``model_extra``) to be refused by
    :meth:`refuse_unknown`."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    allow_out: list[str] | None = Field(None, alias="allowOut", max_length=256)
    deny_out: list[str] | None = Field(None, alias="denyOut", max_length=256)
    rules: dict[str, Any] | None = None
    dns_servers: list[str] | None = Field(None, alias="dnsServers")
    egress_proxy: dict[str, Any] | None = Field(None, alias="egressProxy")
    allow_internet_access: bool | None = None

    def refuse_unknown(self) -> None:
        """``InvalidRequest`` for a key E2B's update does not define (the ingress options, ``maskRequestHost``
        among them, are set at create only, as in E2B)."""
        unknown = sorted(self.model_extra or {})
        if unknown:
            raise InvalidRequest(f"network.{unknown[0]}: not an option of E2B's network update (allowOut, "
                                 "denyOut, dnsServers, egressProxy, rules, allow_internet_access)")


def _network(entry: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(entry.strip(), strict=False)
    except ValueError:
        return None


def _rule(entry: str) -> EgressRule:
    net = _network(entry)
    try:
        return EgressRule(cidr=str(net)) if net is not None else EgressRule(domain=entry)
    except ValidationError as exc:
        raise InvalidRequest(f"network: {entry!r} is neither a CIDR, an address nor a domain name") from exc


def transforms(rules: Any) -> list[HeaderTransform]:
    """E2B's ``network.rules`` as podbay header transforms, one per host and rule, in order. ``InvalidRequest``
    for a host that is not a domain name, or a rule or transform that is not E2B's shape."""
    if rules is None:
        return []
    if not isinstance(rules, dict):
        raise InvalidRequest("network.rules: expected an object of host -> list of rules")
    out: list[HeaderTransform] = []
    for host, host_rules in rules.items():
        if _network(str(host)) is not None:
            raise InvalidRequest(f"network.rules: {host!r} is an address: podbay applies transforms to host "
                                 "names (the name of the request), not to addresses or networks")
        if not isinstance(host_rules, list):
            raise InvalidRequest(f"network.rules[{host!r}]: expected a list of rules")
        for rule in host_rules:
            if not isinstance(rule, dict) or set(rule) - {"transform"}:
                raise InvalidRequest(f"network.rules[{host!r}]: a rule is {{\"transform\": {{\"headers\": ...}}}}")
            transform = rule.get("transform") or {}
            if not isinstance(transform, dict) or set(transform) - {"headers"}:
                raise InvalidRequest(f"network.rules[{host!r}]: a transform sets only headers")
            headers = transform.get("headers") or {}
            if not headers:
                continue
            try:
                out.append(HeaderTransform(domain=str(host), headers=headers))
            except ValidationError as exc:
                raise InvalidRequest(f"network.rules[{host!r}]: {exc.errors()[0]['msg']}") from exc
    if len(out) > 64:
        raise InvalidRequest("network.rules: at most 64 host rules with headers")
    return out


MAX_IAM_TOKENS = 5  # E2B's limit
_BAD_TOKEN_NAME = re.compile(r"[{}\x00-\x1f\x7f-\x9f]")


def iam_tokens(iam: Any) -> dict[str, dict[str, str]]:
    """E2B's ``iam`` (``{"tokens": {name: {"audience", "tokenType"}}}``) checked as E2B's API checks it ->
    ``{name: {"audience", "tokenType"}}`` (empty when no token is asked). ``InvalidRequest`` naming the field."""
    if iam is None:
        return {}
    if not isinstance(iam, dict) or set(iam) - {"tokens"}:
        raise InvalidRequest("iam: expected {\"tokens\": {name: {\"audience\", \"tokenType\"}}}")
    tokens = iam.get("tokens") or {}
    if not isinstance(tokens, dict):
        raise InvalidRequest("iam.tokens: expected an object of name -> token definition")
    if len(tokens) > MAX_IAM_TOKENS:
        raise InvalidRequest(f"iam.tokens: too many tokens: {len(tokens)} (max {MAX_IAM_TOKENS})")
    out: dict[str, dict[str, str]] = {}
    for name, spec in tokens.items():
        if not name or _BAD_TOKEN_NAME.search(name) or len(name) > 128:
            raise InvalidRequest("iam.tokens: a token name must be 1-128 characters without '{', '}' or control "
                                 "characters")
        if not isinstance(spec, dict) or not isinstance(spec.get("audience"), str) or not spec["audience"]:
            raise InvalidRequest(f"iam.tokens.{name}.audience: audience is required")
        if len(spec["audience"]) > 1024:
            raise InvalidRequest(f"iam.tokens.{name}.audience: at most 1024 characters")
        if spec.get("tokenType") != oidc.TOKEN_TYPE:
            raise InvalidRequest(f"iam.tokens.{name}.tokenType: only {oidc.TOKEN_TYPE!r} is supported")
        out[name] = {"audience": spec["audience"], "tokenType": oidc.TOKEN_TYPE}
    return out


def check_placeholders(policy: EgressPolicy | None, tokens: dict[str, dict[str, str]]) -> None:
    """``InvalidRequest`` for a rule's header value whose placeholder does not parse, or that names a workload
    identity token not in ``tokens`` (the gateway would never mint it)."""
    for t in policy.transforms if policy else []:
        for header, value in t.headers.items():
            try:
                found = parse(value)
            except MalformedPlaceholder as exc:
                raise InvalidRequest(f"network.rules[{t.domain!r}] header {header}: {exc}") from exc
            for p in found:
                if p.kind == "token" and p.name not in tokens:
                    raise InvalidRequest(f"network.rules[{t.domain!r}] header {header}: iam token {p.name!r} is "
                                         "not registered in the sandbox's iam.tokens")


def network_info(stored: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``network`` of E2B's ``SandboxDetail`` from what create or update_network stored: ``allowOut``,
    ``denyOut``, ``rules``, ``dnsServers`` (the ingress options are the port edge's, returned as given)."""
    if not stored:
        return None
    keep = ("allowOut", "denyOut", "rules", "dnsServers", "allowPublicTraffic", "maskRequestHost")
    return {k: stored[k] for k in keep if stored.get(k) is not None}


#: Keep E2B's network configuration (and, when given, the ``iam.tokens``) on ``e2b_sandboxes``.
store_network = store_e2b_network


def _dns_servers(network: dict[str, Any]) -> list[str]:
    servers = network.get("dnsServers")
    if servers is None:
        return list(E2B_DEFAULT_DNS)
    if not isinstance(servers, list) or len(servers) > MAX_DNS_SERVERS:
        raise InvalidRequest(f"network.dnsServers: at most {MAX_DNS_SERVERS} IPv4 addresses")
    for entry in servers:
        try:
            ipaddress.IPv4Address(str(entry))
        except ValueError as exc:
            raise InvalidRequest(f"network.dnsServers: {entry!r} is not an IPv4 address") from exc
    return [str(e) for e in servers]


def mask_request_host(network: dict[str, Any] | None, port: int | None = None) -> str | None:
    """``network.maskRequestHost``, checked: None when not given; with ``port``, ``${PORT}`` replaced by it.
    ``InvalidRequest`` unless it is ``host[:port]`` (at most 253 characters) once ``${PORT}`` is replaced."""
    mask = (network or {}).get("maskRequestHost")
    if mask is None:
        return None
    if not isinstance(mask, str) or len(mask) > 253 or not _HOST.match(mask.replace("${PORT}", "1")):
        raise InvalidRequest(f"network.maskRequestHost: {str(mask)[:80]!r} is not host[:port] (with ${{PORT}} "
                             "for the sandbox's port)")
    return mask if port is None else mask.replace("${PORT}", str(port))


def _check_keys(network: dict[str, Any]) -> None:
    """``InvalidRequest`` for a key of ``network`` E2B does not define, or for ``httpsPorts`` that lists a
    port (podbay's edge speaks plain HTTP to a sandbox's ports)."""
    unknown = sorted(set(network) - NETWORK_KEYS)
    if unknown:
        raise InvalidRequest(f"network.{unknown[0]}: not an option of E2B's network configuration podbay knows "
                             f"(it knows {', '.join(sorted(NETWORK_KEYS))})")
    if network.get("httpsPorts"):
        raise InvalidRequest("network.httpsPorts: podbay's port edge reaches a sandbox's ports over plain HTTP "
                             "and cannot speak TLS to them; serve plain HTTP on those ports (the edge or its "
                             "TLS terminator gives clients HTTPS)")


def egress_policy(allow_internet_access: bool | None, network: dict[str, Any] | None, *,
                  at_create: bool = True) -> EgressPolicy | None:
    """The podbay egress policy for E2B's options (see the module docstring); None at create when nothing
    about egress was asked. ``InvalidRequest`` for an entry that is not a network or a domain, a domain in
    ``denyOut``, bad ``rules`` or ``dnsServers``, any ``egressProxy``; and for the ingress options and keys
    refused (:func:`mask_request_host`, an ``httpsPorts`` port, an unknown key)."""
    network = network or {}
    _check_keys(network)
    mask_request_host(network)
    if network.get("egressProxy") is not None:
        raise InvalidRequest("network.egressProxy: podbay does not tunnel a sandbox's egress through a proxy "
                             "(its gateway sends it out directly); leave egressProxy out")
    allow_out = [str(e) for e in network.get("allowOut") or []]
    deny_out = [str(e) for e in network.get("denyOut") or []]
    headers = transforms(network.get("rules"))
    dns = _dns_servers(network)
    if at_create and allow_internet_access is None and not allow_out and not deny_out and not headers:
        return None
    if any(_network(e) is None for e in allow_out):  # a domain: E2B opens its DNS servers too
        allow_out += [d for d in dns if d not in allow_out]
    policy = _allow_deny(allow_internet_access, allow_out, deny_out)
    policy.transforms = headers
    if headers:  # E2B: the most specific host's rules only, never merged with a wildcard's
        policy.transform_match = "most_specific"
    return policy


def _allow_deny(allow_internet_access: bool | None, allow_out: list[str], deny_out: list[str]) -> EgressPolicy:
    denied: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for entry in deny_out:
        net = _network(entry)
        if net is None:
            raise InvalidRequest(f"network.denyOut: {entry!r} is not a CIDR or an address (E2B denies no domains)")
        denied.append(net)
    if allow_internet_access is False:
        denied.append(_EVERYTHING[0])
    allow_rules = [_rule(e) for e in allow_out]
    everything = [EgressRule(cidr=str(n)) for n in _EVERYTHING]
    if any(n.prefixlen == 0 for n in denied):  # closed: only allowOut is reachable
        return EgressPolicy(allow=allow_rules)
    if not denied:
        return EgressPolicy(allow=everything)
    allowed_nets = [n for n in (_network(e) for e in allow_out) if n is not None]
    deny: list[EgressRule] = []
    for net in denied:
        parts = [net]
        for hole in allowed_nets:
            nxt: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
            for part in parts:
                if hole.version == part.version and hole.subnet_of(part):  # type: ignore[arg-type]  # IPv4/IPv6 union; the versions are compared first, so the pair matches
                    nxt.extend(part.address_exclude(hole))  # type: ignore[arg-type]  # as above
                elif not (part.version == hole.version and part.subnet_of(hole)):  # type: ignore[arg-type]  # as above
                    nxt.append(part)
            parts = nxt
        deny.extend(EgressRule(cidr=str(p)) for p in parts)
    if len(deny) > 256:
        raise InvalidRequest("network: the denied networks split into more than 256 rules around allowOut")
    return EgressPolicy(allow=everything, deny=deny)


@router.put("/sandboxes/{sandbox_id}/network", status_code=204)
async def update_network(sandbox_id: str, body: NetworkUpdate, ctx: CtxDep, who: WhoDep) -> Response:
    """Replace a sandbox's egress configuration (omitted fields are cleared: the internet is open unless
    closed) -> 204; the gateway applies it from the guest's next connection."""
    body.refuse_unknown()
    await _row(ctx, who, sandbox_id)
    network: dict[str, Any] = {"allowOut": body.allow_out or [], "denyOut": body.deny_out or [],
                               "rules": body.rules, "dnsServers": body.dns_servers, "egressProxy": body.egress_proxy}
    policy = egress_policy(body.allow_internet_access, network, at_create=False)
    assert policy is not None
    tokens = await e2b_iam_tokens(ctx.pool, sandbox_id)
    check_placeholders(policy, dict(tokens or {}))
    await podbay_network.set_sandbox_policy(ctx, who, sandbox_id, policy)
    if body.allow_internet_access is False:
        network["denyOut"] = [*(body.deny_out or []), "0.0.0.0/0"]
    await store_network(ctx.pool, sandbox_id, {k: v for k, v in network.items() if v is not None})
    return Response(status_code=204)
