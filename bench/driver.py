"""The workload driver: one scenario on one stack, in that stack's own Python process.

    python -m bench.driver --stack eventlight|agentlightning SCENARIO [--scale X] [--seed N] [--out F]

It imports only the stack under test (``bench.stack_eventlight`` or ``bench.stack_agl``), starts its
servers and ``n_runners`` runner processes, waits until every runner is ready, then runs the
algorithm and measures from its first enqueue to its last checked rollout:

* the algorithm (this process) enqueues with ``enqueue_many_rollouts`` (``batch``,
  ``batch_partial``) or ``enqueue_rollout`` (``single``), polls with
  ``wait_for_rollouts(rollout_ids=..., timeout=POLL_S)`` (the peer's client refuses timeouts above
  0.1 s, so both stacks are polled the same way), reads each finished rollout's spans with
  ``query_spans(rollout_id, attempt_id="latest")`` (``single`` also calls ``get_rollout_by_id``),
  and checks them against the task's plan (``bench.workload.check_rollout``);
* a sampler sums RSS and CPU of every process of the stack (this one, the servers and their
  children, the runners) every 0.5 s.

The result (one JSON object) goes to ``--out`` (default: stdout). A failure anywhere is reported in
the result (``ok: false``, ``error``) rather than raised, after the stack is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import platform
import shutil
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from bench import require_positive, write_json
from bench.procs import ProcessSampler, wait_files
from bench.workload import (
    POLL_S,
    RUNNER_POLL_S,
    SCENARIOS,
    PlanCheck,
    Scenario,
    agent_bound,
    agent_cpu_bound,
    agent_cpu_s_per_rollout,
    batch_barrier_bound,
    check_rollout,
    percentile,
    plan_task,
    task_name,
)

STACK_MODULES = {"eventlight": "bench.stack_eventlight", "agentlightning": "bench.stack_agl"}
READY_TIMEOUT_S = 300.0
STALL_S = 60.0
MAX_ERRORS_KEPT = 5


def load_stack(name: str) -> ModuleType:
    """Import the module of stack ``name`` (and with it only that stack's package)."""
    if name not in STACK_MODULES:
        raise SystemExit(f"unknown stack {name!r}; choose from {sorted(STACK_MODULES)}")
    return importlib.import_module(STACK_MODULES[name])


class StalledError(RuntimeError):
    pass


@dataclass
class Record:
    index: int
    enqueued_s: float
    done_s: float | None = None
    status: str | None = None
    store_latency_s: float | None = None
    n_spans: int = 0
    error: str | None = None


class Algorithm:
    """The three submission patterns over the shared store API, with the checks."""

    def __init__(self, mod: ModuleType, store: Any, scn: Scenario, plans: dict[str, PlanCheck]):
        self.mod, self.store, self.scn, self.plans = mod, store, scn, plans
        self.records: dict[str, Record] = {}
        self.last_progress_s = time.perf_counter()

    async def run(self) -> None:
        scn = self.scn
        if scn.mode == "batch":
            await self._batch()
        elif scn.mode == "batch_partial":
            await self._batch_partial()
        else:
            await self._single()

    # -- submission patterns ------------------------------------------------------------------

    async def _batch(self) -> None:
        scn = self.scn
        for start in range(0, scn.total_tasks, scn.batch_size):
            pending = set(await self._enqueue_batch(range(start, min(start + scn.batch_size, scn.total_tasks))))
            while pending:
                pending.difference_update(await self._poll(sorted(pending)))

    async def _batch_partial(self) -> None:
        scn = self.scn
        active: set[str] = set()
        submitted = completed = 0
        while completed < scn.total_tasks:
            if submitted < scn.total_tasks and len(active) < scn.remaining:
                n = min(scn.batch_size, scn.total_tasks - submitted)
                active.update(await self._enqueue_batch(range(submitted, submitted + n)))
                submitted += n
                continue
            done = await self._poll(sorted(active))
            active.difference_update(done)
            completed += len(done)

    async def _single(self) -> None:
        scn = self.scn
        await self._add_resources(0)
        indices = self._task_indices()
        waiters: dict[str, asyncio.Future[Any]] = {}
        slots_done = 0

        async def slot() -> None:
            nonlocal slots_done
            try:
                for i in indices:
                    t = time.perf_counter()
                    rollout = await self.store.enqueue_rollout(input=task_name(i), mode="train")
                    self.records[rollout.rollout_id] = Record(i, t)
                    fut = asyncio.get_running_loop().create_future()
                    waiters[rollout.rollout_id] = fut
                    await fut
                    current = await self.store.get_rollout_by_id(rollout.rollout_id)
                    await self._verify(current)
            finally:
                slots_done += 1

        async def poller() -> None:
            while slots_done < scn.concurrency:
                if not waiters:
                    await asyncio.sleep(0.005)
                    continue
                finished = await self.store.wait_for_rollouts(rollout_ids=list(waiters), timeout=POLL_S)
                for r in finished:
                    fut = waiters.pop(r.rollout_id, None)
                    if fut is not None and not fut.done():
                        self.records[r.rollout_id].done_s = time.perf_counter()
                        fut.set_result(r)
                self._check_stall(bool(finished), len(waiters))

        tasks = [asyncio.create_task(poller()), *(asyncio.create_task(slot()) for _ in range(scn.concurrency))]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]  # the poller stalled, or a slot failed
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _task_indices(self) -> Iterator[int]:
        """The tasks ``single`` mode enqueues, in order (a soak overrides it to stop on time: ending
        by cancellation is unreliable on Python 3.11, whose ``wait_for`` can swallow it)."""
        return iter(range(self.scn.total_tasks))

    # -- store calls ----------------------------------------------------------------------------

    async def _add_resources(self, first_index: int) -> None:
        llm = self.mod.LLM(endpoint=f"http://localhost:{first_index}/v1", model=f"test-model-{first_index}")
        await self.store.add_resources({"llm": llm})

    async def _enqueue_batch(self, indices: range) -> list[str]:
        await self._add_resources(indices.start)
        t = time.perf_counter()
        requests = [self.mod.EnqueueRolloutRequest(input=task_name(i), mode="train") for i in indices]
        rollouts = await self.store.enqueue_many_rollouts(requests)
        for r, i in zip(rollouts, indices, strict=True):
            self.records[r.rollout_id] = Record(i, t)
        return [r.rollout_id for r in rollouts]

    async def _poll(self, ids: list[str]) -> list[str]:
        finished = await self.store.wait_for_rollouts(rollout_ids=ids, timeout=POLL_S)
        now = time.perf_counter()
        done: list[str] = []
        for r in finished:
            rec = self.records[r.rollout_id]
            if rec.done_s is None:
                rec.done_s = now
                done.append(r.rollout_id)
        for r in finished:
            if r.rollout_id in done:
                await self._verify(r)
        self._check_stall(bool(done), len(ids) - len(done))
        return done

    async def _verify(self, rollout: Any) -> None:
        rec = self.records[rollout.rollout_id]
        rec.status = rollout.status
        if rollout.end_time is not None:
            rec.store_latency_s = rollout.end_time - rollout.start_time
        if rollout.status != "succeeded":
            rec.error = f"{task_name(rec.index)}: rollout {rollout.rollout_id} finished {rollout.status}"
            return
        spans = list(await self.store.query_spans(rollout.rollout_id, attempt_id="latest"))
        rec.n_spans = len(spans)
        plan = self.plans[task_name(rec.index)]
        rec.error = check_rollout(spans, plan, self.mod.get_reward_value, self.mod.find_final_reward)

    def _check_stall(self, progress: bool, pending: int) -> None:
        now = time.perf_counter()
        if progress:
            self.last_progress_s = now
        elif pending and now - self.last_progress_s > STALL_S:
            raise StalledError(f"no rollout finished for {STALL_S:.0f} s ({pending} pending)")


