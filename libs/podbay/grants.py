"""Node grants: the API's per-request permission for one node call (docs/DESIGN.md §6).

Every request the API sends to a node agent's data plane carries a grant in :data:`HEADER`: who it is for
(tenant), what it may touch (one sandbox, or one build for build routes), the sandbox's generation, the kind
of operation (:class:`GrantKind`), an expiry and a unique id. Grants are signed with Ed25519: the API holds
the private key (``PODBAY_GRANT_SIGNING_KEY``), node agents only the public key
(``PODBAY_GRANT_VERIFY_KEY``), so neither a node nor anything else on the stack network can mint one. The
node checks a grant at the start of a request (:class:`GrantVerifier`); a stream may run past its expiry.

Wire form (ASCII, one header value)::

    <base64url(payload JSON)>.<base64url(64-byte Ed25519 signature over the payload bytes)>
    payload: {"t": tenant, "s": subject, "g": generation, "k": kind, "e": expiry (unix s), "j": jti}

Errors: :class:`GrantRefused` (HTTP 403, code ``grant_refused``) for a missing, malformed, badly signed,
expired, mismatched or replayed grant; :class:`GrantKeyError` (a ``ValueError``) for a key setting that is
not the base64 of a raw 32-byte Ed25519 key. Cost: about 100 µs for a mint plus a verify (reported in
tests/security/test_grants.py).
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from podbay.errors import GrantRefused

__all__ = ["HEADER", "BUILD_ID_HEADER", "TTL_S", "GrantKind", "Grant", "GrantRefused", "GrantKeyError", "GrantSigner",
           "GrantVerifier", "ReplayGuard", "new_keypair", "public_key_of"]

#: The request header that carries a grant.
HEADER = "x-podbay-grant"
#: The build id of a node's ``POST /internal/v1/templates/build`` (the subject of its ``build`` grant), sent
#: beside the grant because the node's gate does not read the form body; the route checks the two agree.
BUILD_ID_HEADER = "x-podbay-build-id"
#: Lifetime of a grant (seconds): it is checked when the node's request starts.
TTL_S = 60.0
# Clock skew tolerated between the API's and the node's clocks (seconds).
_SKEW_S = 5.0
_MAX_WIRE = 2048


class GrantKind(StrEnum):
    """The kinds of node operation a grant can allow, one per family of node routes
    (services/nodeagent/dataplane/grant_check.py maps each route to its kind)."""

    EXEC = "exec"            # /internal/v1/sandboxes/{id}/exec, /exec/stream
    FILES = "files"          # /internal/v1/sandboxes/{id}/files, /files/{stat,list,mkdir}
    PORTS = "ports"          # /internal/v1/sandboxes/{id}/ports (the guest's listening ports)
    TRAFFIC = "traffic"      # /internal/ports/{id}/{port} (HTTP and WebSocket to a guest port)
    ENVD = "envd"            # /internal/e2b/{id}/<envd route>
    COMPUTER = "computer"    # /internal/v1/sandboxes/{id}/computer/{screenshot,mouse,keyboard,cdp}
    FILL = "fill"            # /internal/v1/sandboxes/{id}/computer/fill (reveals credentials into a page)
    DIFF = "diff"            # /internal/v1/sandboxes/{id}/snapshots/{a}/diff/{b}
    BUILD = "build"          # /internal/v1/templates/build (subject: the build id)
    BUILD_STATUS = "build_status"  # /internal/v1/templates/building/{name} (subject: the template name)
    VOLUME = "volume"        # /internal/v1/volumes/{id}/content/{path,dir,file} (subject: the volume id)


class GrantKeyError(ValueError):
    """A grant key setting that is not the base64 of a raw 32-byte Ed25519 key."""


@dataclass(frozen=True, slots=True)
class Grant:
    """A verified grant. ``generation`` is 0 for build grants; ``expires`` is unix seconds."""

    tenant: str
    subject: str
    generation: int
    kind: GrantKind
    expires: float
    jti: str


def _b64e(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _b64d(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _raw_key(b64: str, what: str) -> bytes:
    if not b64.strip():
        raise GrantKeyError(f"{what} is not set")
    try:
        raw = base64.b64decode(b64.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise GrantKeyError(f"{what} is not base64") from exc
    if len(raw) != 32:
        raise GrantKeyError(f"{what} must be the base64 of a raw 32-byte Ed25519 key, not {len(raw)} bytes")
    return raw


def new_keypair() -> tuple[str, str]:
    """A new ``(signing key, verify key)``, each the base64 of the raw 32-byte Ed25519 key."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.b64encode(private).decode(), base64.b64encode(public).decode()


