"""Shared fixtures: real servers on free loopback ports, and a whole podbay stack of real processes.

Session fixtures (started once per test run, on demand):

- ``nats_url``: NATS with JetStream; ``PODBAY_NATS_URL`` points at an external one instead.
- ``pg_dsn``: PostgreSQL, database ``podbay`` owned by role ``podbay``; ``PODBAY_PG_DSN`` overrides.
- ``s3``: an :class:`~podbay.devstack.servers.S3Endpoint` (url, bucket, keys); ``PODBAY_S3_URL`` with
  ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (and ``PODBAY_S3_BUCKET``) overrides.
- ``openbao``: an :class:`~podbay.devstack.openbao.OpenBaoServer`-like ``(addr, token)`` of ``bao server -dev``
  on a free port with a random root token; ``PODBAY_OPENBAO_ADDR`` (with ``PODBAY_OPENBAO_TOKEN``) overrides.
- ``stack``: a :class:`~podbay.devstack.stack.Stack` with its own servers (or the external ones above) and
  every service as a child process, started the way ``podbay up`` starts them, plus an API key. It offers
  ``api_url``, ``api_key``, ``nats_url``, ``pg_dsn``, ``data_dir``, ``log_dir``, ``env`` and
  ``kill(service, signal)``, ``restart(service)``, ``log_tail(service)``. ``PODBAY_API_REPLICAS``,
  ``PODBAY_SCHEDULER_REPLICAS`` and ``PODBAY_WARMPOOL_REPLICAS`` start that many processes of each (``api-2``
  ... on ports of their own, ``api_urls``); ``add_replica(service)`` adds one to the running stack.

Everything lives in one temporary directory (mode 0711, so PostgreSQL's unprivileged user can reach its
cluster), removed at the end unless ``PODBAY_KEEP_TEST_DATA=1``. Tests under ``tests/e2e`` (or marked
``e2e``) need real microVMs and the base template; they are skipped only when ``PODBAY_SKIP_E2E=1``. The
per-test timeout comes from ``[tool.pytest.ini_options] timeout`` in pyproject.toml.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from podbay.config import Settings
from podbay.devstack.procs import free_port, run_sync
from podbay.devstack.servers import S3Endpoint, probe_s3, start_nats, start_postgres, start_s3
from podbay.devstack.openbao import probe_openbao, start_openbao
from podbay.devstack.stack import THROWAWAY_SERVER_GRACE_S, External, Stack, StackPorts, kill_strays
from podbay.egress_ranges import TEST_PEER_NETS

_TESTS = Path(__file__).parent

# CPU admission (PODBAY_NODE_CPU_PRESSURE_MAX) refuses creates on a node whose CPU pressure stays above the bound:
# on a 2-core test host running several emulated guests at once that is most of the time, whatever the test.
# Every stack the tests start inherits this environment, so admission by CPU is off unless a test turns it on;
# its rule is tested by tests/unit/test_pressure.py, test_heartbeat_pressure.py and test_placement.py.
os.environ.setdefault("PODBAY_NODE_CPU_PRESSURE_MAX", "0")


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: the order is of the tests that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests by folder (``integration``, ``e2e``, ``security``, ``faults``) and skip e2e tests when ``PODBAY_SKIP_E2E=1``;
    run the modules that share ``multinode_stack`` one after the other.

    ``tests/security`` holds tests of one trust boundary each: they are marked ``security`` and, unless marked
    ``e2e`` themselves (a module that needs microVMs sets ``pytestmark = pytest.mark.e2e``), ``integration``."""
    _order_multinode_modules(config, items)
    skip_e2e = os.environ.get("PODBAY_SKIP_E2E") == "1"
    for item in items:
        path = Path(str(item.fspath))
        for kind in ("integration", "e2e"):
            if (_TESTS / kind) in path.parents:
                item.add_marker(getattr(pytest.mark, kind))
        if (_TESTS / "faults") in path.parents:  # real servers too: run with the integration tests, or apart
            item.add_marker(pytest.mark.faults)
            item.add_marker(pytest.mark.integration)
        if (_TESTS / "security") in path.parents:
            item.add_marker(pytest.mark.security)
            if item.get_closest_marker("e2e") is None:
                item.add_marker(pytest.mark.integration)
        if skip_e2e and item.get_closest_marker("e2e") is not None:
            item.add_marker(pytest.mark.skip(reason="PODBAY_SKIP_E2E=1: end-to-end tests (real microVMs) skipped"))


