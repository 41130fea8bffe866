"""Structured logs: JSON lines with the ids bound by the code that handles a sandbox's command or request."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest

from podbay.logs import (bind_from_message, bind_from_path, bind_log_context, configure_logging,
                         current_log_context, log_context)


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    buf = io.StringIO()
    configure_logging("scheduler", fmt="json", static={"node_id": "node-7"},
                      secrets=["s3cr3t-internal-token-value"], stream=buf)
    try:
        yield buf
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


def _lines(buf: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_json_line_has_the_fixed_keys_and_the_static_node_id(captured: io.StringIO) -> None:
    logging.getLogger("podbay.test").info("placed %s", "x")
    (line,) = _lines(captured)
    assert line["level"] == "INFO" and line["service"] == "scheduler" and line["logger"] == "podbay.test"
    assert line["message"] == "placed x" and line["node_id"] == "node-7"
    assert str(line["time"]).endswith("Z") and "T" in str(line["time"])
    assert "sandbox_id" not in line and "operation_id" not in line


async def test_ids_bound_in_one_handler_task_stay_in_that_task(captured: io.StringIO) -> None:
    log = logging.getLogger("podbay.test")

    async def handle(sandbox: str, op: str) -> None:
        bind_log_context(sandbox_id=sandbox, operation_id=op)
        await asyncio.sleep(0)
        log.info("handling")

    await asyncio.gather(asyncio.create_task(handle("sbx_a", "op_a")), asyncio.create_task(handle("sbx_b", "op_b")))
    log.info("outside")
    lines = _lines(captured)
    handled = {(line["sandbox_id"], line["operation_id"]) for line in lines if line["message"] == "handling"}
    assert handled == {("sbx_a", "op_a"), ("sbx_b", "op_b")}
    outside = [line for line in lines if line["message"] == "outside"][0]
    assert "sandbox_id" not in outside and "operation_id" not in outside


def test_ids_from_a_command_and_from_a_request_path(captured: io.StringIO) -> None:
    async def one() -> dict[str, str]:
        bind_from_message(b'{"sandbox_id": "sbx_1", "operation_id": "op_9", "generation": 3}')
        return current_log_context()

    async def two() -> dict[str, str]:
        bind_from_path("/v1/sandboxes/sbx_2/exec")
        return current_log_context()

    async def three() -> dict[str, str]:
        bind_from_message(b"not json")
        return current_log_context()

    assert asyncio.run(one()) == {"sandbox_id": "sbx_1", "operation_id": "op_9"}
    assert asyncio.run(two()) == {"sandbox_id": "sbx_2"}
    assert asyncio.run(three()) == {}


def test_log_context_block_and_exception_traceback(captured: io.StringIO) -> None:
    log = logging.getLogger("podbay.test")
    with log_context(sandbox_id="sbx_c", operation_id="op_c"):
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
    log.info("after")
    failed, after = _lines(captured)
    assert failed["sandbox_id"] == "sbx_c" and failed["operation_id"] == "op_c" and failed["level"] == "ERROR"
    assert "RuntimeError: boom" in str(failed["exc"])
    assert "sandbox_id" not in after


def test_secret_values_and_bearer_tokens_never_reach_a_line(captured: io.StringIO) -> None:
    log = logging.getLogger("podbay.test")
    log.warning("token %s rejected", "s3cr3t-internal-token-value")
    log.info("header Authorization: Bearer pb_abcdef123456")
    try:
        raise ValueError("bad s3cr3t-internal-token-value")
    except ValueError:
        log.exception("oops")
    text = captured.getvalue()
    assert "s3cr3t-internal-token-value" not in text and "pb_abcdef123456" not in text
    assert text.count("[redacted]") >= 3  # message, bearer header, exception (and its source line)


def test_text_format_is_the_readable_default() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    buf = io.StringIO()
    try:
        configure_logging("api", stream=buf)
        logging.getLogger("podbay.test").info("hello")
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    line = buf.getvalue().strip()
    assert line.endswith("INFO  api podbay.test: hello") and not line.startswith("{")


def test_httpx_request_lines_are_quieted_but_podbay_lines_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    # The node agent's port proxy makes one httpx request per proxied request; httpx logs each at INFO.
    from podbay.telemetry import setup_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    for name in ("httpx", "httpcore", "uvicorn.access", "nats", "botocore", "aiobotocore", "qemu.qmp", "asyncio"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)  # restored after
    # Earlier tests in the same process may have set a child logger's level or disabled it (a dictConfig does):
    # the check is about what setup_logging does, so start these from their defaults.
    for name in ("httpx", "httpcore.connection", "podbay", "podbay.nodeagent", "podbay.nodeagent.ports"):
        monkeypatch.setattr(logging.getLogger(name), "disabled", False)
        monkeypatch.setattr(logging.getLogger(name), "propagate", True)
    for name in ("httpcore.connection", "podbay", "podbay.nodeagent", "podbay.nodeagent.ports"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    monkeypatch.setenv("PODBAY_LOG_FORMAT", "text")
    buf = io.StringIO()
    try:
        setup_logging("nodeagent", "DEBUG")
        root.handlers[0].setStream(buf)  # type: ignore[attr-defined]
        logging.getLogger("httpx").info("HTTP Request: GET http://10.0.0.2:8000/ \"HTTP/1.1 200 OK\"")
        logging.getLogger("httpcore.connection").debug("connect_tcp.started host='10.0.0.2' port=8000")
        logging.getLogger("httpx").warning("a real problem")
        logging.getLogger("podbay.nodeagent.ports").info("our own line")
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    text = buf.getvalue()
    assert "HTTP Request" not in text and "connect_tcp" not in text
    assert "a real problem" in text and "our own line" in text
