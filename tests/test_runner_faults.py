"""Runners under transient faults (issue 12, point 5): retries with backoff, reconnects after a NATS
outage, release what they hold when stopped, die with their parent, are restarted, have unique ids.

The process tests start real ``eventlight runner`` processes (``tests/fault_agents.py``); the outage
test kills and restarts a nats-server of its own, on its own port and data folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
import types
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import fault_agents
import nats.errors
import psutil
import pytest

import eventlight as agl
from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.core.types import STATUS_REASON
from eventlight.ops import Services, drop_namespace, prepare_services, stop_services
from eventlight.runner import Backoff, worker_name
from eventlight.runner_pool import RESTART_MAX_S, SIGTERM_REASON, RunnerPool, restart_delay_s
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.connect import RECONNECT_WAIT_S, _Events
from eventlight.store.validate import is_token

ROOT = Path(__file__).resolve().parent.parent
AGENTS = "tests/fault_agents.py"
ENV_VARS = ("EVENTLIGHT_NATS_URL", "EVENTLIGHT_PG_DSN", "EVENTLIGHT_NAMESPACE", "EVENTLIGHT_STATE_DIR")
RESOURCES = {"prompt_template": agl.PromptTemplate(template="{q}")}


# -- in one process ----------------------------------------------------------------------------


def test_backoff_doubles_from_a_tenth_of_a_second_to_five() -> None:
    b = Backoff()
    assert [b.next() for _ in range(8)] == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    b.reset()
    assert b.next() == 0.1


class FlakyStore(agl.InMemoryLightningStore):
    """Fails the dequeues and the status updates it is told to, in order, then behaves."""

    def __init__(self, dequeue_faults: list[Exception], update_faults: list[Exception]):
        super().__init__()
        self.dequeue_faults = dequeue_faults
        self.update_faults = update_faults

    async def dequeue_rollout(self, worker_id: str | None = None) -> Any:
        if self.dequeue_faults:
            raise self.dequeue_faults.pop(0)
        return await super().dequeue_rollout(worker_id)

    async def update_attempt(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("status") in ("succeeded", "failed") and self.update_faults:
            raise self.update_faults.pop(0)
        return await super().update_attempt(*args, **kwargs)


async def test_dequeue_and_status_faults_are_one_line_each_and_the_runner_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nats_down = ServiceUnavailableError("nats://127.0.0.1:1", "pull from the runners queue failed")
    dequeue_faults: list[Exception] = [
        nats_down,
        nats_down,
        InvalidInputError("not an eventlight event: malformed queue message"),
        nats.errors.TimeoutError(),
    ]
    store = FlakyStore(dequeue_faults, [ServiceUnavailableError("nats://127.0.0.1:1", "publish failed")])
    await store.add_resources(RESOURCES)
    made = [await store.enqueue_rollout({"q": i}) for i in range(2)]
    runner = agl.LitAgentRunner(agl.OtelTracer(), max_rollouts=2, poll_interval=0.01, heartbeat_interval=0)
    with caplog.at_level(logging.DEBUG, logger="eventlight.runner"):
        with runner.run_context(agent=fault_agents.quick, store=store):
            assert await asyncio.wait_for(runner.iter(), 20) == 2
            dequeue_faults.append(nats_down)  # a fault after a success starts from 0.1 s again
            runner.max_rollouts = 1
            await store.enqueue_rollout({"q": 2})
            assert await asyncio.wait_for(runner.iter(), 20) == 1
    failed = [r for r in caplog.records if "dequeue failed" in r.getMessage()]
    delays = [float(re.search(r"again in ([\d.]+) s", r.getMessage()).group(1)) for r in failed]  # type: ignore[union-attr]
    assert delays == [0.1, 0.2, 0.4, 0.8, 0.1], failed
    # one warning per outage (the retryable faults in a row), and one for the malformed message
    assert [r.levelname for r in failed] == ["WARNING", "DEBUG", "WARNING", "DEBUG", "WARNING"], failed
    assert all("\n" not in r.getMessage() for r in failed)
    assert sum("could not record status succeeded" in r.getMessage() for r in caplog.records) == 1
    got = [await store.get_rollout_by_id(r.rollout_id) for r in made]
    assert [r.status for r in got] == ["succeeded", "succeeded"]  # the first one recorded late


async def test_a_nats_outage_is_one_dequeue_warning_and_an_orderly_shutdown_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A runner warned for each failed dequeue of an outage: the server's 409 Server Shutdown to the
    pull in flight, then the pull that timed out just after the reconnect. Now the 409 of a server
    stopping in order is an INFO line, and the failures in a row one warning; the next outage warns again."""
    server = "nats://127.0.0.1:1"
    shutdown = ServiceUnavailableError(server, "pull answered 409 Server Shutdown", shutting_down=True)
    faults: list[Exception] = [
        shutdown,
        ServiceUnavailableError(server, "pull from the runners queue failed: TimeoutError()"),
        nats.errors.TimeoutError(),
    ]
    store = FlakyStore(faults, [])
    await store.add_resources(RESOURCES)
    await store.enqueue_rollout({"q": 1})
    runner = agl.LitAgentRunner(agl.OtelTracer(), max_rollouts=1, poll_interval=0.01, heartbeat_interval=0)
    with caplog.at_level(logging.DEBUG, logger="eventlight.runner"):
        with runner.run_context(agent=fault_agents.quick, store=store):
            assert await asyncio.wait_for(runner.iter(), 20) == 1
            faults.append(shutdown)  # the next outage, after a success
            faults.append(nats.errors.TimeoutError())
            await store.enqueue_rollout({"q": 2})
            assert await asyncio.wait_for(runner.iter(), 20) == 1
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "dequeue" in r.getMessage()]
    assert [level for level, _ in lines] == ["INFO", "WARNING", "DEBUG", "INFO", "INFO", "WARNING", "INFO"], lines
    assert "409" in lines[0][1] and "409" not in lines[1][1], lines
    assert lines[3][1].endswith("dequeue works again (after 3 failed tries)"), lines


