"""Certificates of the API's TLS edge (services/api/edge/tls.py; docs/operations.md "Ports by hostname").

E2B's SDK builds a guest port's address as ``https://{port}-{sandboxID}.{domain}`` (``Sandbox.get_host``), so
the edge must present, for every such name, a certificate the client trusts. Two ways:

* an operator's certificate and key (a wildcard ``*.DOMAIN`` certificate from their CA), served for every name;
* a CA (certificate and key) from which the edge mints, per TLS server name (SNI) under the configured domains,
  a leaf certificate naming exactly that host. ``podbay up`` makes one under its data directory
  (:func:`ensure_dev_ca`) and ``podbay env --e2b`` points the shell's trust at it.

Why per-name leaves rather than one wildcard in the dev stack: podbay's sandbox ids hold ``_`` (``sbx_3f2a...``),
and OpenSSL (so Python, curl and Node) lets a ``*`` stand only for letters, digits and ``-``: a ``*.e2b.localhost``
certificate never matches ``8000-sbx_3f2a.e2b.localhost``, while a certificate naming that host exactly does.
OpenSSL also refuses a wildcard directly under one label (``*.localhost``), so the dev domain has two labels.

Keys are ECDSA P-256 (a leaf takes about a millisecond to make); leaves are valid from one hour before now
(clock skew) for :data:`LEAF_DAYS` days and are kept in a bounded cache (:class:`EdgeCertificates`).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
import tempfile
from collections import OrderedDict
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["new_edge_ca", "mint_leaf", "ensure_dev_ca", "write_trust_bundle", "EdgeCertificates", "domain_host",
           "LEAF_DAYS", "SNI_ATTR"]

LEAF_DAYS = 90
#: Attribute set on the server-side ``ssl.SSLObject`` by the SNI callback: the server name the client asked
#: for, lower case (``""`` when it sent none). The edge compares it with the request's Host.
SNI_ATTR = "podbay_server_name"
_CACHE_MAX = 4096


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_edge_ca(common_name: str = "podbay edge CA", *, days: int = 3650) -> tuple[bytes, bytes]:
    """A fresh CA for the edge: ``(key_pem, cert_pem)`` (PKCS#8 key, X.509 cert; CA:TRUE, pathlen 0, keyCertSign).

    Its name constraints limit it to ``.localhost`` names: a dev CA a shell trusts can never vouch for a real
    site, even if its key leaks."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "podbay"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.NameConstraints(permitted_subtrees=[x509.DNSName("localhost")],
                                            excluded_subtrees=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _pem_key(key), cert.public_bytes(serialization.Encoding.PEM)


def mint_leaf(ca_key_pem: bytes, ca_cert_pem: bytes, names: list[str], *,
              days: int = LEAF_DAYS) -> tuple[bytes, bytes]:
    """A server certificate for ``names`` (DNS names; IP literals become IP SANs) signed by the CA:
    ``(key_pem, chain_pem)``, the chain being the leaf then the CA. Raises ValueError for a bad CA or name."""
    ca_key = serialization.load_pem_private_key(ca_key_pem, None)
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]  # the CA's key type is whatever it was made with
                       critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]  # same
    )
    return _pem_key(key), leaf.public_bytes(serialization.Encoding.PEM) + ca_cert_pem


def ensure_dev_ca(data_dir: Path) -> tuple[Path, Path]:
    """The dev stack's edge CA under ``data_dir``: ``(cert_path, key_path)`` = ``edge-ca.pem``, ``edge-ca.key``
    (0600), made on first use and kept, so that a shell that trusts it keeps trusting it across restarts."""
    cert, key = data_dir / "edge-ca.pem", data_dir / "edge-ca.key"
    if not (cert.is_file() and key.is_file()):
        data_dir.mkdir(parents=True, exist_ok=True)
        key_pem, cert_pem = new_edge_ca()
        _write(key, key_pem, 0o600)
        _write(cert, cert_pem, 0o644)
    return cert, key


