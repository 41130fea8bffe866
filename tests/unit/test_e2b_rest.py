"""Pure parts of E2B's REST API on podbay (services/api/e2b/sandboxes.py) and the e2b_ key alias."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from podbay.contracts.e2b import from_e2b_key, to_e2b_key
from podbay.errors import InvalidRequest
from podbay_api.e2b.sandboxes import _started_after


def test_e2b_key_alias_names_the_same_key() -> None:
    key = "pb_0123abcd_" + "f" * 40
    alias = to_e2b_key(key)
    assert alias == "e2b_0123abcd" + "f" * 40
    assert alias.startswith("e2b_") and all(c in "0123456789abcdef" for c in alias[4:])
    assert from_e2b_key(alias) == key
    # Other shapes pass through unchanged (the API then refuses them as malformed).
    assert to_e2b_key("pb_k") == "pb_k" and from_e2b_key("e2b_xyz") == "e2b_xyz"


def test_started_after_reads_rfc3339_and_naive_times_as_utc() -> None:
    assert _started_after("2026-12-02T01:02:03Z") == datetime(2026, 12, 2, 1, 2, 3, tzinfo=UTC)
    assert _started_after("2026-12-02T01:02:03") == datetime(2026, 12, 2, 1, 2, 3, tzinfo=UTC)
    assert _started_after(None) is None
    with pytest.raises(InvalidRequest):
        _started_after("yesterday")


def test_file_url_signatures_match_the_sdks_and_expire() -> None:
    from e2b.sandbox.signature import get_signature
    from podbay_api.edge.envd import check_file_signature

    token = "t" * 64
    for user, exp in ((None, None), ("root", 60)):
        sig = get_signature("/home/user/a.txt", "read", user, token, exp)
        query = {"path": "/home/user/a.txt", "signature": sig["signature"]}
        if user:
            query["username"] = user
        if sig["expiration"]:
            query["signature_expiration"] = str(sig["expiration"])
        now = datetime.now(UTC).timestamp()
        assert check_file_signature(query, "read", token, now) is None
        assert check_file_signature(query, "write", token, now) is not None  # signed for reading only
        assert check_file_signature(query, "read", "other", now) is not None
        if exp:
            assert "expired" in (check_file_signature(query, "read", token, now + 3600) or "")


def test_e2b_network_options_map_onto_podbay_egress_policy() -> None:
    from podbay_api.e2b.network import egress_policy

    def rules(policy: object, side: str) -> list[str]:
        return [r.cidr or r.domain for r in getattr(policy, side)]

    assert egress_policy(None, None) is None  # nothing asked: the template's policy
    everything = ["0.0.0.0/0", "::/0"]
    assert rules(egress_policy(True, None), "allow") == everything
    closed = egress_policy(False, {"allowOut": ["api.example.com", "8.8.8.8"]})
    assert rules(closed, "allow") == ["api.example.com", "8.8.8.8/32"] and closed.deny == []
    same = egress_policy(None, {"denyOut": ["0.0.0.0/0"], "allowOut": ["*.github.com"]})
    # A domain in allowOut opens E2B's default DNS server too (dnsServers left out).
    assert rules(same, "allow") == ["*.github.com", "8.8.8.8/32"] and same.deny == []
    # allowOut wins over denyOut: the allowed network is cut out of the denied one.
    part = egress_policy(None, {"denyOut": ["10.0.0.0/8"], "allowOut": ["10.1.0.0/16"]})
    assert rules(part, "allow") == everything
    denied = rules(part, "deny")
    assert "10.1.0.0/16" not in denied and "10.0.0.0/16" in denied and len(denied) == 8
    # update_network with nothing: everything cleared, the internet open (E2B's default).
    assert rules(egress_policy(None, {}, at_create=False), "allow") == everything
    with pytest.raises(InvalidRequest):
        egress_policy(None, {"denyOut": ["example.com"]})
    with pytest.raises(InvalidRequest):
        egress_policy(None, {"allowOut": ["not a host!"]})


def test_e2b_network_rules_dns_servers_and_egress_proxy() -> None:
    from podbay_api.e2b.network import egress_policy

    rules = {"api.example.com": [{"transform": {"headers": {"X-Team": "blue"}}}, {}],
             "*.example.org": [{"transform": {"headers": {"Authorization": "Bearer t"}}}]}
    policy = egress_policy(None, {"rules": rules})
    assert policy is not None  # rules alone: E2B's open internet, with the transforms
    assert [r.cidr for r in policy.allow] == ["0.0.0.0/0", "::/0"]
    assert [(t.domain, t.headers) for t in policy.transforms] == [
        ("api.example.com", {"X-Team": "blue"}), ("*.example.org", {"Authorization": "Bearer t"})]
    assert policy.model_dump(mode="json")["transforms"][0] == {"domain": "api.example.com",
                                                               "headers": {"X-Team": "blue"}}
    assert "transforms" not in egress_policy(True, None).model_dump(mode="json")  # the plain shape stays
    dns = egress_policy(None, {"allowOut": ["api.example.com"], "denyOut": ["0.0.0.0/0"],
                               "dnsServers": ["1.1.1.1", "9.9.9.9"]})
    assert [r.cidr or r.domain for r in dns.allow] == ["api.example.com", "1.1.1.1/32", "9.9.9.9/32"]
    none = egress_policy(None, {"allowOut": ["api.example.com"], "denyOut": ["0.0.0.0/0"], "dnsServers": []})
    assert [r.domain for r in none.allow] == ["api.example.com"]
    no_domain = egress_policy(None, {"allowOut": ["10.0.0.1"], "denyOut": ["0.0.0.0/0"]})
    assert [r.cidr for r in no_domain.allow] == ["10.0.0.1/32"]  # no domain: DNS servers change nothing
    for bad in ({"egressProxy": {"address": "proxy.example.com:1080"}},
                {"rules": {"10.0.0.0/8": [{"transform": {"headers": {"X-A": "b"}}}]}},
                {"rules": {"a.example.com": [{"transform": {"body": "x"}}]}},
                {"rules": {"a.example.com": [{"transform": {"headers": {"Bad Name": "b"}}}]}},
                {"rules": {"a.example.com": [{"transform": {"headers": {"X-A": "b\r\nX-B: c"}}}]}},
                {"dnsServers": ["::1"]}, {"dnsServers": ["1.1.1.1"] * 11}):
        with pytest.raises(InvalidRequest):
            egress_policy(None, bad)


def test_e2b_ingress_options_mask_host_and_refuse_https_ports_and_unknown_keys() -> None:
    from podbay_api.e2b.network import egress_policy, mask_request_host

    assert mask_request_host(None) is None and mask_request_host({"allowOut": []}) is None
    assert mask_request_host({"maskRequestHost": "localhost:${PORT}"}, 3000) == "localhost:3000"
    assert mask_request_host({"maskRequestHost": "${PORT}-app.example.com"}, 8080) == "8080-app.example.com"
    assert mask_request_host({"maskRequestHost": "[::1]:${PORT}"}, 80) == "[::1]:80"
    assert egress_policy(None, {"maskRequestHost": "localhost:${PORT}", "httpsPorts": []}) is None  # not egress
    e2b_models = pytest.importorskip("e2b.api.client.models")
    every = e2b_models.SandboxNetworkConfig(allow_public_traffic=False, allow_out=["a.example.com"],
                                            deny_out=["0.0.0.0/0"], dns_servers=["1.1.1.1"],
                                            mask_request_host="localhost:${PORT}", https_ports=[])
    assert egress_policy(None, every.to_dict()) is not None  # every key the SDK sends is known
    for bad in ({"maskRequestHost": "a b"}, {"maskRequestHost": "host/path"}, {"maskRequestHost": 3},
                {"maskRequestHost": "x" * 254}, {"httpsPorts": [3000]}, {"allowPackageRegistryAccess": True}):
        with pytest.raises(InvalidRequest) as err:
            egress_policy(None, bad)
        assert err.value.message.startswith("network."), err.value.message


def test_e2b_network_update_refuses_keys_it_does_not_define() -> None:
    from podbay_api.e2b.network import NetworkUpdate

    ok = NetworkUpdate.model_validate({"allowOut": ["api.example.com"], "denyOut": ["0.0.0.0/0"],
                                       "allow_internet_access": False})
    ok.refuse_unknown()
    assert ok.allow_out == ["api.example.com"] and ok.allow_internet_access is False
    e2b_models = pytest.importorskip("e2b.api.client.models")
    every = e2b_models.SandboxNetworkUpdateConfig(allow_out=["a.example.com"], deny_out=["0.0.0.0/0"],
                                                  dns_servers=["1.1.1.1"], allow_internet_access=False)
    NetworkUpdate.model_validate(every.to_dict()).refuse_unknown()  # what the SDK sends passes
    for bad in ({"maskRequestHost": "localhost:${PORT}"}, {"allowPublicTraffic": False},
                {"allowPackageRegistryAccess": True}):
        with pytest.raises(InvalidRequest, match=f"network.{next(iter(bad))}"):
            NetworkUpdate.model_validate(bad).refuse_unknown()
