"""Soak: eventlight under a steady load for minutes, memory of every process sampled over time.

    python -m bench.soak [--minutes 10] [--runners 16] [--in-flight 64] [--sleep-s 0.02] [--retention-s S]
                         [--out FILE.json]

Runs the benchmark's ``single`` pattern (``--in-flight`` rollouts kept in flight, enqueued one by one,
each checked: spans and final reward) without a task limit for ``--minutes``, with the same stack as
the scenarios (embedded NATS + Postgres, 16 runner processes, the algorithm's store with projector
and watchdog in this process). Every ``--every-s`` it records the rollouts finished so far and the
PSS of each role (``algorithm``, ``nats``, ``postgres``, ``runners`` summed; PSS, not RSS, so pages
shared between processes, like Postgres' shared buffers, count once). Finished rollouts'
bookkeeping is dropped as it goes, so the driver's own memory does not grow with the run.

Memory is flat when each role's PSS at the end is close to its PSS after the first two minutes
(warm-up: caches, connection pools, Postgres shared buffers filling up to ``shared_buffers``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import require_positive
from bench.driver import READY_TIMEOUT_S, Algorithm
from bench.procs import ProcessSampler, wait_files
from bench.report import print_and_save
from bench.workload import SCENARIOS, TaskPlan, plan_task


class _Plans(dict[str, TaskPlan]):
    """Plans made when first asked for (a soak has no fixed task list)."""

    def __init__(self, seed: int, max_rounds: int, sleep_s: float):
        super().__init__()
        self.args = (seed, max_rounds, sleep_s)

    def __missing__(self, task: str) -> TaskPlan:
        return plan_task(self.args[0], task, self.args[1], self.args[2])  # not kept: a plan is ~100 kB


class _TimedAlgorithm(Algorithm):
    """``single`` mode that stops enqueuing at ``deadline`` (``time.perf_counter`` seconds)."""

    deadline = float("inf")

    def _task_indices(self) -> Iterator[int]:
        i = 0
        while time.perf_counter() < self.deadline:
            yield i
            i += 1


async def soak(
    minutes: float, runners: int, in_flight: int, sleep_s: float, every_s: float, retention_s: float | None = None
) -> dict[str, Any]:
    import bench.stack_eventlight as mod

    scn = replace(SCENARIOS["single"], total_tasks=10**9, n_runners=runners, concurrency=in_flight, sleep_s=sleep_s)
    stack = mod.Stack()
    if retention_s is not None:  # the algorithm's projector retires finished rollouts to the archive
        stack.settings_overrides = {"retention_s": retention_s}
    sampler = ProcessSampler(1.0).start()
    sampler.add("algorithm", os.getpid())
    stats_dir = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    samples: list[dict[str, Any]] = []
    finished = failed = 0
    store = None
    try:
        await stack.start()
        for role, pid in stack.server_roles().items():
            sampler.add(role, pid)
        stack.start_runners(runners, 1, scn.max_rounds, sleep_s, stats_dir)
        for pid in stack.runner_pids():
            sampler.add("runners", pid)
        names = [f"ready-{i}" for i in range(runners)]
        missing = await asyncio.to_thread(wait_files, stats_dir, names, READY_TIMEOUT_S, lambda: True)
        if missing:
            raise RuntimeError(f"{len(missing)} runner(s) not ready")
        store = await stack.open_store()
        t0 = time.perf_counter()
        alg = _TimedAlgorithm(mod, store, scn, _Plans(1, scn.max_rounds, sleep_s))
        alg.deadline = t0 + minutes * 60

        async def watch() -> None:
            nonlocal finished, failed
            while True:
                await asyncio.sleep(every_s)
                for rid, rec in list(alg.records.items()):
                    if rec.done_s is not None and rec.status is not None:
                        finished += 1
                        failed += rec.error is not None
                        del alg.records[rid]
                sampler.sample(refresh=True)
                pss = await asyncio.to_thread(sampler.pss)
                samples.append(
                    {"t_s": round(time.perf_counter() - t0, 1), "finished": finished, "failed_checks": failed}
                    | await _stream_state(store)
                    | {f"pss_mb_{k}": round(v, 1) for k, v in pss.items()}
                )
                s = samples[-1]
                print(
                    f"  {s['t_s']:6.0f} s  {finished:7,} rollouts  {s['hot_subjects']:,} hot subjects  "
                    f"{s['retired']:,} retired  "
                    + "  ".join(f"{k[7:]} {v:,.0f} MB" for k, v in s.items() if k.startswith("pss_mb_"))
                )

        watcher = asyncio.create_task(watch())
        try:
            await alg.run()  # enqueues until the deadline, then lets the rollouts in flight finish
        finally:
            watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher  # a sampling error surfaces here instead of vanishing with the task
    finally:
        if store is not None:
            await store.close()
        await asyncio.to_thread(stack.stop_runners)
        await stack.stop()
        sampler.stop()
        shutil.rmtree(stats_dir, ignore_errors=True)
    return {"minutes": minutes, "runners": runners, "in_flight": in_flight, "sleep_s": sleep_s, "samples": samples}


async def _stream_state(store: Any) -> dict[str, int]:
    """The hot stream's subject and message counts, and the rollouts the projector retired so far."""
    from bench.stack_eventlight import stream_subjects

    log_ = store._log()
    info = await log_.js.stream_info(log_.stream)
    projector = store.projector
    return {
        "hot_subjects": await stream_subjects(store, log_.stream) or 0,
        "hot_messages": int(info.state.messages),
        "retired": int(getattr(projector, "retired", 0) if projector is not None else 0),
    }


def report(result: dict[str, Any]) -> str:
    samples = result["samples"]
    if len(samples) < 2:
        return "too few samples"
    warm = next((s for s in samples if s["t_s"] >= 120), samples[len(samples) // 2])
    last = samples[-1]
    lines = [
        f"{last['finished']:,} rollouts in {last['t_s']:.0f} s "
        f"({last['finished'] / last['t_s']:.1f}/s), {last['failed_checks']} failed checks",
        "",
        f"hot stream: {warm.get('hot_subjects', 0):,} subjects at warm-up, {last.get('hot_subjects', 0):,} at the end; "
        f"{last.get('retired', 0):,} rollouts retired to the archive",
        "",
        "| role | PSS at warm-up (MB) | PSS at end (MB) | change |",
        "|---|---|---|---|",
    ]
    for key in sorted(k for k in last if k.startswith("pss_mb_")):
        a, b = warm.get(key, 0.0), last[key]
        lines.append(f"| {key[7:]} | {a:,.0f} (t={warm['t_s']:.0f} s) | {b:,.0f} | {b - a:+,.0f} MB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--runners", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--sleep-s", type=float, default=0.02)
    parser.add_argument("--every-s", type=float, default=30.0)
    parser.add_argument(
        "--retention-s", type=float, default=None, help="retire finished rollouts after this many seconds (archive)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    require_positive(parser, args, "minutes", "runners", "in_flight", "every_s")
    import uvloop

    result = uvloop.run(soak(args.minutes, args.runners, args.in_flight, args.sleep_s, args.every_s, args.retention_s))
    print_and_save(report(result), result, args.out)


if __name__ == "__main__":
    main()
