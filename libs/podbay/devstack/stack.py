"""A whole podbay stack on one machine: the three servers plus every service as a child process.

Used by ``podbay up`` (through :mod:`podbay.devstack.supervisor`) and by the ``stack`` test fixture, so that
both start the services the same way: each by its console script next to ``sys.executable``
(``podbay-api``, ``podbay-scheduler``, ``podbay-nodeagent``, ``podbay-snapshotter``, ``podbay-warmpool``; and
``podbay-gateway`` from its own virtualenv, see :func:`gateway_executable`), with
its configuration as ``PODBAY_*`` environment variables, its output in ``<log_dir>/<name>.log``, and
start-up finished only when ``GET http://127.0.0.1:<port>/healthz`` answers 200. The servers start first, all
at once (none needs another); then the API, which applies the migrations; then every other service at once.

Replicas: ``PODBAY_API_REPLICAS``, ``PODBAY_SCHEDULER_REPLICAS`` and ``PODBAY_WARMPOOL_REPLICAS`` (default 1; or
``Stack(replicas={...})``) start that many processes of the service. The first is ``api`` (``scheduler``,
``warmpool``) on the usual port; each further one is ``api-2``, ``api-3``, ... on a free port of its own (its
``PODBAY_<SERVICE>_PORT`` set to it), logging to ``<log_dir>/api-2.log``. They share everything else, as
replicas on several hosts would. Other services run once per host and refuse a replica count.

NATS cluster: ``PODBAY_NATS_SERVERS=3`` (or ``Stack(nats_servers=3)``) starts three JetStream servers clustered
over routes on loopback ports (``nats`` on the usual port, ``nats-2`` and ``nats-3`` and every route port on free
ones; stores ``servers/nats/<name>/``); ``PODBAY_NATS_URL`` then lists all three, and podbay's streams and KV
buckets get three replicas (:func:`podbay.bus.stream_replicas`). The default stays one server.

Layout under ``data_dir``: ``servers/{nats,postgres,s3}/`` for server state; the services use ``data_dir``
itself (``PODBAY_DATA_DIR``) for theirs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel

from podbay.config import Settings
from podbay.credentials import new_key
from podbay.devstack import servers as srv
from podbay.devstack.netns import NodeNetwork, plan_network, purge_networks, sweep_orphans
from podbay.devstack.nodeops import NodeOps
from podbay.devstack.openbao import probe_openbao, start_openbao
from podbay.devstack.vms import find_strays, kill_strays, node_stores, unmount_node_stores
from podbay.devstack.procs import free_port, free_ports, port_is_free, process_start_ticks, run_sync, stop_process, tail
from podbay.errors import Unavailable
from podbay.grants import new_keypair, public_key_of
from podbay.edge_tls import ensure_dev_ca, write_trust_bundle
from podbay.hostca import host_extra_cas, to_pem
from podbay.stacknet import register_stack

__all__ = [
    "SERVICES",
    "REPLICABLE",
    "replica_counts",
    "SERVER_NAMES",
    "ServiceSpec",
    "StackPorts",
    "External",
    "StackError",
    "ServiceProcess",
    "Stack",
    "PortInUse",
    "check_ports_free",
    "find_strays",
    "kill_strays",
    "node_stores",
    "unmount_node_stores",
    "default_bin_dir",
    "gateway_executable",
    "credential_key_for",
    "internal_token_for",
    "grant_keys_for",
    "guest_ca_for",
    "NODE_SERVICES",
]

log = logging.getLogger("podbay.devstack")


@dataclass(frozen=True)
class ServiceSpec:
    """A service: its ``name``, console ``script`` and the :class:`StackPorts` field holding its HTTP port."""

    name: str
    script: str
    port_field: str


SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec("api", "podbay-api", "api"),
    ServiceSpec("scheduler", "podbay-scheduler", "scheduler"),
    ServiceSpec("nodeagent", "podbay-nodeagent", "node"),
    ServiceSpec("snapshotter", "podbay-snapshotter", "snapshotter"),
    ServiceSpec("warmpool", "podbay-warmpool", "warmpool"),
    ServiceSpec("gateway", "podbay-gateway", "gateway"),
)
SERVER_NAMES: tuple[str, ...] = ("nats", "postgres", "s3")
#: Services that run once per node; in a multi-node stack each node's copy is named ``<service>@<node id>``
#: and runs inside that node's network namespace (:mod:`podbay.devstack.netns`).
NODE_SERVICES: frozenset[str] = frozenset({"nodeagent", "snapshotter", "gateway"})

#: Services that may run as several processes at once (the others run one per host), and the variable of each
#: one's port, which every further replica gets set to a free port.
REPLICABLE: dict[str, str] = {"api": "PODBAY_API_PORT", "scheduler": "PODBAY_SCHEDULER_PORT",
                              "warmpool": "PODBAY_WARMPOOL_PORT"}


def replica_counts(env: dict[str, str], explicit: dict[str, int] | None = None) -> dict[str, int]:
    """Processes per replicable service: ``explicit``, else ``PODBAY_<SERVICE>_REPLICAS`` from ``env``, else 1.

    Raises :class:`StackError` for a count that is not an integer from 1 to 16, or a service that cannot have
    replicas.
    """
    out: dict[str, int] = {}
    for name in explicit or {}:
        if name not in REPLICABLE:
            raise StackError(f"{name} runs once per host; only {', '.join(REPLICABLE)} can have replicas",
                             details={"part": name})
    for name in REPLICABLE:
        var = f"PODBAY_{name.upper()}_REPLICAS"
        raw = (explicit or {}).get(name, env.get(var) or 1)
        try:
            n = int(raw)
        except (TypeError, ValueError):
            n = 0
        if not 1 <= n <= 16:
            raise StackError(f"{var} must be an integer from 1 to 16, not {raw!r}", details={"part": name})
        out[name] = n
    return out


class StackPorts(BaseModel):
    """Loopback TCP ports of every part of a stack."""

    nats: int = 4222
    pg: int = 5432
    s3: int = 8333
    api: int = 8080
    #: The API's HTTP/2-capable listener (PODBAY_API_H2_PORT; services/api/core/serving.py).
    api_h2: int = 8081
    #: The API's HTTPS listener, the TLS edge (PODBAY_API_TLS_PORT; services/api/edge/tls.py).
    api_tls: int = 8443
    node: int = 8090
    scheduler: int = 8091
    snapshotter: int = 8092
    warmpool: int = 8093
    gateway: int = 8095
    gateway_proxy: int = 8094
    gateway_dns: int = 8053

    @classmethod
    def from_settings(cls, settings: Settings) -> StackPorts:
        """Service ports from ``settings``; server ports from ``PODBAY_NATS_PORT``, ``PODBAY_PG_PORT`` and
        ``PODBAY_S3_PORT`` (defaults 4222, 5432, 8333) until Settings has fields for them."""
        extra = {k: getattr(settings, f"{k}_port", None) for k in ("nats", "pg", "s3")}
        env = {k: os.environ.get(f"PODBAY_{k.upper()}_PORT") for k in ("nats", "pg", "s3")}
        servers = {k: int(env[k] or extra[k] or cls.model_fields[k].default) for k in ("nats", "pg", "s3")}
        return cls(
            **servers,
            api=settings.api_port,
            api_h2=settings.api_h2_port or cls.model_fields["api_h2"].default,
            api_tls=settings.api_tls_port or cls.model_fields["api_tls"].default,
            node=settings.node_port,
            scheduler=settings.scheduler_port,
            snapshotter=settings.snapshotter_port,
            warmpool=settings.warmpool_port,
            gateway=settings.gateway_port,
            gateway_proxy=settings.gateway_proxy_port,
            gateway_dns=settings.gateway_dns_port,
        )

    @classmethod
    def free(cls) -> StackPorts:
        """Freshly chosen free ports for every part (test stacks)."""
        names = list(cls.model_fields)
        return cls(**dict(zip(names, free_ports(len(names)), strict=True)))


class External(BaseModel):
    """Servers not started by the stack: each given one is used as is (``None`` means: start our own)."""

    nats_url: str | None = None
    pg_dsn: str | None = None
    s3_url: str | None = None
    s3_access_key: str | None = None
    s3_secret_key: str | None = None

    @classmethod
    def from_env(cls) -> External:
        """From ``PODBAY_NATS_URL``, ``PODBAY_PG_DSN``, ``PODBAY_S3_URL`` and the ``AWS_*`` keys, when set."""
        env = os.environ
        return cls(
            nats_url=env.get("PODBAY_NATS_URL") or None,
            pg_dsn=env.get("PODBAY_PG_DSN") or None,
            s3_url=env.get("PODBAY_S3_URL") or None,
            s3_access_key=env.get("AWS_ACCESS_KEY_ID") or None,
            s3_secret_key=env.get("AWS_SECRET_ACCESS_KEY") or None,
        )


class StackError(Unavailable):
    """A part did not start or answer; ``details`` has ``part``, ``log`` and ``log_tail``."""

    code = "stack_unavailable"


class PortInUse(StackError):
    """A port the stack would bind is already taken; ``details`` has ``part``, ``port`` and ``variable``."""

    code = "port_in_use"


# The variable that moves each port (the message tells the user which one to set).
_PORT_VARIABLES = {
    "nats": "PODBAY_NATS_PORT", "pg": "PODBAY_PG_PORT", "s3": "PODBAY_S3_PORT", "api": "PODBAY_API_PORT",
    "api_h2": "PODBAY_API_H2_PORT", "api_tls": "PODBAY_API_TLS_PORT", "node": "PODBAY_NODE_PORT", "scheduler": "PODBAY_SCHEDULER_PORT", "snapshotter": "PODBAY_SNAPSHOTTER_PORT",
    "warmpool": "PODBAY_WARMPOOL_PORT", "gateway": "PODBAY_GATEWAY_PORT",
    "gateway_proxy": "PODBAY_GATEWAY_PROXY_PORT", "gateway_dns": "PODBAY_GATEWAY_DNS_PORT",
}  # fmt: skip
_PART_OF_PORT = {"api_h2": "api", "api_tls": "api", "pg": "postgres", "node": "nodeagent", "gateway_proxy": "gateway", "gateway_dns": "gateway"}


def check_ports_free(ports: StackPorts, external: External | None = None) -> None:
    """Raise :class:`PortInUse` for the first port of ``ports`` that a listener could not bind now, naming the
    part and the variable that moves it (``port 4222 (nats) is in use; set PODBAY_NATS_PORT``). Ports of
    servers given in ``external`` are not bound by the stack and are skipped.

    Why up front: a server whose port is taken exits at once, but its readiness probe may meanwhile be
    answered by whatever holds the port (another stack's NATS), which would pass for ours.
    """
    ext = external or External()
    skip = {"nats": bool(ext.nats_url), "pg": bool(ext.pg_dsn), "s3": bool(ext.s3_url)}
    for key, port in ports.model_dump().items():
        if skip.get(key) or port_is_free(port):
            continue
        part, variable = _PART_OF_PORT.get(key, key), _PORT_VARIABLES[key]
        raise PortInUse(
            f"port {port} ({part}) is in use; set {variable}",
            details={"part": part, "port": port, "variable": variable},
        )


@dataclass
class ServiceProcess:
    """A service child: spawned by :meth:`start`, healthy when ``health_url`` answers 200."""

    spec: ServiceSpec
    argv: list[str]
    env: dict[str, str] = field(repr=False)  # holds keys and passwords
    log_path: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None
    start_ticks: int | None = None
    log_offset: int = 0
    #: Instance name of a further replica (``api-2``); empty for the first process of a service.
    instance: str = ""
    #: Address its health endpoint answers on (a node's namespace address for a multi-node node agent).
    host: str = "127.0.0.1"
    #: The network namespace it runs in (multi-node stacks), entered with ``nsenter``; None: the host's.
    netns: str | None = None
    #: The node it belongs to, for per-node services of a multi-node stack.
    node_id: str | None = None

    @property
    def name(self) -> str:
        """The part name: the service's (``api``, ``scheduler``, ...), a further replica's (``api-2``), or a
        node's copy in a multi-node stack (``nodeagent@node-a``)."""
        if self.instance:
            return self.instance
        return f"{self.spec.name}@{self.node_id}" if self.node_id else self.spec.name

    @property
    def url(self) -> str:
        """``http://<host>:<port>`` (host ``127.0.0.1`` unless the service runs in a node namespace)."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The process id, while it has been started."""
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        """Whether the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Spawn the service (in its own session, output appended to its log)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {self.name}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.start_ticks = process_start_ticks(self.proc.pid)

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """Whether ``GET /healthz`` answers 200 now (asked from inside its namespace when it listens on that
        namespace's loopback)."""
        if self.netns and self.host == "127.0.0.1":
            argv = ["nsenter", f"--net=/run/netns/{self.netns}", "--", "curl", "-sf", "-o", "/dev/null",
                    "-m", str(timeout_s), f"{self.url}/healthz"]
            return subprocess.run(argv, capture_output=True, timeout=timeout_s + 5, check=False).returncode == 0
        try:
            return httpx.get(f"{self.url}/healthz", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until healthy; raises :class:`StackError` with the log tail if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.proc.returncode if self.proc else None
                raise self._error(f"exited with code {code} during start-up")
            # Alive after the answer too: with our port taken by someone else, their /healthz may answer
            # while our process is exiting on "address already in use".
            if self.healthy() and self.alive():
                return
            time.sleep(delay)
            delay = min(0.5, delay * 1.5)
        raise self._error(f"did not answer GET /healthz with 200 within {timeout_s:.0f} s")

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_s`` seconds; returns the exit code (None if never started)."""
        return stop_process(self.proc, grace_s=grace_s) if self.proc else None

    def _error(self, why: str) -> StackError:
        log_tail = tail(self.log_path, start=self.log_offset)
        return StackError(
            f"{self.name} {why} (log {self.log_path}):\n{log_tail}",
            details={"part": self.name, "log": str(self.log_path), "log_tail": log_tail},
        )


def default_bin_dir() -> Path:
    """Where the services' console scripts are: ``PODBAY_BIN_DIR``, else the directory of ``sys.executable``."""
    return Path(os.environ.get("PODBAY_BIN_DIR") or Path(sys.executable).parent)


def gateway_executable(explicit: str | Path | None = None, bin_dir: Path | None = None) -> Path:
    """The ``podbay-gateway`` to run: ``explicit`` (``settings.gateway_bin``), else ``PODBAY_GATEWAY_BIN``, else
    the gateway virtualenv beside this one (``<checkout>/.venv-gateway/bin``; scripts/setup.sh creates it,
    because mitmproxy cannot share ``.venv`` with the test extra), else the one in ``bin_dir``."""
    chosen = explicit or os.environ.get("PODBAY_GATEWAY_BIN")
    if chosen:
        return Path(chosen)
    bins = bin_dir or default_bin_dir()
    for venv_bin in (bins, Path(sys.prefix) / "bin"):
        sibling = venv_bin.parent.parent / ".venv-gateway" / "bin" / "podbay-gateway"
        if sibling.exists():
            return sibling
    return bins / "podbay-gateway"


def credential_key_for(data_dir: Path, env: dict[str, str]) -> str:
    """The credential sealing key of a stack: ``PODBAY_CREDENTIAL_KEY`` when given, else the one kept in
    ``DATA_DIR/credential.key`` (created on first use, mode 0600), so that the API (which seals) and the gateway
    (which reveals) share it and a restarted stack can still read what it sealed."""
    return env.get("PODBAY_CREDENTIAL_KEY") or _kept_secret(data_dir / "credential.key", new_key)


def internal_token_for(data_dir: Path, env: dict[str, str]) -> str:
    """The secret the API and the node data planes share (``PODBAY_INTERNAL_TOKEN`` when given, else the one
    kept in ``DATA_DIR/internal.token``, created on first use, mode 0600). Kept, not drawn anew at each start,
    because the tokens derived from it outlive a restart: the port edge's traffic tokens and cookies, E2B's
    envd access tokens."""
    return env.get("PODBAY_INTERNAL_TOKEN") or _kept_secret(data_dir / "internal.token",
                                                           lambda: secrets.token_urlsafe(32))


def grant_keys_for(data_dir: Path, env: dict[str, str]) -> tuple[str, str]:
    """``(signing key, verify key)`` of a stack's node grants (podbay.grants): ``PODBAY_GRANT_SIGNING_KEY``
    when given, else the one kept in ``DATA_DIR/grant.key`` (created on first use, mode 0600); the verify key
    is ``PODBAY_GRANT_VERIFY_KEY`` when given, else derived from the signing key. Only API processes get the
    signing key (:meth:`Stack._service`); node agents get the verify key."""
    signing = env.get("PODBAY_GRANT_SIGNING_KEY") or _kept_secret(data_dir / "grant.key", lambda: new_keypair()[0])
    return signing, env.get("PODBAY_GRANT_VERIFY_KEY") or public_key_of(signing)


def _kept_secret(path: Path, make: Callable[[], str]) -> str:
    """The secret in ``path``, or a new one from ``make`` written there first (mode 0600, never overwritten:
    of two starts racing, the second reads what the first wrote)."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    value = make()
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


def guest_ca_for(data_dir: Path, env: dict[str, str]) -> Path | None:
    """The extra CAs a stack's guests trust (``PODBAY_GUEST_CA_FILE``, docs/egress.md "Guest trust"): None when
    the caller set that variable (its value passes through; empty turns it off) or the host trusts nothing
    beyond the public roots; else ``DATA_DIR/guest-ca.pem``, written with what the host's bundle
    (``SSL_CERT_FILE`` in ``env``, else OpenSSL's default) holds beyond them: the CA of a network that inspects
    TLS, which guests meet because the gateway passes their TLS through. A bundle that cannot be read adds
    nothing (logged)."""
    if "PODBAY_GUEST_CA_FILE" in env:
        return None
    bundle = Path(env["SSL_CERT_FILE"]) if env.get("SSL_CERT_FILE") else None
    try:
        extra = host_extra_cas(bundle)
    except (OSError, ValueError) as exc:
        log.warning("guests get no extra CA: the host's CA bundle cannot be read (%s)", exc)
        return None
    if not extra:
        return None
    path = data_dir / "guest-ca.pem"
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pem.tmp")
    tmp.write_text(to_pem(extra))
    tmp.replace(path)
    return path


def _run_together(jobs: dict[str, Callable[[], None]], on_ready: Callable[[str], None] | None) -> None:
    """Run each job in a thread of its own; call ``on_ready(name)`` from this thread as each one finishes.

    Returns once every job has ended, so nothing is still starting when the caller cleans up after a failure;
    then raises the first failure in ``jobs`` order.
    """
    errors: dict[str, BaseException] = {}
    with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="stack-start") as pool:
        futures = {pool.submit(job): name for name, job in jobs.items()}
        for done in as_completed(futures):
            name = futures[done]
            if (exc := done.exception()) is not None:
                errors[name] = exc
            elif on_ready is not None:
                on_ready(name)
    for name in jobs:
        if name in errors:
            raise errors[name]


#: Seconds a server of a stack that is not durable (tests) gets to stop after its signal before SIGKILL.
THROWAWAY_SERVER_GRACE_S = 2.0


@dataclass
class Stack(NodeOps):
    """Servers and services of one stack. Start with :meth:`start`, stop with :meth:`stop` (reverse order).

    After :meth:`start`: ``nats_url``, ``pg_dsn``, ``s3_url``, ``s3_bucket``, ``s3_keys`` and ``env`` (the
    environment given to every service) are set; ``api_key`` once :meth:`create_api_key` ran.
    """

    data_dir: Path
    log_dir: Path
    cache_dir: Path
    ports: StackPorts = field(default_factory=StackPorts)
    external: External = field(default_factory=External)
    durable: bool = True
    s3_bucket: str = "podbay"
    bin_dir: Path = field(default_factory=lambda: default_bin_dir())
    base_env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    #: Shared by the API and the node data planes; empty: :func:`internal_token_for` at start.
    internal_token: str = field(default="", repr=False)
    start_timeout_s: float = 120.0
    #: Port of the OpenBao dev server (started only for ``PODBAY_CREDENTIAL_BACKEND=openbao`` without an
    #: external ``PODBAY_OPENBAO_ADDR``); 0: ``PODBAY_OPENBAO_PORT``, else a free one.
    openbao_port: int = 0
    #: Processes per replicable service (see the module docstring); empty: from ``base_env``.
    replicas: dict[str, int] = field(default_factory=dict)
    #: NATS servers to start (1, or a cluster of 3); 0: ``PODBAY_NATS_SERVERS`` from ``base_env``, else 1.
    nats_servers: int = 0
    #: Multi-node: ids of the nodes, each with its own network namespace, node agent, snapshotter and gateway
    #: (:mod:`podbay.devstack.netns`); the servers then listen on the bridge address. Empty: one node
    #: (``PODBAY_NODE_ID``) in the host's namespace, servers on 127.0.0.1.
    node_ids: list[str] = field(default_factory=list)
    #: Extra environment per node id (e.g. ``PODBAY_NODE_MEMORY_MIB``), over :attr:`env`.
    node_env: dict[str, dict[str, str]] = field(default_factory=dict)
    #: ``PODBAY_WEBHOOK_ALLOW_PRIVATE`` for the API unless ``base_env`` sets it: a dev or test stack is one
    #: user's, whose webhook receivers listen on loopback or the LAN; production's default is off.
    webhook_allow_private: bool = True
    network: NodeNetwork | None = None

    servers: dict[str, srv.ServerProcess] = field(default_factory=dict)
    services: dict[str, ServiceProcess] = field(default_factory=dict)
    nats_url: str = ""
    pg_dsn: str = ""
    s3_url: str = ""
    s3_keys: tuple[str, str] = ("", "")
    api_key: str = ""
    tenant_id: str = ""
    # Secrets (keys, passwords, tokens) live here: kept out of repr, which test failures print.
    env: dict[str, str] = field(default_factory=dict, repr=False)
    credential_key: str = field(default="", repr=False)
    grant_signing_key: str = field(default="", repr=False)
    grant_verify_key: str = ""
    openbao_addr: str = ""
    openbao_token: str = field(default="", repr=False)

    @property
    def api_url(self) -> str:
        """``http://127.0.0.1:<api port>``."""
        return f"http://127.0.0.1:{self.ports.api}"

    @property
    def api_h2_url(self) -> str:
        """``http://127.0.0.1:<api_h2 port>``: the first API process's listener that also speaks HTTP/2 (h2c)."""
        return f"http://127.0.0.1:{self.ports.api_h2}"

    @property
    def api_urls(self) -> list[str]:
        """Every API process's URL, the first one (:attr:`api_url`) first."""
        return [self.api_url, *(svc.url for name, svc in self.services.items() if name.startswith("api-"))]

    def service_names(self) -> list[str]:
        """Every service process this stack runs (or will), in start order: ``api``, ``api-2``, ...,
        ``scheduler``, ..., ``nodeagent@node-a`` for a node's copy in a multi-node stack (raises
        :class:`StackError` for a bad replica count)."""
        counts = replica_counts(self.base_env, self.replicas)
        names: list[str] = []
        for spec in SERVICES:
            if self.node_ids and spec.name in NODE_SERVICES:
                names += [f"{spec.name}@{n}" for n in self.node_ids]
            else:
                names += [spec.name if i == 1 else f"{spec.name}-{i}" for i in range(1, counts.get(spec.name, 1) + 1)]
        return names

    # --- start ------------------------------------------------------------------------------------------

    def start(self, on_ready: Callable[[str], None] | None = None) -> Stack:
        """Start servers, then services, each waited for. On failure everything started is stopped and the
        :class:`StackError`/:class:`podbay.devstack.servers.ServerError` propagates. ``on_ready(name)`` is
        called as each part answers."""
        try:
            check_ports_free(self.ports, self.external)
            # What killed stacks whose data directories are gone left on the host; then this one's record,
            # before it makes anything, so that its own leftovers are found the same way.
            if swept := sweep_orphans():
                log.info("removed the host network state of %d deleted stack(s): %s", len(swept), swept)
            register_stack(self.data_dir)
            self.start_network()
            self.start_servers(on_ready)
            self.start_services(on_ready)
        except BaseException:
            self.stop(grace_s=5.0)
            raise
        return self

    def start_network(self) -> None:
        """Multi-node only: create (or reuse) the bridge and the node namespaces, recorded in the data dir."""
        if not self.node_ids or self.network is not None:
            return
        net = plan_network(self.data_dir, list(self.node_ids))
        net.save(self.data_dir)  # first, so that `down --purge` finds a half-made network
        net.create()
        self.network = net

    @property
    def server_host(self) -> str:
        """Where the stack's own servers listen: the bridge address of a multi-node stack, else 127.0.0.1."""
        return self.network.host_address if self.network else "127.0.0.1"

    def _server_kwargs(self, name: str) -> dict[str, Any]:
        if self.network is None:
            return {}
        extra: dict[str, Any] = {"host": self.network.host_address}
        if name == "postgres":
            extra["client_cidr"] = self.network.cidr
        return extra

    def start_servers(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Start (or adopt the external) NATS, PostgreSQL and S3, and build :attr:`env`. A multi-node stack
        refuses external servers on a loopback address: its node namespaces could not reach them."""
        ext = self.external
        if self.network is not None:
            for name, url in (("nats", ext.nats_url), ("postgres", ext.pg_dsn), ("s3", ext.s3_url)):
                host = (urlsplit(url).hostname or "") if url else ""
                if host in ("localhost", "::1") or host.startswith("127."):
                    raise StackError(f"external {name} server at {host} is not reachable from the node namespaces "
                                     "of a multi-node stack; give an address they can reach", details={"part": name})
        # The servers do not need one another: each starts (or is probed) in a thread of its own, so the
        # stack waits for the slowest (PostgreSQL's initdb) instead of for their sum.
        jobs: dict[str, Callable[[], None]] = {"nats": self._start_nats, "postgres": self._start_postgres,
                                               "s3": self._start_s3}
        self.credential_key = credential_key_for(self.data_dir, self.base_env)
        self.internal_token = self.internal_token or internal_token_for(self.data_dir, self.base_env)
        self.grant_signing_key, self.grant_verify_key = grant_keys_for(self.data_dir, self.base_env)
        # The credential key: PODBAY_CREDENTIAL_KEY from the caller, else made once and kept in
        # data_dir/credential.key (mode 0600). An OpenBao server only for PODBAY_CREDENTIAL_BACKEND=openbao.
        if self.base_env.get("PODBAY_CREDENTIAL_BACKEND", "pg") == "openbao":
            jobs["openbao"] = self._start_openbao
        try:
            _run_together(jobs, on_ready)
        finally:
            # Completion order put them in any order; stop (reverse order) and status expect this one.
            order = [*SERVER_NAMES, "openbao"]
            # A cluster's further servers (nats-2, nats-3) sort right after nats.
            self.servers = {n: self.servers[n] for n in sorted(
                self.servers, key=lambda n: (order.index(n.split("-")[0]), n))}
        self.env = self._service_env()

    def _start_nats(self) -> None:
        ext = self.external
        if ext.nats_url:
            self._probe_external("nats", srv.probe_nats(ext.nats_url))
            self.nats_url = ext.nats_url
            return
        count = self.nats_server_count()
        if count > 1:
            host = self._server_kwargs("nats").get("host", "127.0.0.1")
            cluster = srv.start_nats_cluster(self.data_dir / "servers" / "nats",
                                             [self.ports.nats, *free_ports(count - 1)], free_ports(count),
                                             log_dir=self.log_dir, host=host)
            for server in cluster:
                self.servers[server.name] = server
            self.nats_url = ",".join(server.url for server in cluster)
            return
        nats = srv.start_nats(self.data_dir / "servers" / "nats", self.ports.nats, log_dir=self.log_dir,
                              **self._server_kwargs("nats"))
        self.servers["nats"], self.nats_url = nats, nats.url

    def nats_server_count(self) -> int:
        """NATS servers this stack starts: :attr:`nats_servers`, else ``PODBAY_NATS_SERVERS``, else 1. Raises
        :class:`StackError` for anything but 1 or 3 to 5 (two servers have no majority left after one is lost)."""
        raw = self.nats_servers or self.base_env.get("PODBAY_NATS_SERVERS") or 1
        try:
            n = int(raw)
        except (TypeError, ValueError):
            n = 0
        if n != 1 and not 3 <= n <= 5:
            raise StackError(f"PODBAY_NATS_SERVERS must be 1 or 3 to 5, not {raw!r}", details={"part": "nats"})
        return n

    def _start_postgres(self) -> None:
        ext = self.external
        if ext.pg_dsn:
            self._probe_external("postgres", srv.probe_postgres(ext.pg_dsn))
            self.pg_dsn = ext.pg_dsn
            return
        pg = srv.start_postgres(self.data_dir / "servers" / "postgres", self.ports.pg, log_dir=self.log_dir,
                                durable=self.durable, **self._server_kwargs("postgres"))
        self.servers["postgres"], self.pg_dsn = pg, pg.dsn

    def _start_s3(self) -> None:
        ext = self.external
        if ext.s3_url:
            keys = (ext.s3_access_key or "", ext.s3_secret_key or "")
            self._probe_external("s3", srv.probe_s3(ext.s3_url, *keys, bucket=self.s3_bucket))
            self.s3_url, self.s3_keys = ext.s3_url, keys
            return
        s3 = srv.start_s3(self.data_dir / "servers" / "s3", self.ports.s3, log_dir=self.log_dir,
                          bucket=self.s3_bucket, **self._server_kwargs("s3"))
        self.servers["s3"], self.s3_url, self.s3_keys = s3, s3.url, (s3.access_key, s3.secret_key)

    def _start_openbao(self) -> None:
        """For ``PODBAY_CREDENTIAL_BACKEND=openbao``: the external ``PODBAY_OPENBAO_ADDR``, probed, or else an
        OpenBao dev server (in memory: its secrets end with it)."""
        addr, token = self.base_env.get("PODBAY_OPENBAO_ADDR", ""), self.base_env.get("PODBAY_OPENBAO_TOKEN", "")
        if addr:
            self._probe_external("openbao", probe_openbao(addr, token))
            self.openbao_addr, self.openbao_token = addr, token
            return
        port = self.openbao_port or int(self.base_env.get("PODBAY_OPENBAO_PORT") or 0) or free_port()
        bao = start_openbao(self.data_dir / "servers" / "openbao", port, log_dir=self.log_dir)
        self.servers["openbao"] = bao
        self.openbao_port, self.openbao_addr, self.openbao_token = port, bao.addr, bao.token

    def start_services(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Start the API (every replica) and wait for its ``/healthz``, then start all the other services at
        once and wait for each. The API goes first because it applies the migrations; the others need only
        the servers, and each declares the streams it uses itself."""
        counts = replica_counts(self.base_env, self.replicas)
        groups: list[list[ServiceProcess]] = [[], []]
        for spec in SERVICES:
            if self.node_ids and spec.name in NODE_SERVICES:
                procs = [self._service(spec, node_id=n) for n in self.node_ids]
            else:
                procs = [self._service(spec, i) for i in range(1, counts.get(spec.name, 1) + 1)]
            groups[0 if spec.name == "api" else 1] += procs
        self.start_groups(groups, on_ready)

    def start_groups(self, groups: list[list[ServiceProcess]],
                     on_ready: Callable[[str], None] | None = None) -> None:
        """Start ``groups`` in order: a group's services all at once, then wait for each one's ``/healthz``
        (``on_ready(name)`` after each) before the next group starts. ``StackError`` when one is not healthy
        within ``start_timeout_s``."""
        for group in groups:
            for svc in group:
                self.services[svc.name] = svc
                svc.start()
            for svc in group:
                svc.wait_healthy(self.start_timeout_s)
                self._notify(on_ready, svc.name)

    def create_api_key(self, tenant: str = "dev", name: str = "dev", *, replace: bool = False) -> str:
        """Run ``podbay-api create-key --tenant T --name N`` (with ``--replace`` when ``replace``: the tenant's
        live keys of that name are revoked first); stores and returns the key (``pb_...``).

        Raises :class:`StackError` when the command fails or prints no ``{"key": ...}`` JSON line.
        """
        argv = [str(self.bin_dir / "podbay-api"), "create-key", "--tenant", tenant, "--name", name]
        if replace:
            argv.append("--replace")
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=120, check=False)
        for line in reversed(done.stdout.splitlines()):
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if done.returncode == 0 and isinstance(data, dict) and str(data.get("key", "")).startswith("pb_"):
                self.api_key, self.tenant_id = str(data["key"]), str(data.get("tenant_id", ""))
                return self.api_key
        out = (done.stderr + done.stdout)[-2000:]
        raise StackError(
            f"podbay-api create-key failed with code {done.returncode}:\n{out}",
            details={"part": "api", "log_tail": out},
        )

    # --- operate ----------------------------------------------------------------------------------------

    def part_names(self) -> list[str]:
        """Names of the parts this stack runs, in start order."""
        return [*self.servers, *self.services]

    def log_path(self, name: str) -> Path:
        """The log file of part ``name``."""
        return self.log_dir / f"{name}.log"

    def log_tail(self, name: str, lines: int = 60) -> str:
        """The last ``lines`` lines of part ``name``'s log."""
        return tail(self.log_path(name), lines)

    def pid(self, name: str) -> int | None:
        """The pid of part ``name`` (None if not running or unknown)."""
        part = self.servers.get(name) or self.services.get(name)
        if part is None:
            return None
        return part.pid if part.alive() else None

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to part ``name`` and, for SIGKILL, reap it. Raises ``KeyError`` for an unknown part."""
        part = self.servers.get(name) or self.services[name]
        if part.alive() and part.proc is not None:
            part.proc.send_signal(sig)
            if sig == signal.SIGKILL:
                part.proc.wait(timeout=10)

    def restart(self, name: str, timeout_s: float | None = None) -> None:
        """Stop part ``name`` if it runs, start it again with the same ports and data, and wait until it answers."""
        if name in self.servers:
            self.servers[name].stop()
            sdir = self.data_dir / "servers" / name
            kw = self._server_kwargs(name)
            old = self.servers[name]
            if isinstance(old, srv.NatsServer) and old.member is not None:
                # One server of a cluster: same name, ports, routes and store; it rejoins and catches up.
                self.servers[name] = srv.start_nats(old.store_dir, old.port, log_dir=self.log_dir, member=old.member,
                                                    host=urlsplit(old.url).hostname or "127.0.0.1")
            elif name == "nats":
                self.servers[name] = srv.start_nats(sdir, self.ports.nats, log_dir=self.log_dir, **kw)
            elif name == "postgres":
                self.servers[name] = srv.start_postgres(sdir, self.ports.pg, log_dir=self.log_dir,
                                                        durable=self.durable, **kw)
            elif name == "openbao":
                # Dev mode keeps secrets in memory: a restarted server starts empty, with the same token.
                self.servers[name] = start_openbao(sdir, self.openbao_port, token=self.openbao_token,
                                                   log_dir=self.log_dir)
            else:
                self.servers[name] = srv.start_s3(sdir, self.ports.s3, log_dir=self.log_dir, bucket=self.s3_bucket,
                                                  **kw)
            return
        svc = self.services[name]
        svc.stop()
        svc.start()
        svc.wait_healthy(timeout_s or self.start_timeout_s)

    def add_replica(self, service: str, timeout_s: float | None = None) -> ServiceProcess:
        """Start one more process of a replicable ``service`` on a running stack (``api-3`` after ``api-2``)
        and wait until it answers; :meth:`stop` stops it with the rest. Raises :class:`StackError` for a
        service that runs once per host."""
        if service not in REPLICABLE:
            raise StackError(f"{service} runs once per host; only {', '.join(REPLICABLE)} can have replicas",
                             details={"part": service})
        spec = next(s for s in SERVICES if s.name == service)
        i = 2
        while f"{service}-{i}" in self.services:
            i += 1
        svc = self._service(spec, i)
        self.services[svc.name] = svc
        svc.start()
        svc.wait_healthy(timeout_s or self.start_timeout_s)
        return svc

    def remove_replica(self, name: str, grace_s: float = 10.0) -> None:
        """Stop further replica ``name`` (``api-2``) and forget it; the first process of a service stays."""
        svc = self.services[name]
        if not svc.instance:
            raise StackError(f"{name} is not a further replica", details={"part": name})
        svc.stop(grace_s)
        del self.services[name]

    def stop(self, grace_s: float = 10.0, *, purge: bool = False) -> None:
        """Stop services in reverse start order, then the servers; idempotent. Sandbox VMs keep running (the
        node agent leaves them on SIGTERM and re-attaches on its next start). With ``purge``, this data dir's
        VMs are killed too (:func:`kill_strays`) and its node stores unmounted (:func:`unmount_node_stores`).
        Each process gets ``grace_s`` seconds after SIGTERM before SIGKILL. A stack that is not ``durable``
        gives its servers at most :data:`THROWAWAY_SERVER_GRACE_S`, and with ``purge`` stops its services all
        at once."""
        services = list(reversed(list(self.services.values())))
        if purge and not self.durable:
            # A throwaway stack (tests): its services stop at once, not one after the other (each takes 1 to
            # 3 s to shut down, about 10 s in a row); whatever they leave behind is purged below.
            with ThreadPoolExecutor(max(1, len(services))) as pool:
                list(pool.map(lambda svc: svc.stop(grace_s), services))
        else:
            for svc in services:
                svc.stop(grace_s)
        if purge:
            kill_strays(self.data_dir)
            unmount_node_stores(self.data_dir)
        # A stack that need not survive a crash (``durable=False``: test stacks) gives its servers a short grace:
        # weed mini waits up to 10 s for its S3 listener to drain connections before it exits, and such a
        # stack keeps nothing that needs it (10 s of every test stack's teardown).
        server_grace_s = grace_s if self.durable else min(grace_s, THROWAWAY_SERVER_GRACE_S)
        for server in reversed(list(self.servers.values())):
            server.stop(server_grace_s)
        if purge:
            purge_networks(self.data_dir)
            self.network = None

    # --- internals --------------------------------------------------------------------------------------

    def _service(self, spec: ServiceSpec, replica: int = 1, node_id: str | None = None) -> ServiceProcess:
        if spec.name == "gateway":
            script = gateway_executable(self.base_env.get("PODBAY_GATEWAY_BIN"), self.bin_dir)
        else:
            script = self.bin_dir / spec.script
        if not script.exists():
            raise StackError(f"{spec.script} not found in {self.bin_dir}", details={"part": spec.name})
        port = getattr(self.ports, spec.port_field)
        # Only the API mints node grants; no other process holds the key that signs them.
        # Likewise only the API holds the edge CA's key.
        base = self.env if spec.name == "api" else {k: v for k, v in self.env.items()
                                                     if k not in ("PODBAY_GRANT_SIGNING_KEY",
                                                                  "PODBAY_API_TLS_CA_KEY_FILE")}
        if node_id is None or self.network is None:
            if replica == 1:
                return ServiceProcess(spec, [str(script)], base, self.log_path(spec.name), port)
            # A further replica: same environment but its own HTTP port (and log), as on another host.
            name, port = f"{spec.name}-{replica}", free_port()
            env = {**base, REPLICABLE[spec.name]: str(port)}
            if spec.name == "api":
                env["PODBAY_API_H2_PORT"] = str(free_port())
                env["PODBAY_API_TLS_PORT"] = str(free_port())  # another host's edge: a port of its own here
            return ServiceProcess(spec, [str(script)], env, self.log_path(name), port, instance=name)
        link = self.network.node(node_id)
        # Each namespace has its own ports, so every node uses the same ones; the data plane listens on the
        # namespace's bridge address, which the node advertises (nodes.dataplane_url) so the API reaches it.
        env = {**base, "PODBAY_NODE_ID": node_id, "PODBAY_NODE_HOST": link.address,
               **self.node_env.get(node_id, {})}
        host = link.address if spec.name == "nodeagent" else "127.0.0.1"
        name = f"{spec.name}@{node_id}"
        return ServiceProcess(spec, [*link.nsenter(), str(script)], env, self.log_path(name), port,
                              host=host, netns=link.netns, node_id=node_id)

    def _service_env(self) -> dict[str, str]:
        p = self.ports
        ours = {
            "PODBAY_NATS_URL": self.nats_url,
            "PODBAY_PG_DSN": self.pg_dsn,
            "PODBAY_S3_URL": self.s3_url,
            "PODBAY_S3_BUCKET": self.s3_bucket,
            "AWS_ACCESS_KEY_ID": self.s3_keys[0],
            "AWS_SECRET_ACCESS_KEY": self.s3_keys[1],
            "PODBAY_DATA_DIR": str(self.data_dir),
            "PODBAY_LOG_DIR": str(self.log_dir),
            "PODBAY_CACHE_DIR": str(self.cache_dir),
            "PODBAY_INTERNAL_TOKEN": self.internal_token,
            # Node grants: the signing key is taken out again for every process but the API (_service).
            "PODBAY_GRANT_SIGNING_KEY": self.grant_signing_key,
            "PODBAY_GRANT_VERIFY_KEY": self.grant_verify_key,
            "PODBAY_API_HOST": "127.0.0.1",
            "PODBAY_API_PORT": str(p.api),
            "PODBAY_API_H2_PORT": str(p.api_h2),
            "PODBAY_API_TLS_PORT": str(p.api_tls),
            "PODBAY_API_URL": self.api_url,
            "PODBAY_NODE_HOST": "127.0.0.1",
            "PODBAY_NODE_PORT": str(p.node),
            "PODBAY_SCHEDULER_PORT": str(p.scheduler),
            "PODBAY_SNAPSHOTTER_PORT": str(p.snapshotter),
            "PODBAY_WARMPOOL_PORT": str(p.warmpool),
            "PODBAY_GATEWAY_PORT": str(p.gateway),
            "PODBAY_GATEWAY_PROXY_PORT": str(p.gateway_proxy),
            "PODBAY_GATEWAY_DNS_PORT": str(p.gateway_dns),
            "PODBAY_NATS_PORT": str(p.nats),
            "PODBAY_PG_PORT": str(p.pg),
            "PODBAY_S3_PORT": str(p.s3),
            "PYTHONUNBUFFERED": "1",
            # The API seals credential values with it; the gateway opens them (docs/DESIGN.md §6).
            "PODBAY_CREDENTIAL_KEY": self.credential_key,
        }
        if self.openbao_addr:
            ours.update({"PODBAY_OPENBAO_ADDR": self.openbao_addr, "PODBAY_OPENBAO_TOKEN": self.openbao_token})
        guest_ca = guest_ca_for(self.data_dir, self.base_env)
        if guest_ca is not None:
            ours["PODBAY_GUEST_CA_FILE"] = str(guest_ca)
        # A client key from the caller's shell means nothing to a service of another stack.
        base = {k: v for k, v in self.base_env.items() if k not in ("PODBAY_API_KEY", "PODBAY_CONFIG")}
        defaults = {"PODBAY_WEBHOOK_ALLOW_PRIVATE": "1" if self.webhook_allow_private else "0",
                    **self._edge_defaults()}
        return {**defaults, **base, **ours}

    def _edge_defaults(self) -> dict[str, str]:
        """The TLS edge's settings unless the environment gives its own (docs/operations.md "Ports by
        hostname"): E2B's domain ``e2b.localhost:<tls port>``, whose every name resolves to loopback through
        nss-myhostname (scripts/setup.sh), and the stack's CA (kept in ``DATA_DIR/edge-ca.{pem,key}``) from
        which the edge mints a certificate per name. Writes ``DATA_DIR/edge-trust.pem`` (system roots + that
        CA) for ``podbay env --e2b``."""
        ca_cert, ca_key = ensure_dev_ca(self.data_dir)
        write_trust_bundle(self.data_dir / "edge-trust.pem", ca_cert)
        return {"PODBAY_E2B_DOMAIN": f"e2b.localhost:{self.ports.api_tls}",
                "PODBAY_API_TLS_CA_CERT_FILE": str(ca_cert), "PODBAY_API_TLS_CA_KEY_FILE": str(ca_key)}

    def edge_client(self) -> dict[str, str]:
        """What a client of this (started) stack needs for the TLS edge: ``e2b_domain``, ``ca_cert`` (the
        stack's CA) and ``ca_bundle`` (system roots + that CA); an empty value when not in use."""
        ca = self.env.get("PODBAY_API_TLS_CA_CERT_FILE", "")
        bundle = self.data_dir / "edge-trust.pem"
        own = ca == str(self.data_dir / "edge-ca.pem")
        return {"e2b_domain": self.env.get("PODBAY_E2B_DOMAIN", ""), "ca_cert": ca if own else "",
                "ca_bundle": str(bundle) if own and bundle.is_file() else ""}

    def _probe_external(self, name: str, probe: Coroutine[Any, Any, None]) -> None:
        try:
            run_sync(asyncio.wait_for(probe, timeout=10))
        except Exception as exc:  # noqa: BLE001 - reported with the server's name and what was configured
            raise StackError(
                f"external {name} server (from the environment) does not answer: {type(exc).__name__}: {exc}",
                details={"part": name},
            ) from exc

    @staticmethod
    def _notify(on_ready: Callable[[str], None] | None, name: str) -> None:
        if on_ready is not None:
            on_ready(name)


