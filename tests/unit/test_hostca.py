"""What the host trusts beyond the public roots reaches every guest, and the gateway verifies upstream TLS
against the host's bundle (podbay.hostca; docs/egress.md, "Guest trust"): detection by `podbay up`, the
operator's file as the node agent reads it, and what the node agent tells each guest."""

from __future__ import annotations

from pathlib import Path

import certifi
import pytest

from podbay import hostca
from podbay.config import ConfigError, Settings
from podbay.contracts.egress import NetBinding
from podbay.devstack.stack import guest_ca_for
from podbay.sandbox_ca import new_sandbox_ca
from podbay_nodeagent.net.network import SandboxNetwork
from podbay_nodeagent.ops.sandboxes import SandboxManager
from podbay_nodeagent.storage.store import NodeStore
from podbay_nodeagent.vm.vmdriver import VmDriver
from podbay_nodeagent.vm.vmm import QemuVmm

PUBLIC = Path(certifi.where()).read_bytes()


def _private_ca(name: str) -> bytes:
    """A CA certificate no public set holds (PEM)."""
    return new_sandbox_ca(name, 1)[1]


def _ders(pem: bytes) -> list[bytes]:
    return hostca.der_certificates(pem)


def test_pem_blocks_round_trip_and_text_between_them_is_ignored() -> None:
    a, b = _private_ca("a"), _private_ca("b")
    ders = _ders(b"# comment\n" + a + b"text\n" + b)
    assert len(ders) == 2
    assert hostca.to_pem(ders).encode() == a + b  # the same encoding as cryptography's
    assert hostca.der_certificates(b"no certificate here") == []
    with pytest.raises(ValueError):
        hostca.der_certificates(b"-----BEGIN CERTIFICATE-----\nAAA\n-----END CERTIFICATE-----\n")


def test_what_the_host_trusts_beyond_the_public_roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostca, "DISTRO_ROOT_DIRS", (tmp_path / "distro",))
    inspecting, local = _private_ca("inspecting"), _private_ca("local")
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes(PUBLIC + inspecting + local + inspecting)
    # The public roots drop out, duplicates too; the order is the bundle's.
    assert hostca.host_extra_cas(bundle) == _ders(inspecting + local)
    bundle.write_bytes(PUBLIC)
    assert hostca.host_extra_cas(bundle) == []
    # A root the distribution ships (one certifi may have dropped since) counts as public.
    (tmp_path / "distro").mkdir()
    (tmp_path / "distro" / "Old_Root.crt").write_bytes(local)
    bundle.write_bytes(PUBLIC + local + inspecting)
    assert hostca.host_extra_cas(bundle) == _ders(inspecting)


def test_the_host_bundle_is_ssl_cert_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes(PUBLIC)
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    assert hostca.host_bundle() == bundle


def test_the_stack_gives_guests_the_hosts_extra_cas(tmp_path: Path) -> None:
    inspecting = _private_ca("inspecting")
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes(PUBLIC + inspecting)
    path = guest_ca_for(tmp_path / "data", {"SSL_CERT_FILE": str(bundle)})
    assert path == tmp_path / "data" / "guest-ca.pem" and path.read_bytes() == inspecting
    assert hostca.load_guest_ca(path) == inspecting.decode()
    # Nothing beyond the public roots: nothing to add.
    bundle.write_bytes(PUBLIC)
    assert guest_ca_for(tmp_path / "other", {"SSL_CERT_FILE": str(bundle)}) is None
    # The operator's own setting wins, including an empty one (none at all).
    bundle.write_bytes(PUBLIC + inspecting)
    for given in ("", str(tmp_path / "mine.pem")):
        assert guest_ca_for(tmp_path / "third", {"SSL_CERT_FILE": str(bundle), "PODBAY_GUEST_CA_FILE": given}) is None
    assert not (tmp_path / "third" / "guest-ca.pem").exists()


def test_the_guest_ca_file_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _private_ca("a"), _private_ca("b")
    f = tmp_path / "ca.pem"
    f.write_bytes(b"corporate CAs\n" + a + b"\n\n" + b)
    assert hostca.load_guest_ca(f) == (a + b).decode()
    assert hostca.load_guest_ca(None) is None
    for bad in (b"", b"not PEM", b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"):
        f.write_bytes(bad)
        with pytest.raises(ValueError, match=str(f)):
            hostca.load_guest_ca(f)
    with pytest.raises(ValueError, match="cannot|No such file"):
        hostca.load_guest_ca(tmp_path / "missing.pem")
    f.write_bytes(PUBLIC)  # a whole bundle is too much for one channel frame
    with pytest.raises(ValueError, match="at most"):
        hostca.load_guest_ca(f)
    monkeypatch.setenv("PODBAY_GUEST_CA_FILE", "")
    assert Settings().guest_ca_file is None


def test_the_gateway_verifies_upstream_against_the_hosts_bundle(tmp_path: Path) -> None:
    inspecting, private = _private_ca("inspecting"), _private_ca("private service")
    host, extra = tmp_path / "host.crt", tmp_path / "extra.pem"
    host.write_bytes(PUBLIC + inspecting)
    extra.write_bytes(private)
    assert _ders(hostca.upstream_bundle(extra, host)) == _ders(PUBLIC + inspecting + private)
    assert _ders(hostca.upstream_bundle(None, host)) == _ders(PUBLIC + inspecting)
    # A host without a usable bundle: the public roots.
    host.write_bytes(b"")
    assert _ders(hostca.upstream_bundle(extra, host)) == _ders(PUBLIC + private)
    assert _ders(hostca.upstream_bundle(None, tmp_path / "missing.crt")) == _ders(PUBLIC)


def _manager(tmp_path: Path, **settings: object) -> SandboxManager:
    s = Settings(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache", accel="tcg", **settings)
    store = NodeStore(s.data_dir, s.node_id, 1)
    return SandboxManager(s, None, None, None, store, VmDriver(s, store, QemuVmm()),  # type: ignore[arg-type]
                          SandboxNetwork(s))


def test_every_guest_net_carries_the_nodes_extra_cas(tmp_path: Path) -> None:
    cert = new_sandbox_ca("sbx_1", 1)[1].decode()
    binding = NetBinding(sandbox_id="sbx_1", generation=1, tap="pbt0", host_addr="10.88.0.1",
                         guest_addr="10.88.0.2", prefix_len=30, ca_path="/x", ca_cert_pem=cert)
    assert _manager(tmp_path / "none").guest_net(binding).extra_ca_pem is None
    inspecting = _private_ca("inspecting")
    f = tmp_path / "ca.pem"
    f.write_bytes(inspecting)
    net = _manager(tmp_path / "one", guest_ca_file=f).guest_net(binding)
    assert net.extra_ca_pem == inspecting.decode() and net.ca_cert_pem == cert and net.address == "10.88.0.2"
    f.write_bytes(b"not PEM")
    with pytest.raises(ConfigError, match="PODBAY_GUEST_CA_FILE"):
        _manager(tmp_path / "bad", guest_ca_file=f)
