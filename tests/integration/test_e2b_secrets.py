"""E2B's Secrets API (services/api/e2b/secrets.py) through the unmodified ``e2b`` SDK's ``Secret`` against the
real stack (PostgreSQL credential store): values never come back, pagination, versions, another tenant's
ids and encoded paths refused."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import httpx
import pytest
from access_helpers import Tenant, new_tenant, sql

from podbay.credentials import PgCredentialStore, Sealed
from podbay.devstack.stack import Stack

pytestmark = pytest.mark.integration

e2b = pytest.importorskip("e2b")


@pytest.fixture(scope="module")
def acme(stack: Stack) -> Tenant:
    return new_tenant(stack, "acme-secrets")


@pytest.fixture(scope="module")
def other(stack: Stack) -> Tenant:
    return new_tenant(stack, "other-secrets")


def _opts(t: Tenant) -> dict[str, Any]:
    return {"api_key": t.key, "api_url": f"{t.api_url}/e2b"}


def _value() -> str:
    return "sk-" + secrets.token_hex(20)


def _reveal(stack: Stack, t: Tenant, secret_id: str) -> str:
    row = sql(stack, "SELECT ciphertext FROM credentials WHERE id=$1", secret_id)[0]
    return asyncio.run(PgCredentialStore(stack.env["PODBAY_CREDENTIAL_KEY"]).reveal(
        secret_id, t.tenant_id, Sealed("pg", ciphertext=bytes(row["ciphertext"]))))


def test_create_get_update_list_and_destroy_never_return_the_value(stack: Stack, acme: Tenant) -> None:
    value, newer = _value(), _value()
    s = e2b.Secret.create("OpenAI-Key", value, metadata={"team": "ml"}, **_opts(acme))
    assert s.secret_id.startswith("sec_") and s.name == "openai-key" and s.version == 1
    assert s.metadata == {"team": "ml"}
    for ref in (s.secret_id, "openai-key", "OPENAI-KEY"):
        assert e2b.Secret.get_info(ref, **_opts(acme)).secret_id == s.secret_id
    # Backed by the credential store: sealed, and in no sandbox's scope (no placeholder, no injection).
    row = sql(stack, "SELECT backend, scope_sandboxes, ciphertext FROM credentials WHERE id=$1", s.secret_id)[0]
    assert row["backend"] == "pg" and list(row["scope_sandboxes"]) == [] and value.encode() not in row["ciphertext"]
    assert _reveal(stack, acme, s.secret_id) == value
    up = e2b.Secret.update("openai-key", newer, metadata={"team": "infra"}, **_opts(acme))
    assert up.version == 2 and up.metadata == {"team": "infra"} and up.updated_at >= s.updated_at
    assert _reveal(stack, acme, s.secret_id) == newer
    kept = e2b.Secret.update(s.secret_id, value, **_opts(acme))  # no metadata: kept as it was
    assert kept.version == 3 and kept.metadata == {"team": "infra"}
    with acme.http() as http:
        for path in ("/e2b/secrets", f"/e2b/secrets/{s.secret_id}", "/v1/credentials"):
            r = http.get(path)
            assert r.status_code == 200 and value not in r.text and newer not in r.text, path
        dup = http.post("/e2b/secrets", json={"name": "openai-key", "value": "x"})
        assert dup.status_code == 409 and dup.json()["code"] == 409
        for bad in ({"name": "sec_abc", "value": "x"}, {"name": "has space", "value": "x"},
                    {"name": "ok-name", "value": "x", "metadata": {f"k{i}": "v" for i in range(33)}},
                    {"name": "ok-name", "value": "x", "metadata": {"k": "v" * 1025}}):
            r = http.post("/e2b/secrets", json=bad)
            assert r.status_code == 400 and r.json()["code"] == 400, (bad, r.text)
    assert e2b.Secret.destroy("openai-key", **_opts(acme)) is True
    assert e2b.Secret.destroy(s.secret_id, **_opts(acme)) is False
    with pytest.raises(e2b.SecretNotFoundException):
        e2b.Secret.get_info(s.secret_id, **_opts(acme))
    gone = sql(stack, "SELECT deleted_at, ciphertext FROM credentials WHERE id=$1", s.secret_id)[0]
    assert gone["deleted_at"] is not None and gone["ciphertext"] is None


def test_list_pages_newest_first(acme: Tenant) -> None:
    made = [e2b.Secret.create(f"page-{i}", _value(), **_opts(acme)).secret_id for i in range(3)]
    try:
        pages = e2b.Secret.list(limit=2, **_opts(acme))
        first = pages.next_items()
        assert len(first) == 2 and pages.has_next
        rest = pages.next_items()
        assert not pages.has_next
        listed = [s.secret_id for s in first + rest]
        assert listed[:3] == made[::-1] and len(set(listed)) == len(listed)
    finally:
        for sid in made:
            e2b.Secret.destroy(sid, **_opts(acme))


def test_another_tenants_ids_names_and_encoded_paths_are_not_found(acme: Tenant, other: Tenant) -> None:
    mine = e2b.Secret.create("private", _value(), **_opts(acme))
    try:
        for ref in (mine.secret_id, "private"):
            with pytest.raises(e2b.SecretNotFoundException):
                e2b.Secret.get_info(ref, **_opts(other))
            with pytest.raises(e2b.SecretNotFoundException):
                e2b.Secret.update(ref, "stolen", **_opts(other))
            assert e2b.Secret.destroy(ref, **_opts(other)) is False
        assert mine.secret_id not in [s.secret_id for s in e2b.Secret.list(**_opts(other)).next_items()]
        with other.http() as http, acme.http() as own:
            for path in (f"/e2b/secrets/{mine.secret_id}%2F..", f"/e2b/secrets/..%2F{mine.secret_id}",
                         "/e2b/secrets/%2e%2e%2fv1%2fcredentials", f"/e2b/secrets/{mine.secret_id.upper()}"):
                assert http.get(path).status_code == 404, path
                assert own.get(path).status_code == 404, path
        assert httpx.get(f"{acme.api_url}/e2b/secrets").status_code == 401  # no key
        assert e2b.Secret.get_info(mine.secret_id, **_opts(acme)).version == 1  # untouched
    finally:
        e2b.Secret.destroy(mine.secret_id, **_opts(acme))
