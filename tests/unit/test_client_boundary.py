"""The client package (libs/pyproject.toml) imports nothing of the server, and says so when a host command
needs the server package.

The client's modules run here in a child Python where every server module of ``podbay``, every service and
the server's libraries refuse to import, and where no ``podbay.cli`` entry point is installed: the situation
of a fresh ``pip install podbay``. tests/integration/test_client_package.py builds and installs the real
wheel.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Top-level modules of the server package's dependencies and of the services, none of which the client
#: may import.
SERVER_TOPS = (
    "asyncpg", "fastapi", "uvicorn", "qemu", "nats", "aiobotocore", "botocore", "hvac", "pyroute2", "connectrpc",
    "uvloop", "zstandard", "pydantic_settings", "prometheus_client", "tenacity", "cryptography",
    "podbay_api", "podbay_scheduler", "podbay_nodeagent", "podbay_snapshotter", "podbay_warmpool",
    "podbay_gateway", "podbay_guestd",
)

_CHILD = r"""
import importlib, importlib.abc, importlib.metadata, json, pkgutil, sys
client_packages, client_modules, server_tops = json.loads(sys.argv[1])
client = {"podbay", *client_packages, *client_modules}

def is_client(name):
    return name in client or any(name.startswith(p + ".") for p in client_packages)

class RefuseServer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in server_tops or (name.startswith("podbay.") and not is_client(name)):
            raise ImportError(f"the client imported {name}")
        return None

sys.meta_path.insert(0, RefuseServer())
importlib.metadata.entry_points = lambda **kw: []  # no server package installed
from podbay import Sandbox, AsyncSandbox
for pkg in client_packages:
    for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        importlib.import_module(info.name)
for mod in client_modules:
    importlib.import_module(mod)
from typer.testing import CliRunner
from podbay.cli.main import app
runner = CliRunner()
results = {argv: runner.invoke(app, argv.split()) for argv in ("up --detach", "down", "status", "template build base")}
print(json.dumps({
    "imported": sorted(m for m in sys.modules if m.startswith("podbay")),
    "commands": {argv: [r.exit_code, r.stderr] for argv, r in results.items()},
    "help": runner.invoke(app, ["--help"]).exit_code,
}))
"""


def _client_lists() -> tuple[list[str], list[str]]:
    cfg = tomllib.loads((ROOT / "libs" / "pyproject.toml").read_text())["tool"]["setuptools"]
    return cfg["packages"], cfg["py-modules"]


def test_client_modules_import_no_server_code_and_host_commands_name_the_server_package() -> None:
    packages, modules = _client_lists()
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([packages, modules, SERVER_TOPS])],
        capture_output=True, text=True, check=False, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert "podbay.cli.main" in seen["imported"] and "podbay.sdk" in seen["imported"]
    assert seen["help"] == 0
    named = {"up --detach": "up", "down": "down", "status": "status", "template build base": "template build"}
    for argv, (code, stderr) in seen["commands"].items():
        assert (code, stderr) == (
            1, f"error: `podbay {named[argv]}` comes with the server package: pip install podbay-server (unavailable)\n"
        ), argv


def test_with_the_server_package_the_host_commands_are_its_own() -> None:
    from podbay import servercli
    from podbay.cli.main import app
    from podbay.cli.template import template_app

    root = {c.name: c.callback for c in app.registered_commands}
    assert (root["up"], root["down"], root["status"]) == (servercli.up, servercli.down, servercli.status)
    assert {c.name: c.callback for c in template_app.registered_commands}["build"] is servercli.build