def _unmount_under(root: Path) -> None:
    """Unmount whatever a node agent left mounted under ``root`` (deepest first), so removal stays inside."""
    prefix = str(root.resolve())
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return
    points = [line.split()[4] for line in lines if len(line.split()) > 4]
    for point in sorted((p for p in points if p == prefix or p.startswith(prefix + "/")), key=len, reverse=True):
        if subprocess.run(["umount", point], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)


@pytest.fixture(scope="session")
def test_root() -> Iterator[Path]:
    """One temporary directory for every server and stack of this test session."""
    root = Path(tempfile.mkdtemp(prefix="podbay-test-"))
    os.chmod(root, 0o711)
    (root / "logs").mkdir()  # server fixtures write their logs here, whichever starts first
    try:
        yield root
    finally:
        kill_strays(root)
        if os.environ.get("PODBAY_KEEP_TEST_DATA") != "1":
            _unmount_under(root)
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def nats_url(test_root: Path) -> Iterator[str]:
    """URL of a NATS server with JetStream (``PODBAY_NATS_URL`` or one started here)."""
    if os.environ.get("PODBAY_NATS_URL"):
        yield os.environ["PODBAY_NATS_URL"]
        return
    server = start_nats(test_root / "nats", free_port(), log_dir=test_root / "logs")
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg_dsn(test_root: Path) -> Iterator[str]:
    """DSN of PostgreSQL database ``podbay`` as role ``podbay`` (``PODBAY_PG_DSN`` or one started here)."""
    if os.environ.get("PODBAY_PG_DSN"):
        yield os.environ["PODBAY_PG_DSN"]
        return
    server = start_postgres(test_root / "postgres", free_port(), log_dir=test_root / "logs", durable=False)
    try:
        yield server.dsn
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3(test_root: Path) -> Iterator[S3Endpoint]:
    """An S3 endpoint with an existing bucket (``PODBAY_S3_URL`` + ``AWS_*`` keys, or weed started here)."""
    if os.environ.get("PODBAY_S3_URL"):
        endpoint = S3Endpoint(
            url=os.environ["PODBAY_S3_URL"],
            bucket=os.environ.get("PODBAY_S3_BUCKET", "podbay-test"),
            access_key=os.environ.get("AWS_ACCESS_KEY_ID", ""),
            secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY", ""),
        )
        run_sync(probe_s3(endpoint.url, endpoint.access_key, endpoint.secret_key, bucket=endpoint.bucket))
        yield endpoint
        return
    server = start_s3(test_root / "s3", free_port(), log_dir=test_root / "logs", bucket="podbay-test")
    try:
        yield server.endpoint()
    finally:
        server.stop(THROWAWAY_SERVER_GRACE_S)  # its data goes with the session; weed's drain would cost 10 s


@pytest.fixture(scope="session")
def openbao(test_root: Path) -> Iterator[tuple[str, str]]:
    """``(addr, token)`` of an OpenBao server with KV v2 at ``secret/`` (``PODBAY_OPENBAO_ADDR`` and
    ``PODBAY_OPENBAO_TOKEN``, or ``bao server -dev`` started here with a random root token)."""
    if os.environ.get("PODBAY_OPENBAO_ADDR"):
        addr, token = os.environ["PODBAY_OPENBAO_ADDR"], os.environ.get("PODBAY_OPENBAO_TOKEN", "")
        run_sync(probe_openbao(addr, token))
        yield addr, token
        return
    server = start_openbao(test_root / "openbao", free_port(), log_dir=test_root / "logs")
    try:
        yield server.addr, server.token
    finally:
        server.stop()


