"""``eventlight.replay(..., workers=N)``: the adapter in worker processes, started on attempts while
the log is still read, gives the records the one-process replay gives, in the same order.

The workload has what could make the two differ: span batches that arrive after the attempt's
terminal status (a result made ahead is stale and must be made again), failed attempts, a second
attempt of one rollout, train and val rollouts, and an adapter that raises on some attempts.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import eventlight
from eventlight.adapter import TracerTraceToTriplet
from eventlight.core.errors import InvalidInputError
from eventlight.logreplay.parallel import CHUNK
from eventlight.logreplay.replay import ReplayWorkerError
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.memory import InMemoryLightningStore
from tests.test_cli import cli, env_of
from tests.test_replay import collect, genai_workload, interrupted, llm_span, only_error, reward_span

ROLLOUTS = 5 * CHUNK  # enough that attempts are sent to the workers during the read


async def workload(store: Any) -> dict[str, list[str]]:
    """``ROLLOUTS`` rollouts: most succeed with 2 calls and a reward; every 7th gets a late call after
    it succeeded, every 9th fails, every 11th is val, every 13th is "[bad]", and one is retried."""
    kinds: dict[str, list[str]] = {"late": [], "bad": [], "retried": []}
    for i in range(ROLLOUTS):
        text = f"task {i}" + (" [bad]" if i % 13 == 5 else "")
        r = await store.enqueue_rollout({"i": i}, mode="val" if i % 11 == 3 else "train")
        d = await store.dequeue_rollout(worker_id="w")
        rid, aid = r.rollout_id, d.attempt.attempt_id
        await store.add_many_spans([llm_span(rid, aid, 1, text, 10.0), llm_span(rid, aid, 2, text + "'", 12.0)])
        if i == 17:  # its first attempt times out; the second one succeeds
            await store.update_attempt(rid, aid, status="timeout")
            await store.enqueue_rollout({"i": i, "again": True})  # keeps the queue's order honest
            kinds["retried"].append(rid)
            again = await store.dequeue_rollout(worker_id="w")
            await store.add_span(llm_span(again.rollout_id, again.attempt.attempt_id, 1, text, 20.0))
            await store.update_attempt(again.rollout_id, again.attempt.attempt_id, status="succeeded")
            continue
        await store.add_span(reward_span(rid, aid, 3, i / ROLLOUTS, 14.0))
        await store.update_attempt(rid, aid, status="failed" if i % 9 == 4 else "succeeded")
        if i % 7 == 2:  # a span batch after the terminal status: an ahead result made before it is stale
            await store.add_span(llm_span(rid, aid, 4, text + " late", 16.0))
            kinds["late"].append(rid)
        if "[bad]" in text:
            kinds["bad"].append(rid)
    return kinds


CASES: list[dict[str, Any]] = [
    {"adapter": "triplets"},
    {"adapter": "messages", "statuses": ["succeeded"], "modes": "train"},
    {"adapter": "triplets", "reward": "tests.replay_adapters:calls", "min_reward": 2.5},
    {"adapter": "proxy-triplets", "since": 40},
]


async def same_both_ways(source: Any, **kwargs: Any) -> eventlight.Replay:
    one = eventlight.replay(source, workers=1, **kwargs)
    serial = await collect(one)
    two = eventlight.replay(source, workers=2, **kwargs)
    parallel = await collect(two)
    assert two.workers == 2
    assert parallel == serial, f"{kwargs}: the records differ with worker processes"
    assert two.errors == one.errors and two.stats.records == one.stats.records
    return two


@pytest.mark.parametrize("kwargs", CASES, ids=lambda k: "-".join(f"{v}" for v in k.values()))
async def test_workers_give_the_records_of_one_process_in_the_same_order(kwargs: dict[str, Any]) -> None:
    async with InMemoryLightningStore() as store:
        kinds = await workload(store)
        run = await same_both_ways(store, **kwargs)
    assert run.stats.records > 0
    if kwargs.get("adapter") == "triplets" and len(kwargs) == 1:
        assert run.stats.ahead > 0, "no attempt was adapted while the log was read"
        assert run.stats.ahead < run.stats.attempts, "the late batches' attempts were not made again"
        late = {r["rollout_id"] for r in await collect(eventlight.replay(store, workers=2)) if "late" in str(r)}
        assert late == set(kinds["late"])


async def test_llm_call_match_reaches_the_workers() -> None:
    """Each worker builds its adapter from the name: without the pattern it gave no triplets."""
    async with InMemoryLightningStore() as store:
        await genai_workload(store, ROLLOUTS)
        run = await same_both_ways(store, adapter="triplets", llm_call_match=r"^chat ")
    assert run.stats.records == ROLLOUTS and run.stats.ahead > 0


async def test_an_adapter_that_raises_in_a_worker_is_reported_with_its_ids() -> None:
    async with InMemoryLightningStore() as store:
        kinds = await workload(store)
        run = await same_both_ways(store, adapter="tests.replay_adapters:picky")
    assert {e.rollout_id for e in run.errors} == set(kinds["bad"]) and kinds["bad"]
    assert all(e.error == "RuntimeError: cannot adapt this one" and e.attempt_id for e in run.errors)


async def test_a_worker_that_dies_is_a_clear_error_not_a_hang() -> None:
    async with InMemoryLightningStore() as store:
        await workload(store)
        run = eventlight.replay(store, adapter="tests.replay_adapters:dies", workers=2)
        with pytest.raises(ReplayWorkerError, match="a replay worker process died .* --workers 1"):
            await collect(run)


async def test_workers_on_the_jetstream_log(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace) as store:
        await workload(store)
    run = await same_both_ways(namespace, adapter="triplets")
    assert run.stats.ahead > 0


async def test_an_adapter_object_runs_in_this_process() -> None:
    """Its state (here ``stats``) is the caller's to read, which a copy in a worker would not update."""
    adapter = TracerTraceToTriplet()
    async with InMemoryLightningStore() as store:
        await workload(store)
        run = eventlight.replay(store, adapter=adapter, workers=2)
        records = await collect(run)
    assert run.workers == 1 and run.stats.ahead == 0
    assert adapter.stats.triplets == len(records) > 0


