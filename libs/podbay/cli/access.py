"""``podbay credential``, ``podbay key``, ``podbay audit`` and ``podbay sandbox network`` (docs/DESIGN.md §6).

A credential's value is read from ``--value-file`` or standard input, never from the command line (argv is
visible to every local user in ``ps`` and lands in shell history).
"""

from __future__ import annotations

import ipaddress
import sys
from datetime import datetime
from pathlib import Path

import typer
from pydantic import ValidationError

from podbay.cli._common import IdArg, JsonFlag, client, handle_errors, print_json, print_rows
from podbay.contracts.access import CREDENTIAL_VALUE_MAX, NetworkInfo
from podbay.contracts.egress import EgressPolicy, EgressRule
from podbay.errors import InvalidRequest, validation_message

__all__ = ["credential_app", "key_app", "network_app", "audit", "parse_rule", "read_value"]

credential_app = typer.Typer(help="Credentials the gateway injects; values are write-only.", no_args_is_help=True)
key_app = typer.Typer(help="API keys of your tenant.", no_args_is_help=True)
network_app = typer.Typer(help="A sandbox's egress policy (default: no egress).", no_args_is_help=True)


def read_value(value_file: Path | None) -> str:
    """The credential value from ``value_file`` (``-`` = stdin) or, without it, from stdin when it is not a
    terminal. One trailing newline (what ``echo`` and editors add) is dropped. ``InvalidRequest`` otherwise."""
    try:
        if value_file is not None and str(value_file) != "-":
            raw = value_file.read_text(encoding="utf-8")
        elif value_file is not None or not sys.stdin.isatty():
            raw = sys.stdin.read(CREDENTIAL_VALUE_MAX + 2)
        else:
            raise InvalidRequest("give the value with --value-file PATH or on standard input")
    except UnicodeDecodeError:
        # The decoder's message quotes bytes of the secret: say only what is wrong.
        raise InvalidRequest("the credential value is not UTF-8 text") from None
    except OSError as exc:
        raise InvalidRequest(f"cannot read the value file: {exc.strerror}") from None
    if raw.endswith("\n"):
        raw = raw[:-1]
        if raw.endswith("\r"):
            raw = raw[:-1]
    if not raw:
        raise InvalidRequest("the credential value is empty")
    return raw


@credential_app.command("add")
@handle_errors
def credential_add(
    ctx: typer.Context,
    name: str = typer.Argument(..., metavar="NAME"),
    hosts: list[str] = typer.Option(..., "--host", help="Destination host or *.domain; repeatable."),
    value_file: Path | None = typer.Option(None, "--value-file", help="File holding the value ('-': stdin). "
                                           "Without it the value is read from stdin."),
    header: str = typer.Option("Authorization", "--header", help="Header the gateway sets."),
    fmt: str = typer.Option("Bearer {value}", "--format", help="Header value; must contain {value}."),
    path_prefix: str | None = typer.Option(None, "--path-prefix", help="Only requests under this path."),
    expires_at: datetime | None = typer.Option(None, "--expires-at", help="ISO 8601 time it stops working."),
    rate_limit: int | None = typer.Option(None, "--rate-limit", min=1, help="Injections per minute."),
    sandboxes: list[str] = typer.Option([], "--sandbox", help="Only this sandbox; repeatable."),
    templates: list[str] = typer.Option([], "--template", help="Only sandboxes of this template; repeatable."),
    as_json: JsonFlag = False,
) -> None:
    """Store credential NAME for --host destinations. The value is never shown again by anything."""
    info = client(ctx).credentials.create(
        name, read_value(value_file), hosts, header=header, format=fmt, path_prefix=path_prefix,
        expires_at=expires_at, rate_limit_per_min=rate_limit, sandboxes=sandboxes or None,
        templates=templates or None)
    if as_json:
        print_json(info)
    else:
        print(f"{info.name}: sandboxes in scope get {info.placeholder}=podbay-credential:{info.name}")


