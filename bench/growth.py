"""Cost growth: the same operations on an empty store and on one holding 100,000 finished rollouts.

    python -m bench.growth [--preload 100000] [--seconds 3] [--concurrency 4] [--out FILE.json]

On eventlight's servers (fresh temporary state dir, as the benchmark scenarios), measures with
``bench.micro``'s loop (``--concurrency`` tasks for ``--seconds`` each):

* ``enqueue``: ``enqueue_rollout``;
* ``dequeue``: ``dequeue_rollout`` from a pre-filled queue (a claim; the claimed attempts are
  finished afterwards, untimed);
* ``query_rollouts(limit=100)``: the first page of all rollouts, with its ``total``;
* ``query_rollouts(status_in=[queuing], limit=100)``: what an algorithm asks for;

first on the empty store, then after ``--preload`` finished rollouts were written. The preload goes
through the real event path, pipelined like ``bench.ceiling``: for each rollout the four events
``start_rollout`` + a span + ``update_attempt(succeeded)`` produce (``RolloutCreated``,
``AttemptStarted``, ``SpansAdded``, ``AttemptUpdated``), published with ``js.publish_async`` and
projected by the store's own projector. While it runs, the projector's lag (stream messages not yet
committed to Postgres) is sampled every 0.5 s: its maximum and the seconds to catch up after the
last publish show whether the lag stays bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from bench import require_positive
from bench.micro import EmptyResult, _measure, _prefill
from bench.procs import ProcessSampler
from bench.report import print_and_save
from bench.stack_eventlight import Stack, make_span
from eventlight.core.events import AttemptStarted, AttemptUpdated, RolloutCreated, SpansAdded, encode_event
from eventlight.core.types import Attempt, Rollout
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.layout import subject_for

WINDOW = 1024


async def _ops(alg: JetStreamLightningStore, runner: JetStreamLightningStore, seconds: float, conc: int) -> dict:
    sampler = ProcessSampler(0.5).start()
    out: dict[str, Any] = {}
    try:

        async def enqueue(w: int) -> None:
            await alg.enqueue_rollout(f"growth-{w}")

        claimed: list[Any] = []

        async def dequeue(w: int) -> None:
            got = await runner.dequeue_rollout(worker_id=f"growth-{w}")
            if got is None:
                raise EmptyResult
            claimed.append(got)

        async def first_page(w: int) -> None:
            await alg.query_rollouts(limit=100)

        async def queued_page(w: int) -> None:
            await alg.query_rollouts(status_in=["queuing"], limit=100)

        out["enqueue"] = await _measure("enqueue", enqueue, seconds, conc, sampler)
        await _prefill(sys.modules["bench.stack_eventlight"], alg, 3000)
        out["dequeue"] = await _measure("dequeue", dequeue, seconds, conc, sampler)
        for got in claimed:  # untimed: finish the claims, or their queue messages come back after ack_wait
            await runner.update_attempt(got.rollout_id, got.attempt.attempt_id, status="succeeded")
        await alg.sync_all()
        out["query_rollouts(limit=100)"] = await _measure("page", first_page, seconds, conc, sampler)
        out["query_rollouts(status_in=[queuing], limit=100)"] = await _measure(
            "queued", queued_page, seconds, conc, sampler
        )
    finally:
        sampler.stop()
    return out


def _finished_rollout(i: int, now: float) -> list[Any]:
    rid, aid = f"ro-g{i:011d}", f"at-g{i:07d}"
    rollout = Rollout(rollout_id=rid, input={"i": i}, start_time=now, status="preparing", mode="train")
    attempt = Attempt(rollout_id=rid, attempt_id=aid, sequence_id=1, start_time=now)
    span = make_span(rid, aid, 1, {"task": f"growth-{i}"})
    return [
        RolloutCreated(time=now, rollout=rollout),
        AttemptStarted(time=now, attempt=attempt),
        SpansAdded(time=now, rollout_id=rid, attempt_id=aid, spans=[span], seq_high=1),
        AttemptUpdated(
            time=now + 0.1,
            rollout_id=rid,
            attempt_id=aid,
            status="succeeded",
            end_time=now + 0.1,
            rollout_status="succeeded",
            rollout_end_time=now + 0.1,
        ),
    ]


async def _preload(alg: JetStreamLightningStore, n: int) -> dict[str, Any]:
    log_ = alg._log()
    js = log_.nc.jetstream(timeout=60.0, publish_async_max_pending=WINDOW)
    projector = alg.projector
    assert projector is not None
    lags: list[int] = []
    published = 0
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            lags.append(max(0, published - (projector.checkpoint - base)))
            await asyncio.sleep(0.5)

    base = projector.checkpoint
    sampler = asyncio.create_task(sample())
    t0 = time.perf_counter()
    now = time.time()
    for i in range(n):
        for event in _finished_rollout(i, now):
            await js.publish_async(subject_for(log_.prefix, event), encode_event(event))
            published += 1
        if i % 10_000 == 9_999:
            print(f"  preload: {i + 1:,} rollouts published, projector lag {lags[-1] if lags else 0:,} messages")
    await js.publish_async_completed()
    t_pub = time.perf_counter()
    await alg.sync_all(timeout_s=600.0)
    t_done = time.perf_counter()
    stop.set()
    await sampler
    return {
        "rollouts": n,
        "messages": published,
        "publish_s": round(t_pub - t0, 1),
        "catch_up_after_publish_s": round(t_done - t_pub, 1),
        "projected_messages_per_s": round(published / (t_done - t0), 1),
        "max_lag_messages": max(lags) if lags else 0,
        "lag_samples": len(lags),
    }


async def run(preload: int, seconds: float, conc: int) -> dict[str, Any]:
    stack = Stack()
    await stack.start()
    try:
        alg = await stack.open_store()
        runner = await stack.open_runner_store()
        try:
            empty = await _ops(alg, runner, seconds, conc)
            print("empty store measured; preloading …")
            pre = await _preload(alg, preload)
            stats = await alg.statistics()
            loaded = await _ops(alg, runner, seconds, conc)
        finally:
            await runner.close()
            await alg.close()
    finally:
        await stack.stop()
    return {"preload": pre, "store_after_preload": stats, "empty": empty, "loaded": loaded}


def report(result: dict[str, Any]) -> str:
    pre = result["preload"]
    lines = [
        f"preload: {pre['rollouts']:,} finished rollouts ({pre['messages']:,} messages) published in "
        f"{pre['publish_s']} s; projector caught up {pre['catch_up_after_publish_s']} s after the last publish, "
        f"max lag {pre['max_lag_messages']:,} messages ({pre['projected_messages_per_s']:,} messages/s projected)",
        "",
        "| operation | empty ops/s | empty p50 / p99 ms | loaded ops/s | loaded p50 / p99 ms | loaded / empty |",
        "|---|---|---|---|---|---|",
    ]
    for op, e in result["empty"].items():
        lo = result["loaded"][op]
        ratio = lo["ops_per_s"] / e["ops_per_s"] if e["ops_per_s"] else float("nan")
        lines.append(
            f"| {op} | {e['ops_per_s']:,} | {e['p50_ms']} / {e['p99_ms']} | {lo['ops_per_s']:,} | "
            f"{lo['p50_ms']} / {lo['p99_ms']} | {ratio:.2f}× |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.growth", description=__doc__.splitlines()[0])
    parser.add_argument("--preload", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    require_positive(parser, args, "preload", "seconds", "concurrency")
    import uvloop

    result = uvloop.run(run(args.preload, args.seconds, args.concurrency))
    print_and_save(report(result), result, args.out)


if __name__ == "__main__":
    main()