def _runner_stats(stats_dir: Path) -> dict[str, Any]:
    claims: list[float] = []
    empty = files = 0
    calls: dict[str, list[float]] = {}
    for f in stats_dir.glob("stats-*.json"):
        data = json.loads(f.read_text())
        claims += data["claim_s"]
        empty += data["empty_polls"]
        files += 1
        for name, (n, total) in (data.get("store_calls") or {}).items():
            acc = calls.setdefault(name, [0, 0.0])
            acc[0] += n
            acc[1] += total
    return {
        "store_calls": {k: {"calls": n, "wall_s": round(t, 3)} for k, (n, t) in calls.items()},
        "runners_reporting": files,
        "claims": len(claims),
        "claim_p50_ms": _ms(percentile(claims, 50)),
        "claim_p99_ms": _ms(percentile(claims, 99)),
        "empty_polls": empty,
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 3)


def _summary(alg: Algorithm, wall_s: float, scn: Scenario, plans: dict[str, PlanCheck], seed: int) -> dict[str, Any]:
    recs = list(alg.records.values())
    done = [r for r in recs if r.done_s is not None]
    errors = [r.error for r in recs if r.error]
    spans = sum(r.n_spans for r in recs)
    lat = [r.done_s - r.enqueued_s for r in done if r.done_s is not None]
    store_lat = [r.store_latency_s for r in done if r.store_latency_s is not None]
    ordered = [plans[task_name(i)] for i in range(scn.total_tasks)]
    bound = agent_bound(scn, ordered)
    cpu_bound = None
    if bound == float("inf"):  # no sleeps: the agent's own CPU on these cores is the bound
        cpu_bound = agent_cpu_bound(agent_cpu_s_per_rollout(seed, scn), os.cpu_count() or 1)
        bound = cpu_bound
    barrier = batch_barrier_bound(scn, ordered)
    rps = len(done) / wall_s if wall_s > 0 else 0.0
    return {
        "rollouts": len(done),
        "rollouts_failed_checks": len(errors),
        "check_errors": errors[:MAX_ERRORS_KEPT],
        "spans": spans,
        "spans_expected": sum(p.n_spans for p in plans.values()),
        "wall_s": round(wall_s, 3),
        "rollouts_per_s": round(rps, 3),
        "spans_per_s": round(spans / wall_s, 1) if wall_s > 0 else 0.0,
        "latency_p50_ms": _ms(percentile(lat, 50)),
        "latency_p99_ms": _ms(percentile(lat, 99)),
        "store_latency_p50_ms": _ms(percentile(store_lat, 50)),
        "store_latency_p99_ms": _ms(percentile(store_lat, 99)),
        "agent_bound_rollouts_per_s": None if bound == float("inf") else round(bound, 3),
        "ratio_to_agent_bound": None if bound == float("inf") else round(rps / bound, 4),
        "agent_bound_with_barrier_rollouts_per_s": None if barrier is None else round(barrier, 3),
        "agent_bound_kind": "sleep" if cpu_bound is None else "cpu",
    }


