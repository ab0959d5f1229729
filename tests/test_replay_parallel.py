"""``eventlight.replay(..., workers=N)``: the adapter in worker processes, started on attempts while
the log is still read, gives the records the one-process replay gives, in the same order.

The workload has what could make the two differ: span batches that arrive after the attempt's
terminal status (a result made ahead is stale and must be made again), failed attempts, a second
attempt of one rollout, train and val rollouts, and an adapter that raises on some attempts.
"""

from __future__ import annotations

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
from tests.test_replay import collect, llm_span, reward_span

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


@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "2"])
def test_workers_must_be_a_whole_number_of_at_least_one(workers: Any) -> None:
    with pytest.raises(InvalidInputError, match="workers must be a whole number >= 1"):
        eventlight.replay(Settings(namespace="x"), workers=workers)


def test_cli_workers_zero_is_a_usage_error(namespace: Settings, tmp_path: Any) -> None:
    out = cli("replay", "--out", str(tmp_path / "x.jsonl"), "--workers", "0", env=env_of(namespace))
    assert out.returncode == 2 and "--workers" in out.stderr and not (tmp_path / "x.jsonl").exists()