async def test_a_malformed_queue_message_does_not_stop_the_runner(
    namespace: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    import nats

    nc = await nats.connect(namespace.nats_url)
    try:
        await nc.jetstream().publish(f"{namespace.subject_prefix}.r.rbad.q", b"\xffnot an event")
    finally:
        await nc.close()
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.add_resources(RESOURCES)
        good = await store.enqueue_rollout({"q": 1})
        runner = agl.LitAgentRunner(agl.OtelTracer(), max_rollouts=1, poll_interval=0.2, heartbeat_interval=0)
        async with JetStreamLightningStore(namespace) as runner_store:
            with caplog.at_level(logging.WARNING):
                with runner.run_context(agent=fault_agents.quick, store=runner_store):
                    assert await asyncio.wait_for(runner.iter(), 30) == 1
        done = await store.wait_for_rollouts(rollout_ids=[good.rollout_id], timeout=30)
        consumer = await store.log.js.consumer_info(store.log.stream, "runners")
    assert [r.status for r in done] == ["succeeded"]
    assert any("dropping queue entry" in r.getMessage() and "rbad" in r.getMessage() for r in caplog.records)
    assert consumer.num_ack_pending == 0 and consumer.num_pending == 0  # dropped, not redelivered for ever


def test_worker_ids_are_unique_across_processes_and_valid() -> None:
    here = worker_name(0)
    code = "from eventlight.runner import worker_name; print(worker_name(0))"
    others = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True) for _ in "ab"]
    ids = {here, *(o.stdout.strip() for o in others)}
    assert len(ids) == 3, ids
    for wid in ids:
        assert is_token(wid) and wid.startswith("Worker-0@"), wid
    assert f"-{os.getpid()}-" in here
    runner = agl.LitAgentRunner(agl.OtelTracer())
    runner.init_worker(3, agl.InMemoryLightningStore())
    assert runner.worker_id == 3 and runner.get_worker_id() == worker_name(3)  # Agent-lightning: an index


def test_restart_delay_is_capped() -> None:
    assert [restart_delay_s(k) for k in (0, 1, 2, 3)] == [1.0, 1.0, 2.0, 4.0]
    assert restart_delay_s(50) == RESTART_MAX_S


# -- real processes ----------------------------------------------------------------------------


def _env(settings: Settings) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    return {
        **base,
        "EVENTLIGHT_NATS_URL": settings.nats_url or "",
        "EVENTLIGHT_PG_DSN": settings.pg_dsn or "",
        "EVENTLIGHT_NAMESPACE": settings.namespace,
        "EVENTLIGHT_STATE_DIR": str(settings.state_dir),
        "EVENTLIGHT_LOG_LEVEL": "INFO",
    }


# Starts the command with SIGINT ignored, as a parent that ignores it passes it on through exec.
_SIGINT_IGNORED = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])"
)


async def _start_runner(
    settings: Settings, agent: str, n: int, *args: str, sigint_ignored: bool = False, own_group: bool = False
) -> asyncio.subprocess.Process:
    """``eventlight runner``; ``own_group``: in a process group (and session) of its own."""
    wrap = (sys.executable, "-c", _SIGINT_IGNORED) if sigint_ignored else ()
    return await asyncio.create_subprocess_exec(
        *wrap,
        *(sys.executable, "-X", "faulthandler", "-m", "eventlight.cli", "runner", f"{AGENTS}:{agent}", "-n", str(n)),
        *args,
        cwd=ROOT,
        env=_env(settings),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=own_group,
    )


async def _stop_runner(proc: asyncio.subprocess.Process, sig: int | None = signal.SIGINT) -> tuple[int, str]:
    """Send ``sig`` (``None``: none) and wait for the runner to exit."""
    if proc.returncode is None and sig is not None:
        with _suppress_lookup():
            proc.send_signal(sig)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        _, err = await _dump_and_kill(proc)
    return proc.returncode or 0, err.decode(errors="replace")


