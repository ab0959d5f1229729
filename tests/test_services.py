"""Real tests of eventlight.ops: embedded nats-server and Postgres, streams, migrations.

The embedded servers live in a fresh folder in the system temp folder (never under /root: Postgres runs as
``postgres`` when the tests run as root). Every test stops what it started; the fixture kills
and reports any process still naming its folder. The tests that need an existing NATS use the test
session's own server (the ``services`` fixture), never whatever listens on the machine's 4222.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import nats
import psutil
import pytest

from eventlight import ops as svc
from eventlight._data import data_dir
from eventlight.core.errors import ServiceUnavailableError
from eventlight.net import free_port
from eventlight.ops import lifecycle
from eventlight.ops.nats_server import nats_probe
from eventlight.ops.postgres import system_bindir
from eventlight.settings import Settings
from eventlight.store.jetstream.definitions import consumer_config

STREAMS_DIR = data_dir("streams")


def _procs_naming(folder: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(folder) in cmd and p.info["status"] != psutil.STATUS_ZOMBIE and p.pid != os.getpid():
            found.append(p)
    return found


def _gone(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _ns() -> str:
    return "t" + uuid.uuid4().hex[:12]


def _make_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="el-test-svc-", dir=tempfile.gettempdir()))
    root.chmod(0o755)  # mkdtemp makes it 0700, which the postgres user could not enter
    return root


@pytest.fixture
async def root_dir() -> AsyncIterator[Path]:
    """A fresh 0755 folder under /tmp; afterwards nothing may still run from it."""
    root = _make_root()
    yield root
    for state in (root / "state", root / "closed" / "state"):
        await svc.stop_services(Settings(state_dir=state))
    leftovers = _procs_naming(root)
    for p in leftovers:
        p.kill()
    shutil.rmtree(root, ignore_errors=True)
    assert not leftovers, f"processes left running: {[p.info['cmdline'] for p in leftovers]}"


def _write_migrations(folder: Path) -> Path:
    folder.mkdir()
    (folder / "001_first.sql").write_text("CREATE TABLE t1 (x int); INSERT INTO t1 VALUES (1);")
    (folder / "002_second.sql").write_text("CREATE TABLE t2 (y text);\nINSERT INTO t2 SELECT 'a';")
    (folder / "notes.txt").write_text("not a migration")
    return folder


async def _pg_settings(dsn: str) -> dict[str, str]:
    conn = await asyncpg.connect(dsn)
    try:
        names = ("fsync", "max_connections", "shared_buffers")
        return {n: await conn.fetchval(f"SHOW {n}") for n in names}
    finally:
        await conn.close()


async def test_embedded_start_reuse_stop_restart(root_dir: Path) -> None:
    settings = Settings(state_dir=root_dir / "state", namespace=_ns())

    t0 = time.monotonic()
    first, twin = await asyncio.gather(svc.ensure_services(settings), svc.ensure_services(settings))
    first_s = time.monotonic() - t0
    assert sorted([len(first.started), len(twin.started)]) == [0, 2], (first, twin)
    assert (first.nats_url, first.pg_dsn) == (twin.nats_url, twin.pg_dsn)
    assert first.pg_kind in ("system", "pgserver")
    embedded = {"fsync": "on", "max_connections": "200", "shared_buffers": "256MB"}
    assert await _pg_settings(first.pg_dsn) == embedded
    conf = (root_dir / "state" / "nats" / "nats.conf").read_text()
    assert "sync_interval: always" in conf and "max_payload: 8MB" in conf

    t0 = time.monotonic()
    again = await svc.ensure_services(settings)
    reuse_s = time.monotonic() - t0
    assert again.started == []
    assert (again.nats_url, again.pg_dsn, again.nats_pid, again.pg_pid) == (
        first.nats_url, first.pg_dsn, first.nats_pid, first.pg_pid,
    )  # fmt: skip
    assert svc.read_services(settings) == again

    external = os.environ.get("EVENTLIGHT_PG_DSN")
    if external:  # `up` with EVENTLIGHT_PG_DSN set beside the running embedded servers (a fresh-user run):
        mixed = await svc.ensure_services(msgspec.structs.replace(settings, pg_dsn=external))
        assert (mixed.nats_pid, mixed.pg_pid, mixed.pg_dsn) == (first.nats_pid, None, external)
        assert svc.read_services(settings) == again  # the record still names the embedded Postgres

    nc = await nats.connect(first.nats_url)
    try:
        assert await svc.apply_streams(nc, settings) == await svc.apply_streams(nc.jetstream(), settings)
        ack = await nc.jetstream().publish(f"el.{settings.namespace}.r.r1.q", b"x" * 2_000_000)
        assert ack.seq == 1  # a 2 MB event fits: max_payload 8MB
    finally:
        await nc.close()

    migrations = _write_migrations(root_dir / "migrations")
    runs = await asyncio.gather(*[svc.apply_migrations(first.pg_dsn, settings.pg_schema, migrations) for _ in range(3)])
    assert sorted(v for run in runs for v in run) == ["001_first", "002_second"]

    stopped = await svc.stop_services(settings)
    assert stopped == [f"nats-server pid {first.nats_pid}", f"postgres pid {first.pg_pid}"]
    assert _gone(first.nats_pid) and _gone(first.pg_pid)
    assert svc.read_services(settings) is None
    assert await svc.stop_services(settings) == []

    t0 = time.monotonic()
    restarted = await svc.ensure_services(settings)
    restart_s = time.monotonic() - t0
    assert len(restarted.started) == 2
    assert (restarted.nats_url, restarted.pg_dsn) == (first.nats_url, first.pg_dsn)  # same ports
    nc = await nats.connect(restarted.nats_url)
    try:
        assert (await nc.jetstream().stream_info(settings.stream_name)).state.messages == 1  # same store
    finally:
        await nc.close()
    assert await svc.apply_migrations(restarted.pg_dsn, settings.pg_schema, migrations) == []
    conn = await asyncpg.connect(restarted.pg_dsn)
    try:
        assert await conn.fetchval(f"SELECT count(*) FROM {settings.pg_schema}.t1") == 1
    finally:
        await conn.close()
    assert len(await svc.stop_services(settings)) == 2
    assert not _procs_naming(root_dir)
    print(f"\nfirst start {first_s:.2f} s, reuse {reuse_s:.3f} s, restart on existing data {restart_s:.2f} s")


async def test_dead_nats_url_names_the_url(root_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    monkeypatch.setenv("EVENTLIGHT_NATS_URL", url)
    monkeypatch.delenv("EVENTLIGHT_PG_DSN", raising=False)
    settings = Settings.from_env(state_dir=root_dir / "state")
    t0 = time.monotonic()
    with pytest.raises(ServiceUnavailableError) as err:
        await svc.ensure_services(settings)
    assert time.monotonic() - t0 < 5
    assert err.value.server == url and url in str(err.value)
    assert not (root_dir / "state" / "pg").exists()  # failed before starting Postgres
    assert not (root_dir / "state" / "services.json").exists()


async def test_unreachable_pg_dsn_falls_back_to_embedded(
    root_dir: Path, caplog: pytest.LogCaptureFixture, services: tuple[Settings, Any]
) -> None:
    existing = services[1].nats_url
    dead = f"postgresql://postgres:s3cret@127.0.0.1:{free_port()}/postgres"
    settings = Settings(nats_url=existing, pg_dsn=dead, state_dir=root_dir / "state")
    with caplog.at_level(logging.WARNING, logger="eventlight.ops"):
        services = await svc.ensure_services(settings)
    assert services.nats_url == existing and services.nats_pid is None
    assert services.pg_dsn != dead and services.pg_kind in ("system", "pgserver")
    assert services.started == [f"postgres pid {services.pg_pid}"]
    assert "did not answer" in caplog.text and "s3cret" not in caplog.text
    assert await svc.stop_services(settings) == [f"postgres pid {services.pg_pid}"]
    assert await nats_probe(existing) is None  # the external server was left alone


def _apply_fails_for(namespace: str, monkeypatch: pytest.MonkeyPatch, after: asyncio.Event | None = None) -> None:
    """``prepare_services`` cannot create ``namespace``'s stream (once ``after`` is set, or 2 s passed)."""
    real = lifecycle.apply_streams

    async def apply_streams(nc: Any, settings: Settings, **kwargs: Any) -> list[str]:
        if settings.namespace != namespace:
            return await real(nc, settings, **kwargs)
        if after is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(after.wait(), 2.0)
        raise ServiceUnavailableError(settings.stream_name, "creating the stream failed (the test's)")

    monkeypatch.setattr(lifecycle, "apply_streams", apply_streams)


