"""Port addressing and access logic of the API edge (services/api/edge/ports_access.py) and the node's parser of
the guest's listening sockets (services/nodeagent/net/ports.py)."""

from __future__ import annotations

import pytest
from podbay_api.edge import ports_access as pa
from podbay_nodeagent.net.netfilter import render_ruleset
from podbay_nodeagent.net.ports import Listener, not_open_message, parse_proc_net_tcp


def test_a_sandbox_id_has_a_host_label_without_underscores_and_back() -> None:
    sid = "sbx_3f2a0123456789abcdef"
    assert pa.host_label(sid) == "sbx-3f2a0123456789abcdef"
    assert pa.sandbox_from_label(pa.host_label(sid)) == sid
    assert pa.sandbox_from_label(sid) == sid  # the '_' spelling passes as it is


@pytest.mark.parametrize(("host", "domain", "want"), [
    ("8000-sbx-abc.localhost", "localhost", (8000, "sbx_abc")),
    ("8000-sbx-abc.localhost:8080", "localhost", (8000, "sbx_abc")),
    ("8000-sbx_abc.LOCALHOST:8080", "localhost", (8000, "sbx_abc")),
    ("3000-sbx-abc.ports.example.com", "ports.example.com", (3000, "sbx_abc")),
    ("3000-sbx-abc.ports.example.com.", "ports.example.com", (3000, "sbx_abc")),
    ("3000-sbx-abc.evil.com", "ports.example.com", None),
    ("3000-sbx-abc.example.com", "ports.example.com", None),
    ("localhost:8080", "localhost", None),
    ("127.0.0.1:8080", "localhost", None),
    ("0-sbx-abc.localhost", "localhost", None),
    ("70000-sbx-abc.localhost", "localhost", None),
    ("8000-sbx-abc.localhost", None, None),
    ("8000-.localhost", "localhost", None),
])
def test_host_form(host: str, domain: str | None, want: object) -> None:
    assert pa.parse_host(host, domain) == want


def test_path_form() -> None:
    assert pa.parse_path("/ports/8000-sbx-abc/a/b") == (8000, "sbx_abc", "/a/b")
    assert pa.parse_path("/ports/8000-sbx-abc/") == (8000, "sbx_abc", "/")
    assert pa.parse_path("/ports/8000-sbx-abc") == (8000, "sbx_abc", "")
    assert pa.parse_path("/ports/x-sbx-abc/") is None
    assert pa.parse_path("/v1/sandboxes") is None


def test_tokens_are_bound_to_one_sandbox_and_secret() -> None:
    a, b = pa.traffic_token("s", "sbx_a"), pa.traffic_token("s", "sbx_b")
    assert a != b and len(a) == 64
    assert pa.traffic_token("other secret", "sbx_a") != a
    assert pa.e2b_traffic_token("s", "sbx_a") != a  # E2B's token is another one
    assert pa.token_ok(a, a) and not pa.token_ok(b, a) and not pa.token_ok(None, a) and not pa.token_ok("", a)


def test_urls_for_the_api_as_reached() -> None:
    url, path_url = pa.port_url("sbx_a1", 8000, scheme="http", domain="localhost", api_host="127.0.0.1:8080")
    assert url == "http://8000-sbx-a1.localhost:8080/"
    assert path_url == "http://127.0.0.1:8080/ports/8000-sbx-a1/"
    url, _ = pa.port_url("sbx_a1", 443, scheme="https", domain="p.example.com", api_host="api.example.com")
    assert url == "https://443-sbx-a1.p.example.com/"


def test_listening_sockets_are_parsed_from_proc_net_tcp() -> None:
    tcp = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
           "   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n"
           "   1: 0100007F:0CEA 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1\n"
           "   2: 0200A8C0:1F40 0100A8C0:D431 01 00000000:00000000 00:00000000 00000000     0        0 3 1\n"
           "garbage line\n   3: zz:zz 0 0A\n")
    got = parse_proc_net_tcp(tcp, ipv6=False)
    assert got == [{"port": 8000, "address": "0.0.0.0", "family": "ipv4"},
                   {"port": 3306, "address": "127.0.0.1", "family": "ipv4"}]
    tcp6 = ("  sl  local_address                         remote_address                        st\n"
            "   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 0\n"
            "   1: 00000000000000000000000001000000:0050 00000000000000000000000000000000:0000 0A 0\n")
    assert parse_proc_net_tcp(tcp6, ipv6=True) == [{"port": 8080, "address": "::", "family": "ipv6"},
                                                   {"port": 80, "address": "::1", "family": "ipv6"}]


def test_a_refused_port_names_a_loopback_only_listener() -> None:
    loopback = [Listener(port=3000, address="127.0.0.1", family="ipv4"),
                Listener(port=3000, address="::1", family="ipv6"), Listener(port=8000, address="0.0.0.0", family="ipv4")]
    msg = not_open_message(3000, loopback)
    assert "listens only on 127.0.0.1, ::1" in msg and "0.0.0.0" in msg
    assert not_open_message(4000, loopback) == "nothing listens on port 4000 in the sandbox (connection refused)"
    # Any address beyond loopback: the refusal is something else than the binding, so no hint.
    both = [Listener(port=5000, address="127.0.0.1", family="ipv4"), Listener(port=5000, address="::", family="ipv6")]
    assert not_open_message(5000, both).startswith("nothing listens")


def test_only_the_port_proxy_opens_connections_into_a_tap() -> None:
    text = render_ruleset(8094, 8053, table="podbay_x", tap_prefix="pbxt")
    assert "ct direction reply accept" in text
    assert 'oifname "pbxt*" meta l4proto tcp ct state new meta mark != 0x70620001 reject with tcp reset' in text


def test_e2b_closed_port_answer_is_e2bs_json_or_its_browser_page() -> None:
    import json

    ctype, body = pa.e2b_closed_port("sbx_1", 3000, "python-httpx/0.28")
    assert ctype == b"application/json; charset=utf-8"
    assert json.loads(body) == {"message": "The sandbox is running but port is not open", "sandboxId": "sbx_1",
                                "port": 3000, "code": 502}
    ctype, body = pa.e2b_closed_port("sbx_<1>", 3000, "Mozilla/5.0 (X11; Linux x86_64) Chrome/131.0")
    assert ctype == b"text/html; charset=utf-8" and b"<title>Closed Port Error</title>" in body
    assert b"sbx_&lt;1&gt;" in body and b"port 3000" in body
