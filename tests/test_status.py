"""``eventlight status``: queue depth, projector lag and live workers by heartbeat age, run as a user
runs it (a subprocess) against the test servers; and the liveness rules it shares with the Trainer."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from eventlight.core.types import Worker
from eventlight.net import free_port
from eventlight.ops import Services
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.liveness import (
    LIVE_HEARTBEAT_S,
    STOPPED_AT,
    is_alive,
    no_live_worker,
    stopped_at,
    waiting_without_workers,
)
from tests.conftest import old_nats_server
from tests.test_cli import ENV_VARS, ROOT, assert_one_line_error, cli, env_of


def test_liveness_is_the_age_of_the_last_heartbeat() -> None:
    now = 1_000.0
    fresh = Worker(worker_id="a", last_heartbeat_time=now - 5)
    old = Worker(worker_id="b", last_heartbeat_time=now - LIVE_HEARTBEAT_S - 1)
    never = Worker(worker_id="c")
    assert is_alive(fresh, now) and not is_alive(old, now) and not is_alive(never, now)
    assert no_live_worker(0, [], now) is None  # nothing waits: nothing to say
    assert no_live_worker(3, [fresh, old], now) is None
    message = no_live_worker(3, [old, never], now)
    assert message is not None and "3 rollout(s) wait" in message and "2 known, none" in message
    assert "none has ever" in (no_live_worker(1, [], now) or "")
    # a runner that stopped in an orderly way says so in its last heartbeat: not alive at once
    stopped = Worker(worker_id="d", last_heartbeat_time=now, heartbeat_stats={"cpu": 1, STOPPED_AT: now})
    assert stopped_at(stopped) == now and not is_alive(stopped, now) and stopped_at(fresh) is None
    assert "(1 known: 1 stopped, the others sent no heartbeat in the last 30 s)" in (
        no_live_worker(2, [stopped], now) or ""
    )
    restarted = Worker(worker_id="d", last_heartbeat_time=now, heartbeat_stats={"cpu": 1})  # beats again
    foreign = Worker(worker_id="e", last_heartbeat_time=now, heartbeat_stats={STOPPED_AT: "soon"})
    assert is_alive(restarted, now) and is_alive(foreign, now) and stopped_at(foreign) is None


async def test_status_shows_a_stopped_runner_stopped_at_once(namespace: Settings) -> None:
    """A finished trainer's or a stopped runner's workers showed alive in ``eventlight status`` for
    up to 30 s after they exited (alive was a heartbeat's age alone). A runner that stops in an
    orderly way says so in its last heartbeat, and ``status`` shows it stopped at once; one killed
    (no such heartbeat) still ages out, as ``Worker-gone`` here."""
    import eventlight as agl

    @agl.rollout
    def agent(task: dict, llm: agl.LLM) -> float:  # never called: the queue stays empty
        return 0.0

    long_ago = time.time() - 600
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn, clock=lambda: long_ago) as store:
        await store.update_worker("Worker-gone", {"cpu": 0.1})  # its last heartbeat: 10 min ago
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.update_worker("Worker-live", {"cpu": 0.1})
        runner = agl.LitAgentRunner(agl.OtelTracer(), poll_interval=0.05, heartbeat_interval=0.05)
        stop = asyncio.Event()
        with runner.run_context(agent=agent, store=store):
            task = asyncio.create_task(runner.iter(event=stop))
            while (await store.get_worker_by_id(runner.get_worker_id())) is None:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
            stop.set()
            await asyncio.wait_for(task, 10)
        await store.sync_all()
    out = cli("status", env={**env_of(namespace), "COLUMNS": "200"}).stdout
    assert re.search(r"^workers\s+1 live \(a heartbeat in the last 30 s\), 1 stopped, 1 silent$", out, re.M), out
    assert re.search(rf"{re.escape(runner.get_worker_id())}\s+stopped\s+idle\s+\d+ s ago", out), out
    assert re.search(r"Worker-live\s+yes\s", out) and re.search(r"Worker-gone\s+no\s", out), out
    assert out.index("Worker-live") < out.index(runner.get_worker_id()), out  # live ones first


async def test_status_shows_queue_depth_and_live_workers(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        for i in range(3):
            await store.enqueue_rollout({"i": i})
        await store.update_worker("Worker-live", {"cpu": 0.1})
        await store.sync_all()
        assert await waiting_without_workers(store) is None
    out = cli("status", env=env_of(namespace)).stdout
    assert re.search(r"^queue\s+3 rollout\(s\) waiting \(queuing=3\)$", out, re.M), out
    assert re.search(r"^workers\s+1 live \(a heartbeat in the last 30 s\), 0 silent$", out, re.M), out
    assert re.search(r"Worker-live\s+yes\s+\S+\s+\d+ s ago", out), out
    assert "warning" not in out


async def test_status_warns_when_rollouts_wait_and_no_worker_is_alive(namespace: Settings) -> None:
    long_ago = time.time() - 600
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn, clock=lambda: long_ago) as store:
        await store.enqueue_rollout({"q": 1})
        await store.update_worker("Worker-gone", {"cpu": 0.1})  # its last heartbeat: 10 min ago
        await store.sync_all()
        message = await waiting_without_workers(store)
    assert message is not None and "1 rollout(s) wait" in message
    out = cli("status", env=env_of(namespace)).stdout
    assert re.search(r"^workers\s+0 live .*, 1 silent$", out, re.M), out
    assert re.search(r"Worker-gone\s+no\s+\S+\s+10 min ago", out), out
    assert re.search(r"^warning\s+1 rollout\(s\) wait in the queue and no runner is alive", out, re.M), out
    # piped (no terminal, no COLUMNS): rich's 80 columns broke such lines mid-phrase (a fresh user)
    piped = cli("status", env={**env_of(namespace), "COLUMNS": ""}).stdout
    assert re.search(r"^warning\s+1 rollout\(s\) wait in the queue and no runner is alive \(.*\)", piped, re.M), piped


async def test_status_shows_projector_lag(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace) as writer:  # a runner's store: nothing projects
        for i in range(2):
            await writer.enqueue_rollout({"i": i})
    out = cli("status", env=env_of(namespace)).stdout
    found = re.search(r"^projection\s+at event (\d+) of (\d+) \(lag (\d+) events", out, re.M)
    assert found, out
    projected, head, lag = map(int, found.groups())
    assert lag == head - projected >= 2
    # the line points to the fix, as `sql`'s warning does
    fix = r"^projection .*lag \d+ events: `eventlight sql --catch-up` projects up to the head"
    assert re.search(fix, out, re.M), out


async def test_status_lists_the_live_lease_holders_not_stale_files(namespace: Settings, tmp_path: Path) -> None:
    """`status` did not say who held the embedded servers: it lists each process holding a lease (pid,
    what, since when) from ``<state>/leases``; a file no process holds a lock on (its holder was
    killed) is not. A process holding two leases (a demo's ``use_services`` block and the Trainer's
    run inside it) was listed twice, under the same pid, and counted as two processes: one row now."""
    from eventlight.ops.leases import live_leases
    from eventlight.ops.lifecycle import lease_services, release_services

    state = tmp_path / "state"
    state.mkdir()
    at_start = Settings(state_dir=state, namespace=namespace.namespace)
    runner = await lease_services(at_start, "eventlight runner")
    trainer = await lease_services(at_start, "Trainer")
    other = await asyncio.create_subprocess_exec(  # another process, holding one lease until its stdin closes
        sys.executable,
        "-c",
        "import sys; from pathlib import Path; from eventlight.ops.leases import take_lease; "
        "lease = take_lease(Path(sys.argv[1]), 'use_services'); print('held', flush=True); sys.stdin.read()",
        str(state),
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert other.stdin is not None and other.stdout is not None
    stale = state / "leases" / "999999-dead.json"
    stale.write_bytes(msgspec.json.encode({"pid": 999999, "what": "eventlight serve", "since": time.time()}))
    try:
        assert await asyncio.wait_for(other.stdout.readline(), 60) == b"held\n"
        env = {**env_of(namespace), "EVENTLIGHT_STATE_DIR": str(state)}
        out = await asyncio.to_thread(lambda: cli("status", env=env).stdout)
        said = live_leases(state)  # what `down` and a run's end name: one entry a process too
    finally:
        other.stdin.close()
        await other.wait()
        await release_services(trainer)
        await release_services(runner)
    assert re.search(r"^leases\s+2 process\(es\) use the embedded servers$", out, re.M), out
    rows = re.findall(r"^\s*(\d+)\s+(.+?)\s+(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC) \((\d+) s ago\)$", out, re.M)
    mine = "`eventlight runner`, a trainer's run"  # its leases in the order taken
    assert [r[:2] for r in rows] == [(str(os.getpid()), mine), (str(other.pid), "a program's use_services block")], out
    assert not re.search(r"^\s*999999 ", out, re.M) and "`eventlight serve`" not in out, out
    assert sorted(said) == sorted(
        [f"pid {os.getpid()} (eventlight runner, Trainer)", f"pid {other.pid} (use_services)"]
    )


async def test_sql_says_when_the_read_models_are_behind_the_log_and_catch_up_projects_them(
    namespace: Settings,
) -> None:
    """A script that wrote through a store and closed left ``status`` at "projection at event 0 of
    N", and ``sql`` answered from the empty read models without a word. It now warns, by how many
    events, and ``--catch-up`` projects up to the head first; with NATS down the query still runs."""
    async with JetStreamLightningStore(namespace) as writer:  # a runner's store: nothing projects
        for i in range(2):
            await writer.enqueue_rollout({"i": i})
    query = ("sql", "SELECT count(*) AS n FROM rollouts", "-f", "csv")
    behind = cli(*query, env=env_of(namespace))
    assert behind.returncode == 0 and behind.stdout.split() == ["n", "0"], behind.stderr
    found = re.fullmatch(
        r"warning: the read models are (\d+) events behind the log \(projected up to event 0 of (\d+)\), "
        r"so this result may be stale: `eventlight sql --catch-up` projects up to the head first .*\n",
        behind.stderr,
    )
    assert found and found[1] == found[2] and int(found[1]) >= 2, behind.stderr
    caught = cli(*query, "--catch-up", env=env_of(namespace))
    # stdout is the result alone; without a terminal no progress, and not the projector's INFO line
    assert caught.returncode == 0 and caught.stdout == "n\n2\n", (caught.stdout, caught.stderr)
    assert caught.stderr == "", caught.stderr
    again = cli(*query, env=env_of(namespace))  # caught up: not a word
    assert again.returncode == 0 and again.stdout.split() == ["n", "2"] and again.stderr == "", again.stderr
    nats_down = {**env_of(namespace), "EVENTLIGHT_NATS_URL": f"nats://127.0.0.1:{free_port()}"}
    down = cli(*query, env=nats_down)
    assert down.returncode == 0 and down.stdout.split() == ["n", "2"], down.stderr
    unknown = r"warning: whether the read models are behind the log is unknown: cannot reach .*\n"
    assert re.fullmatch(unknown, down.stderr), down.stderr
    no_nats = {**env_of(namespace), "EVENTLIGHT_NATS_URL": ""}  # nothing configured nor recorded: no check
    quiet = cli(*query, env={**no_nats, "EVENTLIGHT_STATE_DIR": str(namespace.state_dir / "none")})
    assert quiet.returncode == 0 and quiet.stdout.split() == ["n", "2"] and quiet.stderr == "", quiet.stderr


async def test_with_only_the_embedded_postgres_down_runner_starts_and_status_names_it(
    namespace: Settings, services: tuple[Settings, Services], tmp_path: Path
) -> None:
    """A stopped embedded postmaster made `runner` and `status` say no servers ran at all, though
    NATS, all runners need, was up."""
    _, svc = services
    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await gone.wait()  # a pid that no longer runs: the postmaster that stopped
    record = Services(
        nats_url=svc.nats_url,
        pg_dsn=f"postgresql://postgres@127.0.0.1:{free_port()}/postgres",
        nats_pid=svc.nats_pid or os.getpid(),
        pg_pid=gone.pid,
        pg_kind="system",
    )
    (tmp_path / "services.json").write_bytes(msgspec.json.encode(record))
    env = {"EVENTLIGHT_STATE_DIR": str(tmp_path), "EVENTLIGHT_NAMESPACE": namespace.namespace}

    status = cli("status", env=env)
    stopped = f"postgres pid {gone.pid} is no longer running"
    assert_one_line_error(status, 1, stopped, "runners need only NATS")
    assert re.search(r"^NATS\s+nats://\S+\s+embedded", status.stdout, re.M), status.stdout
    assert re.search(rf"^Postgres\s+embedded postgresql://\S+\s+down: {stopped}", status.stdout, re.M), status.stdout
    assert f"stream {namespace.stream_name} (" in status.stdout
    assert_one_line_error(cli("sql", "SELECT 1", env=env), 1, stopped)
    stale = msgspec.structs.replace(record, nats_pid=gone.pid)  # a record every server of which stopped
    (tmp_path / "services.json").write_bytes(msgspec.json.encode(stale))
    assert_one_line_error(cli("status", env=env), 1, "no eventlight servers are running", "run `eventlight up`")
    (tmp_path / "services.json").write_bytes(msgspec.json.encode(record))

    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    runner = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "eventlight.cli", "runner", "tests/fault_agents.py:quick"),
        cwd=ROOT,
        env={**base, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert runner.stdout is not None
    try:
        first = await asyncio.wait_for(runner.stdout.readline(), 60)
        runner.send_signal(signal.SIGINT)
        rest, err = await asyncio.wait_for(runner.communicate(), 60)
    finally:
        if runner.returncode is None:
            runner.kill()
            await runner.wait()
    assert "consuming" in first.decode(), (first + rest + err).decode()
    assert runner.returncode == 130, err.decode()


async def test_with_only_nats_down_status_shows_what_postgres_holds_and_names_nats(
    namespace: Settings, services: tuple[Settings, Services], tmp_path: Path
) -> None:
    """With NATS down and Postgres up `status` stopped with one line about NATS; now it shows what
    Postgres holds (projection, rollouts, queue, spans, workers), then exits 1 naming NATS, as it
    does the other way round."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        for i in range(2):
            await store.enqueue_rollout({"i": i})
        await store.update_worker("Worker-a", {"cpu": 0.1})
        await store.sync_all()
    dead = f"nats://127.0.0.1:{free_port()}"
    status = cli("status", env={**env_of(namespace), "EVENTLIGHT_NATS_URL": dead})
    assert_one_line_error(status, 1, f"cannot reach EVENTLIGHT_NATS_URL {dead}", "come from NATS")
    out = status.stdout
    assert re.search(rf"^NATS\s+EVENTLIGHT_NATS_URL {dead}\s+down: NATS is not reachable", out, re.M), out
    assert re.search(r"^Postgres\s+postgresql://\S+\s+external", out, re.M), out
    assert f"stream {namespace.stream_name} (unknown: NATS is down)" in out, out
    assert re.search(r"^projection\s+at event [1-9]\d* \(the stream's last event is unknown", out, re.M), out
    assert re.search(r"^rollouts\s+queuing=2$", out, re.M), out
    assert re.search(r"^queue\s+2 rollout\(s\) waiting \(queuing=2\)$", out, re.M), out
    assert re.search(r"^spans\s+0$", out, re.M) and re.search(r"Worker-a\s+yes", out), out

    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await gone.wait()  # the embedded nats-server that stopped, while the recorded Postgres runs
    _, svc = services
    record = Services(nats_url=dead, pg_dsn=svc.pg_dsn, nats_pid=gone.pid, pg_pid=svc.pg_pid or os.getpid())
    (tmp_path / "services.json").write_bytes(msgspec.json.encode(record))
    env = {"EVENTLIGHT_STATE_DIR": str(tmp_path), "EVENTLIGHT_NAMESPACE": namespace.namespace}
    status = cli("status", env=env)
    assert_one_line_error(status, 1, f"nats-server pid {gone.pid} is no longer running")
    assert re.search(r"^NATS\s+embedded nats://\S+\s+down: nats-server pid", status.stdout, re.M), status.stdout
    assert re.search(r"^rollouts\s+queuing=2$", status.stdout, re.M), status.stdout

    dead_pg = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    both = cli("status", env={**env_of(namespace), "EVENTLIGHT_NATS_URL": dead, "EVENTLIGHT_PG_DSN": dead_pg})
    assert_one_line_error(both, 1, f"EVENTLIGHT_NATS_URL {dead}", "; and cannot reach EVENTLIGHT_PG_DSN")


async def test_status_says_an_old_nats_is_up_but_too_old_and_shows_no_other_postgres(
    namespace: Settings, tmp_path: Path
) -> None:
    """Against a nats-server older than eventlight needs (the machine's own 2.9.10), `status` said
    "down" for a server that answered, and with EVENTLIGHT_NATS_URL set and EVENTLIGHT_PG_DSN unset it
    showed the rows of the Postgres `eventlight up` recorded beside another NATS. It now says the
    server is up but too old (both versions), ends with an error line, exit 1, and takes the recorded
    Postgres only when `up` recorded that NATS too."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.enqueue_rollout({"i": 0})
        await store.sync_all()
    another = f"nats://127.0.0.1:{free_port()}"  # the NATS `up` ran with, and its (running) Postgres
    record = Services(nats_url=another, pg_dsn=namespace.pg_dsn or "", pg_pid=os.getpid(), pg_kind="system")
    (tmp_path / "services.json").write_bytes(msgspec.json.encode(record))
    async with old_nats_server("2.9.10") as old:
        configured = {**env_of(namespace), "EVENTLIGHT_NATS_URL": old}  # and its Postgres: shown
        with_pg = await asyncio.to_thread(cli, "status", env=configured)
        only_nats = {**configured, "EVENTLIGHT_PG_DSN": "", "EVENTLIGHT_STATE_DIR": str(tmp_path)}
        without_pg = await asyncio.to_thread(cli, "status", env=only_nats)
    too_old = f"EVENTLIGHT_NATS_URL {old} answered, but nats-server 2.9.10 is too old: eventlight needs >= 2.11"
    assert_one_line_error(with_pg, 1, too_old)
    out = with_pg.stdout
    up = r"up, but too old: nats-server 2\.9\.10 answered; eventlight needs >= 2\.11$"
    assert re.search(rf"^NATS\s+EVENTLIGHT_NATS_URL {re.escape(old)}\s+{up}", out, re.M), out
    assert "down" not in out and f"stream {namespace.stream_name} (unknown: NATS is too old)" in out, out
    assert re.search(r"^rollouts\s+queuing=1$", out, re.M), out

    assert_one_line_error(without_pg, 1, too_old, "not the NATS of the servers `eventlight up` recorded")
    assert "EVENTLIGHT_PG_DSN" in without_pg.stderr and "rollouts" not in without_pg.stdout, without_pg.stdout
    with_nats = {**only_nats, "EVENTLIGHT_NATS_URL": namespace.nats_url or ""}  # a NATS that works, not up's
    other = cli("status", env=with_nats)
    assert_one_line_error(other, 2, "not the NATS of the servers `eventlight up` recorded", "EVENTLIGHT_PG_DSN")
    assert "rollouts" not in other.stdout, other.stdout
    unknown = {**configured, "EVENTLIGHT_NAMESPACE": "nosuchns"}  # NATS too old *and* no such namespace
    async with old_nats_server("2.9.10") as old:
        both = await asyncio.to_thread(cli, "status", env={**unknown, "EVENTLIGHT_NATS_URL": old})
    too_old_there = f"EVENTLIGHT_NATS_URL {old} answered, but nats-server 2.9.10 is too old"
    assert_one_line_error(both, 1, too_old_there, "; and namespace 'nosuchns' does not exist")
    same = msgspec.structs.replace(record, nats_url=namespace.nats_url or "")  # `up` ran with this NATS
    (tmp_path / "services.json").write_bytes(msgspec.json.encode(same))
    paired = cli("status", env=with_nats)
    assert paired.returncode == 0 and re.search(r"^rollouts\s+queuing=1$", paired.stdout, re.M), paired


def test_status_says_an_external_server_came_from_the_record_of_up_when_its_variable_is_unset(
    namespace: Settings, services: tuple[Settings, Services], tmp_path: Path
) -> None:
    """After ``EVENTLIGHT_PG_DSN=... eventlight up`` and ``unset EVENTLIGHT_PG_DSN``, `status` said
    "external, from EVENTLIGHT_PG_DSN" (fresh-user run): it comes from services.json, which `up`
    wrote, and says so; with the variable set, it is the variable's."""
    _, svc = services
    alive = os.getpid()  # an embedded server that still runs, as services.json counts one
    env = {"EVENTLIGHT_STATE_DIR": str(tmp_path), "EVENTLIGHT_NAMESPACE": namespace.namespace}
    external_pg = Services(nats_url=svc.nats_url, pg_dsn=svc.pg_dsn, nats_pid=svc.nats_pid or alive)
    (tmp_path / "services.json").write_bytes(msgspec.json.encode(external_pg))
    out = cli("status", env=env).stdout
    then = r"external, recorded by `eventlight up` \(EVENTLIGHT_PG_DSN then\)$"
    assert re.search(rf"^Postgres\s+postgresql://\S+\s+{then}", out, re.M), out
    out = cli("status", env={**env, "EVENTLIGHT_PG_DSN": svc.pg_dsn}).stdout
    assert re.search(r"^Postgres\s+postgresql://\S+\s+external, from EVENTLIGHT_PG_DSN$", out, re.M), out
    external_nats = Services(nats_url=svc.nats_url, pg_dsn=svc.pg_dsn, pg_pid=alive, pg_kind="system")
    (tmp_path / "services.json").write_bytes(msgspec.json.encode(external_nats))
    out = cli("status", env=env).stdout
    then = r"external, recorded by `eventlight up` \(EVENTLIGHT_NATS_URL then\)$"
    assert re.search(rf"^NATS\s+nats://\S+\s+{then}", out, re.M), out


class _Checkpoints:
    """A connection whose ``projector_checkpoint`` reads ``positions`` one after another (the last
    one from then on): a projector running meanwhile, or none."""

    def __init__(self, *positions: int) -> None:
        self.positions = list(positions)

    async def fetchval(self, query: str) -> int:
        return self.positions.pop(0) if len(self.positions) > 1 else self.positions[0]


async def test_sql_does_not_warn_of_a_lag_a_running_projector_closes(monkeypatch: Any, capsys: Any) -> None:
    """During a demo almost every ``sql`` warned "the read models are 1 events behind the log": a
    projector that is running trails the log's head by a few events for milliseconds. The warning
    now comes only when the projection does not reach the head it read within ``LAG_SETTLE_S``, and
    it says "1 event"."""
    from eventlight.cli import projection

    async def head(settings: Settings) -> int:
        return 40

    monkeypatch.setattr(projection, "log_head", head)
    await projection.warn_if_behind(Settings(), _Checkpoints(39, 39, 40))  # caught up within the settle time
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(projection, "LAG_SETTLE_S", 0.2)
    await projection.warn_if_behind(Settings(), _Checkpoints(39))  # nothing projects
    said = capsys.readouterr().err
    assert said.startswith("warning: the read models are 1 event behind the log (projected up to event 39 of 40)")


async def test_sql_stops_waiting_for_a_projection_that_does_not_move(monkeypatch: Any, capsys: Any) -> None:
    """With nothing projecting, waiting the whole ``LAG_SETTLE_S`` for the head added 1 s to every
    ``sql`` on a lagging namespace: the check gives up once the projection has not moved for
    ``LAG_STILL_S`` (a fake clock here: each poll's sleep advances it)."""
    import types

    from eventlight.cli import projection

    clock = [0.0]

    async def sleep(seconds: float) -> None:
        clock[0] += seconds

    async def head(settings: Settings) -> int:
        return 40

    polls = _Checkpoints(30, 31, 32, 32)  # it moved, then stopped short of the head
    monkeypatch.setattr(projection, "log_head", head)
    monkeypatch.setattr(projection, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(projection, "asyncio", types.SimpleNamespace(sleep=sleep, wait_for=asyncio.wait_for))
    monkeypatch.setattr(projection, "LAG_SETTLE_S", 60.0)
    await projection.warn_if_behind(Settings(), polls)
    assert "are 8 events behind the log (projected up to event 32 of 40)" in capsys.readouterr().err
    assert clock[0] <= 0.1 + projection.LAG_STILL_S + 0.05  # moved until 0.1 s, then still for LAG_STILL_S


async def test_find_pg_takes_the_recorded_postgres_for_its_nats_however_spelled(
    namespace: Settings, tmp_path: Path
) -> None:
    """With EVENTLIGHT_NATS_URL set and EVENTLIGHT_PG_DSN not, the Postgres `eventlight up` recorded
    goes with the NATS it recorded under any spelling of that server (credentials, a trailing ``/``,
    the host's case, a cluster's order, no scheme); another server is still refused."""
    from eventlight.core.errors import InvalidInputError
    from eventlight.ops.discovery import find_pg

    port, other = free_port(), free_port()
    record = Services(
        nats_url=f"nats://127.0.0.1:{port},nats://localhost:{other}",
        pg_dsn=namespace.pg_dsn or "",
        pg_pid=os.getpid(),
        pg_kind="system",
    )
    (tmp_path / "services.json").write_bytes(msgspec.json.encode(record))
    for url in (
        f"nats://u:secret@127.0.0.1:{port},nats://localhost:{other}",
        f"nats://127.0.0.1:{port}/,nats://LocalHost:{other}/",
        f"localhost:{other},127.0.0.1:{port}",
    ):
        settings = Settings(nats_url=url, pg_dsn=None, state_dir=tmp_path)
        found = await find_pg(settings)
        assert found is not None and found.url == namespace.pg_dsn, url
    for url in (f"nats://127.0.0.1:{port}", f"nats://127.0.0.1:{free_port()},nats://localhost:{other}"):
        with pytest.raises(InvalidInputError, match="not the NATS of the servers"):
            await find_pg(Settings(nats_url=url, pg_dsn=None, state_dir=tmp_path))