@pytest.fixture(scope="session")
def stack(test_root: Path) -> Iterator[Stack]:
    """A running stack of real processes with a dev API key (see the module docstring)."""
    data_dir = test_root / "stack"
    running = Stack(
        data_dir=data_dir,
        log_dir=data_dir / "logs",
        cache_dir=Settings().cache_dir,  # shared, so that built templates are found
        ports=StackPorts.free(),
        external=External.from_env(),
        durable=False,
        # Paused sandboxes release their RAM after 6 s here (default 60 s), so tests can see it happen.
        # PODBAY_E2B_DOMAIN: the stack's own (e2b.localhost:<its TLS edge port>), whose names resolve to
        # loopback, unless the environment gives one (tests/security/test_e2b_tls_edge.py fetches
        # https:// + get_host()).
        # PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS: the e2e tests' peers (namespaces on this host) use two documentation
        # ranges, opened here as an operator opens a private range; every other private range stays shut.
        base_env={**os.environ, "PODBAY_PAUSED_RELEASE_S": os.environ.get("PODBAY_PAUSED_RELEASE_S", "6"),
                  "PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS": os.environ.get("PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS",
                                                                       TEST_PEER_NETS)},
    )
    running.start()
    try:
        running.create_api_key("dev", "dev")
        yield running
    finally:
        # Purge: a test stack's VMs and loop-mounted store must not outlive the session.
        running.stop(purge=True)
        kill_strays(data_dir)


#: Test modules that use ``multinode_stack`` and run last of them, in this order (they drain, kill or partition
#: a node; whatever the fixture finds after them, nothing else has to run on that stack).
_MULTINODE_LAST = ("test_desktop_nodes.py", "test_node_loss.py")
_MULTINODE_USERS = pytest.StashKey[list[str]]()