def public_key_of(signing_key: str) -> str:
    """The verify key (base64, raw 32 bytes) of ``signing_key`` (base64, raw 32 bytes). GrantKeyError if bad."""
    key = Ed25519PrivateKey.from_private_bytes(_raw_key(signing_key, "the grant signing key"))
    return base64.b64encode(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


class GrantSigner:
    """Mints grants (the API side). ``signing_key``: base64 of the raw 32-byte Ed25519 private key."""

    def __init__(self, signing_key: str, ttl_s: float = TTL_S) -> None:
        self._key = Ed25519PrivateKey.from_private_bytes(_raw_key(signing_key, "the grant signing key"))
        self.ttl_s = ttl_s

    def mint(self, tenant: str, subject: str, generation: int, kind: GrantKind, *, now: float | None = None) -> str:
        """The header value of a new grant for one request: ``tenant``'s ``kind`` operation on ``subject``
        (a sandbox id, or a build id / template name for build kinds) at ``generation``."""
        expires = int((time.time() if now is None else now) + self.ttl_s)
        payload = json.dumps({"t": tenant, "s": subject, "g": generation, "k": str(kind), "e": expires,
                              "j": secrets.token_urlsafe(12)}, separators=(",", ":")).encode()
        return f"{_b64e(payload)}.{_b64e(self._key.sign(payload))}"


class ReplayGuard:
    """The jtis seen within their lifetime, bounded at ``capacity``: :meth:`claim` is False for a jti seen
    before. Entries leave once their grant has expired; when ``capacity`` unexpired grants are held, new ones
    are refused (fail closed) rather than an old entry forgotten, which would let it be replayed."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[str, float] = OrderedDict()  # jti -> expiry; insertion order ~ expiry order

    def claim(self, jti: str, expires: float, now: float) -> bool:
        if jti in self._seen:
            return False
        if len(self._seen) >= self.capacity:
            self._prune(now)
            if len(self._seen) >= self.capacity:
                return False
        elif len(self._seen) % 1024 == 0:
            self._prune(now)
        self._seen[jti] = expires + _SKEW_S
        return True

    def _prune(self, now: float) -> None:
        # Expiries are nearly in insertion order (one TTL for every grant): stop at the first live one, so a
        # prune costs what it removes (OrderedDict: O(1) to look at and drop the oldest).
        seen = self._seen
        while seen:
            jti = next(iter(seen))
            if seen[jti] > now:
                break
            seen.popitem(last=False)

    def __len__(self) -> int:
        return len(self._seen)


class GrantVerifier:
    """Checks grants (the node side). ``verify_key``: base64 of the raw 32-byte Ed25519 public key."""

    def __init__(self, verify_key: str, replay: ReplayGuard | None = None) -> None:
        self._key = Ed25519PublicKey.from_public_bytes(_raw_key(verify_key, "the grant verify key"))
        self.replay = replay if replay is not None else ReplayGuard()

    def verify(self, wire: str | bytes | None, subject: str, kind: GrantKind, *, generation: int | None = None,
               now: float | None = None) -> Grant:
        """The grant in ``wire`` if it is validly signed, unexpired, unseen, for ``subject`` and ``kind`` (and
        ``generation`` when given); :class:`GrantRefused` saying why otherwise. The jti is claimed only
        once every other check passed, so a refused request does not burn a good grant."""
        if not wire:
            raise GrantRefused("this node call carries no grant")
        text = wire.decode("ascii", "replace") if isinstance(wire, bytes) else wire
        head, dot, tail = text.partition(".")
        if not dot or len(text) > _MAX_WIRE:
            raise GrantRefused("malformed grant")
        try:
            payload, sig = _b64d(head), _b64d(tail)
        except (binascii.Error, ValueError) as exc:
            raise GrantRefused("malformed grant") from exc
        try:
            self._key.verify(sig, payload)
        except InvalidSignature as exc:
            raise GrantRefused("grant signature does not verify") from exc
        try:
            d = json.loads(payload)
            grant = Grant(tenant=str(d["t"]), subject=str(d["s"]), generation=int(d["g"]), kind=GrantKind(d["k"]),
                          expires=float(d["e"]), jti=str(d["j"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise GrantRefused("malformed grant") from exc
        t = time.time() if now is None else now
        if grant.expires + _SKEW_S < t:
            raise GrantRefused("grant expired")
        if grant.subject != subject:
            raise GrantRefused(f"grant is for another {'build' if kind.name.startswith('BUILD') else 'sandbox'}")
        if grant.kind != kind:
            raise GrantRefused(f"grant is for {grant.kind}, not {kind}")
        if generation is not None and grant.generation != generation:
            raise GrantRefused(f"grant is for generation {grant.generation}, not {generation}")
        if not self.replay.claim(grant.jti, grant.expires, t):
            raise GrantRefused("grant already used")
        return grant
