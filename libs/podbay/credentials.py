"""Credential values at rest (docs/DESIGN.md §6): sealed on write by the API, revealed only by the gateway at the
moment it injects one. No API returns a value.

Backends (``PODBAY_CREDENTIAL_BACKEND``):

* ``pg`` (embedded default): AES-256-GCM (NIST SP 800-38D) with the key from ``PODBAY_CREDENTIAL_KEY``; the
  row's ``ciphertext`` column holds a 12-byte random nonce followed by ciphertext and tag, and the associated
  data is the credential id, so a ciphertext copied onto another row does not decrypt.
* ``openbao``: OpenBao's KV version 2 engine through hvac, one secret per credential at
  ``podbay/<tenant>/<credential id>`` under ``openbao_mount``; the row's ``secret_ref`` holds that path.

Errors: :class:`podbay.errors.StorageError` (retryable) when the backend cannot be reached or refuses, and
:class:`CredentialUnreadable` when a stored value cannot be decrypted or is gone.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
from dataclasses import dataclass
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from podbay.config import Settings
from podbay.errors import PodbayError, StorageError

__all__ = ["Sealed", "CredentialStore", "PgCredentialStore", "OpenBaoCredentialStore", "CredentialUnreadable",
           "open_store", "new_key"]


class CredentialUnreadable(PodbayError):
    """A stored credential value cannot be decrypted or no longer exists in its backend."""

    code = "credential_unreadable"
    http_status = 500


@dataclass(frozen=True)
class Sealed:
    """What a ``credentials`` row stores for a value: exactly one of the two is set."""

    backend: str
    ciphertext: bytes | None = None
    secret_ref: str | None = None


class CredentialStore(Protocol):
    """Seal, reveal and destroy credential values."""

    backend: str

    async def seal(self, cred_id: str, tenant_id: str, value: str) -> Sealed: ...

    async def reveal(self, cred_id: str, tenant_id: str, sealed: Sealed) -> str: ...

    async def destroy(self, cred_id: str, tenant_id: str, sealed: Sealed) -> None: ...


def new_key() -> str:
    """A new random AES-256 key, base64-encoded, for ``PODBAY_CREDENTIAL_KEY``."""
    return base64.b64encode(os.urandom(32)).decode()


class PgCredentialStore:
    """AES-256-GCM sealing into the ``credentials.ciphertext`` column."""

    backend = "pg"

    def __init__(self, key_b64: str) -> None:
        try:
            key = base64.b64decode(key_b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("PODBAY_CREDENTIAL_KEY is not base64") from exc
        if len(key) != 32:
            raise ValueError("PODBAY_CREDENTIAL_KEY must be 32 bytes (base64 of 32 random bytes)")
        self._aead = AESGCM(key)

    async def seal(self, cred_id: str, tenant_id: str, value: str) -> Sealed:
        nonce = os.urandom(12)
        return Sealed("pg", ciphertext=nonce + self._aead.encrypt(nonce, value.encode(), cred_id.encode()))

    async def reveal(self, cred_id: str, tenant_id: str, sealed: Sealed) -> str:
        blob = sealed.ciphertext or b""
        try:
            return self._aead.decrypt(blob[:12], blob[12:], cred_id.encode()).decode()
        except (InvalidTag, ValueError) as exc:
            raise CredentialUnreadable(f"credential {cred_id} does not decrypt with this key") from exc

    async def destroy(self, cred_id: str, tenant_id: str, sealed: Sealed) -> None:
        return None  # the row's soft delete drops the ciphertext with it


class OpenBaoCredentialStore:
    """OpenBao KV v2 through hvac (synchronous: each call runs in a worker thread)."""

    backend = "openbao"

    def __init__(self, addr: str, token: str, mount: str = "secret") -> None:
        import hvac  # only this backend needs it at import time

        if not addr or not token:
            raise ValueError("the openbao backend needs PODBAY_OPENBAO_ADDR and PODBAY_OPENBAO_TOKEN")
        self._client = hvac.Client(url=addr, token=token, timeout=10)
        self._mount = mount

    @staticmethod
    def _path(cred_id: str, tenant_id: str) -> str:
        return f"podbay/{tenant_id}/{cred_id}"

    async def _call(self, what: str, fn, *args, **kwargs):  # type: ignore[no-untyped-def]  # forwards any hvac call: its arguments and result are hvac's, untyped
        import hvac.exceptions
        import requests

        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except hvac.exceptions.InvalidPath as exc:
            raise CredentialUnreadable(f"openbao {what}: no such secret") from exc
        except (hvac.exceptions.VaultError, requests.RequestException) as exc:
            raise StorageError(f"openbao {what} failed: {exc}") from exc

    async def seal(self, cred_id: str, tenant_id: str, value: str) -> Sealed:
        path = self._path(cred_id, tenant_id)
        await self._call("write", self._client.secrets.kv.v2.create_or_update_secret, path=path,
                         secret={"value": value}, mount_point=self._mount)
        return Sealed("openbao", secret_ref=path)

    async def reveal(self, cred_id: str, tenant_id: str, sealed: Sealed) -> str:
        resp = await self._call("read", self._client.secrets.kv.v2.read_secret_version, path=sealed.secret_ref,
                                mount_point=self._mount, raise_on_deleted_version=True)
        try:
            return str(resp["data"]["data"]["value"])
        except (KeyError, TypeError) as exc:
            raise CredentialUnreadable(f"openbao secret for {cred_id} has no value") from exc

    async def destroy(self, cred_id: str, tenant_id: str, sealed: Sealed) -> None:
        await self._call("delete", self._client.secrets.kv.v2.delete_metadata_and_all_versions,
                         path=sealed.secret_ref or self._path(cred_id, tenant_id), mount_point=self._mount)


def open_store(settings: Settings, backend: str | None = None) -> CredentialStore:
    """The store for ``backend`` (default: ``settings.credential_backend``). ``ValueError`` on bad config.
    A row records its own backend, so a reader opens the store the row names."""
    which = backend or settings.credential_backend
    if which == "openbao":
        return OpenBaoCredentialStore(settings.openbao_addr, settings.openbao_token, settings.openbao_mount)
    return PgCredentialStore(settings.credential_key)
