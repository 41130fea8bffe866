"""Egress contracts (docs/DESIGN.md §6): the policy a sandbox's traffic is held to, and the node-local binding
that tells the gateway which sandbox a source address belongs to.

Policy semantics (the gateway is the one place that applies them):

* Default deny. A destination is allowed when some ``allow`` rule matches it and no ``deny`` rule does.
* A rule names either a ``domain`` or a ``cidr``, plus optional ``ports`` (empty = any port).
  ``domain`` is an exact name (``api.github.com``) or a wildcard ``*.github.com``, which matches names below
  ``github.com`` at any depth but not ``github.com`` itself. Names are compared lower-case without a final dot.
* A connection is matched by the name the guest asked for (TLS SNI, HTTP Host, or the name whose DNS answer
  gave the address) and by its destination address and port.
* ``transforms`` set HTTP headers on requests to a host (E2B's ``network.rules``): on plain HTTP, and on HTTPS,
  which the gateway then intercepts with the sandbox's own CA (as for a credential). A transform allows
  nothing by itself; a header already on the request is replaced; a credential for the same header wins.
  ``transform_match`` ``most_specific`` (E2B's rules) applies only the transforms of the most specific
  matching domain instead of every matching one.
* Whatever the policy says, the gateway never connects to loopback, link-local (169.254.0.0/16, fe80::/10,
  including the metadata address 169.254.169.254), multicast, the node's own addresses or the sandbox
  network: those are refused before any rule is read.

Binding (node agent -> gateway, same host): one JSON file per guest address in
``bindings_dir(data_dir, node_id)``, written atomically (temp file + rename) by the node agent before the guest
runs and removed when the sandbox leaves the node. The gateway reads it on every new connection or DNS query,
so there is nothing to invalidate.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from podbay.contracts.ids import safe_component

__all__ = [
    "name_matches",
    "EgressRule",
    "HeaderTransform",
    "EgressPolicy",
    "NetBinding",
    "bindings_dir",
    "binding_path",
]

_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_DOMAIN_RE = re.compile(rf"^(\*\.)?({_LABEL}\.)*{_LABEL}$")
_HEADER_NAME_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$")  # an HTTP token (RFC 9110)


def _host_pattern(v: str) -> str:
    """``v`` as a rule's ``domain``: trimmed, lower case, without a trailing dot; ``ValueError`` when it is not a
    host name or a ``*.`` wildcard."""
    v = v.strip().lower().rstrip(".")
    if not _DOMAIN_RE.match(v):
        raise ValueError("domain must be a host name such as api.example.com or *.example.com")
    return v


Port = Annotated[int, Field(ge=1, le=65535)]


class EgressRule(BaseModel):
    """One allow or deny rule: ``{"domain": "*.github.com", "ports": [443]}`` or ``{"cidr": "10.0.0.0/8"}``."""

    model_config = ConfigDict(extra="forbid")

    domain: str | None = Field(None, max_length=253, description="Exact name or '*.' wildcard.")
    cidr: str | None = Field(None, max_length=43, description="IPv4 or IPv6 network, e.g. 192.0.2.0/24.")
    ports: list[Port] = Field(default_factory=list, max_length=64, description="Destination ports; empty = any.")

    @field_validator("domain")
    @classmethod
    def _domain(cls, v: str | None) -> str | None:
        return None if v is None else _host_pattern(v)

    @field_validator("cidr")
    @classmethod
    def _cidr(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            return str(ipaddress.ip_network(v.strip(), strict=False))
        except ValueError as exc:
            raise ValueError(f"cidr is not a network: {exc}") from exc

    @model_validator(mode="after")
    def _one_target(self) -> Self:
        if (self.domain is None) == (self.cidr is None):
            raise ValueError("a rule names exactly one of domain or cidr")
        return self


class HeaderTransform(BaseModel):
    """Headers set on every HTTP request to a host: ``{"domain": "api.example.com", "headers": {"X-Team":
    "blue"}}`` (``domain`` exact or a ``*.`` wildcard, as in :class:`EgressRule`)."""

    model_config = ConfigDict(extra="forbid")

    domain: str = Field(max_length=253, description="Exact name or '*.' wildcard.")
    headers: dict[str, str] = Field(max_length=32, description="Header name -> value; replaces the request's.")

    @field_validator("domain")
    @classmethod
    def _domain(cls, v: str) -> str:
        return _host_pattern(v)

    @field_validator("headers")
    @classmethod
    def _headers(cls, v: dict[str, str]) -> dict[str, str]:
        for name, value in v.items():
            if not _HEADER_NAME_RE.match(name):
                raise ValueError(f"{name!r} is not an HTTP header name")
            if len(value) > 8192 or any(c in value for c in "\r\n\0"):
                raise ValueError(f"the value of header {name!r} is longer than 8192 or holds CR, LF or NUL")
        return v


class EgressPolicy(BaseModel):
    """A sandbox's egress policy. The empty policy (the default) allows nothing."""

    model_config = ConfigDict(extra="forbid")

    allow: list[EgressRule] = Field(default_factory=list, max_length=256)
    deny: list[EgressRule] = Field(default_factory=list, max_length=256)
    # Left out when empty, so a policy without transforms keeps its plain {"allow", "deny"} shape.
    transforms: list[HeaderTransform] = Field(default_factory=list, max_length=64, exclude_if=lambda v: not v,
                                              description="Headers set on HTTP(S) requests to matching hosts.")
    # E2B's network.rules: only the most specific matching domain's transforms apply (left out when "all").
    transform_match: Literal["all", "most_specific"] = Field(
        "all", exclude_if=lambda v: v == "all",
        description="'all': every matching transform applies, in order (a later one wins a header); "
                    "'most_specific': only those of the most specific matching domain (an exact name, else "
                    "the longest wildcard), as E2B's network rules.")


