"""Gateway output shaping and bookkeeping (services/gateway/shaping.py, identity.py, resolve.py): refusal
bodies, header formatting, redaction, credential choice, rate-limit arithmetic, DNS memory, hosts files and
binding files."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from podbay.contracts.egress import NetBinding, binding_path
from podbay_gateway.identity import DnsMemory, read_binding
from podbay_gateway.resolve import Resolver, parse_hosts
from podbay_gateway.shaping import (
    REDACTED,
    CredentialRow,
    error_body,
    expired,
    format_header,
    over_rate_limit,
    pick_credential,
    redact,
    redact_text,
)


def test_error_body_shape() -> None:
    assert json.loads(error_body("egress_denied", "no allow rule matches x:80")) == {
        "error": {"code": "egress_denied", "message": "no allow rule matches x:80"}}


def test_format_header_is_literal_replacement() -> None:
    assert format_header("Bearer {value}", "s3cr{et}") == "Bearer s3cr{et}"
    assert format_header("token={value}; x={other}", "v") == "token=v; x={other}"
    with pytest.raises(ValueError):
        format_header("Bearer {value}", "a\r\nX-Evil: 1")


def test_redact_bytes_and_text() -> None:
    body = b'{"auth": "Bearer abc123", "again": "abc123abc123"}'
    out, n = redact(body, ["abc123"])
    assert b"abc123" not in out and n == 3 and REDACTED.encode() in out
    # the longer secret first, so a secret containing another is not left half visible
    out, n = redact(b"xx-long-secret-xx", ["secret", "long-secret"])
    assert out == b"xx-" + REDACTED.encode() + b"-xx" and n == 1
    assert redact(b"nothing", ["", "zzz"]) == (b"nothing", 0)
    text, n = redact_text("Bearer abc123", ["abc123"])
    assert text == f"Bearer {REDACTED}" and n == 1


def _row(cid: str, hosts: tuple[str, ...], prefix: str | None = None, **kw: object) -> CredentialRow:
    return CredentialRow(id=cid, tenant_id="t", name=cid, hosts=hosts, header="Authorization",
                         format="Bearer {value}", backend="pg", path_prefix=prefix, **kw)  # type: ignore[arg-type]


def test_pick_credential_by_host_and_path() -> None:
    rows = [_row("wild", ("*.example.com",)), _row("exact", ("api.example.com",)),
            _row("v2", ("api.example.com",), "/v2/"), _row("other", ("other.org",))]
    assert pick_credential(rows, "api.example.com", "/v1/x").id == "exact"  # type: ignore[union-attr]
    assert pick_credential(rows, "API.example.com.", "/v2/items?q=1").id == "v2"  # type: ignore[union-attr]
    assert pick_credential(rows, "www.example.com", "/").id == "wild"  # type: ignore[union-attr]
    assert pick_credential(rows, "example.com", "/") is None
    only_prefixed = [_row("v2", ("api.example.com",), "/v2/")]
    assert pick_credential(only_prefixed, "api.example.com", "/v1/x") is None
    assert pick_credential(only_prefixed, "api.example.com", "/v2") is None


def test_rate_limit_and_expiry_arithmetic() -> None:
    assert not over_rate_limit(0, None) and not over_rate_limit(10_000, None)
    assert not over_rate_limit(1, 2) and over_rate_limit(2, 2) and over_rate_limit(0, 0)
    now = datetime.now(UTC)
    assert expired(_row("a", ("x",), expires_at=now - timedelta(seconds=1)), now)
    assert not expired(_row("a", ("x",), expires_at=now + timedelta(seconds=60)), now)
    assert not expired(_row("a", ("x",)), now)


def test_dns_memory_expires_and_forgets() -> None:
    t = [100.0]
    mem = DnsMemory(grace_s=10, clock=lambda: t[0])
    mem.remember("10.88.0.2", "api.example.com", ["198.51.100.7", "198.51.100.8"], ttl_s=30)
    assert mem.name_of("10.88.0.2", "198.51.100.8") == "api.example.com"
    assert mem.name_of("10.88.0.6", "198.51.100.8") is None  # another sandbox learned nothing
    assert sorted(mem.addrs_of("10.88.0.2", "api.example.com")) == ["198.51.100.7", "198.51.100.8"]
    t[0] += 41
    assert mem.name_of("10.88.0.2", "198.51.100.7") is None
    mem.remember("10.88.0.2", "a.example.com", ["198.51.100.9"], ttl_s=30)
    mem.forget("10.88.0.2")
    assert mem.addrs_of("10.88.0.2", "a.example.com") == []


def test_parse_hosts() -> None:
    table = parse_hosts("# c\n10.99.0.2 Upstream.test  alias.test # x\n::1 v6.test\nbad line\n10.99.0.3 upstream.test\n")
    assert table == {"upstream.test": ["10.99.0.2", "10.99.0.3"], "alias.test": ["10.99.0.2"]}


async def test_resolver_prefers_hosts_file(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("10.99.0.2 upstream.test\n")
    r = Resolver(hosts)
    assert await r.resolve("UPSTREAM.test.") == ["10.99.0.2"]
    assert await r.resolve("no-such-name.invalid") == []


def test_read_binding(tmp_path: Path) -> None:
    b = NetBinding(sandbox_id="sbx_1", generation=3, tap="pbt1", host_addr="10.88.0.1", guest_addr="10.88.0.2",
                   ca_path="/nonexistent", ca_cert_pem="x")
    path = binding_path(tmp_path, "node-1", "10.88.0.2")
    path.parent.mkdir(parents=True)
    path.write_text(b.model_dump_json())
    assert read_binding(tmp_path, "node-1", "10.88.0.2") == b
    assert read_binding(tmp_path, "node-1", "::ffff:10.88.0.2") == b
    assert read_binding(tmp_path, "node-2", "10.88.0.2") is None
    assert read_binding(tmp_path, "node-1", "10.88.0.6") is None
    path.write_text("{torn")
    assert read_binding(tmp_path, "node-1", "10.88.0.2") is None