async def test_records_that_do_not_pickle_are_made_in_this_process_as_with_one() -> None:
    """A lock in an item: with workers the whole replay failed ("cannot pickle '_thread.lock'")."""
    async with InMemoryLightningStore() as store:
        kinds = await workload(store)
        one = await collect(eventlight.replay(store, adapter="tests.replay_adapters:unpicklable", workers=1))
        run = eventlight.replay(store, adapter="tests.replay_adapters:unpicklable", workers=2)
        two = await collect(run)
    locked = [r["rollout_id"] for r in two if r["lock"] is not None]
    assert sorted(locked) == sorted(kinds["bad"]) and not run.errors
    assert [{**r, "lock": r["lock"] is None} for r in two] == [{**r, "lock": r["lock"] is None} for r in one]


async def test_an_adapter_calling_sys_exit_is_a_failed_attempt_not_the_end() -> None:
    async with InMemoryLightningStore() as store:
        kinds = await workload(store)
        run = await same_both_ways(store, adapter="tests.replay_adapters:exits")
    assert {e.rollout_id for e in run.errors} == set(kinds["bad"]) and run.errors[0].error == "SystemExit: 4"


async def test_stopping_a_replay_early_stops_its_workers_at_once() -> None:
    """With a slow adapter, closing the replay waited for every queued chunk (8-14 s; a second
    Ctrl-C hung in multiprocessing's exit handler)."""
    async with InMemoryLightningStore() as store:
        await workload(store)
        run = eventlight.replay(store, adapter="tests.replay_adapters:slow", workers=2)
        first = await run.__anext__()
        workers = [p for p in multiprocessing.active_children() if p.name.startswith(("SpawnProcess", "ForkServer"))]
        await run.aclose()
    assert first["n"] > 0 and workers
    # queued when closed: up to IN_FLIGHT chunks per worker of CHUNK attempts at 0.2 s each (>= 12 s);
    # the workers are terminated, not left to adapt them (they ignored SIGTERM when the forkserver
    # had imported eventlight.runner_pool, which ignores it there, and the close took those seconds)
    assert [p.exitcode for p in workers] == [-signal.SIGTERM] * len(workers)