def write_trust_bundle(path: Path, ca_cert: Path) -> Path:
    """``path`` rewritten as the system's CA bundle (Python's default verify paths, else certifi) followed by
    ``ca_cert``: for ``SSL_CERT_FILE``/``REQUESTS_CA_BUNDLE``, which replace (not extend) a client's roots."""
    system = b""
    paths = ssl.get_default_verify_paths()
    for candidate in (paths.cafile, paths.openssl_cafile):
        if candidate and Path(candidate).is_file():
            system = Path(candidate).read_bytes()
            break
    if not system:
        try:
            import certifi

            system = Path(certifi.where()).read_bytes()
        except ImportError:  # no system roots at all: the stack's CA alone
            system = b""
    _write(path, system.rstrip(b"\n") + b"\n" + ca_cert.read_bytes(), 0o644)
    return path


def _write(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def domain_host(domain: str) -> str:
    """The host part of a configured domain (``e2b.localhost:8443`` -> ``e2b.localhost``), lower case."""
    return domain.rpartition(":")[0].lower() if domain.rpartition(":")[2].isdigit() else domain.lower()


class EdgeCertificates:
    """The edge's server :class:`ssl.SSLContext` (TLS 1.2+, HTTP/1.1 by ALPN).

    Either ``cert_file`` + ``key_file`` (served for every name) or ``ca_cert_file`` + ``ca_key_file`` (a leaf
    per server name under one of ``domains``, minted on the first handshake that asks for it and cached, at
    most 4096 names, least recently used first out). A server name outside the domains, or none, gets the
    default leaf (named after the first domain), which a client verifying another name rejects.

    The SNI callback also records the asked-for name on the connection (:data:`SNI_ATTR`)."""

    def __init__(self, *, domains: list[str], cert_file: Path | None = None, key_file: Path | None = None,
                 ca_cert_file: Path | None = None, ca_key_file: Path | None = None) -> None:
        self.domains = [d.strip(".").lower() for d in domains if d]
        self._ca: tuple[bytes, bytes] | None = None
        self._cache: OrderedDict[str, ssl.SSLContext] = OrderedDict()
        if cert_file and key_file:
            self.context = self._new_context()
            self.context.load_cert_chain(cert_file, key_file)
        elif ca_cert_file and ca_key_file:
            self._ca = (ca_key_file.read_bytes(), ca_cert_file.read_bytes())
            first = self.domains[0] if self.domains else "localhost"
            self.context = self._leaf_context([first, f"*.{first}"])
        else:
            raise ValueError("the TLS edge needs a certificate and key, or a CA certificate and key")
        self.context.sni_callback = self._on_sni

    @staticmethod
    def _new_context() -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])  # the edge's server speaks HTTP/1.1 (and WebSocket) over TLS
        return ctx

    def _leaf_context(self, names: list[str]) -> ssl.SSLContext:
        assert self._ca is not None
        key_pem, chain_pem = mint_leaf(self._ca[0], self._ca[1], names)
        ctx = self._new_context()
        # load_cert_chain takes files only; a private temporary directory holds them for the call.
        with tempfile.TemporaryDirectory() as tmp:
            kp, cp = Path(tmp) / "k.pem", Path(tmp) / "c.pem"
            kp.write_bytes(key_pem)
            cp.write_bytes(chain_pem)
            ctx.load_cert_chain(cp, kp)
        return ctx

    def covers(self, name: str) -> bool:
        """Whether ``name`` is one of the domains or a name under one."""
        return any(name == d or name.endswith("." + d) for d in self.domains)

    def context_for(self, name: str) -> ssl.SSLContext | None:
        """The minted context for server name ``name`` (None: the default context serves it)."""
        if self._ca is None or not self.covers(name):
            return None
        ctx = self._cache.get(name)
        if ctx is None:
            ctx = self._leaf_context([name])
            self._cache[name] = ctx
            while len(self._cache) > _CACHE_MAX:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(name)
        return ctx

    def _on_sni(self, conn: ssl.SSLObject | ssl.SSLSocket, server_name: str | None,
                _ctx: ssl.SSLContext) -> int | None:
        name = (server_name or "").rstrip(".").lower()
        setattr(conn, SNI_ATTR, name)
        try:
            ctx = self.context_for(name) if name else None
        except ValueError:
            return ssl.ALERT_DESCRIPTION_INTERNAL_ERROR
        if ctx is not None:
            conn.context = ctx
        return None
