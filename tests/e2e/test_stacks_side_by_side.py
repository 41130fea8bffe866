"""Two stacks on one host never touch each other (libs/podbay/stacknet.py): each has its own taps, nftables
table and sandbox network, derived from its data directory, and purging one removes only what is its own.

Stack A is the session's ``stack``; stack B starts here with its own data directory, servers and ports. Both
gateways answer an allowed test name from a hosts file. Sandboxes run in both; then B is stopped with a
purge (as ``podbay down --purge`` does), and A's guest still has its tap (the same device), executes,
and resolves the allowed name.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_http import api_client, sh, own_stack

from podbay.contracts.egress import NetBinding, bindings_dir
from podbay.devstack.stack import Stack
from podbay.stacknet import nft_table, tap_prefix

pytestmark = pytest.mark.e2e

_NAME, _ADDR = "allowed.side-by-side.test", "203.0.113.99"  # TEST_PEER_NETS: the test stacks' operator allow-list
_RESOLVE = f"python3 -c \"import socket; print(socket.gethostbyname('{_NAME}'))\""


def _hosts_file(d: Path) -> Path:
    path = d / "side-by-side.hosts"
    path.write_text(f"{_ADDR} {_NAME}\n")
    return path


@pytest.fixture(scope="module")
def stack_a(stack: Any, test_root: Path) -> Iterator[Any]:
    """The session stack, its gateway answering the test name (restored afterwards)."""
    gateway = stack.services["gateway"]
    saved = dict(gateway.env)
    gateway.env["PODBAY_GATEWAY_HOSTS_FILE"] = str(_hosts_file(test_root))
    stack.restart("gateway")
    try:
        yield stack
    finally:
        gateway.env.clear()
        gateway.env.update(saved)
        stack.restart("gateway")


@pytest.fixture(scope="module")
def stack_b(test_root: Path) -> Iterator[Stack]:
    """A second stack with its own data directory, servers and ports (stopped with a purge by the test)."""
    hosts = _hosts_file(Path(tempfile.mkdtemp(prefix="h", dir=test_root)))
    with own_stack(test_root, {"PODBAY_GATEWAY_HOSTS_FILE": str(hosts)}, prefix="b") as running:
        yield running


def _binding(stack: Any, sandbox: dict[str, Any]) -> NetBinding:
    for f in bindings_dir(Path(stack.data_dir), sandbox["node_id"]).glob("*.json"):
        b = NetBinding.model_validate_json(f.read_text())
        if b.sandbox_id == sandbox["id"]:
            return b
    raise AssertionError(f"no binding for {sandbox['id']}")


def _ifindex(tap: str) -> int:
    return int(Path(f"/sys/class/net/{tap}/ifindex").read_text())


def _table_exists(data_dir: Path) -> bool:
    return subprocess.run(["nft", "list", "table", "inet", nft_table(data_dir)], capture_output=True).returncode == 0


def _create(c: httpx.Client) -> dict[str, Any]:
    r = c.post("/v1/sandboxes", json={"template": "base", "network": {"allow": [{"domain": _NAME}]}})
    assert r.status_code == 201, r.text
    assert r.json()["state"] == "running", r.text
    return dict(r.json())


def test_two_stacks_keep_their_own_taps_rules_and_addresses_and_a_purge_removes_only_its_own(
        stack_a: Any, stack_b: Stack) -> None:
    a_dir, b_dir = Path(stack_a.data_dir), Path(stack_b.data_dir)
    assert tap_prefix(a_dir) != tap_prefix(b_dir) and nft_table(a_dir) != nft_table(b_dir)
    with api_client(stack_a) as ca, api_client(stack_b) as cb:
        a = _create(ca)
        try:
            b = _create(cb)  # the stack started second creates too (before: "tap busy", HTTP 500)
            ba, bb = _binding(stack_a, a), _binding(stack_b, b)
            assert ba.tap.startswith(tap_prefix(a_dir)) and bb.tap.startswith(tap_prefix(b_dir))
            assert ba.tap != bb.tap and ba.guest_addr != bb.guest_addr and ba.host_addr != bb.host_addr
            a_index = _ifindex(ba.tap)
            assert _table_exists(a_dir) and _table_exists(b_dir)
            # Each gateway answers its own guest, through its own stack's rules.
            for c, sid in ((ca, a["id"]), (cb, b["id"])):
                assert sh(c, sid, _RESOLVE).strip() == _ADDR
                assert sh(c, sid, "echo ok").strip() == "ok"

            stack_b.stop(purge=True)  # what `podbay down --purge` does to a stack's host state

            assert not _table_exists(b_dir), "the purged stack's nftables table is left behind"
            assert not Path(f"/sys/class/net/{bb.tap}").exists()
            # The other stack is untouched: its table, its tap (the same device), its guest's exec and DNS.
            assert _table_exists(a_dir)
            assert _ifindex(ba.tap) == a_index
            assert sh(ca, a["id"], "echo still").strip() == "still"
            assert sh(ca, a["id"], _RESOLVE).strip() == _ADDR
        finally:
            ca.delete(f"/v1/sandboxes/{a['id']}")
