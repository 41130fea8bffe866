"""Per-sandbox certificate authorities (docs/DESIGN.md §6): the gateway terminates TLS towards destinations that
have credentials with a certificate signed by a CA that only this sandbox (generation) trusts, so a key
leaked from one sandbox's gateway session is worthless for every other sandbox.

ECDSA P-256 keys: generation takes about a millisecond (RSA-2048 takes tens), which matters on the create
path. The certificate follows RFC 5280 for a CA (basicConstraints CA:TRUE, pathlen 0; keyUsage keyCertSign
and cRLSign); it is valid from one hour before now (guest clocks may lag) for ``days`` days.
"""

from __future__ import annotations

import datetime as dt

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["new_sandbox_ca"]


def new_sandbox_ca(sandbox_id: str, generation: int, *, days: int = 365) -> tuple[bytes, bytes]:
    """A fresh CA for ``sandbox_id`` at ``generation``: ``(key_pem, cert_pem)``, PKCS#8 key and X.509 cert.

    The subject is ``CN=podbay sandbox <id> g<generation>``; nothing secret is in it.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "podbay"),
        x509.NameAttribute(NameOID.COMMON_NAME, f"podbay sandbox {sandbox_id} g{generation}"[:64]),
    ])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)