@credential_app.command("list")
@handle_errors
def credential_list(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """The tenant's credentials (never their values)."""
    creds = client(ctx).credentials.list()
    print_rows(creds, as_json, ["name", "hosts", "header", "expires", "rate/min", "backend"],
               ((c.name, ",".join(c.hosts), c.header,
                 c.expires_at.isoformat(timespec="seconds") if c.expires_at else "-",
                 c.rate_limit_per_min or "-", c.backend) for c in creds))


@credential_app.command("rm")
@handle_errors
def credential_rm(ctx: typer.Context, name: str = typer.Argument(..., metavar="NAME")) -> None:
    """Delete credential NAME; its value is destroyed."""
    client(ctx).credentials.delete(name)
    print(f"deleted {name}")


@key_app.command("create")
@handle_errors
def key_create(ctx: typer.Context, name: str = typer.Argument(..., metavar="NAME"),
               as_json: JsonFlag = False) -> None:
    """Create an API key and print it: it is shown this once."""
    k = client(ctx).keys.create(name)
    if as_json:
        print_json(k)
        return
    print(k.key)
    print(f"key {k.id} ({k.prefix}): store it now, it is not shown again", file=sys.stderr)


@key_app.command("list")
@handle_errors
def key_list(ctx: typer.Context, all_: bool = typer.Option(False, "--all", help="Include revoked keys."),
             as_json: JsonFlag = False) -> None:
    """The tenant's keys: id, name and prefix (never the key)."""
    keys = client(ctx).keys.list(all=all_)
    print_rows(keys, as_json, ["id", "name", "prefix", "created", "revoked"],
               ((k.id, k.name, k.prefix, k.created_at.isoformat(timespec="seconds"),
                 k.revoked_at.isoformat(timespec="seconds") if k.revoked_at else "-") for k in keys))


@key_app.command("revoke")
@handle_errors
def key_revoke(ctx: typer.Context, key_id: str = typer.Argument(..., metavar="KEY_ID")) -> None:
    """Revoke a key; it is refused from its next request on."""
    k = client(ctx).keys.revoke(key_id)
    print(f"revoked {k.id} ({k.prefix})")


@handle_errors
def audit(
    ctx: typer.Context,
    action: str | None = typer.Option(None, "--action", help="Only this action; 'sandbox.*' for a prefix."),
    sandbox_id: str | None = typer.Option(None, "--sandbox", help="Only rows about this sandbox."),
    since: datetime | None = typer.Option(None, "--since", help="Only rows at or after this ISO 8601 time."),
    limit: int = typer.Option(50, "--limit", min=1, max=1000),
    as_json: JsonFlag = False,
) -> None:
    """The tenant's audit log, newest first: API changes and the gateway's decisions."""
    page = client(ctx).audit(action=action, sandbox_id=sandbox_id, since=since, limit=limit)
    print_rows(page, as_json, ["id", "at", "actor", "action", "target", "decision"],
               ((e.id, e.at.isoformat(timespec="seconds"), e.actor, e.action, e.target or "-", e.decision or "-")
                for e in page.entries))


def parse_rule(value: str, *, cidr: bool | None = None) -> EgressRule:
    """``DOMAIN[:PORT]`` or ``CIDR[:PORT]`` (IPv6: ``2001:db8::/32:443``; the port follows the prefix length)
    as an :class:`EgressRule`. ``cidr`` None: a value with ``/`` or an IP address is a CIDR, else a domain."""
    target, port = value, None
    if "/" in value:
        net, _, plen = value.partition("/")
        if ":" in plen:
            plen, _, port = plen.partition(":")
        target = f"{net}/{plen}"
    elif value.count(":") == 1:
        target, _, port = value.partition(":")
    is_cidr = cidr if cidr is not None else ("/" in target or _is_ip(target))
    try:
        ports = [int(port)] if port else []
        return EgressRule(cidr=target, ports=ports) if is_cidr else EgressRule(domain=target, ports=ports)
    except ValidationError as exc:
        # pydantic's first message alone, not its multi-line report.
        raise InvalidRequest(f"invalid rule {value!r}: {validation_message(exc.errors()[0])}") from exc
    except ValueError as exc:
        raise InvalidRequest(f"invalid rule {value!r}: {exc}") from exc


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def _print_network(info: NetworkInfo, as_json: bool) -> None:
    if as_json:
        print_json(info)
        return
    print(f"source: {info.source}")
    for kind, rules in (("allow", info.policy.allow), ("deny", info.policy.deny)):
        for r in rules:
            ports = ",".join(str(p) for p in r.ports) or "any"
            print(f"{kind}  {r.domain or r.cidr}  ports {ports}")
    if not info.policy.allow:
        print("(no allow rule: no egress)")


@network_app.command("get")
@handle_errors
def network_get(ctx: typer.Context, sandbox_id: IdArg,
                as_json: JsonFlag = False) -> None:
    """The sandbox's effective egress policy and where it comes from."""
    _print_network(client(ctx).get_network(sandbox_id), as_json)


@network_app.command("set")
@handle_errors
def network_set(
    ctx: typer.Context,
    sandbox_id: IdArg,
    allow: list[str] = typer.Option([], "--allow", help="DOMAIN[:PORT] (or *.domain) to allow; repeatable."),
    allow_cidr: list[str] = typer.Option([], "--allow-cidr", help="CIDR[:PORT] to allow; repeatable."),
    deny: list[str] = typer.Option([], "--deny", help="DOMAIN[:PORT] or CIDR[:PORT] to deny; repeatable."),
    deny_cidr: list[str] = typer.Option([], "--deny-cidr", help="CIDR[:PORT] to deny; repeatable."),
    as_json: JsonFlag = False,
) -> None:
    """Replace the sandbox's egress policy (no option: no egress). Applies from its next connection."""
    policy = EgressPolicy(
        allow=[parse_rule(v) for v in allow] + [parse_rule(v, cidr=True) for v in allow_cidr],
        deny=[parse_rule(v) for v in deny] + [parse_rule(v, cidr=True) for v in deny_cidr])
    _print_network(client(ctx).set_network(sandbox_id, policy), as_json)
