"""``podbay-api create-key`` / ``migrate`` against a real PostgreSQL: with ``PODBAY_PG_DSN`` unset they find the
dev stack's database through its ``stack.json``, as ``podbay status`` finds the stack; a configured DSN wins."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from podbay.devstack.stack import StackPorts
from podbay.devstack.supervisor import STATE_FILE, StackState

API = str(Path(sys.executable).parent / "podbay-api")


def _env(data_dir: Path, **extra: str) -> dict[str, str]:
    """This environment without any PODBAY_* setting (a fresh operator shell), with ``data_dir`` and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODBAY_")}
    return {**env, "PODBAY_DATA_DIR": str(data_dir), **extra}


def _write_stack_state(data_dir: Path, pg_dsn: str) -> None:
    """A ``stack.json`` as ``podbay up`` writes it, naming ``pg_dsn`` among the services' environment."""
    data_dir.mkdir(parents=True, exist_ok=True)
    state = StackState(state="ready", supervisor_pid=os.getpid(), supervisor_start_ticks=None, started_at=0.0,
                       api_url="http://127.0.0.1:8080", data_dir=str(data_dir), log_dir=str(data_dir / "logs"),
                       ports=StackPorts(), env={"PODBAY_PG_DSN": pg_dsn, "PODBAY_NATS_URL": "nats://127.0.0.1:4222"})
    path = data_dir / STATE_FILE
    path.write_text(state.model_dump_json())
    path.chmod(0o600)


def test_create_key_uses_the_dev_stack_database_when_no_dsn_is_set(pg_dsn: str, tmp_path: Path) -> None:
    _write_stack_state(tmp_path / "data", pg_dsn)
    done = subprocess.run([API, "create-key", "--tenant", "admin-cli-test", "--name", "ops"], capture_output=True,
                          text=True, timeout=120, env=_env(tmp_path / "data"))
    assert done.returncode == 0, done.stderr
    minted = json.loads(done.stdout)
    assert minted["key"].startswith("pb_") and minted["tenant_id"] and minted["key_id"]
    assert "using the dev stack's PostgreSQL" in done.stderr and STATE_FILE in done.stderr
    assert str(urlsplit(pg_dsn).password) not in done.stderr  # the note names the file, not the DSN


def test_migrate_uses_the_dev_stack_database_too(pg_dsn: str, tmp_path: Path) -> None:
    _write_stack_state(tmp_path / "data", pg_dsn)
    done = subprocess.run([API, "migrate"], capture_output=True, text=True, timeout=120, env=_env(tmp_path / "data"))
    assert done.returncode == 0, done.stderr
    assert "applied" in json.loads(done.stdout)


@pytest.mark.parametrize("where", ["environment", "config file"])
def test_a_configured_dsn_wins_over_the_dev_stack(pg_dsn: str, tmp_path: Path, where: str) -> None:
    _write_stack_state(tmp_path / "data", pg_dsn)
    parts = urlsplit(pg_dsn)
    wrong = urlunsplit(parts._replace(netloc=f"{parts.username}:not-the-password@{parts.hostname}:{parts.port}"))
    if where == "environment":
        env = _env(tmp_path / "data", PODBAY_PG_DSN=wrong)
    else:
        config = tmp_path / "podbay.toml"
        config.write_text(f"pg_dsn = {json.dumps(wrong)}\n")
        env = _env(tmp_path / "data", PODBAY_CONFIG_FILE=str(config))
    done = subprocess.run([API, "create-key", "--tenant", "admin-cli-test", "--name", "ops"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 1 and done.stdout == ""
    assert "(database_refused)" in done.stderr and "dev stack" not in done.stderr


def test_replace_revokes_the_live_keys_of_that_name_only(pg_dsn: str, tmp_path: Path) -> None:
    """``podbay up`` mints its dev key with ``--replace``: one live dev key per data directory, not one more per
    start. Keys of another name stay live."""
    env = _env(tmp_path / "data", PODBAY_PG_DSN=pg_dsn)

    def mint(name: str, *extra: str) -> dict[str, object]:
        done = subprocess.run([API, "create-key", "--tenant", "admin-cli-replace", "--name", name, *extra],
                              capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout))

    first, other = mint("dev"), mint("ops")
    assert first["revoked"] == []
    second = mint("dev", "--replace")
    assert second["revoked"] == [first["key_id"]]
    third = mint("dev", "--replace")
    assert third["revoked"] == [second["key_id"]]

    async def live() -> list[str]:
        conn = await asyncpg.connect(pg_dsn)
        try:
            rows = await conn.fetch("SELECT id FROM api_keys WHERE tenant_id=$1 AND revoked_at IS NULL ORDER BY id",
                                    third["tenant_id"])
            audit = await conn.fetchval("SELECT count(*) FROM audit_log WHERE target=ANY($1::text[])"
                                        " AND action='api_key.revoke'", [first["key_id"], second["key_id"]])
            assert audit == 2
            return [r["id"] for r in rows]
        finally:
            await conn.close()

    assert sorted(asyncio.run(live())) == sorted([third["key_id"], other["key_id"]])


@pytest.mark.parametrize("tenant", ["", "a b", "../etc", "DEV", "x" * 65, "_lead"])
def test_create_key_refuses_a_tenant_name_an_operator_could_not_address(pg_dsn: str, tmp_path: Path,
                                                                         tenant: str) -> None:
    done = subprocess.run([API, "create-key", "--tenant", tenant, "--name", "ops"], capture_output=True, text=True,
                          timeout=120, env=_env(tmp_path / "data", PODBAY_PG_DSN=pg_dsn))
    assert done.returncode == 2, done.stdout
    assert "is not a tenant name" in done.stderr and not done.stdout
    rows = asyncio.run(_tenants_named(pg_dsn, tenant))
    assert rows == 0  # nothing was made


async def _tenants_named(dsn: str, name: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM tenants WHERE name = $1", name))
    finally:
        await conn.close()