async def _dump_and_kill(proc: asyncio.subprocess.Process) -> tuple[bytes, bytes]:
    """A runner that did not stop: SIGABRT first, so that ``-X faulthandler`` prints every thread's
    stack to its stderr (where it hung goes into the failure message), then SIGKILL."""
    with _suppress_lookup():
        proc.send_signal(signal.SIGABRT)
    try:
        return await asyncio.wait_for(proc.communicate(), 10)
    except TimeoutError:
        proc.kill()
        return await proc.communicate()


def _suppress_lookup() -> Any:
    return contextlib.suppress(ProcessLookupError)


async def _until_running(store: JetStreamLightningStore, rollout_ids: list[str], timeout_s: float = 60) -> None:
    """Until each rollout has an attempt in flight (``preparing`` until its first span, then ``running``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = [await store.get_rollout_by_id(rid) for rid in rollout_ids]
        if all(r is not None and r.status in ("preparing", "running") for r in got):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"not all running after {timeout_s} s: {[r and r.status for r in got]}")


async def _settled(store: JetStreamLightningStore, rollout_ids: list[str], timeout_s: float = 30) -> list[Any]:
    """The rollouts once none is ``running`` or ``preparing`` any more (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        await store.sync_all()
        got = [await store.get_rollout_by_id(rid) for rid in rollout_ids]
        if time.monotonic() > deadline or all(r.status not in ("running", "preparing") for r in got):
            return got
        await asyncio.sleep(0.2)


async def test_ctrl_c_on_eventlight_runner_fails_its_attempts_in_flight(namespace: Settings) -> None:
    """peer_failures C06: Ctrl+C exits 130 without a traceback and records the attempts in flight
    failed, with the reason."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.add_resources(RESOURCES)
        made = [await store.enqueue_rollout({"sleep_s": 600}) for _ in range(2)]  # the default RolloutConfig
        proc = await _start_runner(namespace, "slow", 2)
        try:
            await _until_running(store, [r.rollout_id for r in made])
        finally:
            t0 = time.monotonic()
            code, err = await _stop_runner(proc, signal.SIGINT)
        stop_s = time.monotonic() - t0
        got = await _settled(store, [r.rollout_id for r in made])
    assert code == 130, err
    assert [(r.status, r.attempt.status) for r in got] == [("failed", "failed")] * 2, err
    assert [r.attempt.metadata.get(STATUS_REASON) for r in got] == [SIGTERM_REASON] * 2
    assert "Traceback" not in err
    print(f"\nCtrl+C: {len(got)} attempts in flight recorded failed; the runner exited in {stop_s:.1f} s")


async def test_ctrl_c_on_runners_sharing_a_process_fails_all_their_attempts(namespace: Settings) -> None:
    """peer_failures C06: ``eventlight runner -n 2 --per-process 2``: both runners claim in one
    process, and Ctrl+C records both attempts in flight failed."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.add_resources(RESOURCES)
        made = [await store.enqueue_rollout({"sleep_s": 600}) for _ in range(2)]
        proc = await _start_runner(namespace, "slow", 2, "--per-process", "2")
        try:
            await _until_running(store, [r.rollout_id for r in made])
        finally:
            code, err = await _stop_runner(proc, signal.SIGINT)
        got = await _settled(store, [r.rollout_id for r in made])
        workers = [(await store.get_latest_attempt(r.rollout_id)).worker_id for r in made]
    assert code == 130, err
    assert [(r.status, r.attempt.status) for r in got] == [("failed", "failed")] * 2, err
    pids = {re.sub(r"^Worker-\d+@", "", w or "").rsplit("-", 1)[0] for w in workers}
    assert len(set(workers)) == 2 and len(pids) == 1, workers  # two runners, one process


async def test_ctrl_c_stops_eventlight_runner_started_with_sigint_ignored(namespace: Settings) -> None:
    """A process started with SIGINT ignored (inherited through exec; seen when an earlier test of
    the same pytest process left it so) still stops on SIGINT with exit 130."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.add_resources(RESOURCES)
        made = await store.enqueue_rollout({"q": 1})
        proc = await _start_runner(namespace, "quick", 1, sigint_ignored=True)
        try:
            [done] = await store.wait_for_rollouts(rollout_ids=[made.rollout_id], timeout=60)
        finally:
            code, err = await _stop_runner(proc, signal.SIGINT)
    assert done.status == "succeeded", err
    assert code == 130, err


async def test_sigterm_to_the_process_group_of_eventlight_runner_gives_attempts_the_grace(namespace: Settings) -> None:
    """``kill -TERM -- -PGID`` (systemd, ``timeout``): the runner processes got SIGTERM themselves and
    failed their attempts at once, and the forkserver died of it, so the pool read them as exited
    (code 255) and logged a restart. Now the 4 s attempts finish within the 10 s grace."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.add_resources(RESOURCES)
        made = [await store.enqueue_rollout({"sleep_s": 4}) for _ in range(2)]
        proc = await _start_runner(namespace, "slow", 2, own_group=True)
        try:
            await _until_running(store, [r.rollout_id for r in made])
            os.killpg(proc.pid, signal.SIGTERM)
            t0 = time.monotonic()
        finally:
            code, err = await _stop_runner(proc, None if "t0" in locals() else signal.SIGKILL)
        stop_s = time.monotonic() - t0
        got = await _settled(store, [r.rollout_id for r in made])
    assert code == 143, err
    assert [r.status for r in got] == ["succeeded"] * 2, err
    assert "exited with code" not in err and "restart" not in err, err
    assert stop_s < 10, err
    print(f"\nSIGTERM to the group: both attempts finished; the runner exited in {stop_s:.1f} s")


async def test_runner_pool_stop_fails_in_flight_attempts_and_requeues_by_config(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.add_resources(RESOURCES)
        config = agl.RolloutConfig(max_attempts=2, retry_condition=["failed"])
        made = await store.enqueue_rollout({"sleep_s": 600}, config=config)
        pool = RunnerPool(fault_agents.slow, 1, namespace, namespace.nats_url or "", log_level="INFO")
        pool.start()
        try:
            await _until_running(store, [made.rollout_id])
        finally:
            codes = await asyncio.to_thread(pool.stop, 0.5)
        [got] = await _settled(store, [made.rollout_id])
        attempts = await store.query_attempts(made.rollout_id)
    assert codes == [0]
    assert got.status in ("requeuing", "queuing") and [a.status for a in attempts] == ["failed"], (got, attempts)
    assert attempts[0].metadata[STATUS_REASON] == SIGTERM_REASON  # it said nothing before


async def test_hurry_cuts_the_grace_of_a_pool_stop_short(namespace: Settings) -> None:
    """A second Ctrl+C while a trainer's runners stop (``Trainer``: ``ctrl_c_again_hurries``): the
    attempts in flight are recorded failed at once, not after the grace; a later stop returns the
    same exit codes without stopping anything again."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.add_resources(RESOURCES)
        made = await store.enqueue_rollout({"sleep_s": 600})
        pool = RunnerPool(fault_agents.slow, 1, namespace, namespace.nats_url or "")
        pool.hurry()  # before any stop: nothing
        pool.start()
        stopping = None
        try:
            await _until_running(store, [made.rollout_id])
            assert not pool.cancel_now.is_set()
            t0 = time.monotonic()
            stopping = asyncio.ensure_future(asyncio.to_thread(pool.stop, 60))
            while not pool.stopping:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
            pool.hurry()
            codes = await asyncio.wait_for(stopping, 30)
            stop_s = time.monotonic() - t0
        finally:
            if stopping is None:
                pool.stop(0)
        [got] = await _settled(store, [made.rollout_id])
        attempts = await store.query_attempts(made.rollout_id)
    assert codes == [0] and pool.stopped and pool.stop() == codes
    assert stop_s < 15, stop_s
    assert [(a.status, a.metadata.get(STATUS_REASON)) for a in attempts] == [("failed", SIGTERM_REASON)], got


async def test_kill_9_of_a_runner_process_fails_its_attempt_and_the_rollout_is_retried(namespace: Settings) -> None:
    """kill -9 of one of two runner processes mid-rollout: the pool records the attempt that process
    ran ``failed``, saying so (the default RolloutConfig has no timeout: it stayed ``preparing`` for
    ever, and an algorithm waiting for it with it), so the rollout's retry runs and succeeds; the
    other process's attempt is not touched, and the restarted process claims under a new worker id."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.add_resources(RESOURCES)
        config = agl.RolloutConfig(max_attempts=2, retry_condition=["failed"])
        made = [await store.enqueue_rollout({"sleep_s": 600}, config=config) for _ in range(2)]
        pool = RunnerPool(fault_agents.slow_first, 2, namespace, namespace.nats_url or "", log_level="INFO")
        pool.start()
        try:
            await _until_running(store, [r.rollout_id for r in made])
            pid = pool.procs[0].pid
            assert pid is not None
            [killed] = [r for r in made if f"-{pid}-" in (await store.get_latest_attempt(r.rollout_id)).worker_id]
            [other] = [r for r in made if r is not killed]
            os.kill(pid, signal.SIGKILL)
            [done] = await store.wait_for_rollouts(rollout_ids=[killed.rollout_id], timeout=30)
            still = await store.get_latest_attempt(other.rollout_id)
        finally:
            await asyncio.to_thread(pool.stop, 0.5)
        first, second = await store.query_attempts(killed.rollout_id)
    assert done.status == "succeeded" and (first.status, second.status) == ("failed", "succeeded")
    assert first.metadata[STATUS_REASON] == f"runner process {pid} exited with code -9 (SIGKILL) while the attempt ran"
    assert second.worker_id != first.worker_id and f"-{pool.procs[0].pid}-" in second.worker_id
    assert still.status in ("preparing", "running") and STATUS_REASON not in (still.metadata or {})


async def test_kill_9_right_after_a_claim_is_recorded_fails_the_attempt(namespace: Settings) -> None:
    """A runner process killed once the store recorded its claim, before the claim reached the runner
    loop (``fault_agents.DiesAfterItsFirstClaim``): the loop wrote the claim board after the claim
    returned, so the board was empty and the attempt stayed ``preparing`` for ever (no timeout).
    The claim is now on the board before its append: the pool records it ``failed`` and the retry
    runs on the restarted process."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.add_resources(RESOURCES)
        config = agl.RolloutConfig(max_attempts=2, retry_condition=["failed"])
        made = await store.enqueue_rollout({"q": 1}, config=config)
        runner = fault_agents.DiesAfterItsFirstClaim()
        pool = RunnerPool(fault_agents.quick, 1, namespace, namespace.nats_url or "", runner=runner)
        pool.start()
        try:
            done = await store.wait_for_rollouts(rollout_ids=[made.rollout_id], timeout=20)
        finally:
            await asyncio.to_thread(pool.stop, 0.5)
        attempts = await store.query_attempts(made.rollout_id)
    assert [a.status for a in attempts] == ["failed", "succeeded"] and done[0].status == "succeeded", attempts
    reason = attempts[0].metadata[STATUS_REASON]
    assert re.fullmatch(r"runner process \d+ exited with code -9 \(SIGKILL\) while the attempt ran", reason), reason
    assert pool.restarts == 1


async def test_kill_9_of_the_runner_parent_leaves_no_orphans(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.add_resources(RESOURCES)
        made = await store.enqueue_rollout({"sleep_s": 600})
        proc = await _start_runner(namespace, "slow", 2)
        try:
            await _until_running(store, [made.rollout_id])
            children = psutil.Process(proc.pid).children(recursive=True)
            # spawned runners name spawn_main; forked ones are the forkserver's children
            runners = [c for c in children if "spawn_main" in " ".join(c.cmdline()) or c.ppid() != proc.pid]
            assert len(runners) == 2, [c.cmdline() for c in children]
            proc.kill()
            t0 = time.monotonic()
            _, still = psutil.wait_procs(runners, timeout=15)
            gone_s = time.monotonic() - t0
        finally:
            for p in locals().get("runners", []):  # orphans hold the parent's pipes open
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            await _stop_runner(proc)
        [got] = await _settled(store, [made.rollout_id])
    assert not still, f"orphans still running: {[p.pid for p in still]}"
    assert (got.status, got.attempt.status) == ("failed", "failed")
    print(f"\nkill -9 of the parent: both children gone in {gone_s:.1f} s, the attempt in flight failed")


async def test_runner_processes_take_the_pools_environment_at_start(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runner processes are forked from a forkserver that imported the runner once; each still runs
    with the environment the pool's process has when it starts them (what ``spawn`` gave), not the
    forkserver's: a variable set after an earlier pool started the forkserver reaches the next pool."""
    monkeypatch.delenv("EL_TEST_ENV_MARK", raising=False)

    async def one_rollout() -> float | None:
        made = await store.enqueue_rollout({"q": 1})
        pool = RunnerPool(fault_agents.env_mark, 1, namespace, namespace.nats_url or "")
        pool.start()
        try:
            [done] = await store.wait_for_rollouts(rollout_ids=[made.rollout_id], timeout=60)
            forked = pool.procs[0].pid is not None and psutil.Process(pool.procs[0].pid).ppid() != os.getpid()
        finally:
            await asyncio.to_thread(pool.stop, 5)
        assert done.status == "succeeded", done
        assert forked == ("forkserver" in mp.get_all_start_methods())
        return agl.find_final_reward(list(await store.query_spans(done.rollout_id)))

    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.add_resources(RESOURCES)
        assert await one_rollout() == 0.0  # this pool started the forkserver (or found it running)
        monkeypatch.setenv("EL_TEST_ENV_MARK", "0.5")
        assert await one_rollout() == 0.5


async def test_runner_pool_restarts_a_dead_runner_unless_stopping(
    namespace: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.add_resources(RESOURCES)
        first = await store.enqueue_rollout({"q": 1})
        pool = RunnerPool(fault_agents.quick, 1, namespace, namespace.nats_url or "", log_level="INFO")
        with caplog.at_level(logging.WARNING, logger="eventlight.runner_pool"):
            pool.start()
            try:
                [done] = await store.wait_for_rollouts(rollout_ids=[first.rollout_id], timeout=60)
                old = pool.procs[0].pid
                assert old is not None
                os.kill(old, signal.SIGKILL)
                t0 = time.monotonic()
                while pool.procs[0].pid == old or not pool.procs[0].is_alive():
                    assert time.monotonic() - t0 < 15, "not restarted"
                    await asyncio.sleep(0.1)
                restart_s = time.monotonic() - t0
                second = await store.enqueue_rollout({"q": 2})
                [again] = await store.wait_for_rollouts(rollout_ids=[second.rollout_id], timeout=60)
            finally:
                codes = await asyncio.to_thread(pool.stop, 5)
    assert done.status == again.status == "succeeded"
    assert again.attempt.worker_id != done.attempt.worker_id and f"-{pool.procs[0].pid}-" in again.attempt.worker_id
    assert pool.restarts == 1 and pool.alive() == 0 and codes == [0]  # none restarted after the stop
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"pid {old}) exited with code -9" in m for m in lines), lines
    print(f"\nrestart: a kill -9'd runner came back in {restart_s:.1f} s and took the next rollout")


# -- a NATS outage longer than nats-py's reconnect budget ----------------------------------------


@pytest.fixture
async def own_nats(services: tuple[Settings, Services], tmp_path: Path) -> AsyncIterator[Settings]:
    """A namespace on a nats-server of this test's own (killable), with the session's Postgres."""
    _, svc = services
    base = Settings(state_dir=tmp_path / "state", namespace=f"t{uuid.uuid4().hex[:10]}", pg_dsn=svc.pg_dsn)
    started = await prepare_services(base)
    settings = Settings(
        nats_url=started.nats_url, pg_dsn=svc.pg_dsn, state_dir=base.state_dir, namespace=base.namespace
    )
    try:
        yield settings
    finally:
        await prepare_services(base)  # running again, whatever the test left
        await drop_namespace(started.nats_url, svc.pg_dsn, settings)
        await stop_services(base)


async def test_long_polls_waiting_through_a_nats_restart_are_sent_again(own_nats: Settings) -> None:
    """nats-server killed and restarted under long polls (and under polls just cancelled): once the
    connection is back, the polls still waited for are sent again and claim what is enqueued then.
    Before, their requests died with the server and nothing told the client: each waited out its
    whole ``wait_s`` and failed (``ServiceUnavailableError``), the rollouts left in the queue."""
    settings = own_nats
    base = Settings(state_dir=settings.state_dir, namespace=settings.namespace, pg_dsn=settings.pg_dsn)
    async with (
        JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store,
        JetStreamLightningStore(settings) as runner,
    ):
        assert runner.nc is not None and runner.log is not None
        polls = [asyncio.create_task(runner.dequeue_rollout(worker_id=f"w{i}", wait_s=30)) for i in range(8)]
        await asyncio.sleep(0.3)  # the pull requests are at the server
        for poll in polls[4:]:  # withdrawn (UNSUB) just before the server goes
            poll.cancel()
        nats_pid = (await prepare_services(base)).nats_pid
        assert nats_pid is not None
        os.kill(nats_pid, signal.SIGKILL)
        await asyncio.sleep(1.0)
        await prepare_services(base)
        while not runner.nc.is_connected:  # noqa: ASYNC110  (nats-py has no event for it)
            await asyncio.sleep(0.1)
        enqueued = {(await store.enqueue_rollout(i)).rollout_id for i in range(4)}
        claimed = await asyncio.gather(*polls[:4], return_exceptions=True)
        assert {getattr(c, "rollout_id", repr(c)) for c in claimed} == enqueued
        await asyncio.gather(*polls[4:], return_exceptions=True)
        assert not runner.log.queue._long_polls


OUTAGE_S = 15.0  # nats-py gives up after 5 reconnects 2 s apart: the runner's connection closes for good


async def test_runner_survives_a_nats_outage_longer_than_the_client_reconnects(own_nats: Settings) -> None:
    """A runner and the algorithm's store (with its projector) both outlive a NATS outage longer than
    nats-py's reconnect budget used to be (~10 s), and go on with the same process and store."""
    settings = own_nats
    base = Settings(state_dir=settings.state_dir, namespace=settings.namespace, pg_dsn=settings.pg_dsn)
    proc = await _start_runner(settings, "quick", 1)
    try:
        async with JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
            await store.add_resources(RESOURCES)
            before = [await store.enqueue_rollout({"q": i}) for i in range(2)]
            done = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in before], timeout=60)
            assert [r.status for r in done] == ["succeeded"] * 2
            nats_pid = (await prepare_services(base)).nats_pid
            assert nats_pid is not None
            os.kill(nats_pid, signal.SIGKILL)
            await asyncio.sleep(OUTAGE_S)
            assert proc.returncode is None, "the runner exited during the outage"
            restarted = await prepare_services(base)  # same port and data folder
            assert restarted.nats_url == settings.nats_url and restarted.nats_pid != nats_pid
            t0 = time.monotonic()
            after = [await _retrying(lambda i=i: store.enqueue_rollout({"q": i})) for i in range(3)]
            finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in after], timeout=60)
            resume_s = time.monotonic() - t0
    finally:
        code, err = await _stop_runner(proc)
    assert [r.status for r in finished] == ["succeeded"] * 3, err
    assert {r.attempt.worker_id for r in finished} == {done[0].attempt.worker_id}, "the same process resumed"
    assert "NATS reconnected" in err and code == 130, err
    print(f"\nNATS outage of {OUTAGE_S:.0f} s survived; 3 new rollouts finished {resume_s:.1f} s after the restart")


