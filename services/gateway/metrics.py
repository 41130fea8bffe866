"""The gateway's Prometheus metrics (labels are closed sets: kinds, outcomes and decision reasons, never ids)."""

from __future__ import annotations

from prometheus_client import Counter

__all__ = ["CONNECTIONS", "DECISIONS", "CREDENTIAL_USES", "DNS_ANSWERS", "DNS_RATE_LIMITED", "REDACTIONS",
           "PLACEHOLDERS"]

CONNECTIONS = Counter(
    "podbay_gateway_connections_total",
    "TCP connections accepted from sandboxes, by outcome (identified, no_binding, no_sandbox, error).",
    ["outcome"],
)
DECISIONS = Counter(
    "podbay_gateway_decisions_total",
    "Egress decisions, by protocol (tls, http, tcp, dns) and reason (allowed, or the denial reason).",
    ["protocol", "reason"],
)
CREDENTIAL_USES = Counter(
    "podbay_gateway_credential_uses_total",
    "Credential injections, by outcome (allowed, credential_expired, credential_rate_limited, error).",
    ["outcome"],
)
DNS_ANSWERS = Counter(
    "podbay_gateway_dns_answers_total",
    "DNS answers given to sandboxes, by outcome (answer, nxdomain, empty, refused, formerr).",
    ["outcome"],
)
DNS_RATE_LIMITED = Counter(
    "podbay_gateway_dns_rate_limited_total",
    "DNS queries refused because their sandbox was over its rate (settings.gateway_dns_rate_per_s); no labels.",
)
REDACTIONS = Counter(
    "podbay_gateway_redactions_total",
    "Occurrences of an injected credential value replaced in responses before they reach the guest.",
)
PLACEHOLDERS = Counter(
    "podbay_gateway_rule_placeholders_total",
    "Placeholders of network rules resolved per request, by kind (secret, token: a minted workload identity "
    "token) and outcome (resolved, or the refusal: secret_not_found, credential_expired, "
    "identity_token_not_registered).",
    ["kind", "outcome"],
)
