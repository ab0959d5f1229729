"""bench/micro.py's interleaved blocks and bench/raw_twins.py's raw rows: their shape, never their
speed (no timed assertion: only what every run must give whatever the machine's pace)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench.micro import OPS, EmptyResult, main, measure_interleaved, spread
from bench.raw_twins import OwnStreamRaw, swap_id
from bench.report import micro_table
from eventlight.core.types import LLM
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore


class _Sampler:
    """Stands in for ``ProcessSampler``: one CPU second per block; marks where each block begins."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def open_window(self) -> None:
        self.log.append("|")

    def close_window(self) -> dict[str, Any]:
        return {"cpu_s": {"algorithm": 1.0, "total": 1.0}}


async def test_blocks_of_an_operation_and_its_twin_alternate_and_each_side_reports_its_spread() -> None:
    sampler = _Sampler()

    def op_of(name: str) -> Any:
        async def op(w: int) -> None:
            if sampler.log[-1] == "|":
                sampler.log.append(name)  # the side this block measures
            await asyncio.sleep(0.001)

        return op

    row = await measure_interleaved(op_of("op"), op_of("raw"), 0.2, 2, sampler, blocks=4)  # type: ignore[arg-type]
    order = [x for x in sampler.log if x != "|"]
    assert order == ["op", "raw", "raw", "op", "op", "raw", "raw", "op"]  # op first, then twin first, ...
    for side in (row, row["raw_own"]):
        assert len(side["blocks_ops_per_s"]) == 4 and side["ops"] > 0 and side["errors"] == 0
        assert side["spread"]["min"] <= side["spread"]["median"] <= side["spread"]["max"]
        assert side["ops_per_s"] == pytest.approx(side["ops"] / side["seconds"], rel=0.01)  # seconds rounded
        assert side["cpu_us_per_op"] == round(4.0 / side["ops"] * 1e6, 1)  # the 4 blocks' CPU summed
    assert row["vs_raw_own"] == round(row["ops_per_s"] / row["raw_own"]["ops_per_s"], 3)
    assert len(row["vs_raw_own_pairs"]["ratios"]) == 4
    pairs = row["vs_raw_own_pairs"]["spread"]
    assert pairs["min"] <= row["vs_raw_own"] * 1.5 and pairs["min"] <= pairs["median"] <= pairs["max"]


def test_ops_picks_operations_in_run_order_and_refuses_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.micro import _ops

    assert _ops("query_spans, dequeue") == ("dequeue", "query_spans")  # OPS' order, not the flag's
    assert _ops(",".join(OPS)) == OPS
    with pytest.raises(SystemExit):
        main(["--stack", "eventlight", "--ops", "dequeue,nonsense"])
    assert "no micro operation nonsense" in capsys.readouterr().err


async def test_an_operation_without_a_twin_has_blocks_but_no_raw_row() -> None:
    calls = 0

    async def op(w: int) -> None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.001)
        if calls % 3 == 0:
            raise EmptyResult  # counted, not an op

    row = await measure_interleaved(op, None, 0.1, 1, _Sampler(), blocks=2)  # type: ignore[arg-type]
    assert "raw_own" not in row and "vs_raw_own" not in row
    assert len(row["blocks_ops_per_s"]) == 2 and row["empty_results"] > 0


def test_spread_and_ids() -> None:
    assert spread([]) is None
    assert spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}
    assert spread([1200.04, 800.0]) == {"min": 800.0, "median": 1000.0, "max": 1200.0}
    new = swap_id("ro-0123456789ab")
    assert new.startswith("ro-") and len(new) == len("ro-0123456789ab") and new != "ro-0123456789ab"


def test_the_micro_table_prints_both_raw_rows_and_the_spreads() -> None:
    el = {
        "ok": True,
        "blocks": 2,
        "ops": {
            "enqueue": {
                "ops_per_s": 900.0,
                "blocks_ops_per_s": [800.0, 1000.0],
                "spread": {"min": 800.0, "median": 900.0, "max": 1000.0},
                "raw_own": {
                    "ops_per_s": 1000.0,
                    "blocks_ops_per_s": [950.0, 1050.0],
                    "spread": {"min": 950.0, "median": 1000.0, "max": 1050.0},
                },
                "vs_raw_own": 0.9,
                "vs_raw_own_pairs": {"ratios": [0.842, 0.952], "spread": {"min": 0.842, "median": 0.897, "max": 0.952}},
            }
        },
        "round_trips": {"concurrency": 4, "publish": {"ops_per_s": 2000.0}},
    }
    table = micro_table({"micro": {"eventlight": el}})
    assert (
        "| enqueue | 900.0 (800–1,000) | – | – | 1,000.0 (950–1,050) | 0.90× (0.84 / 0.90 / 0.95) | 2,000.0 | 0.45× |"
        in table
    )
    assert "raw fresh stream" in table and "fresh stream with no consumers" in table