async def test_a_nats_outage_is_one_warning_not_one_a_second(own_nats: Settings) -> None:
    """`eventlight down` with a runner connected: the runner logged `NATS: [Errno 111] Connection
    refused` at every reconnect attempt, one a second, until the next `up` (and the return as a warning)."""
    settings = own_nats
    base = Settings(state_dir=settings.state_dir, namespace=settings.namespace, pg_dsn=settings.pg_dsn)
    proc = await _start_runner(settings, "quick", 1)
    try:
        async with JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
            await store.add_resources(RESOURCES)
            first = await store.enqueue_rollout({"q": 1})
            await store.wait_for_rollouts(rollout_ids=[first.rollout_id], timeout=60)  # the runner is connected
            await stop_services(base)  # `eventlight down`: the embedded nats-server
            await asyncio.sleep(6)
            await prepare_services(base)  # `eventlight up`: same port and data folder
            second = await _retrying(lambda: store.enqueue_rollout({"q": 2}))
            [done] = await store.wait_for_rollouts(rollout_ids=[second.rollout_id], timeout=60)
    finally:
        code, err = await _stop_runner(proc)
    assert done.status == "succeeded" and code == 130, err
    warnings = [line for line in err.splitlines() if " WARNING " in line]
    lost = [line for line in warnings if "eventlight.store.jetstream.connect" in line]
    assert len(lost) == 1 and f"NATS connection to {settings.nats_url} lost" in lost[0], err
    assert "retrying every 1 s until it is back" in lost[0], err
    # besides it, at most one dequeue warning (the pull left pending meanwhile), none for the server's
    # 409 Server Shutdown to the pull in flight when it stopped in order
    assert len(warnings) <= 2 and not any("409" in line for line in warnings), err
    assert re.search(rf"INFO .*NATS reconnected to {settings.nats_url} after \d+\.\d s away", err), err


