"""The dev-stack servers (podbay.devstack.servers): each starts, answers a real client, keeps its data across
a restart on the same data dir, and reports a failed start with its log."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import nats
import pytest
from aiobotocore.session import get_session
from botocore.exceptions import ClientError

from podbay.devstack import pgaccount
from podbay.devstack.procs import free_port, free_ports, run_sync
from podbay.devstack.servers import S3Endpoint, ServerError, start_nats, start_postgres, start_s3

pytestmark = pytest.mark.integration


def _s3_client(endpoint: S3Endpoint, *, secret: str | None = None):  # type: ignore[no-untyped-def]
    return get_session().create_client(
        "s3",
        endpoint_url=endpoint.url,
        region_name=endpoint.region,
        aws_access_key_id=endpoint.access_key,
        aws_secret_access_key=secret or endpoint.secret_key,
    )


@pytest.fixture
def work_dir(test_root: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    path = test_root / "work" / request.node.name
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = [*free_ports(5), free_port()]
    assert len(set(ports[:5])) == 5
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


async def test_nats_jetstream_round_trip(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="SERVERS_TEST", subjects=["servers.test.>"])
        ack = await js.publish("servers.test.one", b"hello")
        msg = await js.get_msg("SERVERS_TEST", ack.seq)
        assert msg.data == b"hello"
        await js.delete_stream("SERVERS_TEST")
    finally:
        await nc.close()


async def test_postgres_answers_as_the_application_role(pg_dsn: str) -> None:
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT 1") == 1
        assert await conn.fetchval("SELECT current_user") == "podbay"
        assert await conn.fetchval("SELECT current_database()") == "podbay"
        await conn.execute("CREATE TABLE IF NOT EXISTS servers_probe (x int)")
        await conn.execute("DROP TABLE servers_probe")
    finally:
        await conn.close()


async def test_s3_round_trip_and_bad_key_refused(s3: S3Endpoint) -> None:
    async with _s3_client(s3) as client:
        names = [b["Name"] for b in (await client.list_buckets())["Buckets"]]
        assert s3.bucket in names
        await client.put_object(Bucket=s3.bucket, Key="probe/one", Body=b"payload")
        got = await client.get_object(Bucket=s3.bucket, Key="probe/one")
        async with got["Body"] as body:
            assert await body.read() == b"payload"
        await client.delete_object(Bucket=s3.bucket, Key="probe/one")
    async with _s3_client(s3, secret="not-the-secret") as client:
        with pytest.raises(ClientError):
            await client.list_buckets()


def test_postgres_runs_unprivileged_and_restarts_on_the_same_data_dir(work_dir: Path) -> None:
    first = start_postgres(work_dir, free_port(), durable=False)
    try:
        assert os.stat(f"/proc/{first.pid}").st_uid != 0
        assert (first.pgdata / "PG_VERSION").exists()

        async def write() -> None:
            conn = await asyncpg.connect(first.dsn)
            try:
                await conn.execute("CREATE TABLE kept (v text); INSERT INTO kept VALUES ('still here')")
            finally:
                await conn.close()

        run_sync(write())
    finally:
        first.stop()
    assert not first.alive()
    second = start_postgres(work_dir, free_port(), durable=False)
    try:
        assert second.dsn != first.dsn  # another port, same credentials and data

        async def read() -> str:
            conn = await asyncpg.connect(second.dsn)
            try:
                return str(await conn.fetchval("SELECT v FROM kept"))
            finally:
                await conn.close()

        assert run_sync(read()) == "still here"
    finally:
        second.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="the unprivileged PostgreSQL account exists only when run as root")
def test_postgres_in_a_data_dir_its_user_cannot_reach(work_dir: Path) -> None:
    private = work_dir / "private"
    private.mkdir(mode=0o700)
    data_dir = private / "pg"
    server = start_postgres(data_dir, free_port(), durable=False)
    cluster = server.pgdata
    try:
        assert (data_dir / "pgdata").is_symlink()
        assert (data_dir / "pgdata").resolve() == cluster
        assert pgaccount.ensure_account().home in cluster.parents
    finally:
        server.stop()
        shutil.rmtree(cluster.parent, ignore_errors=True)


async def test_nats_keeps_streams_across_a_restart(work_dir: Path) -> None:
    first = start_nats(work_dir, free_port())
    try:
        nc = await nats.connect(first.url)
        js = nc.jetstream()
        await js.add_stream(name="KEPT", subjects=["kept.>"])
        await js.publish("kept.one", b"durable")
        await nc.close()
    finally:
        first.stop()
    second = start_nats(work_dir, free_port())
    try:
        nc = await nats.connect(second.url)
        msg = await nc.jetstream().get_msg("KEPT", 1)
        await nc.close()
        assert msg.data == b"durable"
    finally:
        second.stop()


async def test_s3_keeps_objects_and_keys_across_a_restart(work_dir: Path) -> None:
    first = start_s3(work_dir, free_port(), bucket="kept")
    try:
        async with _s3_client(first.endpoint()) as client:
            await client.put_object(Bucket="kept", Key="k", Body=b"object")
    finally:
        first.stop()
    second = start_s3(work_dir, free_port(), bucket="kept")
    try:
        assert (second.access_key, second.secret_key) == (first.access_key, first.secret_key)
        async with _s3_client(second.endpoint()) as client:
            got = await client.get_object(Bucket="kept", Key="k")
            async with got["Body"] as body:
                assert await body.read() == b"object"
    finally:
        second.stop()


def test_failed_start_reports_the_log_tail(work_dir: Path) -> None:
    # A file where JetStream's store directory must be: nats-server starts, logs why, and exits.
    (work_dir / "jetstream").write_text("")
    with pytest.raises(ServerError) as info:
        start_nats(work_dir, free_port(), timeout_s=20)
    assert info.value.details["server"] == "nats"
    assert "storage directory is not a directory" in info.value.details["log_tail"].lower()
    assert str(work_dir / "nats.log") in str(info.value)


def test_a_taken_port_fails_before_starting(work_dir: Path) -> None:
    # Another process's listener could answer the readiness probe for a server that cannot bind its port.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerError) as info:
            start_nats(work_dir, port, timeout_s=20)
    assert str(info.value) == f"port {port} (nats) is in use"
    assert info.value.details == {"server": "nats", "port": port}
    assert not (work_dir / "nats.log").exists()
