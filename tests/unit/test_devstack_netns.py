"""Planning a multi-node stack's network (podbay.devstack.netns): names, addresses, persistence."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from podbay.devstack import netns
from podbay.devstack.netns import NodeNetwork, node_ids_for, plan_network
from podbay.stacknet import SANDBOX_POOL, stack_tag


def test_node_ids() -> None:
    assert node_ids_for(2) == ["node-a", "node-b"]
    assert node_ids_for(27)[:2] == ["node-1", "node-2"]


def test_plan_avoids_networks_in_use_and_the_sandbox_range(tmp_path: Path, monkeypatch) -> None:
    tag = stack_tag(tmp_path)
    first = ipaddress.ip_network(f"10.77.{int(tag, 16) % 256}.0/24")
    monkeypatch.setattr(netns, "_used_networks", lambda: [first])
    plan = plan_network(tmp_path, ["node-a", "node-b"])
    net = ipaddress.ip_network(plan.cidr)
    assert not net.overlaps(first) and not net.overlaps(ipaddress.ip_network(SANDBOX_POOL))
    assert ipaddress.ip_address(plan.host_address) in net
    addrs = [n.address for n in plan.nodes]
    assert len(set(addrs + [plan.host_address])) == 3 and all(ipaddress.ip_address(a) in net for a in addrs)
    # Interface names fit the kernel's 15 characters; namespaces are unique per stack.
    assert all(len(n.veth) <= 15 for n in plan.nodes) and len(plan.bridge) <= 15
    assert len({n.netns for n in plan.nodes}) == 2 and all(tag in n.netns for n in plan.nodes)


def test_a_saved_plan_is_reused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(netns, "_used_networks", lambda: [])
    plan = plan_network(tmp_path, ["node-a", "node-b"])
    plan.save(tmp_path)
    assert NodeNetwork.load(tmp_path) == plan
    monkeypatch.setattr(netns, "_used_networks", lambda: [ipaddress.ip_network(plan.cidr)])
    assert plan_network(tmp_path, ["node-a", "node-b"]) == plan  # our own bridge does not push us away
    assert plan.node("node-b").address == plan.nodes[1].address


def test_a_multi_node_stack_refuses_external_servers_on_loopback(tmp_path: Path) -> None:
    import pytest

    from podbay.devstack.stack import External, Stack, StackError

    st = Stack(data_dir=tmp_path, log_dir=tmp_path, cache_dir=tmp_path,
               external=External(pg_dsn="postgresql://u:p@127.0.0.1:5432/db"))
    st.network = NodeNetwork(tag="t", bridge="pbb-t", cidr="10.77.1.0/24", host_address="10.77.1.1")
    with pytest.raises(StackError, match="postgres server at 127.0.0.1 is not reachable"):
        st.start_servers()
    assert not st.servers