async def test_a_long_nats_outage_is_reminded_at_doubling_intervals(caplog: pytest.LogCaptureFixture) -> None:
    """An hour without NATS: one warning when the connection is lost, reminders after 1, 3, 7, 15 and
    31 minutes (not one a second, as each reconnect attempt was), one line when it is back."""
    now = [0.0]
    events = _Events("nats://127.0.0.1:4222", clock=lambda: now[0])
    events.nc = types.SimpleNamespace(is_closed=False, connected_url=None)  # type: ignore[assignment]
    with caplog.at_level(logging.INFO, logger="eventlight.store.jetstream.connect"):
        await events.error(nats.errors.UnexpectedEOF())
        await events.disconnected()
        for _ in range(3600):
            now[0] += RECONNECT_WAIT_S
            await events.error(ConnectionRefusedError(111, "Connection refused"))
        await events.reconnected()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines[0] == (
        "WARNING",
        "NATS connection to nats://127.0.0.1:4222 lost (nats: unexpected EOF); retrying every 1 s until it is "
        "back (a reminder after 1 min, then at doubling intervals)",
    )
    reminders = [m for level, m in lines[1:-1] if level == "WARNING"]
    assert [m.split(" after ")[1].split(" (")[0] for m in reminders] == ["1 min", "3 min", "7 min", "15 min", "31 min"]
    assert reminders[0].endswith("(60 attempts, the last: [Errno 111] Connection refused); still retrying")
    assert len(lines) == 7 and lines[-1] == ("INFO", "NATS reconnected to nats://127.0.0.1:4222 after 60 min away")