def test_answers_made_ahead_are_held_up_to_a_byte_budget() -> None:
    """Held by attempt count alone, 2 MB records grew the parent to 1 GB for an 850 MB output."""
    from concurrent.futures import Future

    held = sys.modules["eventlight.logreplay.replay"]._Held(budget=100 * 2**20)
    workers = 2
    while held.room(workers):  # nothing back yet: a few chunks per worker, whatever their size
        held.sent += CHUNK
    assert held.sent == held.FIRST_AHEAD * workers * CHUNK
    answer: Future[bytes] = Future()
    answer.set_result(b"x" * (CHUNK * 2**20))  # 1 MB per attempt
    held.add(answer, CHUNK)
    out = held.sent - held.answered
    assert held.room(workers) == ((CHUNK + out) * 2**20 < 100 * 2**20)
    while held.room(workers):
        held.sent += CHUNK
    assert (
        held.bytes + (held.sent - held.answered) * 2**20
        >= 100 * 2**20
        > held.bytes + (held.sent - CHUNK - held.answered) * 2**20
    )


async def test_big_records_give_the_same_output() -> None:
    async with InMemoryLightningStore() as store:
        await workload(store)
        run = await same_both_ways(store, adapter="tests.replay_adapters:big")
    assert run.stats.records == ROLLOUTS + 1


@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "2", 10**20])
def test_workers_must_be_a_whole_number_from_one_to_the_maximum(workers: Any) -> None:
    with pytest.raises(InvalidInputError, match="workers must be a whole number from 1 to 256"):
        eventlight.replay(Settings(namespace="x"), workers=workers)


@pytest.mark.parametrize("workers", ["0", "99999999999999999999"])
def test_cli_workers_out_of_range_is_a_usage_error(namespace: Settings, tmp_path: Any, workers: str) -> None:
    out = cli("replay", "--out", str(tmp_path / "x.jsonl"), "--workers", workers, env=env_of(namespace))
    assert out.returncode == 2 and "--workers" in out.stderr and not (tmp_path / "x.jsonl").exists(), out.stderr
    assert "Traceback" not in out.stderr and "internal error" not in out.stderr


def _forkserver_of(pid: int) -> int | None:
    """The pid of a ``multiprocessing`` forkserver whose parent is ``pid``, if one runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"forkserver" in cmdline:
            return int(entry.name)
    return None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the forkserver in /proc")
async def test_ctrl_c_while_the_workers_start_is_one_line(namespace: Settings, tmp_path: Path) -> None:
    """A Ctrl-C while the forkserver imported eventlight (the first second or so of a replay with
    workers) printed its KeyboardInterrupt traceback: it ignored SIGINT only once it had."""
    async with JetStreamLightningStore(namespace) as store:
        await workload(store)
    out = tmp_path / "x.jsonl"
    seen: list[float] = []

    def importing(pid: int) -> bool:  # 0.2 s after the forkserver started: importing eventlight
        if not seen and _forkserver_of(pid) is not None:
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() - seen[0] > 0.2

    args = ["replay", "-a", "tests.replay_adapters:slow", "-j", "2", "-o", str(out)]
    result = interrupted(env_of(namespace), args, importing)
    assert seen, "no forkserver was seen"
    assert only_error(result, 130).startswith("error: interrupted: nothing was written to"), result.stderr
    assert not out.exists()


async def test_a_pattern_that_matches_no_span_is_told_once_with_its_count(
    namespace: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``--llm-call-match '^chat '`` on spans named otherwise printed the adapter's warning once per
    attempt (178 lines on the demo's data), from the workers too; now one line at the end, with the
    count of attempts and the span names seen."""
    async with JetStreamLightningStore(namespace) as store:
        await workload(store)
    attempts = ROLLOUTS + 1  # one rollout was retried
    names = f"openai.chat.completion ({attempts}), agentlightning.annotation ({ROLLOUTS - 1})"
    told = f"no span matched llm_call_match='^chat ' in {attempts} attempt(s), which gave no record; "
    for workers in ("1", "2"):
        out = tmp_path / f"none-{workers}.jsonl"
        args = ("replay", "--llm-call-match", "^chat ", "-j", workers, "--out", str(out))
        result = cli(*args, env=env_of(namespace))
        assert result.returncode == 0, result.stderr
        lines = [line for line in result.stderr.splitlines() if "llm_call_match" in line]
        assert lines == [f"warning: {told}span names seen (attempts): {names}"], result.stderr
    with caplog.at_level(logging.WARNING, logger="eventlight"):
        run = eventlight.replay(namespace, llm_call_match=r"^chat ")
        assert await collect(run) == []
    assert [r.getMessage() for r in caplog.records if "llm_call_match" in r.getMessage()] == [
        f"replay: {told}span names seen (attempts): {names}"
    ]
    assert run.stats.unmatched == attempts and run.unmatched_names["openai.chat.completion"] == attempts
