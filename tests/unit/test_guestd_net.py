"""guestd's network and trust-store setup (``after_restore.net``): the op against the recording fake, the
trust-bundle install on a scratch tree, and the ioctl structures' layout."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from podbay.channel.client import GuestChannel
from podbay.contracts.channel import GuestNet, Op
from podbay.errors import InvalidRequest
from podbay.sandbox_ca import new_sandbox_ca
from podbay_guestd import net as guest_net


@pytest.fixture(scope="module")
def guestd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("guestd_net")
    sock, log = d / "ch.sock", d / "system.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "podbay_guestd", "--listen", str(sock), "--fake-system", str(log)],
        stderr=subprocess.DEVNULL,
    )
    yield sock, log
    proc.terminate()
    proc.wait(10)


@pytest.fixture
async def ch(guestd: tuple[Path, Path]) -> AsyncIterator[GuestChannel]:
    channel = await GuestChannel.connect(guestd[0], timeout_s=30)
    yield channel
    await channel.close()


def _calls(log: Path) -> list[list[object]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


async def test_after_restore_configures_the_network(ch: GuestChannel, guestd: tuple[Path, Path]) -> None:
    cert = new_sandbox_ca("sbx_1", 1)[1].decode()
    net = GuestNet(address="10.88.0.6", gateway="10.88.0.5", dns=["10.88.0.5"], ca_cert_pem=cert)
    res = await ch.after_restore(net=net)
    assert res.net_interface == "eth0"
    assert ["configure_net", {"address": "10.88.0.6", "prefix_len": 30, "gateway": "10.88.0.5",
                              "dns": ["10.88.0.5"], "ca_cert_pem": cert, "extra_ca_pem": None}] in _calls(guestd[1])
    # The node's extra CAs (GUEST_CA_FILE) come along when it has some.
    extra = new_sandbox_ca("inspecting", 1)[1].decode() + new_sandbox_ca("local", 1)[1].decode()
    await ch.after_restore(net=net.model_copy(update={"extra_ca_pem": extra}))
    assert ["configure_net", {"address": "10.88.0.6", "prefix_len": 30, "gateway": "10.88.0.5",
                              "dns": ["10.88.0.5"], "ca_cert_pem": cert, "extra_ca_pem": extra}] in _calls(guestd[1])
    # Without ``net`` nothing about the network is touched (the warm claim and resume hot paths).
    before = len(_calls(guestd[1]))
    assert (await ch.after_restore(time_ns=1)).net_interface is None
    assert not [c for c in _calls(guestd[1])[before:] if c[0] == "configure_net"]


async def test_bad_network_arguments_are_invalid(ch: GuestChannel, guestd: tuple[Path, Path]) -> None:
    good = {"address": "10.88.0.2", "gateway": "10.88.0.1", "dns": ["10.88.0.1"]}
    before = len(_calls(guestd[1]))
    for bad in ({**good, "address": "10.88.0.300"}, {**good, "gateway": "host"}, {**good, "prefix_len": 31},
                {**good, "dns": ["a", "b", "c", "d"]}, {**good, "ca_cert_pem": "not a certificate"}, "10.0.0.2",
                {**good, "address": "010.88.0.2"}, {**good, "extra_ca_pem": "not a certificate"},
                {**good, "extra_ca_pem": new_sandbox_ca("x", 1)[1].decode() + "trailing text"},
                {**good, "extra_ca_pem": new_sandbox_ca("x", 1)[1].decode() * 250}, {**good, "extra_ca_pem": 1}):
        stream = ch.open_stream(Op.AFTER_RESTORE, {"hostname": "changed", "net": bad})
        with pytest.raises(InvalidRequest):
            await ch.finish(stream, 10)
    # Validated before anything changed: not even the hostname.
    assert not [c for c in _calls(guestd[1])[before:] if c[0] in ("configure_net", "set_hostname")]


def test_the_trust_bundle_is_the_templates_plus_one_sandbox_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = tmp_path / "etc/ssl/certs/ca-certificates.crt"
    bundle.parent.mkdir(parents=True)
    original = new_sandbox_ca("public-root", 1)[1]
    bundle.write_bytes(original)
    monkeypatch.setattr(guest_net, "BUNDLE_PATH", str(bundle))
    monkeypatch.setattr(guest_net, "PRISTINE_BUNDLE_PATH", str(bundle) + ".podbay-orig")
    monkeypatch.setattr(guest_net, "SANDBOX_CA_PATH", str(tmp_path / "usr/local/share/ca-certificates/podbay-sandbox.crt"))
    first, second = new_sandbox_ca("sbx_a", 1)[1], new_sandbox_ca("sbx_a", 2)[1]
    guest_net.install_ca(first.decode())
    assert bundle.read_bytes() == original + first
    assert (tmp_path / "usr/local/share/ca-certificates/podbay-sandbox.crt").read_bytes() == first
    # A second call (fork child, rollback) replaces the sandbox CA; it never piles up.
    guest_net.install_ca(second.decode())
    assert bundle.read_bytes() == original + second
    assert Path(str(bundle) + ".podbay-orig").read_bytes() == original


def test_extra_cas_sit_between_the_templates_bundle_and_the_sandbox_ca(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = tmp_path / "etc/ssl/certs/ca-certificates.crt"
    bundle.parent.mkdir(parents=True)
    original = new_sandbox_ca("public-root", 1)[1]
    bundle.write_bytes(original)
    local = tmp_path / "usr/local/share/ca-certificates"
    monkeypatch.setattr(guest_net, "BUNDLE_PATH", str(bundle))
    monkeypatch.setattr(guest_net, "PRISTINE_BUNDLE_PATH", str(bundle) + ".podbay-orig")
    monkeypatch.setattr(guest_net, "SANDBOX_CA_PATH", str(local / "podbay-sandbox.crt"))
    monkeypatch.setattr(guest_net, "EXTRA_CA_PATH", str(local / "podbay-extra.crt"))
    mine, extra = new_sandbox_ca("sbx_a", 1)[1], new_sandbox_ca("inspecting", 1)[1]
    guest_net.install_ca(mine.decode(), extra.decode())
    assert bundle.read_bytes() == original + extra + mine  # the sandbox CA stays last
    assert (local / "podbay-extra.crt").read_bytes() == extra
    # Each call replaces both; a node without extra CAs takes them away (a guest moved to another node).
    other = new_sandbox_ca("sbx_a", 2)[1]
    guest_net.install_ca(other.decode(), extra.decode())
    assert bundle.read_bytes() == original + extra + other
    guest_net.install_ca(other.decode(), None)
    assert bundle.read_bytes() == original + other and not (local / "podbay-extra.crt").exists()


def test_ioctl_structures_have_the_kernels_layout(tmp_path: Path) -> None:
    assert len(guest_net._ifreq("eth0", guest_net._sockaddr_in("10.0.0.1"))) == 40  # struct ifreq
    assert len(guest_net._rtentry("10.88.0.1")) == 120  # struct rtentry on x86_64
    rt = guest_net._rtentry("10.88.0.1")
    assert rt[24:32] == bytes([2, 0, 0, 0, 10, 88, 0, 1])  # rt_gateway: AF_INET, port 0, the address
    assert int.from_bytes(rt[56:58], "little") == guest_net.RTF_UP | guest_net.RTF_GATEWAY
    assert guest_net._netmask(30) == "255.255.255.252" and guest_net._netmask(8) == "255.0.0.0"
    sysnet = tmp_path / "net"
    for name, device in (("lo", False), ("eth0", True), ("dummy0", False)):
        (sysnet / name).mkdir(parents=True)
        if device:
            (sysnet / name / "device").mkdir()
    assert guest_net.nic_name(str(sysnet)) == "eth0"
    (sysnet / "eth0" / "device").rmdir()
    with pytest.raises(OSError):
        guest_net.nic_name(str(sysnet))
