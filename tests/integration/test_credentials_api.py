"""``/v1/credentials`` against the real stack (PostgreSQL backend), and the OpenBao backend against a real
``bao server -dev``: values go in once and never come out of any API, error or log."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from access_helpers import Tenant, new_tenant, second_api, sql

from podbay.credentials import CredentialUnreadable, OpenBaoCredentialStore, PgCredentialStore, Sealed, new_key
from podbay.devstack.procs import free_port
from podbay.devstack.stack import Stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def acme(stack: Stack) -> Tenant:
    return new_tenant(stack, "acme")


@pytest.fixture(scope="module")
def other(stack: Stack) -> Tenant:
    return new_tenant(stack, "other")


def _secret() -> str:
    return "ghp_" + secrets.token_hex(20)


def _body(name: str, value: str, **over: object) -> dict[str, object]:
    body: dict[str, object] = {"name": name, "value": value, "hosts": ["api.github.com"], "path_prefix": "/repos",
                               "header": "Authorization", "format": "Bearer {value}",
                               "expires_at": (datetime.now(UTC) + timedelta(days=30)).isoformat(),
                               "rate_limit_per_min": 60, "templates": ["base"]}
    body.update(over)
    return body


def test_create_list_get_delete_never_return_the_value(stack: Stack, acme: Tenant) -> None:
    value = _secret()
    with acme.http() as http:
        r = http.post("/v1/credentials", json=_body("github", value))
        assert r.status_code == 201, r.text
        created = r.json()
        assert value not in r.text and "value" not in created
        assert created["name"] == "github" and created["backend"] == "pg"
        assert created["placeholder"] == "PODBAY_CRED_GITHUB" and created["templates"] == ["base"]
        assert created["hosts"] == ["api.github.com"] and created["rate_limit_per_min"] == 60
        listed = http.get("/v1/credentials")
        assert listed.status_code == 200 and value not in listed.text
        assert [c["name"] for c in listed.json()["credentials"]] == ["github"]
        one = http.get("/v1/credentials/github")
        assert one.status_code == 200 and one.json()["id"] == created["id"] and value not in one.text
        dup = http.post("/v1/credentials", json=_body("github", _secret()))
        assert dup.status_code == 409 and dup.json()["error"]["code"] == "conflict"
        # Sealed in PostgreSQL: the row holds AES-GCM ciphertext, never the value's bytes.
        row = sql(stack, "SELECT backend, ciphertext, secret_ref FROM credentials WHERE id=$1", created["id"])[0]
        assert row["backend"] == "pg" and row["secret_ref"] is None
        assert value.encode() not in bytes(row["ciphertext"])
        revealed = asyncio.run(PgCredentialStore(stack.env["PODBAY_CREDENTIAL_KEY"]).reveal(
            created["id"], acme.tenant_id, Sealed("pg", ciphertext=bytes(row["ciphertext"]))))
        assert revealed == value
        gone = http.delete("/v1/credentials/github")
        assert gone.status_code == 204
        assert http.get("/v1/credentials/github").status_code == 404
        assert http.delete("/v1/credentials/github").status_code == 404
        # Soft delete: the row stays for the audit trail, its ciphertext is dropped; the name is free again.
        row = sql(stack, "SELECT deleted_at, ciphertext FROM credentials WHERE id=$1", created["id"])[0]
        assert row["deleted_at"] is not None and row["ciphertext"] is None
        again = http.post("/v1/credentials", json=_body("github", _secret()))
        assert again.status_code == 201 and again.json()["id"] != created["id"]
        actions = [e["action"] for e in http.get("/v1/audit", params={"action": "credential.*"}).json()["entries"]]
        assert actions[:3] == ["credential.create", "credential.delete", "credential.create"]
    for name in ("api", "gateway", "nodeagent", "scheduler"):
        path = stack.log_path(name)
        if path.exists():
            assert value not in path.read_text(errors="replace"), f"the value leaked into the {name} log"


@pytest.mark.parametrize("over,where", [
    ({"name": "GitHub"}, "name"),
    ({"value": ""}, "value"),
    ({"value": "x" * (16 * 1024 + 1)}, "value"),
    ({"hosts": ["not a host"]}, "hosts"),
    ({"hosts": []}, "hosts"),
    ({"header": "Host"}, "header"),
    ({"header": "Bad Header"}, "header"),
    ({"format": "token"}, "format"),
    ({"expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
    ({"rate_limit_per_min": 0}, "rate_limit_per_min"),
    ({"colour": "red"}, "colour"),
])
def test_bad_requests_are_422_and_never_echo_the_value(acme: Tenant, over: dict[str, object], where: str) -> None:
    value = _secret()
    body = _body("bad-one", value)
    body.update(over)
    with acme.http() as http:
        r = http.post("/v1/credentials", json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "validation_error" and where in err["message"]
    assert value not in r.text


def test_placeholder_collisions_and_cross_tenant_access(acme: Tenant, other: Tenant) -> None:
    with acme.http() as http:
        assert http.post("/v1/credentials", json=_body("my-token", _secret())).status_code == 201
        # my_token would also be PODBAY_CRED_MY_TOKEN.
        clash = http.post("/v1/credentials", json=_body("my_token", _secret()))
        assert clash.status_code == 409, clash.text
    with other.http() as http:
        assert http.get("/v1/credentials/my-token").status_code == 404
        assert http.delete("/v1/credentials/my-token").status_code == 404
        assert "my-token" not in http.get("/v1/credentials").text
        # Names are per tenant: the other tenant may use the same one.
        assert http.post("/v1/credentials", json=_body("my-token", _secret())).status_code == 201
    with acme.http() as http:
        assert http.get("/v1/credentials/my-token").status_code == 200


def test_a_wrong_credential_key_is_a_clear_error(stack: Stack, acme: Tenant) -> None:
    with acme.http() as http:
        created = http.post("/v1/credentials", json=_body("wrong-key", _secret())).json()
    row = sql(stack, "SELECT ciphertext FROM credentials WHERE id=$1", created["id"])[0]
    with pytest.raises(CredentialUnreadable, match="does not decrypt with this key"):
        asyncio.run(PgCredentialStore(new_key()).reveal(created["id"], acme.tenant_id,
                                                        Sealed("pg", ciphertext=bytes(row["ciphertext"]))))
    # A ciphertext moved onto another row (another id as associated data) does not open either.
    with pytest.raises(CredentialUnreadable):
        asyncio.run(PgCredentialStore(stack.env["PODBAY_CREDENTIAL_KEY"]).reveal(
            "cred_other", acme.tenant_id, Sealed("pg", ciphertext=bytes(row["ciphertext"]))))


def test_openbao_store_round_trip(openbao: tuple[str, str]) -> None:
    addr, token = openbao
    store = OpenBaoCredentialStore(addr, token)
    value = _secret()

    async def run() -> None:
        sealed = await store.seal("cred_rt", "ten_rt", value)
        assert sealed.backend == "openbao" and sealed.ciphertext is None
        assert sealed.secret_ref == "podbay/ten_rt/cred_rt"
        assert await store.reveal("cred_rt", "ten_rt", sealed) == value
        # It really is in OpenBao's KV v2 engine, read with OpenBao's own HTTP API.
        async with httpx.AsyncClient(base_url=addr, headers={"X-Vault-Token": token}) as http:
            kv = await http.get(f"/v1/secret/data/{sealed.secret_ref}")
        assert kv.status_code == 200 and kv.json()["data"]["data"]["value"] == value
        await store.destroy("cred_rt", "ten_rt", sealed)
        with pytest.raises(CredentialUnreadable):
            await store.reveal("cred_rt", "ten_rt", sealed)

    asyncio.run(run())


def test_unreachable_openbao_is_a_storage_error() -> None:
    from podbay.errors import StorageError

    store = OpenBaoCredentialStore(f"http://127.0.0.1:{free_port()}", "no-token")
    with pytest.raises(StorageError):
        asyncio.run(store.seal("cred_x", "ten_x", "v"))


@pytest.fixture(scope="module")
def bao_api(stack: Stack, openbao: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second ``podbay-api`` on the stack's servers, configured with the OpenBao backend."""
    log = tmp_path_factory.mktemp("bao-api") / "api.log"
    with second_api(stack, log, PODBAY_CREDENTIAL_BACKEND="openbao", PODBAY_OPENBAO_ADDR=openbao[0],
                     PODBAY_OPENBAO_TOKEN=openbao[1]) as url:
        yield url


