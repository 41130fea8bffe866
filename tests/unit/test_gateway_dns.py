"""The gateway's DNS answers (services/gateway/dnsserver.py + engine.py) against binding files on disk and a
fake store: who is refused, what is NXDOMAIN, what is remembered, and which denials are audited."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dns.message
import dns.rcode
import pytest

from podbay.config import Settings
from podbay.contracts.egress import EgressPolicy, NetBinding, binding_path
from podbay_gateway.dnsserver import answer
from podbay_gateway.engine import Gateway
from podbay_gateway.store import SandboxContext

GUEST = "10.88.0.2"


class FakeStore:
    """Stands in for GatewayStore: one sandbox row (or none), denials collected."""

    def __init__(self, policy: EgressPolicy | None, *, exists: bool = True) -> None:
        self.policy, self.exists = policy, exists
        self.denials: list[dict[str, Any]] = []

    async def sandbox(self, sandbox_id: str) -> SandboxContext | None:
        return SandboxContext(sandbox_id, "tnt_1", "base", 1, "running", self.policy) if self.exists else None

    async def record_denial(self, **kw: Any) -> int:
        self.denials.append(kw)
        return len(self.denials)


def _gateway(tmp_path: Path, store: FakeStore, *, bind: bool = True) -> Gateway:
    hosts = tmp_path / "hosts"
    hosts.write_text("198.51.100.7 api.example.com\n")
    settings = Settings(data_dir=tmp_path, node_id="n1", gateway_hosts_file=hosts)
    if bind:
        path = binding_path(tmp_path, "n1", GUEST)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(NetBinding(sandbox_id="sbx_1", generation=1, tap="pbt1", host_addr="10.88.0.1",
                                   guest_addr=GUEST, ca_path="/x", ca_cert_pem="x").model_dump_json())
    return Gateway(settings, store, None)  # type: ignore[arg-type]


async def _ask(gw: Gateway, name: str, qtype: str = "A", src: str = GUEST) -> dns.message.Message:
    out = await answer(gw, src, dns.message.make_query(name, qtype).to_wire())
    assert out is not None
    await gw.drain()
    return dns.message.from_wire(out)


POLICY = EgressPolicy.model_validate({"allow": [{"domain": "*.example.com", "ports": [443]}],
                                      "deny": [{"domain": "bad.example.com"}]})


async def test_allowed_name_is_answered_and_remembered(tmp_path: Path) -> None:
    gw = _gateway(tmp_path, FakeStore(POLICY))
    reply = await _ask(gw, "API.example.com.")
    assert reply.rcode() == dns.rcode.NOERROR
    assert [rd.to_text() for rrset in reply.answer for rd in rrset] == ["198.51.100.7"]
    assert gw.memory.name_of(GUEST, "198.51.100.7") == "api.example.com"
    aaaa = await _ask(gw, "api.example.com", "AAAA")
    assert aaaa.rcode() == dns.rcode.NOERROR and not aaaa.answer


async def test_denied_names_are_nxdomain_and_audited_once_a_minute(tmp_path: Path) -> None:
    store = FakeStore(POLICY)
    gw = _gateway(tmp_path, store)
    for _ in range(3):
        assert (await _ask(gw, "bad.example.com")).rcode() == dns.rcode.NXDOMAIN
    assert (await _ask(gw, "elsewhere.org")).rcode() == dns.rcode.NXDOMAIN
    assert [(d["destination"], d["reason"]) for d in store.denials] == [
        ("bad.example.com", "deny_rule"), ("elsewhere.org", "no_allow_rule")]
    assert store.denials[0]["tenant_id"] == "tnt_1" and store.denials[0]["sandbox_id"] == "sbx_1"


async def test_allowed_name_that_does_not_resolve_is_nxdomain(tmp_path: Path) -> None:
    gw = _gateway(tmp_path, FakeStore(POLICY))
    assert (await _ask(gw, "nothing-here.example.com")).rcode() == dns.rcode.NXDOMAIN


@pytest.mark.parametrize(("bind", "exists"), [(False, True), (True, False)])
async def test_unknown_peer_or_warm_slot_is_refused(tmp_path: Path, bind: bool, exists: bool) -> None:
    store = FakeStore(POLICY, exists=exists)
    gw = _gateway(tmp_path, store, bind=bind)
    assert (await _ask(gw, "api.example.com")).rcode() == dns.rcode.REFUSED
    # a warm slot (binding, no sandbox row) is audited against its sandbox id; an unknown peer only logged
    assert len(store.denials) == (0 if not bind else 1)


async def test_no_policy_denies_every_name(tmp_path: Path) -> None:
    gw = _gateway(tmp_path, FakeStore(None))
    assert (await _ask(gw, "api.example.com")).rcode() == dns.rcode.NXDOMAIN


async def test_garbage_gets_no_answer(tmp_path: Path) -> None:
    gw = _gateway(tmp_path, FakeStore(POLICY))
    assert await answer(gw, GUEST, b"\x00\x01garbage") is None


async def test_names_leading_into_an_allowed_cidr_are_answered_with_those_addresses_only(tmp_path: Path) -> None:
    (tmp_path / "hosts").write_text("")
    policy = EgressPolicy.model_validate({"allow": [{"cidr": "198.51.100.0/24", "ports": [5432]}],
                                          "deny": [{"cidr": "198.51.100.66/32"}]})
    gw = _gateway(tmp_path, FakeStore(policy))
    (tmp_path / "hosts").write_text("198.51.100.7 db.example.net\n203.0.113.5 db.example.net\n"
                                    "203.0.113.9 web.example.net\n198.51.100.66 blocked.example.net\n")
    reply = await _ask(gw, "db.example.net")
    assert [rd.to_text() for rrset in reply.answer for rd in rrset] == ["198.51.100.7"]
    assert gw.memory.name_of(GUEST, "198.51.100.7") == "db.example.net"
    assert (await _ask(gw, "db.example.net", "AAAA")).rcode() == dns.rcode.NOERROR
    assert (await _ask(gw, "web.example.net")).rcode() == dns.rcode.NXDOMAIN
    assert (await _ask(gw, "blocked.example.net")).rcode() == dns.rcode.NXDOMAIN
