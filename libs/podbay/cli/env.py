"""``podbay env``: the shell exports that point the SDK (or E2B's SDK) at the configured API."""

from __future__ import annotations

import os
import shlex
import sys

import typer

from podbay.cli._common import handle_errors, state
from podbay.clientconfig import config_path, load_client_config, stack_edge
from podbay.contracts.e2b import to_e2b_key

__all__ = ["env"]


@handle_errors
def env(ctx: typer.Context, e2b: bool = typer.Option(
        False, "--e2b", help="Print the E2B_* variables that point the e2b SDK at this stack instead.")) -> None:
    """Print `export PODBAY_API_URL=...` and `export PODBAY_API_KEY=...`; use `eval "$(podbay env)"`.

    With `--e2b`: `E2B_API_URL` (the API's `/e2b`), `E2B_SANDBOX_URL` (the API, which routes envd traffic
    by the `E2b-Sandbox-Id` header), `E2B_VOLUME_API_URL` (the API's `/e2b` again, for E2B's volume content
    API) and `E2B_API_KEY` (the podbay key in its `e2b_` alias form, which E2B SDKs that check a key's shape
    accept) (docs/e2b.md). For a stack `podbay up` started (the config file names it), also what makes
    `https://` + `Sandbox.get_host(port)` work (docs/operations.md "Ports by hostname"): `E2B_DOMAIN` (its
    `e2b.localhost:<port>` domain), and trust in its TLS edge's CA: `SSL_CERT_FILE` (OpenSSL, so Python's
    ssl, httpx and curl) and `REQUESTS_CA_BUNDLE` (requests) name a bundle of the system's roots plus that
    CA, as both replace rather than extend the roots; `NODE_EXTRA_CA_CERTS` (Node.js, which adds it to its
    own roots) names the CA alone.

    The values come from `--api-url`/`--api-key`, else the config file `podbay up` writes, else
    `PODBAY_API_URL`/`PODBAY_API_KEY`: the file before the environment, so that after a restart (which
    replaces the dev key) `eval "$(podbay env)"` exports the new key over the one the shell holds; a
    warning on stderr names each exported value that replaces the environment's.

    Without a key configured (no stack started with `podbay up` on this account, no `PODBAY_API_KEY`, no
    `--api-key`), the URL exports are printed alone, with a warning on stderr, and the exit status is 1: an
    `eval` of them leaves the key unset."""
    st = state(ctx)
    cfg = load_client_config(st.api_url, st.api_key, prefer_file=True)
    for var, flag, value in (("PODBAY_API_URL", st.api_url, cfg.api_url), ("PODBAY_API_KEY", st.api_key, cfg.api_key)):
        if not flag and os.environ.get(var) and value and os.environ[var].rstrip("/") != value:
            print(f"warning: {var} in the environment differs from the config file {config_path()}; "
                  "exporting the file's", file=sys.stderr)
    base = cfg.api_url.rstrip("/")
    if e2b:
        print(f"export E2B_API_URL={shlex.quote(base + '/e2b')}")
        print(f"export E2B_SANDBOX_URL={shlex.quote(base)}")
        # E2B's volume content client appends /volumecontent/<volumeID>/... to this (its default is E2B's host).
        print(f"export E2B_VOLUME_API_URL={shlex.quote(base + '/e2b')}")
        if cfg.api_key:
            print(f"export E2B_API_KEY={shlex.quote(to_e2b_key(cfg.api_key))}")
        edge = stack_edge(base)
        if edge is not None:
            for var, value in (("E2B_DOMAIN", edge.e2b_domain), ("SSL_CERT_FILE", edge.ca_bundle),
                               ("REQUESTS_CA_BUNDLE", edge.ca_bundle), ("NODE_EXTRA_CA_CERTS", edge.ca_cert)):
                if value:
                    print(f"export {var}={shlex.quote(value)}")
    else:
        print(f"export PODBAY_API_URL={shlex.quote(cfg.api_url)}")
        if cfg.api_key:
            print(f"export PODBAY_API_KEY={shlex.quote(cfg.api_key)}")
    if not cfg.api_key:
        print("warning: no API key is configured, so none is exported: start a stack with `podbay up` (it writes "
              "the client config), or set PODBAY_API_KEY or --api-key", file=sys.stderr)
        raise typer.Exit(1)
