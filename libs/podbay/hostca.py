"""CA certificates beyond the public roots: the host's trust, the extra CAs every guest trusts, and the
bundle the gateway verifies upstream TLS against (docs/egress.md, "Guest trust").

A network that inspects TLS re-signs every server certificate with its own CA, which the host trusts (its
bundle, ``SSL_CERT_FILE`` or OpenSSL's default file) and the public roots do not. A guest's TLS passes the
gateway untouched unless a credential applies, so the guest sees that CA's certificates and must trust it
too; where the gateway terminates TLS it verifies the upstream itself, against the host's bundle.

- :func:`host_bundle` is the file the host's OpenSSL trusts; :func:`upstream_bundle` is what the gateway
  verifies against (that file, else certifi's roots, plus an operator's extra bundle).
- :func:`host_extra_cas` is what the host trusts beyond the public roots (certifi's, and the distribution's
  copy of the same Mozilla set): what ``podbay up`` adds to every guest when the operator names no file.
- :func:`load_guest_ca` reads ``GUEST_CA_FILE`` into the PEM text the node agent sends to each guest.

Certificates are compared by the SHA-256 of their DER encoding.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import ssl
from collections.abc import Iterable
from pathlib import Path

import certifi
from cryptography import x509

from podbay.contracts.channel import GUEST_EXTRA_CA_MAX

__all__ = ["MAX_GUEST_CA_BYTES", "DISTRO_ROOT_DIRS", "der_certificates", "to_pem", "host_bundle",
           "public_roots", "host_extra_cas", "load_guest_ca", "upstream_bundle"]

#: Largest PEM text of extra guest CAs (``GuestNet.extra_ca_pem``, sent in one guest-channel frame).
MAX_GUEST_CA_BYTES = GUEST_EXTRA_CA_MAX

#: Where distributions keep their copy of the Mozilla root set, which can hold roots certifi has since
#: dropped (Debian and Ubuntu: ``ca-certificates``). Local additions live elsewhere.
DISTRO_ROOT_DIRS = (Path("/usr/share/ca-certificates/mozilla"),)

_PEM_BLOCK = re.compile(rb"-----BEGIN CERTIFICATE-----\s*([A-Za-z0-9+/=\s]+?)-----END CERTIFICATE-----")


def der_certificates(data: bytes) -> list[bytes]:
    """The DER bytes of every PEM certificate block in ``data``, in order (text between blocks is ignored; the
    certificates are not parsed). Raises ``ValueError`` for a block whose base64 does not decode."""
    try:
        return [base64.b64decode(b"".join(m.group(1).split()), validate=True) for m in _PEM_BLOCK.finditer(data)]
    except binascii.Error as exc:
        raise ValueError(f"a PEM certificate block is not base64: {exc}") from exc


def to_pem(ders: Iterable[bytes]) -> str:
    """DER certificates as PEM text, one block after another (64-column base64), each ending in a newline."""
    out = []
    for der in ders:
        b64 = base64.b64encode(der).decode()
        lines = "\n".join(b64[i:i + 64] for i in range(0, len(b64), 64))
        out.append(f"-----BEGIN CERTIFICATE-----\n{lines}\n-----END CERTIFICATE-----\n")
    return "".join(out)


def host_bundle() -> Path | None:
    """The CA bundle file this host's OpenSSL trusts: ``SSL_CERT_FILE`` when set, else OpenSSL's default file
    (``ssl.get_default_verify_paths().cafile``, which exists or is None)."""
    cafile = ssl.get_default_verify_paths().cafile
    return Path(cafile) if cafile else None


def public_roots() -> set[bytes]:
    """SHA-256 fingerprints (of the DER) of the public roots: certifi's bundle plus the distribution's Mozilla
    set (:data:`DISTRO_ROOT_DIRS`, where present; unreadable files there are skipped)."""
    roots = {hashlib.sha256(d).digest() for d in der_certificates(Path(certifi.where()).read_bytes())}
    for directory in DISTRO_ROOT_DIRS:
        for f in sorted(directory.glob("*.crt")) if directory.is_dir() else []:
            try:
                roots.update(hashlib.sha256(d).digest() for d in der_certificates(f.read_bytes()))
            except (OSError, ValueError):
                continue
    return roots


def host_extra_cas(bundle: Path | None = None) -> list[bytes]:
    """DER certificates of ``bundle`` (default :func:`host_bundle`) that are not public roots, in the bundle's
    order, without duplicates; empty when there is no bundle. Raises ``OSError``/``ValueError`` for a bundle
    that cannot be read or decoded."""
    path = bundle if bundle is not None else host_bundle()
    if path is None:
        return []
    public, seen, extra = public_roots(), set(), []
    for der in der_certificates(path.read_bytes()):
        fp = hashlib.sha256(der).digest()
        if fp not in public and fp not in seen:
            seen.add(fp)
            extra.append(der)
    return extra


def load_guest_ca(path: Path | None) -> str | None:
    """The PEM text of the certificates in ``path`` (``GUEST_CA_FILE``), re-encoded (comments and other text
    dropped), or None without a path. Raises ``ValueError`` (naming the path) when the file cannot be read,
    holds no certificate, one is not an X.509 certificate, or the text exceeds :data:`MAX_GUEST_CA_BYTES`."""
    if path is None:
        return None
    try:
        ders = der_certificates(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ValueError(f"guest CA file {path}: {exc}") from exc
    if not ders:
        raise ValueError(f"guest CA file {path}: no PEM certificate in it")
    pem = to_pem(ders)
    if len(pem) > MAX_GUEST_CA_BYTES:
        raise ValueError(f"guest CA file {path}: {len(ders)} certificates, {len(pem)} bytes of PEM; at most "
                         f"{MAX_GUEST_CA_BYTES} (name the extra CAs only, not a whole bundle)")
    for i, der in enumerate(ders):
        try:
            x509.load_der_x509_certificate(der)
        except ValueError as exc:
            raise ValueError(f"guest CA file {path}: certificate {i + 1} does not parse: {exc}") from exc
    return pem


def upstream_bundle(extra: Path | None = None, base: Path | None = None) -> bytes:
    """The PEM bundle the gateway verifies upstream TLS against: ``base`` (default :func:`host_bundle`; certifi's
    roots when there is none or it holds no certificate), plus ``extra`` (``GATEWAY_UPSTREAM_CA``). Raises
    ``OSError`` when ``extra`` cannot be read."""
    path = base if base is not None else host_bundle()
    data = b""
    if path is not None:
        try:
            data = path.read_bytes()
        except OSError:
            data = b""
    if b"-----BEGIN CERTIFICATE-----" not in data:
        data = Path(certifi.where()).read_bytes()
    if extra is not None:
        data = data.rstrip(b"\n") + b"\n" + extra.read_bytes()
    return data
