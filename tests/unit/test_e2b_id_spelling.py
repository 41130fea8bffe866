"""E2B's spelling of sandbox ids (podbay.naming.e2b_sandbox_id): ``sbx-<hex>``, a valid host label, on E2B's
surface, and the parsers that take either spelling back to the stored ``sbx_<hex>`` (E2B hosts, REST paths)."""

from __future__ import annotations

import pytest
from podbay.naming import e2b_sandbox_id, sandbox_id_from_e2b
from podbay_api.edge.envd import HostRefused, canonical_rest_path, parse_host

SID = "sbx_3f2a9c01b7d4e5f60718"
DASH = "sbx-3f2a9c01b7d4e5f60718"
DOMAIN = "e2b.localhost:8443"


def test_the_e2b_spelling_is_a_host_label_and_maps_back() -> None:
    assert e2b_sandbox_id(SID) == DASH
    assert e2b_sandbox_id(DASH) == DASH
    assert sandbox_id_from_e2b(DASH) == SID and sandbox_id_from_e2b(SID) == SID
    assert e2b_sandbox_id("snap_1234") == "snap_1234"  # not a sandbox id: left alone


@pytest.mark.parametrize("bad", ["SBX-3F2A9C01B7D4E5F60718", "sbx-3F2A", "sbx%5f3f2a", "sbx%2d3f2a", "sbx__3f2a",
                                 "sbx-3f2a.x", "xsbx-3f2a", "sbx-", "sbx-3f2a-", "sbx-" + "a" * 49, "",
                                 "sbx-3f2a\x00", "sbx-3f2a/..", "vol_3f2a"])
def test_other_spellings_name_no_sandbox(bad: str) -> None:
    assert sandbox_id_from_e2b(bad) is None


def test_hosts_of_either_spelling_name_the_stored_id() -> None:
    assert parse_host(f"49983-{DASH}.e2b.localhost:8443", DOMAIN) == (49983, SID)
    assert parse_host(f"8000-{SID}.e2b.localhost", DOMAIN) == (8000, SID)
    assert parse_host(f"8000-{DASH}.E2B.Localhost.:8443", DOMAIN) == (8000, SID)  # the domain in any case, FQDN dot
    assert parse_host("api.e2b.localhost:8443", DOMAIN) is None  # the API's own name under the domain
    assert parse_host(f"8000-{DASH}.other.localhost", DOMAIN) is None
    assert parse_host(f"8000-{DASH}.e2b.localhost.evil.com", DOMAIN) is None
    assert parse_host(f"8000-{DASH}.e2b.localhost", None) is None


@pytest.mark.parametrize("host", [
    f"8000-{DASH.upper()}.e2b.localhost",        # upper case
    "8000-sbx%5f3f2a9c01b7d4e5f60718.e2b.localhost",  # an encoded _
    f"8000-{DASH}.x.e2b.localhost",              # an extra label before the domain
    f"x.8000-{DASH}.e2b.localhost",
    f"0-{DASH}.e2b.localhost", f"70000-{DASH}.e2b.localhost", f"08000-{DASH}.e2b.localhost",
    "8000-vol_3f2a.e2b.localhost", "8000-.e2b.localhost", "8000.e2b.localhost",
])
def test_hosts_under_the_domain_that_name_no_sandbox_port_are_refused(host: str) -> None:
    with pytest.raises(HostRefused):
        parse_host(host, DOMAIN)


def test_rest_paths_take_either_spelling_and_refuse_encoded_ids() -> None:
    assert canonical_rest_path(f"/e2b/v2/sandboxes/{DASH}/connect".encode()) == \
        f"/e2b/v2/sandboxes/{SID}/connect".encode()
    assert canonical_rest_path(f"/e2b/sandboxes/{SID}".encode()) == f"/e2b/sandboxes/{SID}".encode()
    assert canonical_rest_path(b"/e2b/sandboxes/sbx%5f3f2a9c01b7d4e5f60718") is None
    assert canonical_rest_path(b"/e2b/sandboxes/sbx%2D3f2a9c01b7d4e5f60718/pause") is None
    # Only ids after "sandboxes/": template names (URL-encoded by the SDK) and other segments pass as sent.
    assert canonical_rest_path(b"/e2b/templates/team%2Fname") == b"/e2b/templates/team%2Fname"
    assert canonical_rest_path(f"/e2b/templates/{DASH}".encode()) == f"/e2b/templates/{DASH}".encode()
    assert canonical_rest_path(b"/e2b/v2/sandboxes") == b"/e2b/v2/sandboxes"