def _order_multinode_modules(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the modules that use ``multinode_stack`` one after the other, where the first of them is, with
    :data:`_MULTINODE_LAST` last; record their order, so that the fixture stops its stack after the last."""
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(str(item.path), []).append(item)
    users = [m for m, its in by_module.items() if any("multinode_stack" in getattr(i, "fixturenames", ()) for i in its)]
    # A stable sort: the others keep their order, before those of _MULTINODE_LAST.
    users.sort(key=lambda m: _MULTINODE_LAST.index(Path(m).name) + 1 if Path(m).name in _MULTINODE_LAST else 0)
    config.stash[_MULTINODE_USERS] = users
    if len(users) < 2:
        return
    first = items.index(by_module[users[0]][0])
    group = [i for m in users for i in by_module[m]]
    grouped = set(group)
    rest = [i for i in items if i not in grouped]
    items[:] = rest[:first] + group + rest[first:]


class _SharedMultinode:
    """The two-node stack that consecutive modules share (see :func:`multinode_stack`)."""

    def __init__(self, test_root: Path) -> None:
        self.test_root = test_root
        self.stack: Stack | None = None

    def start(self) -> Stack:
        """A fresh two-node stack (see :func:`multinode_stack` for its settings)."""
        # A directory (so a PostgreSQL cluster and node rows) of its own: nothing of a stack the fixture gave
        # up on carries over.
        data_dir = Path(tempfile.mkdtemp(prefix="m", dir=self.test_root))  # short: UNIX socket paths below it
        os.chmod(data_dir, 0o711)  # PostgreSQL's unprivileged user must reach its cluster
        node_env = {"PODBAY_NODE_MEMORY_MIB": "2048", "PODBAY_NODE_VCPUS": "8"}
        running = Stack(
            data_dir=data_dir,
            log_dir=data_dir / "logs",
            cache_dir=Settings().cache_dir,
            ports=StackPorts.free(),
            durable=False,
            node_ids=["node-a", "node-b"],
            node_env={"node-a": dict(node_env), "node-b": dict(node_env)},
            base_env={**os.environ,
                      "PODBAY_NODE_HEARTBEAT_S": os.environ.get("PODBAY_NODE_HEARTBEAT_S", "1"),
                      "PODBAY_NODE_HEARTBEAT_TTL_S": os.environ.get("PODBAY_NODE_HEARTBEAT_TTL_S", "4"),
                      "PODBAY_NODE_LOST_GRACE_S": os.environ.get("PODBAY_NODE_LOST_GRACE_S", "3"),
                      # As the single-node stack's (see ``stack``): the same operator allow-list, so that a
                      # build on either node meets the same egress rules (a cold machine builds the desktop
                      # template here first, with apt-get reaching the package mirror).
                      "PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS": os.environ.get("PODBAY_EGRESS_OPERATOR_ALLOW_CIDRS",
                                                                           TEST_PEER_NETS)},
        )
        self.stack = running
        running.start()
        running.create_api_key("dev", "dev")
        return running

    def stop(self) -> None:
        """Purge the stack (VMs, stores, namespaces, veths, bridge), if there is one."""
        running, self.stack = self.stack, None
        if running is not None:
            running.stop(purge=True)
            kill_strays(running.data_dir)

    def as_new(self, timeout_s: float = 30.0) -> bool:
        """Whether the stack is as a fresh one would be, waiting up to ``timeout_s`` seconds for deletions and
        heartbeats to settle: every process runs, every link is up, and ``GET /v1/nodes`` shows both nodes
        ``ready``, live, schedulable, never lost, with no sandbox running or paused."""
        st = self.stack
        if st is None or not all(p.alive() for p in [*st.servers.values(), *st.services.values()]):
            return False
        for node in st.node_ids:
            st.restore_link(node)  # a test that failed between its cut and its restore
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                r = httpx.get(f"{st.api_url}/v1/nodes", headers={"authorization": f"Bearer {st.api_key}"}, timeout=10)
                nodes = r.json()["nodes"] if r.status_code == 200 else []
            except (httpx.HTTPError, ValueError, KeyError):
                nodes = []
            if sorted(n["id"] for n in nodes) == sorted(st.node_ids) and all(
                    n["state"] == "ready" and n["live"] and n["schedulable"] and n["lost_at"] is None
                    and n["running"] == 0 and n["paused"] == 0 for n in nodes):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


@pytest.fixture(scope="session")
def _shared_multinode(test_root: Path) -> Iterator[_SharedMultinode]:
    shared = _SharedMultinode(test_root)
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture(scope="module")
def multinode_stack(request: pytest.FixtureRequest, _shared_multinode: _SharedMultinode) -> Iterator[Stack]:
    """A stack with two nodes, ``node-a`` and ``node-b``, each in its own network namespace with its own node
    agent, snapshotter and gateway (:mod:`podbay.devstack.netns`), plus an API key; its own servers listen on
    the host bridge address.

    Shared by the modules that use it, which run one after the other (``pytest_collection_modifyitems``;
    ``test_node_loss.py`` last): a module gets the previous module's stack when that one left it as a fresh
    stack would be (every process running, both nodes ready, live and never lost, no sandbox left), else a
    new stack in a directory of its own (the old one purged), so that a drained or lost node of one module
    never reaches the next. After the last of these modules, the stack is purged (VMs, stores, namespaces,
    veths, bridge).

    Each node offers 2048 MiB and 8 vCPUs (``PODBAY_NODE_MEMORY_MIB``/``PODBAY_NODE_VCPUS``). The heartbeat
    TTL is 4 s and the lost-node grace 3 s unless ``PODBAY_NODE_HEARTBEAT_TTL_S``/``PODBAY_NODE_LOST_GRACE_S``
    say otherwise. Helpers (besides everything of ``stack``):

    - ``stop_node(node_id)``: SIGTERM then SIGKILL the node's agent, snapshotter and gateway (VMs stay);
    - ``kill_node(node_id, sig=SIGKILL, only=None)``: signal them (``only="nodeagent"`` for the agent alone);
    - ``restart_node(node_id)``: start them again (same namespace, ports, data) and wait until healthy;
    - ``cut_link(node_id)`` / ``restore_link(node_id)``: take the node's veth down / up (a partition);
    - ``network.node(node_id).address``: the node's address; ``node_services(node_id)``: its processes.
    """
    shared = _shared_multinode
    try:
        if not shared.as_new():
            shared.stop()
            shared.start()
        assert shared.stack is not None
        yield shared.stack
    except BaseException:
        shared.stop()
        raise
    users = request.config.stash.get(_MULTINODE_USERS, [])
    if not users or users[-1] == str(request.path):
        shared.stop()
