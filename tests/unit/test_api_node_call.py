"""The API's one-piece calls to a node's data plane (``services/api/nodes_client.call_node``, aiohttp): the
node's status, body and passed headers come back as they are; a node that does not answer is a retryable
``Unavailable``."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from podbay.errors import Unavailable
from podbay_api.nodes_client import call_node as _call_node

PASS = ("content-type", "content-length", "x-podbay-file-size")


@pytest.fixture
async def node() -> AsyncIterator[str]:
    seen: list[dict[str, object]] = []

    async def exec_(request: web.Request) -> web.Response:
        seen.append({"body": await request.json(), "token": request.headers.get("x-podbay-internal-token"),
                     "query": dict(request.query)})
        if request.query.get("fail"):
            return web.json_response({"error": {"code": "stale_generation", "message": "no"}}, status=409)
        return web.json_response({"exit_code": 0, "seen": seen[-1]}, headers={"x-podbay-file-size": "7",
                                                                              "x-other": "dropped"})

    app = web.Application()
    app.router.add_post("/exec", exec_)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_the_nodes_answer_passes_through(node: str) -> None:
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        r = await _call_node(s, f"{node}/exec", {"x-podbay-internal-token": "tok"}, method="POST",
                             params={"a": "x y"}, json_body={"argv": ["true"], "env": {"K": "é"}},
                             pass_headers=PASS)
        assert r.status_code == 200
        body = json.loads(r.body)
        assert body["seen"] == {"body": {"argv": ["true"], "env": {"K": "é"}}, "token": "tok", "query": {"a": "x y"}}
        assert r.headers["x-podbay-file-size"] == "7" and "x-other" not in r.headers
        assert int(r.headers["content-length"]) == len(r.body)
        refused = await _call_node(s, f"{node}/exec", {}, method="POST", params={"fail": "1"}, json_body={},
                                   pass_headers=PASS)
        assert refused.status_code == 409 and json.loads(refused.body)["error"]["code"] == "stale_generation"


async def test_a_node_that_does_not_answer_is_unavailable() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with aiohttp.ClientSession() as s:
        with pytest.raises(Unavailable) as err:
            await _call_node(s, f"http://127.0.0.1:{port}/exec", {}, method="POST", params=None, json_body={},
                             pass_headers=PASS)
    assert err.value.details["retryable"] is True
