"""``podbay up|down|status`` (the all-in-one dev stack) and ``podbay env``."""

from __future__ import annotations

import asyncio
import inspect
import shlex
import sys
from types import ModuleType
from typing import Any

import typer

from podbay.cli._common import fail, handle_errors, print_json, print_table, state
from podbay.clientconfig import load_client_config

__all__ = ["env", "up", "down", "status", "NO_STACK"]


def _supervisor() -> ModuleType:
    # Imported here: the dev stack pulls in server-side code that the other commands never need.
    try:
        from podbay.devstack import supervisor
    except ImportError as exc:
        fail(f"the dev stack is not available: {exc}", "unavailable", 1)
    return supervisor


def _settle(result: Any) -> Any:
    """The value itself, or what a coroutine returns when the supervisor is async."""
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def _settings() -> Any:
    from podbay.config import get_settings

    return get_settings()


@handle_errors
def env(ctx: typer.Context, e2b: bool = typer.Option(
        False, "--e2b", help="Print the E2B_* variables that point the e2b SDK at this stack instead.")) -> None:
    """Print `export PODBAY_API_URL=...` and `export PODBAY_API_KEY=...`; use `eval "$(podbay env)"`.

    With `--e2b`: `E2B_API_URL` (the API's `/e2b`), `E2B_SANDBOX_URL` (the API, which routes envd traffic
    by the `E2b-Sandbox-Id` header) and `E2B_API_KEY` (the podbay key) (docs/e2b.md)."""
    st = state(ctx)
    cfg = load_client_config(st.api_url, st.api_key)
    base = cfg.api_url.rstrip("/")
    if e2b:
        print(f"export E2B_API_URL={shlex.quote(base + '/e2b')}")
        print(f"export E2B_SANDBOX_URL={shlex.quote(base)}")
        if cfg.api_key:
            print(f"export E2B_API_KEY={shlex.quote(cfg.api_key)}")
        return
    print(f"export PODBAY_API_URL={shlex.quote(cfg.api_url)}")
    if cfg.api_key:
        print(f"export PODBAY_API_KEY={shlex.quote(cfg.api_key)}")


@handle_errors
def up(
    detach: bool = typer.Option(False, "--detach", "-d", help="Start in the background and return."),
    nodes: int = typer.Option(0, "--nodes", min=0, max=64, help="Nodes to run (each in its own network namespace; "
                              "default PODBAY_NODES, else 1)."),
) -> None:
    """Start the all-in-one dev stack (NATS, PostgreSQL, S3, API and services) on this host."""
    settings = _settings()
    if nodes:
        # Marked as set, so a detached supervisor is given PODBAY_NODES too.
        settings = settings.model_copy(update={"nodes": nodes})
    code = _settle(_supervisor().up(settings, detach=detach))
    if code:
        raise typer.Exit(int(code))
    if detach:
        print('podbay is up; run: eval "$(podbay env)"', file=sys.stderr)


@handle_errors
def down(
    purge: bool = typer.Option(False, "--purge", help="Also stop this stack's sandbox VMs and unmount its node stores."),
) -> None:
    """Stop the dev stack started with `podbay up`; sandbox VMs keep running unless --purge."""
    code = _settle(_supervisor().down(_settings(), purge=purge))
    if code:
        raise typer.Exit(int(code))


#: What ``podbay status`` says when no stack is recorded.
NO_STACK = "no podbay stack is running (start one with: podbay up)"

#: The part ``detail`` the supervisor reports for a process whose supervisor has died.
_ORPHANED = "no supervisor"


@handle_errors
def status(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Show each dev stack part and whether it answers.

    Exits 1, with the reason on stderr, when no stack runs, when a part does not answer, or when parts
    still run but their supervisor is gone (`podbay down` stops them).
    """
    parts = list(_settle(_supervisor().status(_settings())))
    if not parts:
        if as_json:
            print_json([])
        print(NO_STACK, file=sys.stderr, flush=True)
        raise typer.Exit(1)
    fields = ("name", "kind", "url", "pid", "answering", "detail")
    rows = [tuple(getattr(p, f, None) for f in fields) for p in parts]
    if as_json:
        print_json([dict(zip(fields, row, strict=True)) for row in rows])
    else:
        print_table(fields, ((n, k, u, pid, "yes" if ok else "NO", d) for n, k, u, pid, ok, d in rows))
    silent = [str(getattr(p, "name", "?")) for p in parts if not getattr(p, "answering", False)]
    orphaned = [str(getattr(p, "name", "?")) for p in parts if _ORPHANED in str(getattr(p, "detail", ""))]
    problems = []
    if orphaned:
        problems.append(
            f"the podbay supervisor is not running but {', '.join(orphaned)} still run without it "
            "(stop them with: podbay down)"
        )
    if silent:
        problems.append(f"not answering: {', '.join(silent)}")
    if problems:
        print("; ".join(problems), file=sys.stderr, flush=True)
        raise typer.Exit(1)
