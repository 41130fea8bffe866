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
from prometheus_client import REGISTRY

from podbay_gateway.dnsserver import MAX_ANSWER_ADDRS, answer
from podbay_gateway.engine import Gateway
from podbay_gateway.shaping import TokenBuckets
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


def _gateway(tmp_path: Path, store: FakeStore, *, bind: bool = True, **settings_kw: Any) -> Gateway:
    hosts = tmp_path / "hosts"
    hosts.write_text("93.184.216.7 api.example.com\n")
    settings = Settings(data_dir=tmp_path, node_id="n1", gateway_hosts_file=hosts, **settings_kw)
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
    assert [rd.to_text() for rrset in reply.answer for rd in rrset] == ["93.184.216.7"]
    assert gw.memory.name_of(GUEST, "93.184.216.7") == "api.example.com"
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
    policy = EgressPolicy.model_validate({"allow": [{"cidr": "93.184.216.0/24", "ports": [5432]}],
                                          "deny": [{"cidr": "93.184.216.66/32"}]})
    gw = _gateway(tmp_path, FakeStore(policy))
    (tmp_path / "hosts").write_text("93.184.216.7 db.example.net\n93.184.218.5 db.example.net\n"
                                    "93.184.218.9 web.example.net\n93.184.216.66 blocked.example.net\n")
    reply = await _ask(gw, "db.example.net")
    assert [rd.to_text() for rrset in reply.answer for rd in rrset] == ["93.184.216.7"]
    assert gw.memory.name_of(GUEST, "93.184.216.7") == "db.example.net"
    assert (await _ask(gw, "db.example.net", "AAAA")).rcode() == dns.rcode.NOERROR
    assert (await _ask(gw, "web.example.net")).rcode() == dns.rcode.NXDOMAIN
    assert (await _ask(gw, "blocked.example.net")).rcode() == dns.rcode.NXDOMAIN


def _addrs(reply: dns.message.Message) -> list[str]:
    return [rd.to_text() for rrset in reply.answer for rd in rrset]


async def test_answers_never_lead_into_private_ranges_unless_the_operator_allows(tmp_path: Path) -> None:
    policy = EgressPolicy.model_validate({"allow": [{"domain": "*.example.com"}, {"cidr": "0.0.0.0/0"}]})
    store = FakeStore(policy)
    gw = _gateway(tmp_path, store)
    (tmp_path / "hosts").write_text("10.1.2.3 internal.example.com\n169.254.169.254 meta.example.com\n"
                                    "10.1.2.4 mixed.example.com\n93.184.216.9 mixed.example.com\n"
                                    "192.168.5.5 lan.example.org\n10.77.0.1 node.example.com\n")
    for name in ("internal.example.com", "meta.example.com", "lan.example.org", "node.example.com"):
        reply = await _ask(gw, name)
        assert reply.rcode() == dns.rcode.NXDOMAIN and not reply.answer, name
        assert gw.memory.addrs_of(GUEST, name) == []
    # a name with a public and a private address is answered with the public one only
    assert _addrs(await _ask(gw, "mixed.example.com")) == ["93.184.216.9"]
    reasons = {d["destination"]: d["reason"] for d in store.denials}
    assert reasons["internal.example.com"] == "private" and reasons["meta.example.com"] == "link_local"
    assert reasons["node.example.com"] == "stack_network"
    # the operator opened 10.1.0.0/16: the same name now resolves (10.77/16 stays closed whatever it says)
    opened = _gateway(tmp_path, FakeStore(policy), egress_operator_allow_cidrs="10.1.0.0/16,10.77.0.0/16")
    (tmp_path / "hosts").write_text("10.1.2.3 internal.example.com\n10.77.0.1 node.example.com\n")
    assert _addrs(await _ask(opened, "internal.example.com")) == ["10.1.2.3"]
    assert (await _ask(opened, "node.example.com")).rcode() == dns.rcode.NXDOMAIN


async def test_answers_are_capped(tmp_path: Path) -> None:
    gw = _gateway(tmp_path, FakeStore(POLICY))
    (tmp_path / "hosts").write_text("".join(f"93.184.216.{i} many.example.com\n" for i in range(1, 40)))
    assert len(_addrs(await _ask(gw, "many.example.com"))) == MAX_ANSWER_ADDRS


async def test_queries_beyond_the_rate_are_refused_per_sandbox(tmp_path: Path) -> None:
    store = FakeStore(POLICY)
    gw = _gateway(tmp_path, store, gateway_dns_rate_per_s=0.001, gateway_dns_burst=5)
    other = "10.88.0.6"
    path = binding_path(tmp_path, "n1", other)
    path.write_text(NetBinding(sandbox_id="sbx_2", generation=1, tap="pbt2", host_addr="10.88.0.5",
                               guest_addr=other, ca_path="/x", ca_cert_pem="x").model_dump_json())
    before = REGISTRY.get_sample_value("podbay_gateway_dns_rate_limited_total") or 0.0
    codes = [(await _ask(gw, "api.example.com")).rcode() for _ in range(8)]
    assert codes == [dns.rcode.NOERROR] * 5 + [dns.rcode.REFUSED] * 3
    assert (REGISTRY.get_sample_value("podbay_gateway_dns_rate_limited_total") or 0.0) - before == 3
    # another sandbox has a bucket of its own
    assert (await _ask(gw, "api.example.com", src=other)).rcode() == dns.rcode.NOERROR


def test_token_buckets_refill_at_their_rate() -> None:
    now = [0.0]
    tb = TokenBuckets(2.0, 3, clock=lambda: now[0], max_keys=2)
    assert [tb.take("a") for _ in range(4)] == [True, True, True, False]
    now[0] = 0.5  # one token back
    assert [tb.take("a") for _ in range(2)] == [True, False]
    now[0] = 100.0
    assert [tb.take("a") for _ in range(4)] == [True, True, True, False]  # never more than the burst
    tb.take("b"), tb.take("c")  # over max_keys: full buckets are forgotten, others kept
    assert "a" in tb._buckets