async def test_a_failed_up_never_stops_the_servers_another_up_reused(
    root_dir: Path, services: tuple[Settings, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two `up`s at once: the one that started the embedded NATS failed to create its namespace after
    the other had reused that server and reported it running, and stopped it from under the other."""
    pg_dsn = services[1].pg_dsn
    failing = Settings(state_dir=root_dir / "state", pg_dsn=pg_dsn, namespace=_ns())
    other = msgspec.structs.replace(failing, namespace=_ns())
    other_done = asyncio.Event()
    _apply_fails_for(failing.namespace, monkeypatch, after=other_done)

    async def up_other() -> svc.Services:
        await asyncio.sleep(0.2)  # the first holds the state folder's lock by then
        try:
            return await svc.prepare_services(other)
        finally:
            other_done.set()

    first, second = await asyncio.gather(svc.prepare_services(failing), up_other(), return_exceptions=True)
    try:
        assert isinstance(first, ServiceUnavailableError) and "creating the stream failed" in str(first), first
        assert isinstance(second, svc.Services), second
        assert await nats_probe(second.nats_url) is None, "the NATS the other up reported was stopped"
        assert svc.read_services(other) == msgspec.structs.replace(second, started=[])
    finally:
        await svc.drop_namespace(None, pg_dsn, other)  # the stream goes with root_dir


async def test_a_failed_up_stops_only_the_servers_it_started(
    root_dir: Path, services: tuple[Settings, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An `up` that reused the embedded NATS (runners on it) and started the embedded Postgres, then
    could not create its namespace, stopped every embedded server of the state folder, NATS too."""
    pg_dsn = services[1].pg_dsn
    running = Settings(state_dir=root_dir / "state", pg_dsn=pg_dsn, namespace=_ns())
    nats_pid = (await svc.prepare_services(running)).nats_pid
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"  # nothing answers: the embedded one
    failing = msgspec.structs.replace(running, pg_dsn=dead, namespace=_ns())
    _apply_fails_for(failing.namespace, monkeypatch)
    try:
        with pytest.raises(ServiceUnavailableError, match="creating the stream failed"):
            await svc.prepare_services(failing)
        assert [p.pid for p in _procs_naming(root_dir)] == [nats_pid]  # the Postgres it started is stopped
    finally:
        await svc.drop_namespace(None, pg_dsn, running)


async def test_an_up_interrupted_while_it_starts_postgres_leaves_no_server_running(
    root_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while `up` started the embedded Postgres (the first start: initdb, pg_ctl, the wait for
    it to answer): the NATS it had started was stopped, the Postgres left running, unrecorded."""
    settings = Settings(state_dir=root_dir / "state", namespace=_ns())
    real = lifecycle.ensure_pg

    async def interrupted(settings: Settings, state: Path) -> Any:
        await real(settings, state)  # the postmaster is up: Ctrl-C comes as it is waited for
        raise asyncio.CancelledError

    monkeypatch.setattr(lifecycle, "ensure_pg", interrupted)
    with pytest.raises(asyncio.CancelledError):
        await svc.prepare_services(settings)
    assert [p.info["cmdline"] for p in _procs_naming(root_dir)] == []
    assert svc.read_services(settings) is None


async def test_an_up_interrupted_while_nats_becomes_ready_leaves_it_not_running(
    root_dir: Path, services: tuple[Settings, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while `up` waited for the nats-server it had just started to answer (seconds, for a big
    JetStream store recovering) left that server running, unrecorded."""
    from eventlight.ops import nats_server

    settings = Settings(state_dir=root_dir / "state", pg_dsn=services[1].pg_dsn, namespace=_ns())
    real = nats_server._wait_nats_ready

    async def interrupted(*args: Any) -> None:
        await real(*args)
        raise asyncio.CancelledError

    monkeypatch.setattr(nats_server, "_wait_nats_ready", interrupted)
    with pytest.raises(asyncio.CancelledError):
        await svc.prepare_services(settings)
    assert [p.info["cmdline"] for p in _procs_naming(root_dir)] == []


async def test_servers_of_an_up_killed_before_it_finished_are_named(
    root_dir: Path, services: tuple[Settings, Any]
) -> None:
    """`up` writes services.json once the namespace is applied: one killed (kill -9) after it started
    the embedded NATS left it running unrecorded, and `status` and `runner` said no server ran at all."""
    from tests.test_cli import assert_one_line_error, cli

    settings = Settings(state_dir=root_dir / "state", pg_dsn=services[1].pg_dsn, namespace=_ns())
    started = await svc.ensure_services(settings)
    (root_dir / "state" / "services.json").unlink()  # as an up killed before it wrote the record
    env = {"EVENTLIGHT_STATE_DIR": str(root_dir / "state"), "EVENTLIGHT_NAMESPACE": settings.namespace}
    assert_one_line_error(
        cli("status", env=env),
        1,
        f"nats-server pid {started.nats_pid} run from it: an `eventlight up` was stopped before it finished",
        "run `eventlight up` again (it reuses them) or `eventlight down`",
    )
    again = await svc.ensure_services(settings)  # what the message says to do
    assert again.nats_pid == started.nats_pid and again.started == []
    assert lifecycle.unrecorded_servers(settings) == []


async def test_a_command_run_for_postgres_is_waited_for_when_cancelled(tmp_path: Path) -> None:
    """``pg_ctl start`` (or initdb) cancelled by a Ctrl-C went on by itself (the postmaster came up
    after the clean-up had looked for it), or was killed by the terminal's SIGINT halfway: it runs
    in a session of its own, and a cancelled call waits for it to end before it gives up."""
    from eventlight.ops.procs import run

    marker = tmp_path / "done"
    argv = ["sh", "-c", f"ps -o sid= -p $$ > {tmp_path / 'sid'}; sleep 0.5; touch {marker}"]
    task = asyncio.ensure_future(run(argv, cwd=tmp_path, timeout_s=10))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert marker.exists(), "the command was left running past the cancelled call"
    assert int((tmp_path / "sid").read_text()) != os.getsid(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands Postgres to the postgres user")
async def test_state_dir_postgres_cannot_enter(root_dir: Path) -> None:
    if system_bindir() is None:
        pytest.skip("no system Postgres binaries")
    closed = root_dir / "closed"
    closed.mkdir(mode=0o700)
    settings = Settings(state_dir=closed / "state")
    with pytest.raises(ServiceUnavailableError) as err:
        await svc.ensure_services(settings)
    assert f"cannot enter {closed} (mode 700" in str(err.value)
    assert not _procs_naming(root_dir)  # the nats-server it had started was stopped again


async def test_apply_streams_idempotent_and_updates(tmp_path: Path, services: tuple[Settings, Any]) -> None:
    url = services[1].nats_url
    settings = Settings(namespace=_ns())
    nc = await nats.connect(url)
    try:
        expected = [
            f"stream {settings.stream_name}",
            f"consumer {settings.stream_name}/runners",
        ]  # 003_projector.json is a template: the projector makes its own reader per term
        assert await svc.apply_streams(nc, settings) == expected
        assert await svc.apply_streams(nc, settings) == expected
        js = nc.jetstream()
        stream = (await js.stream_info(settings.stream_name)).config
        assert stream.subjects == [f"el.{settings.namespace}.>"] and stream.duplicate_window == 120
        assert stream.max_msg_size == 8 * 1024 * 1024 and stream.storage == "file"
        runners = (await js.consumer_info(settings.stream_name, "runners")).config
        assert runners.filter_subject == f"el.{settings.namespace}.r.*.q"
        assert (runners.ack_policy, runners.ack_wait, runners.max_ack_pending) == ("explicit", 30, 100000)
        template = consumer_config("projector", settings.namespace)
        assert (template.ack_policy, template.deliver_policy, template.mem_storage) == (
            "none",
            "by_start_sequence",
            True,
        )

        edited = shutil.copytree(STREAMS_DIR, tmp_path / "streams")
        spec = json.loads((edited / "002_runners.json").read_text())
        (edited / "002_runners.json").write_text(json.dumps({**spec, "ack_wait_s": 45}))
        await svc.apply_streams(nc, settings, streams_dir=edited)
        assert (await js.consumer_info(settings.stream_name, "runners")).config.ack_wait == 45
    finally:
        await svc.drop_namespace(url, None, settings)
        await nc.close()
    nc = await nats.connect(url)
    try:
        with pytest.raises(nats.js.errors.NotFoundError):
            await nc.jetstream().stream_info(settings.stream_name)
    finally:
        await nc.close()


async def test_a_program_on_configured_servers_keeps_the_record_of_the_embedded_ones(
    services: tuple[Settings, Any],
) -> None:
    """`eventlight up`'s record (what `down` stops, what `status` shows) survives a program that
    reaches the same servers through EVENTLIGHT_NATS_URL / EVENTLIGHT_PG_DSN."""
    base, embedded = services
    if embedded.nats_pid is None:
        pytest.skip("the session's NATS is not embedded")
    configured = Settings(nats_url=embedded.nats_url, pg_dsn=embedded.pg_dsn, state_dir=base.state_dir, namespace=_ns())
    found = await svc.ensure_services(configured)
    assert found.nats_pid is None and not found.started  # external from this program's point of view
    record = svc.read_services(base)
    assert record is not None and record.nats_pid == embedded.nats_pid


def test_the_record_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    """services.json keeps a configured DSN beside the embedded NATS, password included: mode 600,
    also when it replaces a record written before (0644)."""
    from eventlight.ops.state import write_services_file

    (tmp_path / "services.json").write_text("{}")
    (tmp_path / "services.json").chmod(0o644)
    record = svc.Services("nats://127.0.0.1:1", "postgresql://app:secret@db/app", nats_pid=1, pg_kind="external")
    write_services_file(tmp_path, record)
    assert (tmp_path / "services.json").stat().st_mode & 0o777 == 0o600
    assert msgspec.json.decode((tmp_path / "services.json").read_bytes(), type=svc.Services) == record


def test_a_state_folder_with_a_quote_keeps_the_postgres_config_valid(tmp_path: Path) -> None:
    """``unix_socket_directories = '<home>'``: a quote in the state folder's path (/home/o'brien)
    ended the string, and Postgres refused its config; a comma would split the list. Such a folder
    gets no socket (the DSN is TCP)."""
    from eventlight.ops.pg_system import _write_pg_conf

    for name in ("o'brien", "a,b"):
        home = tmp_path / name / "pg"
        (home / "data").mkdir(parents=True)
        _write_pg_conf(home / "data", home, 5432)
        conf = (home / "data" / "eventlight.conf").read_text()
        assert "unix_socket_directories = ''" in conf and name not in conf
    plain = tmp_path / "plain" / "pg"
    (plain / "data").mkdir(parents=True)
    _write_pg_conf(plain / "data", plain, 5432)
    assert f"unix_socket_directories = '{plain}'" in (plain / "data" / "eventlight.conf").read_text()


def test_a_remembered_port_out_of_range_is_replaced(tmp_path: Path) -> None:
    """A port file holding 99999 or -1 (edited by hand) made `eventlight up` fail with
    "internal error: OverflowError"; it now picks a free port, as for a port taken."""
    from eventlight.ops.procs import remembered_port

    for text in ("99999\n", "-1\n", "0\n"):
        (tmp_path / "port").write_text(text)
        port = remembered_port(tmp_path / "port")
        assert 0 < port < 65536 and (tmp_path / "port").read_text() == f"{port}\n"


async def test_drop_namespace_also_drops_what_a_rebuild_left_beside_it(services: tuple[Settings, Any]) -> None:
    _, found = services
    settings = Settings(namespace=_ns())
    other = Settings(namespace=_ns())
    conn = await asyncpg.connect(found.pg_dsn)
    try:
        names = [
            settings.pg_schema,
            f"{settings.pg_schema}_rebuild",
            f"{settings.pg_schema}_replaced_1",
            other.pg_schema,
        ]
        for name in names:
            await conn.execute(f'CREATE SCHEMA "{name}"')
        await svc.drop_namespace(None, found.pg_dsn, settings)
        left = {r[0] for r in await conn.fetch("SELECT nspname FROM pg_namespace WHERE nspname = ANY($1)", names)}
        assert left == {other.pg_schema}  # only the namespace's own schemas went
    finally:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{other.pg_schema}"')
        await conn.close()


async def test_stream_replicas_on_a_single_server_is_a_usage_error(services: tuple[Settings, Any]) -> None:
    """It was 'cannot reach ParseResult(scheme=...)': the connected URL's repr, and a server that
    answered named as unreachable (fresh-user run)."""
    from eventlight.core.errors import InvalidInputError

    _, embedded = services  # the tests' own nats-server: one node
    nc = await nats.connect(embedded.nats_url)
    try:
        with pytest.raises(InvalidInputError, match="single node and takes no stream replicas") as info:
            await svc.apply_streams(nc, Settings(namespace=_ns(), stream_replicas=3))
        assert "ParseResult" not in str(info.value)
    finally:
        await nc.close()
