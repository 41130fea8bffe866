"""The multi-node dev stack: two node agents, each in its own network namespace, reach the shared servers
across the bridge, register their namespace addresses, and a cut link makes a node unreachable."""

from __future__ import annotations

import ipaddress
import subprocess
from typing import Any

import httpx
import pytest

from podbay.devstack.netns import NodeNetwork
from podbay.devstack.procs import run_sync
from podbay.stacknet import SANDBOX_POOL


async def _nodes(dsn: str) -> dict[str, str]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT id, dataplane_url FROM nodes")
    finally:
        await conn.close()
    return {r["id"]: r["dataplane_url"] for r in rows}


def _reachable(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_two_nodes_in_their_own_namespaces(multinode_stack: Any) -> None:
    st = multinode_stack
    net: NodeNetwork = st.network
    assert net is not None and sorted(n.node_id for n in net.nodes) == ["node-a", "node-b"]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert all(n.netns in namespaces for n in net.nodes)
    assert ipaddress.ip_address(net.host_address) in ipaddress.ip_network(net.cidr)
    assert not ipaddress.ip_network(net.cidr).overlaps(ipaddress.ip_network(SANDBOX_POOL))
    # The servers listen on the bridge, where the node namespaces reach them.
    assert net.host_address in st.nats_url and net.host_address in st.pg_dsn and net.host_address in st.s3_url
    urls = run_sync(_nodes(st.pg_dsn))
    for link in net.nodes:
        assert urls[link.node_id] == f"http://{link.address}:{st.ports.node}"
        assert _reachable(urls[link.node_id])
        assert {s.spec.name for s in st.node_services(link.node_id)} == {"nodeagent", "snapshotter", "gateway"}
        assert all(s.alive() for s in st.node_services(link.node_id))


def test_a_cut_link_makes_the_node_unreachable_until_restored(multinode_stack: Any) -> None:
    st = multinode_stack
    url = f"http://{st.network.node('node-b').address}:{st.ports.node}"
    st.cut_link("node-b")
    try:
        assert not _reachable(url)
        assert _reachable(f"http://{st.network.node('node-a').address}:{st.ports.node}")
    finally:
        st.restore_link("node-b")
    assert _reachable(url)


#: A name the host's own resolver answers when the machine has its way out (the package mirror the template
#: builds use): each node namespace must resolve it too, through the host's uplink.
_OUTSIDE_NAME = "deb.debian.org"


def _resolves(prefix: list[str], name: str) -> bool:
    done = subprocess.run([*prefix, "getent", "hosts", name], capture_output=True, text=True, timeout=30,
                          check=False)
    return done.returncode == 0 and bool(done.stdout.strip())


def test_each_node_reaches_the_outside_as_a_host_would_also_after_a_cut(multinode_stack: Any) -> None:
    """A node's gateway resolves names with the host's resolver and proxies a sandbox's allowed egress, so
    each namespace needs the host's way out (forwarding and masquerade, podbay.devstack.netns): without it a
    template build's ``apt-get`` on a namespaced node failed with "Temporary failure resolving". Runs after
    the cut-link test, so node-b's link has been down and up."""
    if not _resolves([], _OUTSIDE_NAME):
        pytest.skip(f"this host does not resolve {_OUTSIDE_NAME} itself")
    for link in multinode_stack.network.nodes:
        assert _resolves(link.nsenter(), _OUTSIDE_NAME), f"{link.node_id} cannot resolve {_OUTSIDE_NAME}"


def test_the_operator_lists_the_nodes_and_other_tenants_may_not(multinode_stack: Any) -> None:
    st = multinode_stack
    headers = {"authorization": f"Bearer {st.api_key}"}
    r = httpx.get(f"{st.api_url}/v1/nodes", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    nodes = {n["id"]: n for n in r.json()["nodes"]}
    assert set(nodes) == {"node-a", "node-b"}
    for n in nodes.values():
        assert n["state"] == "ready" and n["live"] and n["schedulable"]
        assert n["capacity"] == {"memory_mib": 2048, "vcpus": 8} and n["free"]["memory_mib"] <= 2048
        assert n["heartbeat_age_s"] is not None and n["heartbeat_age_s"] >= 0 and n["lost_at"] is None
        # What the node measured, as placement admits by it (NodeHeartbeat.memory_room_mib).
        m = n["memory"]
        assert m is not None and m["available_mib"] > 0 and m["sandboxes_mib"] >= 0, n
        assert m["limit_mib"] == 2048 and m["headroom_mib"] >= 0 and m["measured_at"] is not None
        assert m["room_mib"] == min(m["available_mib"] - m["headroom_mib"],
                                    m["limit_mib"] - m["sandboxes_mib"]) + m["reclaimable_mib"]
    mine = (st.api_key, st.tenant_id)
    try:
        other = st.create_api_key("someone-else", "k")  # a tenant that is not the operator's
    finally:
        st.api_key, st.tenant_id = mine  # create_api_key keeps the last key; the fixture keeps its own
    r = httpx.get(f"{st.api_url}/v1/nodes", headers={"authorization": f"Bearer {other}"}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
