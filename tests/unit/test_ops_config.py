"""Configuration from a TOML file (``PODBAY_CONFIG_FILE``) under the environment, and clear errors on bad files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from podbay.config import CONFIG_FILE_ENV, ConfigError, load_settings


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in list(os.environ):
        if key.startswith("PODBAY_"):
            monkeypatch.delenv(key)
    return monkeypatch


def test_file_values_are_read_and_the_environment_wins(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    f = tmp_path / "podbay.toml"
    f.write_text('nats_url = "nats://nats.internal:4222"\nnode_port = 9000\nlog_format = "json"\n'
                 'data_dir = "/var/lib/podbay"\n')
    clean_env.setenv(CONFIG_FILE_ENV, str(f))
    s = load_settings()
    assert s.nats_url == "nats://nats.internal:4222" and s.node_port == 9000 and s.log_format == "json"
    assert str(s.data_dir) == "/var/lib/podbay"
    assert s.api_port == 8080  # neither file nor environment: the default
    clean_env.setenv("PODBAY_NODE_PORT", "9001")
    assert load_settings().node_port == 9001


def test_without_a_file_the_defaults_hold(clean_env: pytest.MonkeyPatch) -> None:
    s = load_settings()
    assert s.log_format == "text" and s.nats_url == "nats://127.0.0.1:4222"


@pytest.mark.parametrize(("content", "says"), [
    (None, "does not exist"),
    ("nats_url = ", "not valid TOML"),
    ('nats_urll = "x"\n', "unknown key(s) nats_urll"),
    ('node_port = "many"\n', "invalid setting node_port"),
    ('log_format = "xml"\n', "invalid setting log_format"),
])
def test_a_bad_file_is_one_clear_error(tmp_path: Path, clean_env: pytest.MonkeyPatch, content: str | None,
                                       says: str) -> None:
    f = tmp_path / "podbay.toml"
    if content is not None:
        f.write_text(content)
    clean_env.setenv(CONFIG_FILE_ENV, str(f))
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert says in err.value.message and "\n" not in err.value.message


@pytest.mark.parametrize("entry", ["podbay_scheduler.main", "podbay_api.main", "podbay_warmpool.main",
                                   "podbay_snapshotter.main", "podbay_nodeagent.main"])
def test_a_service_with_a_bad_file_exits_with_one_line(tmp_path: Path, entry: str) -> None:
    f = tmp_path / "podbay.toml"
    f.write_text("[unclosed\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODBAY_")}
    env[CONFIG_FILE_ENV] = str(f)
    p = subprocess.run([sys.executable, "-c", f"from {entry} import main; main()"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "not valid TOML" in lines[0] and str(f) in lines[0]


def test_the_settings_table_in_docs_operations_is_current() -> None:
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("gen_config_docs", root / "scripts" / "gen_config_docs.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    doc = (root / "docs" / "operations.md").read_text()
    assert gen.render(doc) == doc, "run: .venv/bin/python scripts/gen_config_docs.py"
    assert "`PODBAY_CONFIG_FILE`" in doc and "`PODBAY_LOG_FORMAT` / `log_format`" in doc