def _fake_nats(url: str) -> Any:
    """What ``_Events`` reads of a nats-py client: whether it is closed, and the server it is on."""
    from urllib.parse import urlparse

    return types.SimpleNamespace(is_closed=False, connected_url=urlparse(url))


async def test_a_flapping_nats_server_is_not_two_lines_a_second(caplog: pytest.LogCaptureFixture) -> None:
    """A server going down and up every second for an hour was a warning and an info line each time
    (7,200 lines). The first loss and return are logged; the losses that follow soon after a return
    are counted into reminders at doubling intervals, and each reminder's return is logged."""
    now = [0.0]
    events = _Events("nats://127.0.0.1:4222", clock=lambda: now[0])
    events.connected(_fake_nats("nats://127.0.0.1:4222"))  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG, logger="eventlight.store.jetstream.connect"):
        for _ in range(3600):
            await events.error(nats.errors.UnexpectedEOF())
            await events.disconnected()
            now[0] += 0.5
            await events.reconnected()
            now[0] += 0.5
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 12, lines
    assert lines[0][1].startswith("NATS connection to nats://127.0.0.1:4222 lost (nats: unexpected EOF)")
    assert lines[1] == ("INFO", "NATS reconnected to nats://127.0.0.1:4222 after 0.5 s away")
    assert lines[2] == (
        "WARNING",
        "NATS connection to nats://127.0.0.1:4222 lost again (nats: unexpected EOF); lost 60 times in the last "
        "1 min, each time less than 1 min after it came back; retrying every 1 s",
    )
    reminders = [m for level, m in lines if level == "WARNING"][1:]
    assert [m.split("lost again")[0] for m in reminders] == ["NATS connection to nats://127.0.0.1:4222 "] * 5
    assert ["times in the last 2 min" in reminders[1], "times in the last 4 min" in reminders[2]] == [True, True]
    assert [level for level, _ in lines] == ["WARNING", "INFO"] * 6
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 3600 - 6  # the other returns


