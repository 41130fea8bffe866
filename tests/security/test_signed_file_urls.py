"""Signed file URLs (E2B's ``download_url`` / ``upload_url``): a signature opens one sandbox's ``/files`` for one
path, one user, one operation, until its expiry, and nothing else. Client vs sandbox boundary of
docs/SECURITY.md; enforced by services/api/edge/envd.py (``check_file_signature`` in the envd proxy).

Against the session's real API (``stack``), without an API key. The sandboxes named here do not exist: a
request whose signature is accepted goes on to the sandbox lookup and answers 502 "... was not found" (the
SDK's "sandbox is not running"), one whose signature is refused answers 401 in E2B's shape with envd's message,
before anything is looked up. A real sandbox's signed round trip is tests/e2e/test_e2b.py.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from e2b.sandbox.signature import get_signature

from podbay.devstack.stack import Stack
from podbay_api.e2b.common import envd_access_token

A, B = "sbx_5a11ed0000000000000000000000000a", "sbx_5a11ed0000000000000000000000000b"
PATH = "/home/user/report.txt"


def _signed(stack: Stack, sandbox_id: str, operation: str, *, path: str = PATH, user: str | None = "user",
            expires_in: int | None = 120) -> dict[str, str]:
    """The query of a URL the unmodified SDK signs for ``sandbox_id`` (its envd token, as the API hands it out)."""
    sig = get_signature(path, operation, user, envd_access_token(stack.internal_token, sandbox_id),  # type: ignore[arg-type]
                        expires_in)
    query = {"path": path, "signature": sig["signature"]}
    if user:
        query["username"] = user
    if sig["expiration"] is not None:
        query["signature_expiration"] = str(sig["expiration"])
    return query


def _get(stack: Stack, sandbox_id: str, query: Any, **kw: Any) -> httpx.Response:
    return httpx.get(f"{stack.api_url}/files", params=query, headers={"E2b-Sandbox-Id": sandbox_id, **kw})


def _post(stack: Stack, sandbox_id: str, query: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{stack.api_url}/files", params=query, headers={"E2b-Sandbox-Id": sandbox_id},
                      files={"file": ("x", b"x")})


def _refused(r: httpx.Response, message: str) -> None:
    assert r.status_code == 401, r.text
    assert r.json() == {"code": 401, "message": message}


def test_a_valid_signature_passes_without_an_api_key_by_header_and_by_host(stack: Stack) -> None:
    for r in (_get(stack, A, _signed(stack, A, "read")), _post(stack, A, _signed(stack, A, "write")),
              httpx.get(f"{stack.api_url}/files", params=_signed(stack, A, "read", user=None, expires_in=None),
                        headers={"Host": f"49983-{A}.{stack.env['PODBAY_E2B_DOMAIN']}"})):
        assert r.status_code == 502 and "was not found" in r.json()["message"], r.text


def test_a_signature_is_bound_to_its_sandbox_path_user_operation_and_expiry(stack: Stack) -> None:
    good = _signed(stack, A, "read")
    _refused(_get(stack, B, good), "invalid signature")  # sandbox A's URL used on sandbox B
    _refused(_get(stack, A, {**good, "path": "/home/user/other.txt"}), "invalid signature")
    _refused(_get(stack, A, {**good, "username": "root"}), "invalid signature")
    _refused(_get(stack, A, {k: v for k, v in good.items() if k != "username"}), "invalid signature")
    _refused(_post(stack, A, good), "invalid signature")  # signed for reading, used to write
    _refused(_get(stack, A, _signed(stack, A, "write")), "invalid signature")
    _refused(_get(stack, A, {**good, "signature_expiration": str(int(time.time()) + 86400)}), "invalid signature")
    _refused(_get(stack, A, {k: v for k, v in good.items() if k != "signature_expiration"}), "invalid signature")
    _refused(_get(stack, A, _signed(stack, A, "read", expires_in=-120)), "signature is already expired")
    _refused(_get(stack, A, {k: v for k, v in good.items() if k != "signature"}), "missing signature query parameter")
    _refused(_get(stack, A, {**good, "signature": good["signature"] + "x"}), "invalid signature")


def test_other_spellings_of_the_signed_path_are_refused(stack: Stack) -> None:
    good = _signed(stack, A, "read")
    for other in ("/home/user/./report.txt", "/home/user/../user/report.txt", "/home/user//report.txt",
                  "home/user/report.txt", "/home/user/report.txt/", "~/report.txt", "report.txt",
                  "/home/user/%2e%2e/user/report.txt", "/home/user/report.txt\x00", "/HOME/user/report.txt"):
        _refused(_get(stack, A, {**good, "path": other}), "invalid signature")
    # The same parameter twice: the node could read the other one.
    _refused(_get(stack, A, [*good.items(), ("path", "/etc/shadow")]), "invalid signature")
    _refused(_get(stack, A, [("path", "/etc/shadow"), *good.items()]), "invalid signature")
    # An encoded route is no envd route at all.
    r = httpx.get(f"{stack.api_url}/fil%65s", params=good, headers={"E2b-Sandbox-Id": A})
    assert r.status_code == 400, r.text


def test_a_signature_opens_only_files_and_never_overrules_a_wrong_token(stack: Stack) -> None:
    good = _signed(stack, A, "read")
    _refused(_get(stack, A, good, **{"X-Access-Token": "not-the-token"}),
             "access token present in header but does not match")
    for route in ("/filesystem.Filesystem/Stat", "/process.Process/List"):
        r = httpx.post(f"{stack.api_url}{route}", params=good, json={"path": PATH},
                       headers={"E2b-Sandbox-Id": A, "connect-protocol-version": "1"})
        assert r.status_code == 401, r.text
    # The API key of the stack is no envd credential either.
    r = httpx.get(f"{stack.api_url}/files", params={"path": PATH}, headers={"E2b-Sandbox-Id": A,
                                                                            "X-API-KEY": stack.api_key})
    _refused(r, "missing signature query parameter")


@pytest.mark.parametrize("sandbox", ["../" + A, A + "/..", "sbx_%41"])
def test_a_malformed_sandbox_id_is_refused(stack: Stack, sandbox: str) -> None:
    r = _get(stack, sandbox, _signed(stack, A, "read"))
    assert r.status_code == 400, r.text
