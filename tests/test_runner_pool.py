"""Several runners in one process (``RunnerPool(runners_per_process=K)``): each claims with its own
worker id, they run at the same time (a synchronous agent in a thread), their spans reach the
right attempts, and concurrent long polls on one store each get a rollout of their own.

Real runner processes on the test's NATS and Postgres (``tests/fault_agents.py``).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import re
from typing import Any

import fault_agents
import pytest

import eventlight as agl
from eventlight.runner.claims import ENTRIES, ClaimBoard
from eventlight.runner.metrics import RunnerMetrics
from eventlight.runner_pool import RunnerPool, runner_copies
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore

RESOURCES = {"prompt_template": agl.PromptTemplate(template="{q}")}
WORKER = re.compile(r"^Worker-(\d+)@.*-(\d+)-[0-9a-z]+$")


def _worker(worker_id: str | None) -> tuple[int, int]:
    """(runner index, pid) of a worker id ``Worker-<index>@<host>-<pid>-<tag>``."""
    found = WORKER.match(worker_id or "")
    assert found, worker_id
    return int(found[1]), int(found[2])


def _objects(spans: list[Any]) -> list[Any]:
    """The ``i`` of each object span (``emit_object({"i": ...})``), in order."""
    found = [x.attributes.get("agentlightning.object.json") for x in sorted(spans, key=lambda x: x.sequence_id)]
    return [json.loads(j).get("i") for j in found if j is not None]


async def _run(namespace: Settings, agent: Any, n: int, per_process: int, tasks: list[dict[str, Any]]) -> list[Any]:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.add_resources(RESOURCES)
        made = [await store.enqueue_rollout(t) for t in tasks]
        pool = RunnerPool(agent, n, namespace, namespace.nats_url or "", runners_per_process=per_process)
        assert len(pool.procs) == -(-n // per_process)
        pool.start()
        try:
            done = await store.wait_for_rollouts(rollout_ids=[m.rollout_id for m in made], timeout=90)
        finally:
            await asyncio.to_thread(pool.stop, 5)
        assert [d.status for d in done] == ["succeeded"] * len(made), done
        attempted = [await store.get_latest_attempt(d.rollout_id) for d in done]
        spans = [list(await store.query_spans(d.rollout_id)) for d in done]
    return [(d, a, s) for d, a, s in zip(done, attempted, spans, strict=True)]


async def test_four_runners_in_two_processes_run_four_rollouts_at_once(namespace: Settings) -> None:
    got = await _run(namespace, fault_agents.slow, 4, 2, [{"q": i, "sleep_s": 3} for i in range(4)])
    workers = [_worker(a.worker_id) for _, a, _ in got]
    assert sorted(i for i, _ in workers) == [0, 1, 2, 3]  # each runner claimed one, under its own id
    assert len({pid for _, pid in workers}) == 2  # two processes
    overlap = min(a.end_time for _, a, _ in got) - max(a.start_time for _, a, _ in got)
    assert overlap > 1.0, f"the four attempts did not run together (overlap {overlap:.2f} s)"


async def test_a_synchronous_agent_sharing_a_process_runs_in_a_thread(namespace: Settings) -> None:
    """Two runners in one process with an agent that blocks in ``time.sleep``: on the event loop
    they would run one after the other; in threads both attempts overlap, and the span each
    emits from its thread reaches its own attempt."""
    got = await _run(namespace, fault_agents.blocking, 2, 2, [{"q": i, "i": i, "sleep_s": 3} for i in range(2)])
    assert len({_worker(a.worker_id)[1] for _, a, _ in got}) == 1
    assert [len(s) for _, _, s in got] == [2, 2]  # the object span and the reward span, each on its attempt
    assert [_objects(s) for _, _, s in got] == [[0], [1]]
    # each agent ran from its object span (before the sleep) to its reward span (after it)
    ran = [(min(x.start_time for x in s), max(x.end_time for x in s)) for _, _, s in got]
    overlap = min(end for _, end in ran) - max(start for start, _ in ran)
    assert overlap > 1.0, f"the synchronous agents ran one after the other (overlap {overlap:.2f} s)"


async def test_spans_of_runners_sharing_a_process_reach_their_own_attempts(namespace: Settings) -> None:
    tasks = [{"q": i, "i": i, "spans": 1 + i % 5} for i in range(40)]
    got = await _run(namespace, fault_agents.traced, 6, 3, tasks)
    assert [len(s) for _, _, s in got] == [t["spans"] + 1 for t in tasks]  # + the reward span
    assert [_objects(s) for _, _, s in got] == [[t["i"]] * t["spans"] for t in tasks]
    assert len({_worker(a.worker_id)[1] for _, a, _ in got}) <= 2


async def test_concurrent_long_polls_on_one_store_each_claim_their_own_rollout(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.add_resources(RESOURCES)
        async with JetStreamLightningStore(namespace) as runner_store:
            polls = [asyncio.create_task(runner_store.dequeue_rollout(worker_id=f"w{i}", wait_s=5.0)) for i in range(6)]
            await asyncio.sleep(0.5)  # all six wait in the server
            made = {(await store.enqueue_rollout({"q": i})).rollout_id for i in range(6)}
            claimed = await asyncio.wait_for(asyncio.gather(*polls), timeout=4.0)
    assert all(c is not None for c in claimed)
    assert {c.rollout_id for c in claimed} == made  # six polls, six different rollouts


class StatefulAgent(agl.LitAgent[Any]):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    async def rollout_async(self, task: Any, resources: dict[str, Any], rollout: Any) -> float:
        self.seen.append(task)
        return 1.0


def test_runner_copies_keep_one_of_each_per_runner_and_share_the_metrics() -> None:
    agent = StatefulAgent()
    template = agl.LitAgentRunner(agl.OtelTracer(instrument="openai"), metrics=RunnerMetrics())
    [(i, a, r)] = runner_copies(agent, template, [7])
    assert (i, a, r) == (7, agent, template) and not r.sync_agent_in_thread  # one runner: as it was
    copies = runner_copies(agent, template, [0, 1, 2])
    assert [i for i, _, _ in copies] == [0, 1, 2]
    assert len({id(a) for _, a, _ in copies} | {id(agent)}) == 4  # an agent of its own each
    assert len({id(a.seen) for _, a, _ in copies} | {id(agent.seen)}) == 4
    # a @rollout function's agent is its module's object (pickled by name), shared: it holds no state
    assert {id(a) for _, a, _ in runner_copies(fault_agents.quick, template, [0, 1])} == {id(fault_agents.quick)}
    assert len({id(r.tracer) for _, _, r in copies} | {id(template.tracer)}) == 4
    assert all(r.metrics is template.metrics for _, _, r in copies)
    assert all(r.sync_agent_in_thread for _, _, r in copies)
    # instrumentation is process-wide: the first runner's tracer switches it on, for all of them
    assert [r.tracer.instrumented.frameworks for _, _, r in copies] == [("openai",), (), ()]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "2", None])
def test_runners_per_process_that_is_not_a_whole_number_from_one_is_refused(namespace: Settings, bad: Any) -> None:
    with pytest.raises(ValueError, match="runners_per_process must be a whole number >= 1"):
        RunnerPool(fault_agents.quick, 2, namespace, namespace.nats_url or "", runners_per_process=bad)
    with pytest.raises(ValueError, match="runners_per_process must be a whole number >= 1"):
        agl.Trainer(n_runners=2, runners_per_process=bad, settings=namespace)


def test_runners_per_process_with_shared_memory_threads_is_refused() -> None:
    with pytest.raises(ValueError, match="not to 'shm' threads"):
        agl.Trainer(n_runners=1, strategy="shm", runners_per_process=2)


async def test_processes_that_exit_on_the_stop_event_are_not_restarted(namespace: Settings) -> None:
    """Setting the stop event without ``stop()`` (the benchmark's soak did): the processes exit 0 on
    it and the supervisor restarted them, over and over with backoff, until the pool was dropped."""
    pool = RunnerPool(fault_agents.quick, 2, namespace, namespace.nats_url or "")
    pool.start()
    try:
        await asyncio.sleep(1.0)
        pool.stop_event.set()
        for p in pool.procs:
            await asyncio.to_thread(p.join, 30)
        assert pool.alive() == 0
        await asyncio.sleep(2.5)  # past the first restart delay
        assert pool.restarts == 0 and pool.alive() == 0 and not pool.supervising()
    finally:
        await asyncio.to_thread(pool.stop, 5)


def test_the_claim_board_keeps_what_each_runner_holds_until_released_or_taken() -> None:
    board = ClaimBoard(mp.get_context("spawn"), 3)
    board.hold(0, "ro-a", "at-1")
    board.hold(2, "ro-b", "at-2")
    board.hold(2, "ro-c", "at-3")
    long_id = "x" * 200  # ids are tokens of up to 200 characters
    board.hold(1, long_id, long_id)
    board.release(2, "ro-b", "at-2")
    board.release(0, "ro-b", "at-2")  # not runner 0's: nothing happens
    assert board.take([1, 2]) == [(1, long_id, long_id), (2, "ro-c", "at-3")]
    assert board.take([1, 2]) == []  # taken means wiped
    assert board.take([0]) == [(0, "ro-a", "at-1")]
    for k in range(ENTRIES + 1):  # a full row keeps what it has (the one that did not fit is logged)
        board.hold(0, "ro-d", f"at-{k}")
    assert [aid for _, _, aid in board.take([0])] == [f"at-{k}" for k in range(ENTRIES)]


async def test_a_claim_goes_on_the_board_before_it_is_made_and_off_when_refused(monkeypatch: Any) -> None:
    """The runner writes each claim on its row as the store is about to append it (``on_claim``),
    not after the claim returned (a kill -9 in between left it off the board); a claim the store
    refuses (its rollout was cancelled after it was queued) is wiped again."""
    async with agl.InMemoryLightningStore() as store:
        await store.add_resources(RESOURCES)
        cancelled = await store.enqueue_rollout({"q": 1})
        await store.update_rollout(cancelled.rollout_id, status="cancelled")
        queued = await store.enqueue_rollout({"q": 2})
        board = ClaimBoard(mp.get_context("spawn"), 1)
        written: list[str] = []
        hold = board.hold
        monkeypatch.setattr(board, "hold", lambda i, rid, aid: (written.append(rid), hold(i, rid, aid)))
        runner = agl.LitAgentRunner()
        runner.claims = board
        with runner.run_context(agent=fault_agents.quick, store=store, worker_id=0):
            claimed = await runner._dequeue(store)
    assert claimed is not None and claimed.rollout_id == queued.rollout_id
    assert written == [cancelled.rollout_id, queued.rollout_id]
    assert board.take([0]) == [(0, queued.rollout_id, claimed.attempt.attempt_id)]
