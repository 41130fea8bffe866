"""Credentials, API keys, the audit log and egress policy in the SDK (docs/DESIGN.md §6).

``client.credentials`` and ``client.keys`` are small namespaces over the client's own connection
(``podbay.sdk._async_namespaces``, and the generated ``_sync_namespaces``);
``client.audit(...)``, ``client.get_network(id)``/``client.set_network(id, policy)`` and the template
variants are plain methods. Builders (``*_call``) are shared by the sync and async clients, like
``podbay.sdk._calls``. A credential's value is sent once and never comes back: no result carries it.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from podbay.contracts.access import (
    AuditPage,
    CredentialCreate,
    CredentialInfo,
    CredentialList,
    KeyCreate,
    KeyCreated,
    KeyInfo,
    KeyList,
    NetworkInfo,
)
from podbay.contracts.egress import EgressPolicy
from podbay.sdk._calls import Call, _model, _none, _sandbox_path, _validate, check_id

__all__ = [
    "NetworkArg",
    "policy_body",
    "create_credential_call",
    "list_credentials_call",
    "get_credential_call",
    "delete_credential_call",
    "create_key_call",
    "list_keys_call",
    "revoke_key_call",
    "audit_call",
    "get_network_call",
    "set_network_call",
    "get_template_network_call",
    "set_template_network_call",
]

T = TypeVar("T")

#: An egress policy: the model, or its JSON shape ``{"allow": [{"domain": ...}], "deny": [...]}``.
NetworkArg = EgressPolicy | Mapping[str, Any]


def policy_body(policy: NetworkArg) -> dict[str, Any]:
    """The JSON of ``policy``, checked locally (``InvalidRequest`` before any request when it is wrong)."""
    model = policy if isinstance(policy, EgressPolicy) else _validate(EgressPolicy, dict(policy), "egress policy")
    return model.model_dump(mode="json")


def _name_path(name: str) -> str:
    return f"/v1/credentials/{quote(check_id(name, 'credential name'), safe='')}"


def create_credential_call(name: str, value: str, hosts: Sequence[str], **scope: Any) -> Call[CredentialInfo]:
    """``POST /v1/credentials``; ``scope``: path_prefix, header, format, expires_at, rate_limit_per_min,
    sandboxes, templates (see ``CredentialCreate``)."""
    fields = {"name": name, "value": value, "hosts": list(hosts), **{k: v for k, v in scope.items() if v is not None}}
    body = _validate(CredentialCreate, fields, "credential")
    payload = body.model_dump(mode="json", exclude_none=True)
    payload["value"] = body.value.get_secret_value()  # model_dump masks a SecretStr
    return Call("POST", "/v1/credentials", _model(CredentialInfo), json=payload)


def _credentials(resp: httpx.Response) -> builtins.list[CredentialInfo]:
    return _model(CredentialList)(resp).credentials


def list_credentials_call() -> Call[builtins.list[CredentialInfo]]:
    """``GET /v1/credentials``."""
    return Call("GET", "/v1/credentials", _credentials)


def get_credential_call(name: str) -> Call[CredentialInfo]:
    """``GET /v1/credentials/{name}``."""
    return Call("GET", _name_path(name), _model(CredentialInfo))


def delete_credential_call(name: str) -> Call[None]:
    """``DELETE /v1/credentials/{name}`` (204)."""
    return Call("DELETE", _name_path(name), _none)


def create_key_call(name: str) -> Call[KeyCreated]:
    """``POST /v1/keys`` -> the new key, shown once."""
    body = _validate(KeyCreate, {"name": name}, "API key")
    return Call("POST", "/v1/keys", _model(KeyCreated), json=body.model_dump())


def _keys(resp: httpx.Response) -> builtins.list[KeyInfo]:
    return _model(KeyList)(resp).keys


def list_keys_call(all: bool = False) -> Call[builtins.list[KeyInfo]]:
    """``GET /v1/keys`` (prefixes only)."""
    return Call("GET", "/v1/keys", _keys, params={"all": "true" if all else "false"})


def revoke_key_call(key_id: str) -> Call[KeyInfo]:
    """``DELETE /v1/keys/{id}``."""
    return Call("DELETE", f"/v1/keys/{quote(check_id(key_id, 'key id'), safe='')}", _model(KeyInfo))


def audit_call(*, action: str | None = None, sandbox_id: str | None = None, since: datetime | None = None,
               before: int | None = None, limit: int = 100) -> Call[AuditPage]:
    """``GET /v1/audit`` with its filters; newest first."""
    params: dict[str, str] = {"limit": str(limit)}
    if action:
        params["action"] = action
    if sandbox_id:
        params["sandbox_id"] = check_id(sandbox_id)
    if since is not None:
        params["since"] = since.isoformat()
    if before is not None:
        params["before"] = str(before)
    return Call("GET", "/v1/audit", _model(AuditPage), params=params)


def get_network_call(sandbox_id: str) -> Call[NetworkInfo]:
    """``GET /v1/sandboxes/{id}/network``."""
    return Call("GET", _sandbox_path(sandbox_id, "/network"), _model(NetworkInfo))


def set_network_call(sandbox_id: str, policy: NetworkArg) -> Call[NetworkInfo]:
    """``PUT /v1/sandboxes/{id}/network``."""
    return Call("PUT", _sandbox_path(sandbox_id, "/network"), _model(NetworkInfo), json=policy_body(policy))


def _template_path(name: str) -> str:
    return f"/v1/templates/{quote(check_id(name, 'template name'), safe='')}/network"


def get_template_network_call(template: str) -> Call[NetworkInfo]:
    """``GET /v1/templates/{name}/network``."""
    return Call("GET", _template_path(template), _model(NetworkInfo))


def set_template_network_call(template: str, policy: NetworkArg) -> Call[NetworkInfo]:
    """``PUT /v1/templates/{name}/network``."""
    return Call("PUT", _template_path(template), _model(NetworkInfo), json=policy_body(policy))