async def test_a_flap_that_lasts_is_logged_as_a_loss(caplog: pytest.LogCaptureFixture) -> None:
    """A loss soon after a return is not logged at once; one that lasts ``FLAP_MAX_S`` is, at the
    attempt that passes it, with how long it has been away."""
    from eventlight.store.jetstream.connect import FLAP_MAX_S

    now = [0.0]
    events = _Events("nats://127.0.0.1:4222", clock=lambda: now[0])
    events.connected(_fake_nats("nats://127.0.0.1:4222"))  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="eventlight.store.jetstream.connect"):
        await events.disconnected()
        now[0] += 1
        await events.reconnected()
        now[0] += 5
        await events.disconnected()  # 5 s after it came back: a flap, counted
        assert len(caplog.records) == 2
        for _ in range(int(FLAP_MAX_S)):
            now[0] += RECONNECT_WAIT_S
            await events.error(ConnectionRefusedError(111, "Connection refused"))
    records = caplog.records
    assert len(records) == 3 and records[2].levelno == logging.WARNING, [r.getMessage() for r in records]
    assert (
        records[2]
        .getMessage()
        .startswith(
            "NATS connection to nats://127.0.0.1:4222 lost 10.0 s ago and not back (10 attempts, the last: [Errno 111] "
            "Connection refused); lost 1 time in the last 16.0 s"
        )
    ), records[2].getMessage()


