"""Key names to CDP key events, and the computer-use bodies (services/nodeagent/computer/computer.py,
podbay.contracts.computer)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from podbay.contracts.computer import KeyboardAction, MouseAction
from podbay_nodeagent.computer.computer import key_events


def test_a_printing_key_types_its_character() -> None:
    down, up = key_events("a")
    assert down == {"type": "keyDown", "key": "a", "code": "KeyA", "windowsVirtualKeyCode": 65, "modifiers": 0,
                    "text": "a", "unmodifiedText": "a"}
    assert up["type"] == "keyUp" and up["key"] == "a"


def test_enter_types_a_carriage_return_and_arrows_type_nothing() -> None:
    assert key_events("Enter")[0]["text"] == "\r" and key_events("Enter")[0]["windowsVirtualKeyCode"] == 13
    arrow = key_events("ArrowDown")[0]
    assert arrow["type"] == "rawKeyDown" and "text" not in arrow and arrow["windowsVirtualKeyCode"] == 40


def test_modifiers_are_pressed_around_the_key_and_a_shortcut_types_nothing() -> None:
    ev = key_events("Control+Shift+a")
    assert [(e["type"], e["key"]) for e in ev] == [("rawKeyDown", "Control"), ("rawKeyDown", "Shift"),
                                                    ("rawKeyDown", "A"), ("keyUp", "A"), ("keyUp", "Shift"),
                                                    ("keyUp", "Control")]
    assert ev[2]["modifiers"] == 2 | 8 and "text" not in ev[2]
    for combo in ("Shift+A", "Shift+a"):
        shifted = key_events(combo)
        assert shifted[1]["key"] == shifted[1]["text"] == "A" and shifted[1]["modifiers"] == 8


@pytest.mark.parametrize("bad", ["Hyper+a", "NoSuchKey", "Control+", ""])
def test_unknown_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        key_events(bad)


def test_bodies_are_checked() -> None:
    with pytest.raises(ValidationError):
        MouseAction(action="drag", x=1, y=1)  # no end
    with pytest.raises(ValidationError):
        MouseAction.model_validate({"action": "click", "x": -1, "y": 0})
    with pytest.raises(ValidationError):
        KeyboardAction(action="type")
    with pytest.raises(ValidationError):
        KeyboardAction.model_validate({"action": "keys", "keys": []})
    assert MouseAction(action="drag", x=1, y=1, to_x=5, to_y=5).steps == 8


def test_no_browser_comes_back_typed_from_the_wire() -> None:
    from podbay.errors import NoBrowser, error_from_wire

    err = error_from_wire(NoBrowser("no browser").to_wire(), 409)
    assert isinstance(err, NoBrowser) and err.code == "no_browser" and err.http_status == 409


def test_fill_origin_matching() -> None:
    from podbay_nodeagent.computer.computer_fill import origin_host_allowed

    assert origin_host_allowed(["example.com"], "https://Example.com/login?x=1") == ("https://example.com", True)
    assert origin_host_allowed(["*.example.com"], "https://a.b.example.com:8443/") == (
        "https://a.b.example.com:8443", True)
    assert origin_host_allowed(["*.example.com"], "https://example.com/")[1] is False
    assert origin_host_allowed(["example.com"], "https://example.com.evil.test/")[1] is False
    assert origin_host_allowed(["example.com"], "https://user@evil.test/?example.com")[1] is False
    assert origin_host_allowed(["127.0.0.1"], "http://localhost:8000/")[1] is False
    assert origin_host_allowed(["example.com"], "file:///etc/passwd") == ("file:", False)
    assert origin_host_allowed(["example.com"], "about:blank")[1] is False


async def test_the_redactor_hides_filled_values_from_then_on() -> None:
    from podbay_nodeagent.computer.computer_fill import REDACTED, Filler
    from podbay_nodeagent.computer.fill_memory import Filled, FillMemory

    async def nothing_recorded(sandbox_id: str) -> Filled:
        return Filled()

    filler = Filler.__new__(Filler)  # only its memory of filled values is used here
    filler.fills = FillMemory(nothing_recorded)
    redact = await filler.redactor("sbx_a")
    secret = 'p"w\\1'
    msg = json.dumps({"id": 3, "result": {"value": secret}})
    assert redact(msg) == msg  # nothing filled yet
    filler.fills.add("sbx_a", secret, "#pw")
    assert secret not in redact(msg) and json.dumps(secret)[1:-1] not in redact(msg) and REDACTED in redact(msg)
    assert redact(b"binary " + secret.encode()) == b"binary " + secret.encode()  # CDP is text; bytes pass
    assert (await filler.redactor("sbx_b"))(msg) == msg  # another sandbox's stream is untouched


def test_a_bad_mouse_action_is_an_invalid_request_naming_the_field() -> None:
    import pytest

    from podbay.errors import InvalidRequest
    from podbay.sdk._computer import mouse_call

    with pytest.raises(InvalidRequest, match="invalid mouse action: action: Input should be 'move'"):
        mouse_call("sbx_x", "explode", 1, 2)
