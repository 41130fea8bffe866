"""``podbay.clientconfig.load_client_config``: precedence, and malformed config files refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_sdk_fake import clean_env  # noqa: F401  (fixture)

from podbay.clientconfig import load_client_config
from podbay.errors import InvalidRequest
from podbay.sdk import Client

pytestmark = pytest.mark.usefixtures("clean_env")


def _config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.json"
    path.write_text(text)
    monkeypatch.setenv("PODBAY_CONFIG", str(path))
    return path


def test_a_good_file_is_used_and_explicit_values_win(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _config(monkeypatch, tmp_path, json.dumps({"api_url": "http://file:1/", "api_key": "pb_file"}))
    cfg = load_client_config()
    assert (cfg.api_url, cfg.api_key) == ("http://file:1", "pb_file")
    monkeypatch.setenv("PODBAY_API_KEY", "pb_env")
    assert load_client_config().api_key == "pb_env"
    assert load_client_config("http://arg:2", "pb_arg").model_dump() == {"api_url": "http://arg:2", "api_key": "pb_arg"}


def test_no_file_means_the_local_default() -> None:
    assert load_client_config().model_dump() == {"api_url": "http://127.0.0.1:8080", "api_key": None}


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{broken", "is not valid JSON: Expecting property name enclosed in double quotes at line 1 column 2"),
        ("[1, 2]", "must hold a JSON object, not list"),
        ('{"api_key": 7}', "api_key must be a string"),
    ],
)
def test_a_malformed_file_is_an_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str, problem: str
) -> None:
    path = _config(monkeypatch, tmp_path, text)
    with pytest.raises(InvalidRequest) as exc:
        load_client_config()
    assert str(path) in exc.value.message and problem in exc.value.message
    with pytest.raises(InvalidRequest):
        Client()


def test_a_malformed_file_is_not_read_when_not_needed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _config(monkeypatch, tmp_path, "{broken")
    assert load_client_config("http://arg:2", "pb_arg").api_key == "pb_arg"


@pytest.mark.parametrize("url", ["http://[::1", "notaurl", "ftp://host:21", "http://", "127.0.0.1:8080"])
def test_a_malformed_api_url_is_refused_with_a_clear_error(url: str) -> None:
    with pytest.raises(InvalidRequest, match="the API URL"):
        load_client_config(url, "pb_x")


def test_the_cli_answers_a_malformed_api_url_as_a_usage_error() -> None:
    from typer.testing import CliRunner

    from podbay.cli.main import app

    result = CliRunner().invoke(app, ["--api-url", "http://[::1", "--api-key", "pb_x", "pool", "list"])
    assert result.exit_code == 2, result.output
    assert "the API URL" in result.output and "(invalid_request)" in result.output
    assert "Traceback" not in result.output
