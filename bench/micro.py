"""Micro benchmarks: single store operations per second, on one stack, in that stack's process.

    python -m bench.micro --stack eventlight|agentlightning [--seconds 3] [--concurrency 4] [--blocks 6]
        [--ops dequeue,query_spans] [--out F]

Each operation runs for ``--seconds`` with ``--concurrency`` asyncio tasks (each its own worker id)
in this process, against a fresh stack (eventlight: embedded NATS + Postgres; the peer: a fresh
``agl store --backend memory``). Runner-side operations use what a runner process opens (eventlight:
a store without Postgres; the peer: a ``LightningStoreClient``); algorithm-side ones the algorithm's
store. In order (``dequeue`` after ``dequeue_update``: its claims stay held, and past the queue
consumer's 30 s ack wait they would come back to the pulls of any operation after it):

=================  ==========================  =====================================================
operation          side                        one op
=================  ==========================  =====================================================
heartbeat          runner                      ``update_worker(worker_id, stats)``
dequeue_empty      runner                      ``dequeue_rollout(worker_id=...)`` on an empty queue
enqueue            algorithm                   ``enqueue_rollout(input, mode="train")``
dequeue_update     runner                      ``dequeue_rollout`` + ``update_attempt(succeeded)``
dequeue            runner                      ``dequeue_rollout(worker_id=...)`` (queue pre-filled)
add_span           runner                      ``add_span(span)`` (ids allocated beforehand)
query_spans        algorithm                   ``query_spans(rollout_id)`` of a 20-span rollout
=================  ==========================  =====================================================

``--ops`` runs only the operations it names (comma-separated, still in the order above; the
``round_trips`` row only with all of them). Each operation's ``--seconds`` are split into
``--blocks`` blocks. Reported per operation: ops/s, p50/p99 latency and CPU microseconds per op
summed over every process of the stack (this one and the servers), over all blocks, and each
block's ops/s with their ``spread`` (min, median, max).

On eventlight, two raw rows:

* ``raw_own``: the operation's raw twin (``bench.raw_twins``: the same messages on eventlight's own
  stream, by nats-py / asyncpg alone) for as many blocks as long, alternating with the operation's
  (op, twin, twin, op, ...); ``vs_raw_own`` is the operation's ops/s over the twin's, and
  ``vs_raw_own_pairs`` that ratio per pair of blocks with its spread;
* ``round_trips`` (top level, the older row): right after all operations, on the same servers but a
  fresh stream with no consumers, the raw round trips they are made of (``bench.ceiling``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from bench import require_positive, write_json
from bench.driver import load_stack
from bench.procs import ProcessSampler
from bench.workload import percentile, random_attributes

PREFILL = 3000  # per side: twice that where a raw twin dequeues from the same queue
BLOCKS = 6
PREFILL_LIMIT_S = 40.0
QUERY_SPANS = 20
OPS = ("heartbeat", "dequeue_empty", "enqueue", "dequeue_update", "dequeue", "add_span", "query_spans")
"""The micro operations, in the order they run."""
STATS = {"cpu_usage_pct": 12.5, "mem_used_gb": 3.2, "host": "bench", "pid": 1}


class Exhausted(Exception):
    """The operation has nothing left to work on (e.g. no pre-allocated span ids left)."""


class EmptyResult(Exception):
    """A dequeue returned ``None`` although the queue was pre-filled (counted, not an op)."""


async def _measure(
    op: Callable[[int], Awaitable[Any]], seconds: float, concurrency: int, sampler: ProcessSampler
) -> dict[str, Any]:
    """One block: ``op`` back to back in ``concurrency`` tasks for ``seconds``; latencies kept raw
    (``_summary`` reduces a side's blocks)."""
    lat: list[float] = []
    errors: list[str] = []
    exhausted = False
    empty = 0
    deadline = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal exhausted, empty
        while time.perf_counter() < deadline and not exhausted:
            t = time.perf_counter()
            try:
                await op(w)
            except Exhausted:
                exhausted = True
                return
            except EmptyResult:
                empty += 1
                continue
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}"[:300])
                if len(errors) > 50:
                    return
                continue
            lat.append(time.perf_counter() - t)

    sampler.open_window()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - t0
    cpu_by_role = sampler.close_window()["cpu_s"]
    return {
        "lat": lat,
        "seconds": elapsed,
        "cpu_s": cpu_by_role,
        "errors": errors,
        "ran_out": exhausted,
        "empty": empty,
    }


