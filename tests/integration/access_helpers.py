"""Helpers for the credential, key, audit and network tests: fresh tenants on the shared stack, and SQL."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from podbay.devstack.procs import free_port, stop_process
from podbay.devstack.stack import Stack


@dataclass
class Tenant:
    """A tenant of its own (so tests never see each other's rows), with one API key."""

    name: str
    tenant_id: str
    key: str
    api_url: str

    def http(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.api_url, headers={"authorization": f"Bearer {key or self.key}"},
                            timeout=30)


def new_tenant(stack: Stack, prefix: str) -> Tenant:
    """Mint a key for a new tenant through ``podbay-api create-key``, leaving the stack's dev key in place."""
    saved = stack.api_key, stack.tenant_id
    name = f"{prefix}-{secrets.token_hex(4)}"
    try:
        key = stack.create_api_key(name, "test")
        tenant_id = stack.tenant_id
    finally:
        stack.api_key, stack.tenant_id = saved
    return Tenant(name=name, tenant_id=tenant_id, key=key, api_url=stack.api_url)


def sql(stack: Stack, query: str, *args: Any) -> list[asyncpg.Record]:
    """Run one statement against the stack's PostgreSQL and return its rows."""

    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(stack.pg_dsn)
        try:
            return list(await conn.fetch(query, *args))
        finally:
            await conn.close()

    return asyncio.run(run())


def template_and_sandbox(stack: Stack, tenant: Tenant, state: str = "suspended") -> tuple[str, str]:
    """A template row and a sandbox row of ``tenant`` that no node runs (so no microVM is needed)."""
    tpl = f"nettest-{secrets.token_hex(3)}"
    sbx = f"sbx_{secrets.token_hex(12)}"
    sql(stack, "INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1, 'sha256:none', 256, 1)", tpl)
    sql(stack, "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, memory_mib,"
        " vcpus, hostname) VALUES ($1, $2, $3, 'sha256:none', $4, $4, 256, 1, 'h')", sbx, tenant.tenant_id, tpl, state)
    return tpl, sbx


@contextmanager
def second_api(stack: Stack, log: Path, **env_over: str) -> Iterator[str]:
    """Another ``podbay-api`` process on the stack's servers, with ``env_over`` on top of the stack's env;
    yields its URL once ``/healthz`` answers, stops it at the end."""
    port = free_port()
    # Ports of its own for the HTTP/2 and TLS listeners too: the stack's env names the first API's.
    env = {**stack.env, "PODBAY_API_PORT": str(port), "PODBAY_API_H2_PORT": str(free_port()), **env_over}
    if env.get("PODBAY_API_TLS_PORT"):
        env["PODBAY_API_TLS_PORT"] = str(free_port())
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(stack.bin_dir / "podbay-api")], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield url
    finally:
        stop_process(proc, grace_s=10)