async def run_scenario(mod: ModuleType, scn: Scenario, seed: int, timeout_s: float) -> dict[str, Any]:
    """Run one scenario on the stack ``mod``; never raises (failures are in the result)."""
    result: dict[str, Any] = {
        "stack": mod.NAME,
        "stack_version": mod.VERSION,
        "scenario": scn.to_dict(),
        "seed": seed,
        "ok": False,
        "error": None,
        "event_loop": mod.LOOP,
        "python": platform.python_version(),
        "poll_s": POLL_S,
        "runner_poll_s": RUNNER_POLL_S,
    }
    stack = mod.Stack()
    sampler = ProcessSampler(0.5).start()
    sampler.add("algorithm", os.getpid())
    stats_dir = Path(tempfile.mkdtemp(prefix="bench-runners-"))
    phase = "start servers"
    store = None
    try:
        t0 = time.perf_counter()
        await stack.start()
        for role, pid in stack.server_roles().items():
            sampler.add(role, pid)
        result["stack_detail"] = stack.describe()
        phase = "start runners"
        stack.start_runners(scn.n_runners, seed, scn.max_rounds, scn.sleep_s, stats_dir)
        for pid in stack.runner_pids():
            sampler.add("runners", pid)
        names = [f"ready-{i}" for i in range(scn.n_runners)]
        missing = await asyncio.to_thread(
            wait_files, stats_dir, names, READY_TIMEOUT_S, lambda: stack.runners_alive() == scn.n_runners
        )
        if missing:
            raise RuntimeError(f"{len(missing)} runner(s) not ready ({stack.runners_alive()} alive)")
        store = await stack.open_store()
        plans = {
            task_name(i): plan_task(seed, task_name(i), scn.max_rounds, scn.sleep_s).check()
            for i in range(scn.total_tasks)
        }
        result["startup_s"] = round(time.perf_counter() - t0, 2)
        phase = "run the algorithm"
        alg = Algorithm(mod, store, scn, plans)
        sampler.open_window()
        t_start = time.perf_counter()
        try:
            await asyncio.wait_for(alg.run(), timeout_s)
        except TimeoutError:
            result["error"] = f"timed out after {timeout_s:.0f} s"
        except StalledError as e:
            result["error"] = str(e)
        wall_s = time.perf_counter() - t_start
        resources = sampler.close_window()
        result.update(_summary(alg, wall_s, scn, plans, seed))
        result["resources"] = resources
        n = max(1, result["rollouts"])
        result["cpu_s_per_rollout"] = round(resources["cpu_s"]["total"] / n, 5)
        result["peak_rss_mb"] = round(resources["peak_rss_mb"].get("total", 0.0), 1)
        if result["error"] is None and result["rollouts_failed_checks"]:
            result["error"] = (
                f"{result['rollouts_failed_checks']} rollout(s) failed checks: {result['check_errors'][0]}"
            )
        result["ok"] = result["error"] is None and result["rollouts"] == scn.total_tasks
        if result["error"] is None and not result["ok"]:
            result["error"] = f"only {result['rollouts']} of {scn.total_tasks} rollouts finished"
    except Exception as e:
        result["error"] = f"{phase}: {type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
    finally:
        phase = "stop"
        try:
            if store is not None:
                await store.close()
            codes = await asyncio.to_thread(stack.stop_runners)
            result["runner_exit_codes"] = codes
            result["dequeue"] = _runner_stats(stats_dir)
        except Exception as e:
            result.setdefault("teardown_errors", []).append(f"runners: {type(e).__name__}: {e}")
        try:
            await stack.stop()
        except Exception as e:
            result.setdefault("teardown_errors", []).append(f"servers: {type(e).__name__}: {e}")
        sampler.stop()
        shutil.rmtree(stats_dir, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.driver", description=__doc__.splitlines()[0])
    parser.add_argument("--stack", required=True, choices=sorted(STACK_MODULES))
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="Limit of the measured part.")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    require_positive(parser, args, "scale", "timeout_s")
    mod = load_stack(args.stack)
    scn = SCENARIOS[args.scenario].scaled(args.scale)
    result = mod.run(run_scenario(mod, scn, args.seed, args.timeout_s))
    write_json(result, args.out)


if __name__ == "__main__":
    main()