def spread(values: list[float]) -> dict[str, float] | None:
    """``{"min", "median", "max"}`` of ``values`` (rounded to 0.1; 0.001 below 10), or ``None`` if empty."""
    if not values:
        return None
    digits = 3 if max(values) < 10 else 1
    return {
        "min": round(min(values), digits),
        "median": round(statistics.median(values), digits),
        "max": round(max(values), digits),
    }


def _summary(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's blocks as one row: totals over all of them, and ``blocks_ops_per_s`` / ``spread``."""
    lat = [x for b in blocks for x in b["lat"]]
    errors = [e for b in blocks for e in b["errors"]]
    elapsed = sum(b["seconds"] for b in blocks)
    cpu_by_role: dict[str, float] = {}
    for b in blocks:
        for role, s in b["cpu_s"].items():
            cpu_by_role[role] = cpu_by_role.get(role, 0.0) + s
    n = len(lat)
    rates = [len(b["lat"]) / b["seconds"] for b in blocks if b["seconds"] > 0]
    return {
        "ops": n,
        "seconds": round(elapsed, 3),
        "ops_per_s": round(n / elapsed, 1) if elapsed > 0 else 0.0,
        "blocks_ops_per_s": [round(r, 1) for r in rates],
        "spread": spread(rates),
        "p50_ms": None if not lat else round(percentile(lat, 50) * 1000, 3),  # type: ignore[operator]
        "p99_ms": None if not lat else round(percentile(lat, 99) * 1000, 3),  # type: ignore[operator]
        "cpu_us_per_op": round(cpu_by_role.get("total", 0.0) / n * 1e6, 1) if n else None,
        "cpu_us_per_op_by_role": {role: round(s / n * 1e6, 1) for role, s in cpu_by_role.items()} if n else None,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "ran_out": any(b["ran_out"] for b in blocks),
        "empty_results": sum(b["empty"] for b in blocks),
    }


async def measure_interleaved(
    op: Callable[[int], Awaitable[Any]],
    twin: Callable[[int], Awaitable[Any]] | None,
    seconds: float,
    concurrency: int,
    sampler: ProcessSampler,
    blocks: int = BLOCKS,
) -> dict[str, Any]:
    """``op`` for ``seconds`` in ``blocks`` blocks; with a ``twin`` (its raw round trips,
    ``bench.raw_twins``), each block of ``op`` paired with one of the twin as long, the pair's
    order alternating (op first, then twin first, ...) so that drift and noise hit both sides alike.

    Returns ``op``'s row (``_summary``); with a twin also ``raw_own`` (the twin's row),
    ``vs_raw_own`` (op's ops/s over the twin's, all blocks) and ``vs_raw_own_pairs`` (that ratio per
    pair: ``blocks_ops_per_s`` ratios and their ``spread``).
    """
    block_s = seconds / blocks
    mine: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    for i in range(blocks):
        sides = [(mine, op), (raw, twin)] if i % 2 == 0 else [(raw, twin), (mine, op)]
        for into, fn in sides:
            if fn is not None and not (into and into[-1]["ran_out"]):
                into.append(await _measure(fn, block_s, concurrency, sampler))
    row = _summary(mine)
    if twin is None:
        return row
    row["raw_own"] = _summary(raw)
    rate, raw_rate = row["ops_per_s"], row["raw_own"]["ops_per_s"]
    row["vs_raw_own"] = round(rate / raw_rate, 3) if rate and raw_rate else None
    pairs = [a / b for a, b in zip(row["blocks_ops_per_s"], row["raw_own"]["blocks_ops_per_s"], strict=False) if b]
    row["vs_raw_own_pairs"] = {"ratios": [round(r, 3) for r in pairs], "spread": spread(pairs)}
    return row


async def _prefill(mod: ModuleType, store: Any, target: int) -> int:
    """Enqueue up to ``target`` rollouts in chunks (untimed); returns how many."""
    done = 0
    t0 = time.perf_counter()
    while done < target and time.perf_counter() - t0 < PREFILL_LIMIT_S:
        chunk = [mod.EnqueueRolloutRequest(input=f"prefill-{done + i}", mode="train") for i in range(200)]
        done += len(await store.enqueue_many_rollouts(chunk))
    return done


async def run_micro(
    mod: ModuleType, seconds: float, concurrency: int, blocks: int = BLOCKS, only: tuple[str, ...] = OPS
) -> dict[str, Any]:
    """The operations ``only`` names (default: all, ``OPS``) on a fresh stack; never raises (a
    failure is in the result)."""
    result: dict[str, Any] = {
        "stack": mod.NAME,
        "stack_version": mod.VERSION,
        "seconds_per_op": seconds,
        "concurrency": concurrency,
        "blocks": blocks,
        "event_loop": mod.LOOP,
        "ok": False,
        "error": None,
        "ops": {},
    }
    stack = mod.Stack()
    sampler = ProcessSampler(0.5).start()
    sampler.add("algorithm", os.getpid())
    alg = runner = raw = None
    phase = "start"
    try:
        await stack.start()
        for role, pid in stack.server_roles().items():
            sampler.add(role, pid)
        alg = await stack.open_store()
        runner = await stack.open_runner_store()
        await alg.add_resources({"llm": mod.LLM(endpoint="http://localhost:1/v1", model="m")})
        ops = result["ops"]
        wid = [f"micro-worker-{w}" for w in range(concurrency)]
        counter = iter(range(10**9))
        if hasattr(stack, "own_stream_raw"):
            phase = "raw twins"
            raw = await stack.own_stream_raw(concurrency)
        result["raw_own"] = raw is not None

        async def twin_of(name: str, rollout_id: str | None = None) -> Callable[[int], Awaitable[Any]] | None:
            return None if raw is None else await raw.twin(name, alg, runner, wid, rollout_id=rollout_id)

        async def measure(name: str, op: Callable[[int], Awaitable[Any]], rollout_id: str | None = None) -> Any:
            twin = await twin_of(name, rollout_id)
            return await measure_interleaved(op, twin, seconds, concurrency, sampler, blocks)

        async def heartbeat(w: int) -> None:
            await runner.update_worker(wid[w], dict(STATS))

        async def dequeue_empty(w: int) -> None:
            if await runner.dequeue_rollout(worker_id=wid[w]) is not None:
                raise RuntimeError("queue not empty")

        async def enqueue(w: int) -> None:
            await alg.enqueue_rollout(input=f"micro-{next(counter)}", mode="train")

        async def dequeue(w: int) -> None:
            if await runner.dequeue_rollout(worker_id=wid[w]) is None:
                raise EmptyResult

        async def dequeue_update(w: int) -> None:
            claimed = await runner.dequeue_rollout(worker_id=wid[w])
            if claimed is None:
                raise EmptyResult
            await runner.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")

        for name, op in (("heartbeat", heartbeat), ("dequeue_empty", dequeue_empty), ("enqueue", enqueue)):
            if name not in only:
                continue
            phase = name
            ops[name] = await measure(name, op)
        # dequeue_update first: dequeue's claims stay held (nothing finishes them), and once the
        # runners consumer's ack wait (30 s) is past, every later pull would get them back first
        for name, op in (("dequeue_update", dequeue_update), ("dequeue", dequeue)):
            if name not in only:
                continue
            phase = f"prefill for {name}"
            ops[name] = {"prefilled": await _prefill(mod, alg, PREFILL * (2 if raw is not None else 1))}
            phase = name
            ops[name].update(await measure(name, op))

        attrs = random_attributes(random.Random(7))  # the spans of add_span and query_spans
        if "add_span" in only:
            phase = "add_span setup"
            attempted = await runner.start_rollout(input="micro-spans", worker_id=wid[0])
            rid, aid = attempted.rollout_id, attempted.attempt.attempt_id
            ids = iter(await runner.get_many_span_sequence_ids([(rid, aid)] * max(5000, int(2500 * seconds))))

            async def add_span(w: int) -> None:
                seq = next(ids, None)
                if seq is None:
                    raise Exhausted
                await runner.add_span(mod.make_span(rid, aid, seq, attrs))

            phase = "add_span"
            ops["add_span"] = await measure("add_span", add_span)
            ops["add_span"]["span_attribute_bytes"] = len(json.dumps(attrs))

        if "query_spans" in only:
            phase = "query_spans setup"
            q = await runner.start_rollout(input="micro-query", worker_id=wid[0])
            qids = await runner.get_many_span_sequence_ids([(q.rollout_id, q.attempt.attempt_id)] * QUERY_SPANS)
            await runner.add_many_spans([mod.make_span(q.rollout_id, q.attempt.attempt_id, i, attrs) for i in qids])
            t_sync = time.perf_counter()
            await stack.sync(alg)
            if mod.NAME == "eventlight":
                result["projector_catchup_s"] = round(time.perf_counter() - t_sync, 2)
            found = len(list(await alg.query_spans(q.rollout_id)))
            if found != QUERY_SPANS:
                raise RuntimeError(f"query_spans found {found} of {QUERY_SPANS} spans")

            async def query_spans(w: int) -> None:
                await alg.query_spans(q.rollout_id)

            phase = "query_spans"
            ops["query_spans"] = await measure("query_spans", query_spans, q.rollout_id)
        if hasattr(stack, "round_trips") and set(only) == set(OPS):
            phase = "round trips"
            result["round_trips"] = await stack.round_trips(sampler, concurrency, seconds)
        result["ok"] = all(not o.get("errors") for o in ops.values())
        if not result["ok"]:
            bad = [f"{k}: {o['first_error']}" for k, o in ops.items() if o.get("errors")]
            result["error"] = "; ".join(bad)[:1000]
    except Exception as e:
        result["error"] = f"{phase}: {type(e).__name__}: {e}"
    finally:
        if raw is not None:
            try:
                await raw.close()
            except Exception as e:
                result.setdefault("teardown_errors", []).append(repr(e))
        for s in (runner, alg):
            if s is not None:
                try:
                    await s.close()
                except Exception as e:
                    result.setdefault("teardown_errors", []).append(repr(e))
        try:
            await stack.stop()
        except Exception as e:
            result.setdefault("teardown_errors", []).append(repr(e))
        sampler.stop()
    return result


def _ops(text: str) -> tuple[str, ...]:
    """``--ops``' value: known operation names, in ``OPS``' order.

    Raises:
        argparse.ArgumentTypeError: A name is not a micro operation, or none is given.
    """
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - set(OPS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"no micro operation {', '.join(unknown) or repr(text)}; of {', '.join(OPS)}")
    return tuple(n for n in OPS if n in names)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.micro", description=__doc__.splitlines()[0])
    parser.add_argument("--stack", required=True)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=BLOCKS, help="blocks each operation's time is split into")
    parser.add_argument(
        "--ops", type=_ops, default=OPS, help=f"comma-separated operations to run (default: all; of {', '.join(OPS)})"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    require_positive(parser, args, "seconds", "concurrency", "blocks")
    mod = load_stack(args.stack)
    result = mod.run(run_micro(mod, args.seconds, args.concurrency, args.blocks, args.ops))
    write_json(result, args.out)


if __name__ == "__main__":
    main()