async def test_a_failover_names_the_server_lost_and_the_one_that_took_over(caplog: pytest.LogCaptureFixture) -> None:
    """With a cluster's URLs the lines named all of them ("lost a,b,c", "reconnected to a,b,c"), not
    which server went away nor which one the client is on now."""
    now = [0.0]
    urls = "nats://10.0.0.1:4222,nats://10.0.0.2:4222,nats://10.0.0.3:4222"
    events = _Events(urls, clock=lambda: now[0])
    events.connected(_fake_nats("nats://10.0.0.1:4222"))  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="eventlight.store.jetstream.connect"):
        await events.disconnected()
        now[0] += 0.3
        events.nc = _fake_nats("nats://10.0.0.2:4222")  # type: ignore[assignment]
        await events.reconnected()
    lost, back = [r.getMessage() for r in caplog.records]
    assert lost.startswith("NATS connection to nats://10.0.0.1:4222 lost; retrying"), lost
    assert (
        back
        == "NATS reconnected to nats://10.0.0.2:4222 after 0.3 s away (the connection lost was to nats://10.0.0.1:4222)"
    )


async def _retrying(call: Any, timeout_s: float = 30.0) -> Any:
    """``call()`` until it stops raising a retryable error (the client may still be reconnecting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except ServiceUnavailableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_runners_open_no_postgres_connection_and_stores_stay_within_their_pools(namespace: Settings) -> None:
    """peer_failures C25: processes that each open a default pool add up past ``max_connections``
    ("too many clients already"). Here 4 runners in 2 processes (given a Postgres DSN all the
    same), two projecting stores with ``pool_size=2`` and a server on one of them run 8 rollouts
    while ``pg_stat_activity`` is sampled: the runners hold no connection at any time, the stores
    never more than their pools together."""
    import asyncpg
    import msgspec

    from eventlight.net import free_port

    assert namespace.pg_dsn is not None
    sep = "&" if "?" in namespace.pg_dsn else "?"
    stores_app, runners_app = f"c25s_{namespace.namespace}", f"c25r_{namespace.namespace}"
    stores_dsn = f"{namespace.pg_dsn}{sep}application_name={stores_app}"
    runners = msgspec.structs.replace(namespace, pg_dsn=f"{namespace.pg_dsn}{sep}application_name={runners_app}")
    peak = {stores_app: 0, runners_app: 0}
    watch = await asyncpg.connect(namespace.pg_dsn)
    try:
        async with (
            JetStreamLightningStore(namespace, pg_dsn=stores_dsn, pool_size=2) as store,
            JetStreamLightningStore(namespace, pg_dsn=stores_dsn, pool_size=2) as second,
            agl.LightningStoreServer(store, port=free_port()) as server,
        ):
            client = agl.LightningStoreClient(server.endpoint)
            await store.add_resources(RESOURCES)
            ids = [(await store.enqueue_rollout({"q": i})).rollout_id for i in range(8)]
            proc = await _start_runner(runners, "quick", 4, "--per-process", "2")
            try:
                deadline = time.monotonic() + 90
                while len(await store.wait_for_rollouts(rollout_ids=ids, timeout=0)) < len(ids):
                    assert time.monotonic() < deadline and proc.returncode is None, "the rollouts did not finish"
                    await second.query_rollouts()
                    await client.query_rollouts()  # reads through the server
                    rows = await watch.fetch(
                        "SELECT application_name, count(*) AS n FROM pg_stat_activity"
                        " WHERE application_name = ANY($1) GROUP BY 1",
                        [stores_app, runners_app],
                    )
                    for row in rows:
                        peak[row["application_name"]] = max(peak[row["application_name"]], row["n"])
                    await asyncio.sleep(0.1)
            finally:
                await client.close()
                code, err = await _stop_runner(proc)
    finally:
        await watch.close()
    assert code == 130, err
    assert peak[runners_app] == 0 and 1 <= peak[stores_app] <= 2 + 2, peak
