"""``podbay-api``: the HTTP API process.

    podbay-api [serve]                         serve on PODBAY_API_HOST:PODBAY_API_PORT (and :PODBAY_API_H2_PORT)
    podbay-api migrate                         apply database migrations and exit
    podbay-api create-key --tenant T --name N [--replace]
                                               create tenant T if needed and print {"tenant_id", "key_id", "key",
                                               "revoked"}; --replace revokes T's live keys named N first
    podbay-api openapi                         print the OpenAPI document
    podbay-api grant-keys                      print a new node-grant key pair {"signing_key", "verify_key"}:
                                               PODBAY_GRANT_SIGNING_KEY for the API, PODBAY_GRANT_VERIFY_KEY
                                               for node agents (podbay.grants)

``create-key`` and ``migrate`` connect to ``PODBAY_PG_DSN``. When it is set neither in the environment nor in
``PODBAY_CONFIG_FILE``, they use the PostgreSQL of the dev stack that ``podbay up`` runs on this data dir (the
DSN it recorded in ``DATA_DIR/stack.json``, as ``podbay status`` finds the stack), saying so on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from typing import Any

import uvloop

from podbay import db
from podbay.config import ConfigError, Settings, get_settings
from podbay.devstack.supervisor import STATE_FILE, stack_env
from podbay.contracts.ids import ID_RE
from podbay.edge_tls import EdgeCertificates, domain_host
from podbay.errors import PodbayError
from podbay.grants import GrantKeyError, GrantSigner, new_keypair
from podbay.telemetry import setup_logging

from .app import create_app
from .core.auth import create_key, ensure_tenant, revoke_keys_named
from .core.serving import serve

__all__ = ["main"]


def _admin_dsn(settings: Settings) -> str:
    """The DSN ``create-key`` and ``migrate`` use: ``PODBAY_PG_DSN`` when configured (environment or file),
    else the running dev stack's (its ``stack.json`` in ``data_dir``; a note on stderr), else the default."""
    if "pg_dsn" in settings.model_fields_set:
        return settings.pg_dsn
    dsn = stack_env(settings).get("PODBAY_PG_DSN")
    if not dsn:
        return settings.pg_dsn
    print(f"podbay-api: PODBAY_PG_DSN is not set; using the dev stack's PostgreSQL "
          f"(from {settings.data_dir / STATE_FILE})", file=sys.stderr)
    return dsn


async def _create_key(tenant: str, name: str, replace: bool) -> dict[str, Any]:
    """Mint a key named ``name`` for ``tenant`` (created if needed); with ``replace``, first revoke the tenant's
    live keys of that name in the same transaction (``podbay up`` mints its dev key so: one live dev key per
    stack, not one more per start). Returns ``{"tenant_id", "key_id", "key", "revoked": [key ids]}``."""
    pool = await db.connect_pool(_admin_dsn(get_settings()), min_size=1, max_size=2)
    try:
        await db.migrate(pool)
        async with pool.acquire() as conn, conn.transaction():
            tenant_id = await ensure_tenant(conn, tenant)
            revoked = await revoke_keys_named(conn, tenant_id, name) if replace else []
            key_id, key = await create_key(conn, tenant_id, name)
        return {"tenant_id": tenant_id, "key_id": key_id, "key": key, "revoked": revoked}
    finally:
        await pool.close()


async def _migrate() -> list[str]:
    pool = await db.connect_pool(_admin_dsn(get_settings()), min_size=1, max_size=2)
    try:
        return await db.migrate(pool)
    finally:
        await pool.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="podbay-api")
    sub = parser.add_subparsers(dest="cmd")
    sub.add_parser("serve")
    sub.add_parser("migrate")
    sub.add_parser("openapi")
    sub.add_parser("grant-keys")
    ck = sub.add_parser("create-key")
    ck.add_argument("--tenant", required=True)
    ck.add_argument("--name", default="default")
    ck.add_argument("--replace", action="store_true", help="revoke the tenant's live keys of this name first")
    args = parser.parse_args(argv)
    if args.cmd == "grant-keys":  # needs no settings: an operator runs it once, before anything is configured
        signing, verify = new_keypair()
        print(json.dumps({"signing_key": signing, "verify_key": verify}))
        return
    try:
        settings = get_settings()
    except ConfigError as exc:  # a bad PODBAY_CONFIG_FILE or value: one line, exit 2
        print(f"podbay-api: {exc}", file=sys.stderr)
        sys.exit(2)
    setup_logging("api", settings.log_level)
    try:
        if args.cmd == "create-key":
            if not re.fullmatch(ID_RE, args.tenant):
                # A tenant is named in routes (/v1/tenants/{tenant}/quota) and logs: '', 'a b', '../etc' or
                # 'DEV' beside 'dev' would make tenants an operator cannot address or tell apart.
                print(f"podbay-api: --tenant {args.tenant!r} is not a tenant name: lowercase letters, digits, "
                      "'_' and '-', starting with a letter or digit, at most 64", file=sys.stderr)
                sys.exit(2)
            print(json.dumps(uvloop.run(_create_key(args.tenant, args.name, args.replace))))
            return
        if args.cmd == "migrate":
            print(json.dumps({"applied": uvloop.run(_migrate())}))
            return
        if args.cmd == "openapi":
            print(json.dumps(create_app(settings).openapi(), indent=2, sort_keys=True))
            return
    except PodbayError as exc:
        print(f"error: {exc.message} ({exc.code})", file=sys.stderr)
        sys.exit(1)
    try:
        # Every node call carries a grant this key signs (podbay.grants): without it no exec or file call works.
        GrantSigner(settings.grant_signing_key)
    except GrantKeyError as exc:
        print(f"podbay-api: PODBAY_GRANT_SIGNING_KEY: {exc}: the API signs node grants with it (base64 of a raw "
              "32-byte Ed25519 key: `podbay-api grant-keys` makes a pair; `podbay up` keeps one in "
              "DATA_DIR/grant.key)", file=sys.stderr)
        sys.exit(2)
    certs = _edge_certificates(settings)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    serve(create_app(settings), host=settings.api_host, port=settings.api_port, h2_port=settings.api_h2_port,
          tls_port=settings.api_tls_port, tls_certs=certs)


def _edge_certificates(settings: Settings) -> EdgeCertificates | None:
    """The TLS edge's certificates when ``PODBAY_API_TLS_PORT`` is set (services/api/edge/tls.py); exits 2
    with the settings to give when neither a certificate nor a CA is configured, or one does not load."""
    if settings.api_tls_port is None:
        return None
    domains = [domain_host(d) for d in (settings.e2b_domain, settings.ports_domain) if d]
    try:
        return EdgeCertificates(domains=domains, cert_file=settings.api_tls_cert_file,
                                key_file=settings.api_tls_key_file, ca_cert_file=settings.api_tls_ca_cert_file,
                                ca_key_file=settings.api_tls_ca_key_file)
    except (ValueError, OSError) as exc:  # ssl.SSLError is an OSError
        print(f"podbay-api: PODBAY_API_TLS_PORT is set but the TLS edge has no usable certificate ({exc}): set "
              "PODBAY_API_TLS_CERT_FILE and PODBAY_API_TLS_KEY_FILE, or PODBAY_API_TLS_CA_CERT_FILE and "
              "PODBAY_API_TLS_CA_KEY_FILE", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
