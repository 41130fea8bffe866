"""Node grants (podbay.grants): only the API's key mints them, and each opens one request of one kind on one
sandbox at one generation, once, for a minute. Client vs node boundary of docs/SECURITY.md.

Pure logic (no servers): the node side of the same checks runs against a real data plane in
test_node_grants.py.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import timeit
from pathlib import Path

import pytest

from podbay.errors import GrantRefused
from podbay.grants import (TTL_S, GrantKeyError, GrantKind, GrantSigner, GrantVerifier, ReplayGuard, new_keypair,
                           public_key_of)

SIGNING, VERIFY = new_keypair()


def _pair() -> tuple[GrantSigner, GrantVerifier]:
    return GrantSigner(SIGNING), GrantVerifier(VERIFY)


def test_a_grant_opens_its_own_sandbox_kind_and_generation() -> None:
    signer, verifier = _pair()
    g = verifier.verify(signer.mint("tnt_a", "sbx_a", 3, GrantKind.EXEC), "sbx_a", GrantKind.EXEC, generation=3)
    assert (g.tenant, g.subject, g.generation, g.kind) == ("tnt_a", "sbx_a", 3, GrantKind.EXEC)
    assert time.time() < g.expires <= time.time() + TTL_S + 1
    # The generation is optional for the check (the node then fences on the grant's own).
    verifier.verify(signer.mint("tnt_a", "sbx_a", 3, GrantKind.FILES), "sbx_a", GrantKind.FILES)


@pytest.mark.parametrize(("subject", "kind", "generation", "why"), [
    ("sbx_b", GrantKind.EXEC, 3, "another sandbox"),
    ("sbx_a", GrantKind.FILES, 3, "for exec, not files"),
    ("sbx_a", GrantKind.ENVD, 3, "for exec, not envd"),
    ("sbx_a", GrantKind.EXEC, 4, "generation 3, not 4"),
])
def test_a_grant_for_one_sandbox_kind_or_generation_opens_no_other(
        subject: str, kind: GrantKind, generation: int, why: str) -> None:
    signer, verifier = _pair()
    with pytest.raises(GrantRefused, match=why) as info:
        verifier.verify(signer.mint("tnt_a", "sbx_a", 3, GrantKind.EXEC), subject, kind, generation=generation)
    assert info.value.code == "grant_refused" and info.value.http_status == 403


def test_a_replayed_grant_is_refused_and_a_refused_one_is_not_burnt() -> None:
    signer, verifier = _pair()
    wire = signer.mint("tnt_a", "sbx_a", 1, GrantKind.EXEC)
    # Presented for the wrong sandbox first: refused, but the jti is not spent by a refused request.
    with pytest.raises(GrantRefused, match="another sandbox"):
        verifier.verify(wire, "sbx_b", GrantKind.EXEC)
    verifier.verify(wire, "sbx_a", GrantKind.EXEC)
    with pytest.raises(GrantRefused, match="already used"):
        verifier.verify(wire, "sbx_a", GrantKind.EXEC)


def test_an_expired_grant_is_refused() -> None:
    signer, verifier = _pair()
    wire = signer.mint("tnt_a", "sbx_a", 1, GrantKind.EXEC, now=time.time() - TTL_S - 10)
    with pytest.raises(GrantRefused, match="expired"):
        verifier.verify(wire, "sbx_a", GrantKind.EXEC)


@pytest.mark.parametrize("wire", [None, "", b"", "nodot", ".", "a.b", "x" * 5000])
def test_a_missing_or_malformed_grant_is_refused(wire: str | bytes | None) -> None:
    with pytest.raises(GrantRefused):
        GrantVerifier(VERIFY).verify(wire, "sbx_a", GrantKind.EXEC)


def test_a_tampered_grant_is_refused() -> None:
    signer, verifier = _pair()
    head, _, sig = signer.mint("tnt_a", "sbx_a", 1, GrantKind.EXEC).partition(".")
    payload = json.loads(base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)))
    payload["s"] = "sbx_b"  # the same signature over another sandbox
    forged = base64.urlsafe_b64encode(json.dumps(payload, separators=(",", ":")).encode()).rstrip(b"=").decode()
    with pytest.raises(GrantRefused, match="signature"):
        verifier.verify(f"{forged}.{sig}", "sbx_b", GrantKind.EXEC)


def test_a_grant_signed_by_another_key_is_refused() -> None:
    other, _ = new_keypair()
    with pytest.raises(GrantRefused, match="signature"):
        GrantVerifier(VERIFY).verify(GrantSigner(other).mint("tnt_a", "sbx_a", 1, GrantKind.EXEC), "sbx_a",
                                     GrantKind.EXEC)


def test_the_node_holds_only_the_public_key() -> None:
    assert public_key_of(SIGNING) == VERIFY
    # Loaded as a signing key, the public key's bytes are just another key: what it signs does not verify.
    with pytest.raises(GrantRefused, match="signature"):
        GrantVerifier(VERIFY).verify(GrantSigner(VERIFY).mint("t", "sbx_a", 1, GrantKind.EXEC), "sbx_a",
                                     GrantKind.EXEC)
    for bad in ("", "not base64!", base64.b64encode(b"short").decode()):
        with pytest.raises(GrantKeyError):
            GrantVerifier(bad)
        with pytest.raises(GrantKeyError):
            GrantSigner(bad)


def test_the_replay_guard_is_bounded_and_fails_closed() -> None:
    guard = ReplayGuard(capacity=3)
    now = 1000.0
    assert all(guard.claim(f"j{i}", now + 60, now) for i in range(3))
    assert not guard.claim("j3", now + 60, now)  # full of live grants: refused, not forgotten
    assert not guard.claim("j0", now + 60, now)
    # Once they have expired they leave, and room is made.
    assert guard.claim("j4", now + 200, now + 100) and len(guard) == 1


def test_mint_and_verify_cost_well_under_a_millisecond() -> None:
    signer, verifier = _pair()
    n = 500
    per = timeit.timeit(lambda: verifier.verify(signer.mint("tnt_a", "sbx_a", 1, GrantKind.EXEC), "sbx_a",
                                                GrantKind.EXEC), number=n) / n
    print(f"grant mint+verify: {per * 1e6:.0f} us")
    assert per < 1e-3


@pytest.mark.parametrize(("exe", "env"), [
    ("podbay-api", {"PODBAY_GRANT_SIGNING_KEY": ""}),
    ("podbay-api", {"PODBAY_GRANT_SIGNING_KEY": "bm90IGEga2V5"}),
    ("podbay-nodeagent", {"PODBAY_GRANT_VERIFY_KEY": ""}),
])
def test_the_api_and_node_agents_refuse_to_start_without_their_grant_key(exe: str, env: dict[str, str]) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PODBAY_")}
    p = subprocess.run([str(Path(sys.executable).with_name(exe))], env={**clean, **env}, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "PODBAY_GRANT_" in p.stderr and "grant" in p.stderr, p.stderr


def test_grant_keys_prints_a_pair_that_works() -> None:
    p = subprocess.run([str(Path(sys.executable).with_name("podbay-api")), "grant-keys"], capture_output=True,
                       text=True, timeout=60, check=True)
    keys = json.loads(p.stdout)
    wire = GrantSigner(keys["signing_key"]).mint("t", "sbx_a", 1, GrantKind.EXEC)
    assert GrantVerifier(keys["verify_key"]).verify(wire, "sbx_a", GrantKind.EXEC).subject == "sbx_a"
