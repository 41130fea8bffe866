"""Pure parts of E2B's REST API on podbay (services/api/e2b.py) and the e2b_ key alias."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from podbay.contracts.e2b import from_e2b_key, to_e2b_key
from podbay.errors import InvalidRequest
from podbay_api.e2b import _started_after


def test_e2b_key_alias_names_the_same_key() -> None:
    key = "pb_0123abcd_" + "f" * 40
    alias = to_e2b_key(key)
    assert alias == "e2b_0123abcd" + "f" * 40
    assert alias.startswith("e2b_") and all(c in "0123456789abcdef" for c in alias[4:])
    assert from_e2b_key(alias) == key
    # Other shapes pass through unchanged (the API then refuses them as malformed).
    assert to_e2b_key("pb_k") == "pb_k" and from_e2b_key("e2b_xyz") == "e2b_xyz"


def test_started_after_reads_rfc3339_and_naive_times_as_utc() -> None:
    assert _started_after("2026-12-02T01:02:03Z") == datetime(2026, 12, 2, 1, 2, 3, tzinfo=UTC)
    assert _started_after("2026-12-02T01:02:03") == datetime(2026, 12, 2, 1, 2, 3, tzinfo=UTC)
    assert _started_after(None) is None
    with pytest.raises(InvalidRequest):
        _started_after("yesterday")


def test_file_url_signatures_match_the_sdks_and_expire() -> None:
    from e2b.sandbox.signature import get_signature
    from podbay_api.e2b_envd import check_file_signature

    token = "t" * 64
    for user, exp in ((None, None), ("root", 60)):
        sig = get_signature("/home/user/a.txt", "read", user, token, exp)
        query = {"path": "/home/user/a.txt", "signature": sig["signature"]}
        if user:
            query["username"] = user
        if sig["expiration"]:
            query["signature_expiration"] = str(sig["expiration"])
        now = datetime.now(UTC).timestamp()
        assert check_file_signature(query, "read", token, now) is None
        assert check_file_signature(query, "write", token, now) is not None  # signed for reading only
        assert check_file_signature(query, "read", "other", now) is not None
        if exp:
            assert "expired" in (check_file_signature(query, "read", token, now + 3600) or "")
