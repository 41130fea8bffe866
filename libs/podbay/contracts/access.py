"""HTTP API bodies for credentials, API keys, the audit log and egress policy (docs/DESIGN.md §6).

A credential's value arrives once, as a ``SecretStr`` (so it never shows in a ``repr``, a log line or a
validation error), and no response model has a field for it.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, SecretStr, StringConstraints, field_validator

from .egress import EgressPolicy, EgressRule

__all__ = [
    "CREDENTIAL_NAME_PATTERN",
    "CREDENTIAL_VALUE_MAX",
    "PLACEHOLDER_PREFIX",
    "placeholder_env",
    "CredentialCreate",
    "CredentialInfo",
    "CredentialList",
    "KeyCreate",
    "KeyCreated",
    "KeyInfo",
    "KeyList",
    "AuditEntry",
    "AuditPage",
    "NetworkInfo",
]

CREDENTIAL_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
#: Largest credential value accepted, in characters (a long JWT or PEM fits).
CREDENTIAL_VALUE_MAX = 16 * 1024
#: Env var prefix of the placeholders a sandbox gets, one per credential in scope.
PLACEHOLDER_PREFIX = "PODBAY_CRED_"

# RFC 9110 token characters; header names are tokens.
_TOKEN_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
# Hop-by-hop and connection-level headers a proxy consumes or rewrites (RFC 9110 §7.6.1), plus Host: an
# injected value there would be dropped or would redirect the request.
_FORBIDDEN_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
    "trailer", "transfer-encoding", "upgrade", "host", "content-length",
})


def placeholder_env(names: list[str]) -> dict[str, str]:
    """``{"PODBAY_CRED_<NAME>": "podbay-credential:<name>"}`` for each credential name (upper-cased, ``-`` as
    ``_``). What a guest sees in place of a value: the gateway, not the guest, adds the real one."""
    return {PLACEHOLDER_PREFIX + n.upper().replace("-", "_"): f"podbay-credential:{n}" for n in names}


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


ScopeId = Annotated[str, StringConstraints(min_length=1, max_length=128)]


class CredentialCreate(_In):
    """``POST /v1/credentials``. The value is sealed at once and never returned."""

    name: str = Field(pattern=CREDENTIAL_NAME_PATTERN, description="Unique per tenant; the placeholder's name.")
    value: SecretStr = Field(description=f"The secret; 1 to {CREDENTIAL_VALUE_MAX} characters. Never returned.")
    hosts: list[str] = Field(min_length=1, max_length=64,
                             description="Destination hosts: exact names or '*.example.com' wildcards.")
    path_prefix: str | None = Field(None, max_length=1024, pattern=r"^/[^\s]*$",
                                    description="Only requests whose path starts with this; default any path.")
    header: str = Field("Authorization", min_length=1, max_length=128, description="Header the gateway sets.")
    format: str = Field("Bearer {value}", max_length=1024, description="Header value; must contain '{value}'.")
    expires_at: datetime | None = Field(None, description="After this the gateway refuses to inject it.")
    rate_limit_per_min: int | None = Field(None, ge=1, le=1_000_000, description="Injections per minute.")
    sandboxes: list[ScopeId] | None = Field(None, max_length=1000, description="Only these sandboxes.")
    templates: list[ScopeId] | None = Field(None, max_length=1000, description="Only sandboxes of these templates.")

    @field_validator("value")
    @classmethod
    def _value(cls, v: SecretStr) -> SecretStr:
        raw = v.get_secret_value()
        # Messages here never quote the value.
        if not raw:
            raise ValueError("value must not be empty")
        if len(raw) > CREDENTIAL_VALUE_MAX:
            raise ValueError(f"value is longer than {CREDENTIAL_VALUE_MAX} characters")
        if any(c in raw for c in "\r\n\x00"):
            raise ValueError("value must not contain CR, LF or NUL (it goes into an HTTP header)")
        # RFC 9110 field values are visible ASCII, space and tab in practice; anything else (a lone surrogate
        # from JSON, non-ASCII text) cannot be sealed or sent as a header.
        if not all(" " <= c <= "~" or c == "\t" for c in raw):
            raise ValueError("value must be printable ASCII (it goes into an HTTP header)")
        return v

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        # The egress contract's domain rule is the one definition of a host name or wildcard.
        return [EgressRule(domain=h).domain or "" for h in v]

    @field_validator("header")
    @classmethod
    def _header(cls, v: str) -> str:
        if not _TOKEN_RE.match(v):
            raise ValueError("header must be an HTTP header name (a token)")
        if v.lower() in _FORBIDDEN_HEADERS:
            raise ValueError(f"header {v!r} is hop-by-hop or connection-level and cannot carry a credential")
        return v

    @field_validator("format")
    @classmethod
    def _format(cls, v: str) -> str:
        if "{value}" not in v:
            raise ValueError("format must contain '{value}'")
        if any(c in v for c in "\r\n\x00"):
            raise ValueError("format must not contain CR, LF or NUL")
        return v

    @field_validator("expires_at")
    @classmethod
    def _expiry(cls, v: datetime | None) -> datetime | None:
        if v is None:
            return v
        if v.tzinfo is None:
            v = v.replace(tzinfo=UTC)
        if v <= datetime.now(UTC):
            raise ValueError("expires_at must be in the future")
        return v


class CredentialInfo(BaseModel):
    """A credential as every API shows it: everything but the value."""

    id: str
    name: str
    hosts: list[str]
    path_prefix: str | None = None
    header: str
    format: str
    expires_at: datetime | None = None
    rate_limit_per_min: int | None = None
    sandboxes: list[str] | None = None
    templates: list[str] | None = None
    backend: str = Field(description="Where the value is sealed: 'pg' or 'openbao'.")
    placeholder: str = Field(description="Env var a sandbox in scope gets, e.g. PODBAY_CRED_GITHUB.")
    created_at: datetime


class CredentialList(BaseModel):
    credentials: list[CredentialInfo]


class KeyCreate(_In):
    """``POST /v1/keys``."""

    name: str = Field(min_length=1, max_length=128)


class KeyInfo(BaseModel):
    """An API key as listings show it: its prefix, never the key or its hash."""

    id: str
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None = None


class KeyCreated(KeyInfo):
    """``POST /v1/keys`` answer: ``key`` is shown this once and never stored."""

    key: str


class KeyList(BaseModel):
    keys: list[KeyInfo]


class AuditEntry(BaseModel):
    """One audit row: an API change (actor = key id), or a gateway decision (actor = ``gateway:<node>``)."""

    id: int
    at: datetime
    actor: str
    action: str
    target: str | None = None
    sandbox_id: str | None = None
    decision: str | None = None
    detail: dict[str, object] = Field(default_factory=dict)


class AuditPage(BaseModel):
    """Newest first; pass ``next_before`` as ``before`` for the next page (None: no more)."""

    entries: list[AuditEntry]
    next_before: int | None = None


class NetworkInfo(BaseModel):
    """``GET/PUT .../network``: the effective policy and where it comes from.

    ``source`` is ``sandbox`` (its own), ``template`` (the template's default) or ``default`` (no egress).
    """

    policy: EgressPolicy
    source: str
