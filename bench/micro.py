"""Micro benchmarks: single store operations per second, on one stack, in that stack's process.

    python -m bench.micro --stack eventlight|agentlightning [--seconds 3] [--concurrency 4] [--out F]

Each operation runs for ``--seconds`` with ``--concurrency`` asyncio tasks (each its own worker id)
in this process, against a fresh stack (eventlight: embedded NATS + Postgres; the peer: a fresh
``agl store --backend memory``). Runner-side operations use what a runner process opens (eventlight:
a store without Postgres; the peer: a ``LightningStoreClient``); algorithm-side ones the algorithm's
store. In order:

=================  ==========================  =====================================================
operation          side                        one op
=================  ==========================  =====================================================
heartbeat          runner                      ``update_worker(worker_id, stats)``
dequeue_empty      runner                      ``dequeue_rollout(worker_id=...)`` on an empty queue
enqueue            algorithm                   ``enqueue_rollout(input, mode="train")``
dequeue            runner                      ``dequeue_rollout(worker_id=...)`` (queue pre-filled)
dequeue_update     runner                      ``dequeue_rollout`` + ``update_attempt(succeeded)``
add_span           runner                      ``add_span(span)`` (ids allocated beforehand)
query_spans        algorithm                   ``query_spans(rollout_id)`` of a 20-span rollout
=================  ==========================  =====================================================

Reported per operation: ops/s, p50/p99 latency, and CPU microseconds per op summed over every
process of the stack (this one and the servers). On eventlight, right after its operations and on
the same servers, ``round_trips`` measures the raw round trips they are made of (``bench.ceiling``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from bench import require_positive, write_json
from bench.driver import load_stack
from bench.procs import ProcessSampler
from bench.workload import percentile, random_attributes

PREFILL = 3000
PREFILL_LIMIT_S = 40.0
QUERY_SPANS = 20
STATS = {"cpu_usage_pct": 12.5, "mem_used_gb": 3.2, "host": "bench", "pid": 1}


class Exhausted(Exception):
    """The operation has nothing left to work on (e.g. no pre-allocated span ids left)."""


class EmptyResult(Exception):
    """A dequeue returned ``None`` although the queue was pre-filled (counted, not an op)."""


async def _measure(
    name: str, op: Callable[[int], Awaitable[Any]], seconds: float, concurrency: int, sampler: ProcessSampler
) -> dict[str, Any]:
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
    cpu = cpu_by_role["total"]
    n = len(lat)
    return {
        "ops": n,
        "seconds": round(elapsed, 3),
        "ops_per_s": round(n / elapsed, 1) if elapsed > 0 else 0.0,
        "p50_ms": None if not lat else round(percentile(lat, 50) * 1000, 3),  # type: ignore[operator]
        "p99_ms": None if not lat else round(percentile(lat, 99) * 1000, 3),  # type: ignore[operator]
        "cpu_us_per_op": round(cpu / n * 1e6, 1) if n else None,
        "cpu_us_per_op_by_role": {role: round(s / n * 1e6, 1) for role, s in cpu_by_role.items()} if n else None,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "ran_out": exhausted,
        "empty_results": empty,
    }


async def _prefill(mod: ModuleType, store: Any, target: int) -> int:
    """Enqueue up to ``target`` rollouts in chunks (untimed); returns how many."""
    done = 0
    t0 = time.perf_counter()
    while done < target and time.perf_counter() - t0 < PREFILL_LIMIT_S:
        chunk = [mod.EnqueueRolloutRequest(input=f"prefill-{done + i}", mode="train") for i in range(200)]
        done += len(await store.enqueue_many_rollouts(chunk))
    return done


async def run_micro(mod: ModuleType, seconds: float, concurrency: int) -> dict[str, Any]:
    """All operations on a fresh stack; never raises (a failure is in the result)."""
    result: dict[str, Any] = {
        "stack": mod.NAME,
        "stack_version": mod.VERSION,
        "seconds_per_op": seconds,
        "concurrency": concurrency,
        "event_loop": mod.LOOP,
        "ok": False,
        "error": None,
        "ops": {},
    }
    stack = mod.Stack()
    sampler = ProcessSampler(0.5).start()
    sampler.add("algorithm", os.getpid())
    alg = runner = None
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
            phase = name
            ops[name] = await _measure(name, op, seconds, concurrency, sampler)
        for name, op in (("dequeue", dequeue), ("dequeue_update", dequeue_update)):
            phase = f"prefill for {name}"
            ops[name] = {"prefilled": await _prefill(mod, alg, PREFILL)}
            phase = name
            ops[name].update(await _measure(name, op, seconds, concurrency, sampler))

        phase = "add_span setup"
        attempted = await runner.start_rollout(input="micro-spans", worker_id=wid[0])
        rid, aid = attempted.rollout_id, attempted.attempt.attempt_id
        ids = iter(await runner.get_many_span_sequence_ids([(rid, aid)] * max(5000, int(2500 * seconds))))
        attrs = random_attributes(random.Random(7))

        async def add_span(w: int) -> None:
            seq = next(ids, None)
            if seq is None:
                raise Exhausted
            await runner.add_span(mod.make_span(rid, aid, seq, attrs))

        phase = "add_span"
        ops["add_span"] = await _measure("add_span", add_span, seconds, concurrency, sampler)
        ops["add_span"]["span_attribute_bytes"] = len(json.dumps(attrs))

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
        ops["query_spans"] = await _measure("query_spans", query_spans, seconds, concurrency, sampler)
        if hasattr(stack, "round_trips"):
            phase = "round trips"
            result["round_trips"] = await stack.round_trips(sampler, concurrency, seconds)
        result["ok"] = all(not o.get("errors") for o in ops.values())
        if not result["ok"]:
            bad = [f"{k}: {o['first_error']}" for k, o in ops.items() if o.get("errors")]
            result["error"] = "; ".join(bad)[:1000]
    except Exception as e:
        result["error"] = f"{phase}: {type(e).__name__}: {e}"
    finally:
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.micro", description=__doc__.splitlines()[0])
    parser.add_argument("--stack", required=True)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    require_positive(parser, args, "seconds", "concurrency")
    mod = load_stack(args.stack)
    result = mod.run(run_micro(mod, args.seconds, args.concurrency))
    write_json(result, args.out)


if __name__ == "__main__":
    main()
