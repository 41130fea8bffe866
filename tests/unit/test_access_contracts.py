"""Credential, key and egress bodies: validation that never echoes a value, placeholders, CLI rule parsing,
SDK request shapes, and the API's key cache forgetting a revoked key."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from pydantic import ValidationError

from podbay.cli.access import parse_rule
from podbay.contracts.access import CredentialCreate, placeholder_env
from podbay.errors import InvalidRequest
from podbay.sdk import Client, EgressPolicy

SECRET = "s3cr3t-VALUE-never-shown"


def _cred(**over: object) -> CredentialCreate:
    fields: dict[str, object] = {"name": "github", "value": SECRET, "hosts": ["api.github.com"]}
    fields.update(over)
    return CredentialCreate.model_validate(fields)


def test_a_valid_credential_hides_its_value() -> None:
    c = _cred(hosts=["API.GitHub.com.", "*.example.com"], path_prefix="/repos",
              expires_at=datetime.now(UTC) + timedelta(days=1), rate_limit_per_min=60)
    assert c.hosts == ["api.github.com", "*.example.com"]
    assert SECRET not in repr(c) and SECRET not in c.model_dump_json()
    assert c.value.get_secret_value() == SECRET


@pytest.mark.parametrize("over", [
    {"name": "Bad Name"}, {"name": "-x"}, {"name": "a" * 64},
    {"value": ""}, {"value": "x" * (16 * 1024 + 1)}, {"value": "a\r\nX-Evil: 1"},
    {"value": "SECRET\udc00CT"}, {"value": "S\u00c9CRET\u2713"},
    {"hosts": []}, {"hosts": ["not a host"]}, {"hosts": ["http://x.com"]}, {"hosts": ["a.*.com"]},
    {"header": "Bad Header"}, {"header": "Host"}, {"header": "connection"}, {"header": "Transfer-Encoding"},
    {"format": "Bearer"}, {"format": "Bearer {value}\r\n"},
    {"expires_at": "2000-01-01T00:00:00Z"}, {"rate_limit_per_min": 0}, {"path_prefix": "repos"},
    {"extra": 1},
])
def test_bad_credentials_are_refused_without_echoing_the_value(over: dict[str, object]) -> None:
    with pytest.raises(ValidationError) as info:
        _cred(**over)
    # Pydantic may echo inputs in its messages; the value's field never appears as an input.
    errors = info.value.errors(include_input=False)
    assert errors and SECRET not in json.dumps(errors, default=str)


def test_placeholders_name_the_credential_not_its_value() -> None:
    assert placeholder_env(["github", "my-api_key"]) == {
        "PODBAY_CRED_GITHUB": "podbay-credential:github",
        "PODBAY_CRED_MY_API_KEY": "podbay-credential:my-api_key",
    }


@pytest.mark.parametrize("value,domain,cidr,ports", [
    ("api.github.com", "api.github.com", None, []),
    ("*.github.com:443", "*.github.com", None, [443]),
    ("10.0.0.0/8", None, "10.0.0.0/8", []),
    ("10.0.0.0/8:5432", None, "10.0.0.0/8", [5432]),
    ("2001:db8::/32:443", None, "2001:db8::/32", [443]),
    ("192.0.2.7:80", None, "192.0.2.7/32", [80]),
])
def test_cli_rules_parse(value: str, domain: str | None, cidr: str | None, ports: list[int]) -> None:
    rule = parse_rule(value)
    assert (rule.domain, rule.cidr, rule.ports) == (domain, cidr, ports)


@pytest.mark.parametrize("value", ["bad host", "x.com:0", "x.com:http", "10.0.0.0/99"])
def test_cli_bad_rules_fail_clearly(value: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_rule(value)
    # One line naming the rule and what is wrong, not pydantic's multi-line report with its links.
    assert err.value.message.startswith(f"invalid rule {value!r}: ")
    assert "\n" not in err.value.message and "validation error" not in err.value.message
    assert "errors.pydantic.dev" not in err.value.message and "Value error," not in err.value.message


def test_sdk_sends_the_value_once_and_the_policy_as_json() -> None:
    seen: list[httpx.Request] = []
    now = "2026-01-01T00:00:00Z"

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        if req.url.path == "/v1/credentials":
            return httpx.Response(201, json={"id": "cred_1", "name": "github", "hosts": ["api.github.com"],
                                             "header": "Authorization", "format": "Bearer {value}",
                                             "backend": "pg", "placeholder": "PODBAY_CRED_GITHUB",
                                             "created_at": now})
        return httpx.Response(200, json={"policy": json.loads(req.content), "source": "sandbox"})

    with Client("http://api.test", "pb_12345678_" + "a" * 40, transport=httpx.MockTransport(handler)) as c:
        info = c.credentials.create("github", SECRET, ["api.github.com"], rate_limit_per_min=5)
        assert info.placeholder == "PODBAY_CRED_GITHUB"
        net = c.set_network("sbx_1", {"allow": [{"domain": "*.github.com", "ports": [443]}]})
        assert net.policy == EgressPolicy(allow=[{"domain": "*.github.com", "ports": [443]}])
        with pytest.raises(InvalidRequest):
            c.set_network("sbx_1", {"allow": [{"domain": "bad domain"}]})
        with pytest.raises(InvalidRequest):
            c.credentials.create("Bad Name", SECRET, ["x.com"])
    body = json.loads(seen[0].content)
    assert body["value"] == SECRET and body["rate_limit_per_min"] == 5
    assert seen[1].method == "PUT" and seen[1].url.path == "/v1/sandboxes/sbx_1/network"
    assert len(seen) == 2  # the invalid calls never left the client


async def test_a_forgotten_key_is_looked_up_again() -> None:
    from podbay_api.core import auth

    key, _ = auth.generate_key()

    class Pool:
        calls = 0
        revoked: datetime | None = None

        async def fetchrow(self, sql: str, prefix: str) -> dict[str, object]:
            Pool.calls += 1
            return {"id": "key_1", "tenant_id": "ten_1", "key_hash": auth.hash_key(key), "revoked_at": None}

    pool = Pool()
    await auth.authenticate(pool, f"Bearer {key}")  # type: ignore[arg-type]
    await auth.authenticate(pool, f"Bearer {key}")  # type: ignore[arg-type]
    assert Pool.calls == 1
    auth.forget_key(auth.hash_key(key))
    await auth.authenticate(pool, f"Bearer {key}")  # type: ignore[arg-type]
    assert Pool.calls == 2


async def test_async_sdk_namespaces_and_audit_query() -> None:
    from podbay.sdk import AsyncClient

    seen: list[httpx.Request] = []
    now = "2026-01-01T00:00:00Z"

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        if req.url.path == "/v1/keys" and req.method == "POST":
            return httpx.Response(201, json={"id": "key_2", "name": "ci", "prefix": "abcd1234", "created_at": now,
                                             "key": "pb_abcd1234_" + "b" * 40})
        if req.url.path == "/v1/audit":
            return httpx.Response(200, json={"entries": [{"id": 7, "at": now, "actor": "gateway:node-1",
                                                          "action": "egress.deny", "decision": "deny"}],
                                             "next_before": None})
        return httpx.Response(204)

    async with AsyncClient("http://api.test", "pb_12345678_" + "a" * 40,
                           transport=httpx.MockTransport(handler)) as c:
        made = await c.keys.create("ci")
        assert made.key.startswith("pb_abcd1234_")
        page = await c.audit(action="egress.*", sandbox_id="sbx_1", limit=5)
        assert page.entries[0].decision == "deny" and page.next_before is None
        await c.credentials.delete("github")
    assert dict(seen[1].url.params) == {"action": "egress.*", "sandbox_id": "sbx_1", "limit": "5"}
    assert (seen[2].method, seen[2].url.path) == ("DELETE", "/v1/credentials/github")


def test_a_value_file_that_is_not_utf8_is_refused_without_quoting_it(tmp_path: object) -> None:
    from pathlib import Path

    from podbay.cli.access import read_value

    f = Path(str(tmp_path)) / "v"
    f.write_bytes(b"\xff\xfeSECRETBYTES")
    with pytest.raises(InvalidRequest) as info:
        read_value(f)
    assert "UTF-8" in str(info.value) and "SECRET" not in str(info.value) and "xff" not in str(info.value)
    with pytest.raises(InvalidRequest, match="cannot read"):
        read_value(Path(str(tmp_path)) / "missing")
