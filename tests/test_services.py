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
import signal
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import nats
import psutil
import pytest

import eventlight as agl
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
PGSERVER_STANDIN = Path(__file__).resolve().parent / "pgserver_standin"


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
    # its unix socket, not TCP on 127.0.0.1: less CPU a round trip in the client and in Postgres (issue 17)
    assert (
        urllib.parse.parse_qs(urllib.parse.urlsplit(first.pg_dsn).query)
        .get("host", [""])[0]
        .startswith(str(root_dir / "state"))
    ), first.pg_dsn
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

    async def interrupted(state: Path) -> Any:
        await real(state)  # the postmaster is up: Ctrl-C comes as it is waited for
        raise asyncio.CancelledError

    monkeypatch.setattr(lifecycle, "ensure_pg", interrupted)
    with pytest.raises(asyncio.CancelledError):
        await svc.prepare_services(settings)
    assert [p.info["cmdline"] for p in _procs_naming(root_dir)] == []
    assert svc.read_services(settings) is None


def _pgserver_standin_unusable() -> str | None:
    """Why the pgserver stand-in cannot run here (it needs Postgres binaries, and as root a
    ``postgres`` user), else ``None``."""
    import importlib.util
    import pwd

    if importlib.util.find_spec("pgserver") is None and system_bindir() is None:
        return "no Postgres binaries (pgserver wheel or system)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "as root, the stand-in runs Postgres as `postgres`, and there is no such user"
    return None


@pytest.mark.skipif(_pgserver_standin_unusable() is not None, reason=str(_pgserver_standin_unusable()))
async def test_an_up_interrupted_while_pgserver_starts_postgres_stops_it_and_says_so_in_one_line(
    root_dir: Path,
) -> None:
    """SIGINT while `eventlight up` started the pgserver Postgres: pgserver's start (initdb, then
    ``pg_ctl -w start``) runs on a thread no cancel stops, so the clean-up looked for a postmaster
    before there was one, asyncio's shutdown then waited for the thread, and `up` exited 130 with no
    word, leaving the postgres the thread had just started running, unrecorded. Now the interrupted
    start waits for the thread and stops what it started; one line says so. (The ``pgserver`` here
    is ``tests/pgserver_standin``: as root the wheel's own adds a system user.)"""
    standin = PGSERVER_STANDIN
    state = root_dir / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVENTLIGHT_")}  # the embedded servers
    env.update(
        EVENTLIGHT_STATE_DIR=str(state),
        EVENTLIGHT_NAMESPACE=_ns(),
        PYTHONPATH=os.pathsep.join([str(standin), str(ROOT)]),
        PGSERVER_STANDIN_DELAY_S="1",  # the start holds 1 s before initdb: the SIGINT lands in it
    )
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, str(standin / "up_with_pgserver.py"), "up"),
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    for _ in range(2400):  # NATS is up and pgserver's start has begun (the stand-in made its folder)
        if (state / "pg-pgserver").is_dir() or proc.returncode is not None:
            break
        await asyncio.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    left = [p.info["cmdline"] for p in _procs_naming(root_dir)]
    assert left == [], err.decode()
    assert proc.returncode == 130, err.decode()
    assert err.decode().strip().splitlines()[-1] == (
        "error: interrupted: the servers this `eventlight up` was starting are stopped again; "
        "those it found running still run"
    )
    assert "Traceback" not in err.decode() and svc.read_services(Settings(state_dir=state)) is None


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


