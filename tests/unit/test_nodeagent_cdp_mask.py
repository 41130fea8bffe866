"""The masking of an agent's own CDP screenshots after a fill (services/nodeagent/computer/cdp_mask.py), on CDP messages as
Chromium and Playwright write them; no browser."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import pytest
from PIL import Image

from podbay_nodeagent.computer.cdp_mask import MAX_PENDING, PROBE_ID_BASE, UNMASKABLE, ScreenshotMasker, picture_boxes
from podbay_nodeagent.computer.computer import PASSWORD_FIELDS

WHITE = (255, 255, 255)
BLACK = (0, 0, 0)


def _picture(w: int, h: int, fmt: str = "PNG") -> str:
    out = io.BytesIO()
    Image.new("RGB", (w, h), WHITE).save(out, format=fmt)
    return base64.b64encode(out.getvalue()).decode()


def _pixels(data_b64: str, fmt: str = "PNG") -> Image.Image:
    with Image.open(io.BytesIO(base64.b64decode(data_b64)), formats=[fmt]) as im:
        return im.convert("RGB")


def _shot(cid: int, session: str | None = "S1", **params: Any) -> str:
    msg: dict[str, Any] = {"id": cid, "method": "Page.captureScreenshot", "params": params}
    if session is not None:
        msg["sessionId"] = session
    return json.dumps(msg)


def _answer(cid: int, result: dict[str, Any], session: str | None = "S1") -> str:
    msg: dict[str, Any] = {"id": cid, "result": result}
    if session is not None:
        msg["sessionId"] = session
    return json.dumps(msg)


def _probe_answer(probe_id: int, value: dict[str, Any], session: str | None = "S1") -> str:
    return _answer(probe_id, {"result": {"type": "object", "value": value}}, session)


def test_nothing_filled_passes_every_message_untouched() -> None:
    m = ScreenshotMasker(lambda: None)
    shot = _shot(4)
    assert m.to_upstream(shot) == [shot]
    answer = _answer(4, {"data": _picture(8, 8)})
    assert m.to_client(answer) == answer


def test_a_screenshot_after_a_fill_is_probed_first_and_answered_masked() -> None:
    m = ScreenshotMasker(lambda: {"#user"})
    shot = _shot(7)
    sent = m.to_upstream(shot)
    assert len(sent) == 2 and sent[1] == shot  # the probe, then the client's command, in the same session
    probe = json.loads(sent[0])
    assert probe["id"] == PROBE_ID_BASE and probe["sessionId"] == "S1" and probe["method"] == "Runtime.evaluate"
    assert probe["params"]["returnByValue"] is True
    assert PASSWORD_FIELDS in probe["params"]["expression"] and "#user" in probe["params"]["expression"]
    # The probe's answer never reaches the client; the picture (device scale 2: 200 px for 100 CSS px) is
    # masked over the box, 2 px wider each side, and nowhere else.
    assert m.to_client(_probe_answer(PROBE_ID_BASE, {"w": 100, "sx": 0, "sy": 0, "r": [[10, 20, 40, 30]]})) is None
    got = json.loads(str(m.to_client(_answer(7, {"data": _picture(200, 120)}))))
    assert got["id"] == 7 and got["sessionId"] == "S1"
    img = _pixels(got["result"]["data"])
    assert img.size == (200, 120)
    assert img.getpixel((20, 40)) == BLACK and img.getpixel((79, 59)) == BLACK  # the box's corners
    assert img.getpixel((18, 38)) == BLACK and img.getpixel((81, 61)) == BLACK  # the 2 px margin
    assert img.getpixel((17, 37)) == WHITE and img.getpixel((82, 62)) == WHITE and img.getpixel((150, 100)) == WHITE


def test_the_format_of_the_command_is_kept() -> None:
    m = ScreenshotMasker(lambda: set())
    m.to_upstream(_shot(1, format="jpeg", quality=90))
    m.to_client(_probe_answer(PROBE_ID_BASE, {"w": 64, "sx": 0, "sy": 0, "r": [[0, 0, 32, 32]]}))
    got = json.loads(str(m.to_client(_answer(1, {"data": _picture(64, 64, "JPEG")}))))
    img = _pixels(got["result"]["data"], "JPEG")  # a JPEG still (opening it as PNG would fail)
    assert sum(img.getpixel((10, 10))) < 30 and sum(img.getpixel((50, 50))) > 700


def test_a_failed_probe_refuses_the_picture_rather_than_send_it_unmasked() -> None:
    m = ScreenshotMasker(lambda: {"#pw"})
    m.to_upstream(_shot(3, session=None))  # a page-level connection: no session ids
    thrown = json.dumps({"id": PROBE_ID_BASE, "result": {"result": {"type": "object"}, "exceptionDetails": {}}})
    assert m.to_client(thrown) is None
    got = json.loads(str(m.to_client(_answer(3, {"data": _picture(8, 8)}, session=None))))
    assert got == {"id": 3, "error": UNMASKABLE}


def test_a_picture_that_is_not_of_its_format_is_refused() -> None:
    m = ScreenshotMasker(lambda: {"#pw"})
    m.to_upstream(_shot(5))
    m.to_client(_probe_answer(PROBE_ID_BASE, {"w": 8, "sx": 0, "sy": 0, "r": []}))
    got = json.loads(str(m.to_client(_answer(5, {"data": base64.b64encode(b"not a png").decode()}))))
    assert got == {"id": 5, "sessionId": "S1", "error": UNMASKABLE}


def test_other_messages_and_the_browser_s_own_errors_pass() -> None:
    m = ScreenshotMasker(lambda: {"#pw"})
    m.to_upstream(_shot(9))
    other = _answer(8, {"result": {"value": 2}})
    event = json.dumps({"method": "Page.loadEventFired", "params": {}, "sessionId": "S1"})
    assert m.to_client(other) == other and m.to_client(event) == event and m.to_client(b"\x00bin") == b"\x00bin"
    assert m.to_client(_answer(9, {"data": _picture(4, 4)}, session="S2")) is not None  # another session's id 9
    m.to_client(_probe_answer(PROBE_ID_BASE, {"w": 4, "sx": 0, "sy": 0, "r": []}))
    error = json.dumps({"id": 9, "error": {"code": -32000, "message": "Unable to capture screenshot"},
                        "sessionId": "S1"})
    assert m.to_client(error) == error
    evaluate = json.dumps({"id": 10, "method": "Runtime.evaluate", "params": {"expression": "1+1"}})
    assert m.to_upstream(evaluate) == [evaluate]


def test_too_many_screenshots_in_flight_are_refused_not_unmasked() -> None:
    m = ScreenshotMasker(lambda: {"#pw"})
    for i in range(MAX_PENDING):
        assert len(m.to_upstream(_shot(i + 1))) == 2
    assert m.to_upstream(_shot(1000)) == [_shot(1000)]  # no probe for it
    got = json.loads(str(m.to_client(_answer(1000, {"data": _picture(4, 4)}))))
    assert got["error"] == UNMASKABLE


@pytest.mark.parametrize("params,probe,expected", [
    # the viewport at device scale 1, not scrolled: one placement
    ({}, {"w": 100, "sx": 0, "sy": 0, "r": [[10, 10, 20, 20]]}, [(8, 8, 22, 22)]),
    # scrolled: the viewport's placement and the document's (captureBeyondViewport)
    ({}, {"w": 100, "sx": 0, "sy": 50, "r": [[10, 10, 20, 20]]}, [(8, 8, 22, 22), (8, 58, 22, 72)]),
    # a clip at scale 2 (its picture is 2x the clip's CSS width), page not scrolled
    ({"clip": {"x": 5, "y": 5, "width": 50, "height": 50, "scale": 2}}, {"w": 100, "sx": 0, "sy": 0,
     "r": [[10, 10, 20, 20]]}, [(8, 8, 32, 32)]),
])
def test_boxes_are_placed_in_the_picture_s_pixels(params: dict[str, Any], probe: dict[str, Any],
                                                  expected: list[tuple[float, float, float, float]]) -> None:
    width = int(params["clip"]["width"] * params["clip"]["scale"]) if "clip" in params else 100
    assert sorted(picture_boxes(probe, params, width)) == sorted(expected)