def test_openbao_backend_through_the_api(stack: Stack, acme: Tenant, bao_api: str,
                                         openbao: tuple[str, str]) -> None:
    value = _secret()
    with httpx.Client(base_url=bao_api, headers={"authorization": f"Bearer {acme.key}"}, timeout=30) as http:
        r = http.post("/v1/credentials", json=_body("vaulted", value))
        assert r.status_code == 201, r.text
        created = r.json()
        assert created["backend"] == "openbao" and value not in r.text
        row = sql(stack, "SELECT backend, ciphertext, secret_ref FROM credentials WHERE id=$1", created["id"])[0]
        # In OpenBao, not in PostgreSQL: the row only knows where.
        assert row["ciphertext"] is None and row["secret_ref"] == f"podbay/{acme.tenant_id}/{created['id']}"
        dump = sql(stack, "SELECT string_agg(t::text, '') AS all FROM credentials t")[0]["all"]
        assert value not in dump
        store = OpenBaoCredentialStore(*openbao)
        sealed = Sealed("openbao", secret_ref=row["secret_ref"])
        assert asyncio.run(store.reveal(created["id"], acme.tenant_id, sealed)) == value
        assert http.delete("/v1/credentials/vaulted").status_code == 204
        with pytest.raises(CredentialUnreadable):
            asyncio.run(store.reveal(created["id"], acme.tenant_id, sealed))


def test_an_unreachable_backend_answers_503(stack: Stack, acme: Tenant,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """With OpenBao down, a create is 503 ``storage_error`` and leaves no row."""
    log = tmp_path_factory.mktemp("dead-bao-api") / "api.log"
    value = _secret()
    with second_api(stack, log, PODBAY_CREDENTIAL_BACKEND="openbao",
                     PODBAY_OPENBAO_ADDR=f"http://127.0.0.1:{free_port()}", PODBAY_OPENBAO_TOKEN="x") as url:
        r = httpx.post(f"{url}/v1/credentials", json=_body("unsealed", value),
                       headers={"authorization": f"Bearer {acme.key}"}, timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "storage_error" and value not in r.text
        assert not sql(stack, "SELECT 1 FROM credentials WHERE tenant_id=$1 AND name='unsealed'", acme.tenant_id)
    assert value not in log.read_text(errors="replace")
