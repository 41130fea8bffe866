"""Webhook destinations when non-public addresses are not allowed (the default): the address check, the
API's refusal at registration, the deliverer's refusal after resolving the host (no request, no retry), and
the dev and test stacks, which allow them."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from podbay_api.routes.webhooks import check_destination

from podbay.devstack.stack import Stack, StackPorts
from podbay.errors import Unprocessable
from podbay.webhooks import ALLOW_PRIVATE_SETTING, Deliverer, refused_addresses, refused_host

REFUSED = ["169.254.169.254", "127.0.0.1", "127.0.0.2", "::1", "0.0.0.0", "::", "10.1.2.3", "172.16.0.1",
           "192.168.1.1", "100.64.0.1", "fd00::1", "fe80::1", "fe80::1%eth0", "224.0.0.1", "ff02::1", "240.0.0.1",
           "::ffff:127.0.0.1", "::ffff:169.254.169.254", "localhost", "LOCALHOST", "localhost.",
           "api.localhost", "2130706433", "0x7f.1", "127.1", "0177.0.0.1"]
ALLOWED = ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946", "hooks.example.com", "localhost.example.com",
           "notlocalhost", "deadbeef", "1.example"]


@pytest.mark.parametrize("host", REFUSED)
def test_non_public_ip_literals_and_localhost_are_refused(host: str) -> None:
    reason = refused_host(host)
    assert reason is not None and reason.startswith(host)


@pytest.mark.parametrize("host", ALLOWED)
def test_public_addresses_and_other_names_pass(host: str) -> None:
    assert refused_host(host) is None


def test_the_reason_names_the_kind_of_address() -> None:
    assert refused_host("169.254.169.254") == "169.254.169.254 is a link-local address"
    assert refused_host("127.0.0.1") == "127.0.0.1 is a loopback address"
    assert refused_host("10.0.0.1") == "10.0.0.1 is a private address"
    assert refused_host("localhost") == "localhost is a loopback name"


def test_one_non_public_resolved_address_is_enough() -> None:
    assert refused_addresses("hooks.example.com", ["93.184.216.34"]) is None
    assert refused_addresses("hooks.example.com", ["93.184.216.34", "10.0.0.5"]) == (
        "hooks.example.com resolves to 10.0.0.5, a private address")
    assert refused_addresses("hooks.example.com", []) is None


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data", "http://127.0.0.1:18999/internal",
                                 "http://[::1]/x", "http://localhost/x", "https://user@10.0.0.1:8443/x"])
def test_registration_refuses_non_public_destinations_unless_allowed(url: str) -> None:
    with pytest.raises(Unprocessable) as err:
        check_destination(url, allow_private=False)
    assert err.value.http_status == 422 and err.value.code == "validation_error"
    assert ALLOW_PRIVATE_SETTING in err.value.message and err.value.details["setting"] == ALLOW_PRIVATE_SETTING
    assert err.value.details["host"] in err.value.message
    check_destination(url, allow_private=True)


def test_registration_lets_public_destinations_through() -> None:
    check_destination("https://hooks.example.com/podbay", allow_private=False)
    check_destination("http://93.184.216.34:8080/x", allow_private=False)


class FakePool:
    def __init__(self) -> None:
        self.updates: list[tuple[Any, ...]] = []

    async def execute(self, sql: str, *args: Any) -> None:
        self.updates.append(args)


def _deliver(resolved: dict[str, list[str]] | Exception, *, allow_private: bool = False,
             url: str = "http://hooks.example.com:8080/x") -> tuple[list[httpx.Request], list[tuple[str, int]],
                                                                     tuple[Any, ...]]:
    seen: list[httpx.Request] = []
    lookups: list[tuple[str, int]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        return httpx.Response(200)

    async def resolver(host: str, port: int) -> list[str]:
        lookups.append((host, port))
        if isinstance(resolved, Exception):
            raise resolved
        return resolved[host]

    pool = FakePool()
    d = Deliverer(pool, bus=None, max_attempts=3, backoff_s=0.001, backoff_max_s=0.001,  # type: ignore[arg-type]
                  transport=httpx.MockTransport(handler), allow_private=allow_private, resolver=resolver)
    hook = {"id": "whk_1", "url": url, "secret": "whsec_s"}
    asyncio.run(d._deliver(hook, b'{"type":"paused"}', {"id": "evt_1", "type": "paused"}, 7))  # type: ignore[arg-type]
    return seen, lookups, pool.updates[-1]


def test_a_name_resolving_to_loopback_is_refused_without_a_request_or_retry() -> None:
    seen, lookups, (_, ok, failed, status, attempts, error, seq) = _deliver({"hooks.example.com": ["127.0.0.1"]})
    assert seen == [] and lookups == [("hooks.example.com", 8080)]
    assert (ok, failed, status, attempts, seq) == (0, 1, None, 1, 7)
    assert error.startswith("refused: hooks.example.com resolves to 127.0.0.1, a loopback address")
    assert ALLOW_PRIVATE_SETTING in error


def test_an_ip_literal_registered_before_the_check_is_refused_at_delivery() -> None:
    seen, _, (_, ok, _, _, attempts, error, _) = _deliver({"169.254.169.254": ["169.254.169.254"]},
                                                          url="http://169.254.169.254/latest/meta-data")
    assert seen == [] and (ok, attempts) == (0, 1)
    assert error.startswith("refused: 169.254.169.254 is a link-local address")


def test_a_public_resolution_is_delivered() -> None:
    seen, lookups, (_, ok, failed, status, attempts, error, _) = _deliver(
        {"hooks.example.com": ["93.184.216.34"]})
    assert len(seen) == 1 and lookups == [("hooks.example.com", 8080)]
    assert (ok, failed, status, attempts, error) == (1, 0, 200, 1, None)


def test_allowed_private_destinations_are_not_resolved_or_refused() -> None:
    seen, lookups, (_, ok, _, status, _, error, _) = _deliver({}, allow_private=True,
                                                              url="http://127.0.0.1:18999/internal")
    assert len(seen) == 1 and lookups == [] and (ok, status, error) == (1, 200, None)


def test_a_name_that_does_not_resolve_is_retried_like_a_network_error() -> None:
    seen, lookups, (_, ok, failed, status, attempts, error, _) = _deliver(
        socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    assert seen == [] and len(lookups) == 3
    assert (ok, failed, status, attempts) == (0, 1, None, 3) and error.startswith("cannot resolve hooks.example.com")


def test_dev_and_test_stacks_allow_private_destinations_unless_told_otherwise(tmp_path: Path) -> None:
    def env(**kw: Any) -> dict[str, str]:
        stack = Stack(data_dir=tmp_path, log_dir=tmp_path / "logs", cache_dir=tmp_path, ports=StackPorts.free(), **kw)
        return stack._service_env()  # noqa: SLF001

    quiet = {"PODBAY_GUEST_CA_FILE": ""}  # no guest CA bundle to work out
    assert env(base_env=quiet)[ALLOW_PRIVATE_SETTING] == "1"
    assert env(base_env=quiet, webhook_allow_private=False)[ALLOW_PRIVATE_SETTING] == "0"
    assert env(base_env={**quiet, ALLOW_PRIVATE_SETTING: "0"})[ALLOW_PRIVATE_SETTING] == "0"
