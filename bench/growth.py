"""Cost growth: the same operations on an empty store and on one holding 100,000 finished rollouts.

    python -m bench.growth [--preload 100000] [--seconds 3] [--concurrency 4] [--retire] [--out FILE.json]

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
projected by the store's own projector; the queue entries it leaves are then acknowledged, as the
runners that would have claimed those rollouts do (``_ack_queue``). While it runs, the projector's
lag (stream messages not yet committed to Postgres) is sampled every 0.5 s: its maximum and the
seconds to catch up after the last publish show whether the lag stays bounded.

With ``--retire`` the namespace has the archive stream; after the loaded
measurement ``retire`` moves every preloaded rollout out of the hot stream (timed: rollouts retired
per second) and the operations are measured once more. Each phase records nats-server's RSS and the
hot stream's subject count, so the report gives nats-server memory per stored rollout with and
without retirement.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil

from bench import require_positive
from bench.micro import EmptyResult, _measure, _prefill
from bench.procs import ProcessSampler
from bench.report import print_and_save
from bench.stack_eventlight import Stack, make_span, stream_subjects
from eventlight.core.events import AttemptStarted, AttemptUpdated, RolloutCreated, SpansAdded, encode_event
from eventlight.core.types import Attempt, Rollout
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.layout import subject_for
from eventlight.store.jetstream.nats_errors import NO_MESSAGES

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
    acked = await _ack_queue(alg)
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
        "queue_entries_acked": acked,
    }


async def _ack_queue(alg: JetStreamLightningStore) -> int:
    """Take and acknowledge every entry on the runners' queue, as the runners that claimed and
    finished the preloaded rollouts would have: the preload bypasses the queue, and a consumer left
    with every preloaded entry undelivered is no state a deployment reaches (nats-server 2.15.1 then
    costs each subject purge O(undelivered messages): see the README's retirement section).
    Returns how many."""
    log_ = alg._log()
    sub = await log_.js.pull_subscribe(f"{log_.prefix}.r.*.q", durable="runners", stream=log_.stream)
    acked = 0
    try:
        while True:
            try:
                msgs = await sub.fetch(1000, timeout=10.0)
            except NO_MESSAGES:
                msgs = []
            for msg in msgs:
                await msg.ack()
            acked += len(msgs)
            if not msgs:  # a fetch can come back short or empty under load: the consumer's count decides
                await log_.nc.flush()
                info = await log_.js.consumer_info(log_.stream, "runners")
                if not info.num_pending and not info.num_ack_pending:
                    break
    finally:
        await sub.unsubscribe()
    await log_.nc.flush()
    return acked


async def _nats_state(stack: Stack, alg: JetStreamLightningStore) -> dict[str, Any]:
    """nats-server's RSS (MB) and the hot stream's subject count, after a short settle."""
    assert stack.services is not None and stack.settings is not None and stack.services.nats_pid is not None
    gc.collect()
    await asyncio.sleep(2.0)
    rss = psutil.Process(stack.services.nats_pid).memory_info().rss / 2**20
    return {"nats_rss_mb": round(rss, 1), "hot_subjects": await stream_subjects(alg, stack.settings.stream_name)}


async def _retire_all(stack: Stack, alg: JetStreamLightningStore, budget_s: float | None) -> dict[str, Any]:
    """Retire the preload in rounds of ``RETIRE_BATCH`` until none is left or ``budget_s`` is spent;
    a round that fails (NATS timing out on purges) is counted and ends the retirement."""
    from eventlight.store.jetstream.projector.leader import RETIRE_BATCH
    from eventlight.store.jetstream.retire import ARCHIVE_LAG_MAX, retire

    assert stack.settings is not None
    due_now = msgspec.structs.replace(stack.settings, retention_s=0.0)
    t0 = time.perf_counter()
    retired, error, waited_s, first_lag = 0, None, 0.0, None
    while budget_s is None or time.perf_counter() - t0 < budget_s:
        r0 = time.perf_counter()
        try:
            report = await retire(alg._log(), alg.pool, due_now, now=time.time() + 1, limit=RETIRE_BATCH)
        except Exception as e:  # recorded in the result: the figures so far still count
            error = f"{type(e).__name__}: {e}"
            print(f"  retirement stopped: {error}")
            break
        if first_lag is None:
            first_lag = report.archive_lag
        if not report.retired and report.archive_lag > ARCHIVE_LAG_MAX:
            # The round refused: the archive is still sourcing the backlog. Wait for it, timed apart.
            print(f"  archive {report.archive_lag:,} messages behind; waiting ({time.perf_counter() - t0:.0f} s)")
            await asyncio.sleep(5.0)
            waited_s += time.perf_counter() - r0
            continue
        retired += report.retired
        print(f"  retired {retired:,} rollouts in {time.perf_counter() - t0:.0f} s")
        if not report.retired:
            break
    seconds = time.perf_counter() - t0
    busy = seconds - waited_s
    rate = round(retired / busy, 1) if retired and busy > 0 else 0.0
    return {
        "retired": retired,
        "retire_s": round(seconds, 1),
        "archive_wait_s": round(waited_s, 1),
        "archive_lag_at_start": first_lag,
        "retired_per_s": rate,
        "error": error,
    }


async def run(
    preload: int, seconds: float, conc: int, retiring: bool = False, retire_budget_s: float | None = None
) -> dict[str, Any]:
    stack = Stack()
    # The archive exists when a window is set; one too long for anything to fall due keeps the
    # leading projector's own retirement rounds out of the measurement, and `_retire_all` retires
    # with a window of 0.
    stack.settings_overrides = {"retention_s": 1e9} if retiring else {}
    await stack.start()
    memory: dict[str, Any] = {}
    retired: dict[str, Any] = {}
    try:
        alg = await stack.open_store()
        runner = await stack.open_runner_store()
        try:
            memory["empty"] = await _nats_state(stack, alg)
            empty = await _ops(alg, runner, seconds, conc)
            print("empty store measured; preloading …")
            pre = await _preload(alg, preload)
            memory["preloaded"] = await _nats_state(stack, alg)
            stats = await alg.statistics()
            loaded = await _ops(alg, runner, seconds, conc)
            print("loaded store measured:", {op: r["ops_per_s"] for op, r in loaded.items()}, flush=True)
            if retiring:
                print(f"  retiring {preload:,} rollouts …")
                retired = await _retire_all(stack, alg, retire_budget_s)
                memory["retired"] = await _nats_state(stack, alg)
                retired["ops"] = await _ops(alg, runner, seconds, conc)
            memory["end"] = await _nats_state(stack, alg)
        finally:
            await runner.close()
            await alg.close()
    finally:
        await stack.stop()
    durability = stack.settings.durability if stack.settings else "fsync"
    return {
        "durability": durability,
        "retire": retiring,
        "preload": pre,
        "retirement": retired,
        "nats_memory": memory,
        "store_after_preload": stats,
        "empty": empty,
        "loaded": loaded,
    }


def report(result: dict[str, Any]) -> str:
    pre = result["preload"]
    lines = [
        f"preload: {pre['rollouts']:,} finished rollouts ({pre['messages']:,} messages) published in "
        f"{pre['publish_s']} s; projector caught up {pre['catch_up_after_publish_s']} s after the last publish, "
        f"max lag {pre['max_lag_messages']:,} messages ({pre['projected_messages_per_s']:,} messages/s projected)",
        "",
        f"durability {result.get('durability', 'fsync')}; retirement {'on' if result.get('retire') else 'off'}",
    ]
    ret = result.get("retirement") or {}
    if ret:
        lines.append(
            f"retired {ret['retired']:,} rollouts in {ret['retire_s']} s ({ret['retired_per_s']:,} rollouts/s "
            f"after waiting {ret.get('archive_wait_s', 0)} s for the archive, "
            f"{ret.get('archive_lag_at_start') or 0:,} messages behind at the start)"
            + (f"; stopped by {ret['error']}" if ret.get("error") else "")
        )
    mem = result.get("nats_memory") or {}
    if mem:
        lines += ["", "| phase | nats-server RSS MB | hot stream subjects |", "|---|---|---|"]
        lines += [f"| {k} | {v['nats_rss_mb']:,} | {v['hot_subjects']:,} |" for k, v in mem.items()]
        stored = mem.get("retired", mem.get("preloaded"))
        if stored and pre["rollouts"]:
            kb = (stored["nats_rss_mb"] - mem["empty"]["nats_rss_mb"]) * 1024 / pre["rollouts"]
            lines.append(f"nats-server memory per stored rollout: {kb:.2f} KB")
    lines += [
        "",
        "| operation | empty ops/s | empty p50 / p99 ms | loaded ops/s | loaded p50 / p99 ms | loaded / empty |",
        "|---|---|---|---|---|---|",
    ]
    after = {"loaded": result["loaded"]} | ({"loaded, retired": ret["ops"]} if ret.get("ops") else {})
    for label, ops in after.items():
        for op, e in result["empty"].items():
            lo = ops[op]
            ratio = lo["ops_per_s"] / e["ops_per_s"] if e["ops_per_s"] else float("nan")
            lines.append(
                f"| {op} ({label}) | {e['ops_per_s']:,} | {e['p50_ms']} / {e['p99_ms']} | {lo['ops_per_s']:,} | "
                f"{lo['p50_ms']} / {lo['p99_ms']} | {ratio:.2f}× |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.growth", description=__doc__.splitlines()[0])
    parser.add_argument("--preload", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--retire", action="store_true", help="retire the preloaded rollouts to the archive before measuring"
    )
    parser.add_argument(
        "--retire-budget-s", type=float, default=None, help="stop retiring after this many seconds (default: all)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    require_positive(parser, args, "preload", "seconds", "concurrency")
    import uvloop

    result = uvloop.run(run(args.preload, args.seconds, args.concurrency, args.retire, args.retire_budget_s))
    print_and_save(report(result), result, args.out)


if __name__ == "__main__":
    main()