async def test_twins_write_what_the_operations_write_on_eventlights_own_stream(namespace: Settings) -> None:
    """Each twin's messages are eventlight events that the projector applies like the operation's own:
    an enqueue's twin queues a rollout, a dequeue_update's claims one and finishes it."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as alg:
        runner = alg
        await alg.add_resources({"llm": LLM(endpoint="http://localhost:1/v1", model="m")})
        raw = await OwnStreamRaw.open(namespace.nats_url or "", namespace.pg_dsn or "", namespace, 2)
        try:
            wids = ["micro-worker-0", "micro-worker-1"]
            assert await raw.twin("add_span", alg, runner, wids) is None
            empty = await raw.twin("dequeue_empty", alg, runner, wids)
            assert empty is not None
            await empty(0)  # nothing queued yet: answered 404

            enqueue = await raw.twin("enqueue", alg, runner, wids)  # its warm-up enqueues one rollout
            assert enqueue is not None
            await enqueue(0)
            await enqueue(1)
            with pytest.raises(RuntimeError, match="not empty"):
                await empty(0)  # the entry it found is handed back (nak), not held
            await alg.sync_all(timeout_s=30.0)
            assert {r.status for r in await alg.query_rollouts()} == {"queuing"}
            assert len(await alg.query_rollouts()) == 3

            heartbeat = await raw.twin("heartbeat", alg, runner, wids)
            assert heartbeat is not None
            await heartbeat(1)

            update = await raw.twin("dequeue_update", alg, runner, wids)  # warm-up: claims and finishes one
            assert update is not None
            await update(0)
            await update(1)
            with pytest.raises(EmptyResult):
                await update(0)  # the queue is empty now
            await alg.sync_all(timeout_s=30.0)
            rollouts = await alg.query_rollouts()
            assert [r.status for r in rollouts] == ["succeeded"] * 3
            for r in rollouts:
                attempts = await alg.query_attempts(r.rollout_id)
                assert [a.status for a in attempts] == ["succeeded"]
            worker = await alg.get_worker_by_id("micro-worker-1")
            assert worker is not None and worker.heartbeat_stats == {"warm_up": True}
            with pytest.raises(ValueError, match="no micro operation"):
                await raw.twin("nonsense", alg, runner, wids)
        finally:
            await raw.close()


async def test_the_query_spans_twin_reads_the_rollouts_rows(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as alg:
        started = await alg.start_rollout(input="q", worker_id="w")
        raw = await OwnStreamRaw.open(namespace.nats_url or "", namespace.pg_dsn or "", namespace, 1)
        try:
            with pytest.raises(ValueError, match="rollout_id"):
                await raw.twin("query_spans", alg, alg, ["w"])
            query = await raw.twin("query_spans", alg, alg, ["w"], rollout_id=started.rollout_id)
            assert query is not None
            await query(0)  # no spans: 0 rows, as many as it found when made
        finally:
            await raw.close()


async def test_a_dequeue_twin_acks_an_entry_whose_fence_is_stale_and_counts_it_empty(namespace: Settings) -> None:
    """As eventlight drops a redelivered entry of a rollout claimed since: the append's fence at the
    entry's sequence fails (10071); the entry is acked, not left to come back, and no op counted."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as alg:
        for i in range(2):
            await alg.enqueue_rollout(input=f"q{i}", mode="train")
        raw = await OwnStreamRaw.open(namespace.nats_url or "", namespace.pg_dsn or "", namespace, 1)
        try:
            dequeue = await raw.twin("dequeue", alg, alg, ["w"])  # its warm-up claims the first
            assert dequeue is not None
            (left,) = [r for r in await alg.query_rollouts() if r.status == "queuing"]
            await alg.update_rollout(left.rollout_id, metadata={"moved": True})  # the entry's fence is stale now
            with pytest.raises(EmptyResult):
                await dequeue(0)
            empty = await raw.twin("dequeue_empty", alg, alg, ["w"])
            assert empty is not None
            await empty(0)  # acked: not handed out again
        finally:
            await raw.close()