class NetBinding(BaseModel):
    """Which sandbox owns a guest address on this node, and where its per-sandbox CA lives.

    ``ca_path`` is a PEM file holding the CA's private key followed by its certificate (the layout
    mitmproxy's certificate store reads); only the node agent and the gateway can read it. ``generation`` is
    the sandbox's generation when the binding was written: a fork or restore writes a new CA and binding.
    """

    sandbox_id: str
    generation: int
    tap: str
    host_addr: str = Field(description="The tap's host side: gateway, router and DNS server for the guest.")
    guest_addr: str
    prefix_len: int = Field(30, ge=8, le=32)
    ca_path: str
    ca_cert_pem: str = Field(description="The CA certificate alone, as installed in the guest's trust store.")


def bindings_dir(data_dir: Path, node_id: str) -> Path:
    """``DATA_DIR/nodes/<node>/net/bindings``: one ``<guest_addr>.json`` (a :class:`NetBinding`) per sandbox."""
    return data_dir / "nodes" / safe_component(node_id, "node id") / "net" / "bindings"


def binding_path(data_dir: Path, node_id: str, guest_addr: str) -> Path:
    """The binding file of ``guest_addr`` on ``node_id``."""
    return bindings_dir(data_dir, node_id) / f"{ipaddress.ip_address(guest_addr)}.json"


def name_matches(pattern: str, name: str) -> bool:
    """Whether host ``name`` matches a rule's ``domain`` ``pattern``: exact, or ``*.suffix`` for names strictly
    below ``suffix`` (any depth). Both are compared lower-case without a final dot. The one rule for every
    place that matches a host against these patterns: the gateway's egress decisions and header transforms,
    and the credential fill's page-origin check on the node."""
    pattern = pattern.lower().rstrip(".")
    name = name.lower().rstrip(".")
    if pattern.startswith("*."):
        return name.endswith(pattern[1:]) and len(name) > len(pattern) - 1
    return name == pattern