async def test_a_test_namespace_whose_set_up_fails_part_way_is_dropped(
    services: tuple[Settings, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fresh_namespace`` (tests/conftest.py) dropped its namespace only once its set-up had ended:
    one interrupted while it migrated (a timeout, Ctrl+C) left ``el_t…`` in the session's Postgres
    with only an empty ``schema_migrations`` (seen in postgresql://…/postgres). Here the first
    migration fails the same way: the schema is gone afterwards."""
    from tests.conftest import fresh_namespace

    bad = tmp_path / "migrations"
    bad.mkdir()
    (bad / "001_fails.sql").write_text("SELECT 1 / 0;")
    real = svc.apply_migrations
    made: list[str] = []

    async def failing(dsn: str, schema: str, *args: Any, **kwargs: Any) -> list[str]:
        made.append(schema)
        return await real(dsn, schema, bad)

    monkeypatch.setitem(fresh_namespace.__wrapped__.__globals__, "apply_migrations", failing)
    with pytest.raises(asyncpg.DivisionByZeroError):
        async with fresh_namespace(services):
            pass
    [schema] = made
    conn = await asyncpg.connect(services[1].pg_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM pg_namespace WHERE nspname = $1", schema) == 0
    finally:
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


# -- servers a Trainer started, which others use meanwhile -----------------------------------------


@agl.rollout
def _no_agent(task: str, prompt_template: agl.PromptTemplate) -> float:  # the algorithm role runs no runner
    return 0.0


def _trainer(settings: Settings, algorithm: Any) -> agl.Trainer:
    """A Trainer that runs only ``algorithm`` (role ``"algorithm"``: no runner process)."""
    return agl.Trainer(algorithm=algorithm, strategy={"type": "cs", "role": "algorithm"}, settings=settings)


def _own(root_dir: Path, pg_dsn: str | None) -> Settings:
    """A namespace on ``root_dir``'s state folder: its embedded NATS, and ``pg_dsn`` (``None``: its
    embedded Postgres too)."""
    return Settings(state_dir=root_dir / "state", pg_dsn=pg_dsn, namespace=_ns())


async def test_a_lone_trainer_stops_the_servers_it_started(root_dir: Path) -> None:
    """What the README promises of the demo: nothing of a Trainer's run keeps running after it."""
    settings = _own(root_dir, None)

    @agl.algo
    async def nothing(*, store: Any, train_dataset: Any = None, val_dataset: Any = None) -> None:
        assert await store.query_rollouts() is not None

    trainer = _trainer(settings, nothing)
    await trainer.fit_async(_no_agent)
    assert trainer.services is not None and len(trainer.services.started) == 2, trainer.services
    assert _procs_naming(root_dir) == [] and not (settings.state_dir / "services.json").exists()
    assert not (settings.state_dir / "stop_when_unused.json").exists()
    assert list((settings.state_dir / "leases").glob("*")) == []


async def test_a_trainer_leaves_the_servers_running_while_another_trainer_uses_them(
    root_dir: Path, services: tuple[Settings, Any]
) -> None:
    """Trainer A started the embedded NATS, Trainer B reused it, and A's run ended first: A stopped
    every embedded server of the state folder from under B. Now the last of them to end stops it."""
    first = _own(root_dir, services[1].pg_dsn)
    second = msgspec.structs.replace(first, namespace=_ns())
    b_running, b_may_end = asyncio.Event(), asyncio.Event()
    b_run: list[asyncio.Task[None]] = []

    @agl.algo
    async def wait_for_the_test(*, store: Any, train_dataset: Any = None, val_dataset: Any = None) -> None:
        b_running.set()
        await b_may_end.wait()

    b = _trainer(second, wait_for_the_test)

    @agl.algo
    async def start_b(*, store: Any, train_dataset: Any = None, val_dataset: Any = None) -> None:
        b_run.append(asyncio.create_task(b.fit_async(_no_agent)))
        await asyncio.wait_for(b_running.wait(), 60)

    a = _trainer(first, start_b)
    try:
        await a.fit_async(_no_agent)
        assert a.services is not None and a.services.started == [f"nats-server pid {a.services.nats_pid}"]
        assert b.services is not None and b.services.started == [] and b.services.nats_url == a.services.nats_url
        assert await nats_probe(a.services.nats_url) is None, "A stopped the NATS that B still used"
        assert [p.pid for p in _procs_naming(root_dir)] == [a.services.nats_pid]
    finally:
        b_may_end.set()
        if b_run:
            await asyncio.wait_for(b_run[0], 60)
        for settings in (first, second):
            await svc.drop_namespace(None, first.pg_dsn, settings)  # the streams go with root_dir
    assert _procs_naming(root_dir) == [], "B, the last to use it, did not stop the NATS A started"


async def test_a_trainer_leaves_the_servers_running_when_up_reused_them(
    root_dir: Path, services: tuple[Settings, Any]
) -> None:
    """`eventlight up` during a Trainer's run reused the NATS the Trainer had started and promised
    it would run until `eventlight down`; the Trainer's end stopped it."""
    first = _own(root_dir, services[1].pg_dsn)
    other = msgspec.structs.replace(first, namespace=_ns())
    up: list[svc.Services] = []

    @agl.algo
    async def up_meanwhile(*, store: Any, train_dataset: Any = None, val_dataset: Any = None) -> None:
        up.append(await svc.prepare_services(other))  # what `eventlight up -N <other>` does

    trainer = _trainer(first, up_meanwhile)
    try:
        await trainer.fit_async(_no_agent)
        assert trainer.services is not None and up[0].started == [] and up[0].nats_url == trainer.services.nats_url
        assert await nats_probe(up[0].nats_url) is None, "the Trainer stopped the NATS `up` reported running"
        assert svc.read_services(other) == up[0]
        assert await svc.stop_services(other) == [f"nats-server pid {up[0].nats_pid}"]  # `eventlight down`
    finally:
        for settings in (first, other):
            await svc.drop_namespace(None, first.pg_dsn, settings)


ROOT = Path(__file__).resolve().parents[1]
CLI_USERS = {  # an `eventlight` command that uses the servers while it runs, and its line once it does
    "serve": (["serve", "--port", "{port}"], b"serving "),
    "runner": (["runner", "tests.role_program:score_length"], b"1 runner(s) consuming "),
}


async def _start_cli(settings: Settings, command: str) -> asyncio.subprocess.Process:
    """``eventlight serve`` or ``runner`` on ``settings``' namespace and state folder; returns once it
    says it runs."""
    assert settings.pg_dsn is not None
    args, ready = CLI_USERS[command]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVENTLIGHT_")}
    env.update(EVENTLIGHT_STATE_DIR=str(settings.state_dir), EVENTLIGHT_PG_DSN=settings.pg_dsn, PYTHONPATH=str(ROOT))
    argv = [a.format(port=free_port()) for a in args]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "eventlight.cli", *argv, "-N", settings.namespace, env=env, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = [await asyncio.wait_for(proc.stdout.readline(), 60)]
    while lines[-1] and not lines[-1].startswith(ready):
        lines.append(await asyncio.wait_for(proc.stdout.readline(), 60))
    assert lines[-1], lines
    return proc


@pytest.mark.parametrize("command", sorted(CLI_USERS))
async def test_a_trainer_leaves_the_servers_running_while_a_command_uses_them(
    root_dir: Path, services: tuple[Settings, Any], command: str
) -> None:
    """`eventlight serve` or `runner` started during a Trainer's run on the NATS the Trainer started:
    the Trainer's end stopped it from under them. Now the command, the last to use it, stops it."""
    settings = _own(root_dir, services[1].pg_dsn)
    started: list[asyncio.subprocess.Process] = []

    @agl.algo
    async def start_meanwhile(*, store: Any, train_dataset: Any = None, val_dataset: Any = None) -> None:
        started.append(await _start_cli(settings, command))

    trainer = _trainer(settings, start_meanwhile)
    try:
        await trainer.fit_async(_no_agent)
        assert trainer.services is not None and trainer.services.nats_pid is not None
        assert await nats_probe(trainer.services.nats_url) is None, f"the Trainer stopped the NATS `{command}` used"
        started[0].send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(started[0].communicate(), 60)
        assert started[0].returncode == 143
        assert _gone(trainer.services.nats_pid), f"`{command}`, the last to use it, did not stop the Trainer's NATS"
        assert f"stopped nats-server pid {trainer.services.nats_pid}: a trainer's run started" in out.decode(), out
    finally:
        if started and started[0].returncode is None:
            started[0].kill()
            await started[0].wait()
        await svc.drop_namespace(None, settings.pg_dsn, settings)


async def test_a_process_killed_while_it_used_the_servers_does_not_keep_them_running(
    root_dir: Path, services: tuple[Settings, Any]
) -> None:
    """`eventlight serve` used the Trainer's NATS and was killed (-9): the Trainer's end still stops it."""
    settings = _own(root_dir, services[1].pg_dsn)

    @agl.algo
    async def serve_then_kill(*, store: Any, train_dataset: Any = None, val_dataset: Any = None) -> None:
        proc = await _start_cli(settings, "serve")
        proc.kill()
        await proc.wait()

    trainer = _trainer(settings, serve_then_kill)
    try:
        await trainer.fit_async(_no_agent)
        assert trainer.services is not None and trainer.services.started
        assert _procs_naming(root_dir) == []
    finally:
        await svc.drop_namespace(None, settings.pg_dsn, settings)


USE_THEN_SLEEP = """
import asyncio, sys
from eventlight.ops import use_services
from eventlight.settings import Settings

async def main():
    settings = Settings(state_dir=sys.argv[1], pg_dsn=sys.argv[2], namespace=sys.argv[3])
    async with use_services(settings) as services:
        print(services.nats_pid, flush=True)
        await asyncio.sleep(600)

asyncio.run(main())
"""


async def test_servers_whose_starter_was_killed_stop_when_the_next_user_ends(
    root_dir: Path, services: tuple[Settings, Any]
) -> None:
    """A run killed (-9) while it used the servers it started leaves them running, and its lease
    stale: the next run that reuses them stops them at its end, as their starter would have."""
    settings = _own(root_dir, services[1].pg_dsn)
    assert settings.pg_dsn is not None
    starter = await asyncio.create_subprocess_exec(
        sys.executable, "-c", USE_THEN_SLEEP, str(settings.state_dir), settings.pg_dsn, settings.namespace,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert starter.stdout is not None
    nats_pid = int(await asyncio.wait_for(starter.stdout.readline(), 60))
    starter.kill()
    await starter.wait()
    try:
        async with svc.use_services(settings) as again:
            assert again.started == [] and again.nats_pid == nats_pid
        assert _gone(nats_pid) and _procs_naming(root_dir) == []
        assert list((settings.state_dir / "leases").iterdir()) == []  # the killed run's, stale, is gone
    finally:
        await svc.drop_namespace(None, settings.pg_dsn, settings)


async def test_down_stops_the_servers_while_they_are_used_and_says_who_used_them(
    root_dir: Path, services: tuple[Settings, Any], caplog: pytest.LogCaptureFixture
) -> None:
    settings = _own(root_dir, services[1].pg_dsn)
    try:
        with caplog.at_level(logging.WARNING, logger="eventlight.ops.lifecycle"):
            async with svc.use_services(settings, what="a test") as used:
                assert await svc.stop_services(settings) == [f"nats-server pid {used.nats_pid}"]  # `eventlight down`
                assert _gone(used.nats_pid)
                await svc.prepare_services(settings)  # `eventlight up` again: runs until `down`
            assert await nats_probe(used.nats_url) is None, "the block's end stopped what `up` started after `down`"
        said = [r.getMessage() for r in caplog.records]
        assert said == [f"stopped nats-server pid {used.nats_pid} while pid {os.getpid()} (a test) still used them"]
    finally:
        await svc.drop_namespace(None, settings.pg_dsn, settings)
