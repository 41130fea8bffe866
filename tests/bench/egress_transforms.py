"""Benchmark: what a header transform, a secret and a minted workload identity token add to one egress request
at the gateway (its per-request work, against a real PostgreSQL; no VM, no network).

    .venv/bin/python tests/bench/egress_transforms.py --requests 400 --json egress_transforms.json

For each request the gateway's proxy (services/gateway/proxy.py ``_inject``) reads the sandbox's transforms for
the host (``transform_headers``) and resolves their placeholders (``Gateway.resolve_transform``); this times
exactly that, per request, for four rule sets on a sandbox row:

- ``none``: no rule for the host (the cost every intercepted request pays anyway: the lookup finds nothing);
- ``transform``: one rule setting two literal headers (E2B's ``{"transform": {"headers": ...}}``);
- ``secret``: a header with ``${e2b.secrets.<name>}`` (an E2B secret's row read, AES-256-GCM decrypted);
- ``token``: a header with ``${e2b.identity.tokens.<name>}`` (a JWT minted and signed RS256; the signing key is
  cached by the gateway, read again every 30 s).

The added cost of a rule is its row minus ``none``. The TLS interception a rule implies (as for a credential)
is not included: it is the same as for a credential and paid once per connection.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from _stats import report, summarise, stop_on_sigterm

from podbay import db
from podbay.config import Settings
from podbay.contracts.egress import EgressPolicy
from podbay.credentials import PgCredentialStore, new_key
from podbay.devstack.procs import free_port
from podbay.devstack.servers import start_postgres
from podbay_gateway.engine import Gateway, Peer
from podbay_gateway.policy import transform_headers
from podbay_gateway.store import GatewayStore, SandboxContext

HOST = "api.example.com"
RULES = {
    "none": [],
    "transform": [{"domain": HOST, "headers": {"X-Team": "blue", "X-Client": "podbay-bench"}}],
    "secret": [{"domain": HOST, "headers": {"X-Api-Key": "${e2b.secrets.bench-key}"}}],
    "token": [{"domain": HOST, "headers": {"Authorization": "Bearer ${e2b.identity.tokens.aws}"}}],
}


async def _run(dsn: str, requests: int) -> dict[str, dict[str, object]]:
    pool = await db.connect_pool(dsn, min_size=1, max_size=4)
    await db.migrate(pool)
    key = new_key()
    settings = Settings(pg_dsn=dsn, credential_key=key, oidc_issuer="https://issuer.bench")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ('tnt_bench', 'bench') ON CONFLICT DO NOTHING")
    sealed = await PgCredentialStore(key).seal("sec_bench", "tnt_bench", "value-of-the-bench-secret")
    await pool.execute(
        "INSERT INTO credentials (id, tenant_id, name, hosts, header, format, backend, ciphertext, scope_sandboxes)"
        " VALUES ('sec_bench','tnt_bench','bench-key','{}','Authorization','{value}','pg',$1,'{}')"
        " ON CONFLICT DO NOTHING", sealed.ciphertext)
    await pool.execute("INSERT INTO e2b_secrets (credential_id, tenant_id) VALUES ('sec_bench', 'tnt_bench')"
                       " ON CONFLICT DO NOTHING")  # as the Secrets API makes one
    gw = Gateway(settings, GatewayStore(pool, "bench"), None)
    tokens = {"aws": {"audience": "sts.amazonaws.com", "tokenType": "JWT-SVID"}}
    results: dict[str, dict[str, object]] = {}
    p50_us: dict[str, float] = {}
    p99_us: dict[str, float] = {}
    for name, transforms in RULES.items():
        ctx = SandboxContext("sbx_bench", "tnt_bench", "base", 1, "running",
                             EgressPolicy.model_validate({"allow": [{"domain": HOST}], "transforms": transforms}),
                             tokens)
        peer = Peer("10.0.0.2", None, ctx)
        await gw.resolve_transform(peer, transform_headers(ctx.policy, HOST))  # warm: the signing key is read
        samples: list[float] = []
        for _ in range(requests):
            t0 = time.perf_counter()
            headers, _ = await gw.resolve_transform(peer, transform_headers(ctx.policy, HOST))
            samples.append((time.perf_counter() - t0) * 1000)
            assert bool(headers) == bool(transforms)
        results[name] = summarise(samples)
        us = sorted(x * 1000 for x in samples)
        p50_us[name], p99_us[name] = us[len(us) // 2], us[min(len(us) - 1, int(len(us) * 0.99))]
    for name in RULES:  # the ms table rounds these away: microseconds, and the added cost over no rule
        results[f"{name}_us"] = {"value": f"p50 {p50_us[name]:.0f} µs, p99 {p99_us[name]:.0f} µs",
                                 "p50_us": round(p50_us[name], 1), "p99_us": round(p99_us[name], 1),
                                 "added_p50_us": round(p50_us[name] - p50_us["none"], 1),
                                 "added_p99_us": round(p99_us[name] - p99_us["none"], 1)}
    await pool.close()
    return results


def main() -> None:
    stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--pg-dsn", default=None, help="an existing PostgreSQL (else one is started in a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.pg_dsn:
        report(asyncio.run(_run(args.pg_dsn, args.requests)), args.json)
        return
    with tempfile.TemporaryDirectory(prefix="podbay-bench-egress-") as d:
        server = start_postgres(Path(d) / "pg", free_port(), durable=False)
        try:
            report(asyncio.run(_run(server.dsn, args.requests)), args.json)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
