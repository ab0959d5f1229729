"""CPU of one runner process per rollout, without sleeps (``python -m bench.runner_cpu``).

Starts the embedded servers once (``bench.stack_eventlight.Stack``), then for each repeat enqueues
``--rollouts`` rollouts and runs one spawned runner process (``LitAgentRunner(OtelTracer())`` on a
write-only ``JetStreamLightningStore``, uvloop, as ``RunnerPool`` runs it) until it has processed
them all. The runner measures its own process CPU (``resource.getrusage``) from its first dequeue
to its last finish, and its NATS messages (nats-py's client counters), and the median over the
repeats is printed with the load average.

Agents (``--agent``):
    * ``nothing``: returns ``None`` at once: no span, so no span message (what an attempt's spans
      cost the runner, beside ``reward``);
    * ``reward``: returns ``1.0`` at once: one reward span per rollout, the store path alone;
    * ``workload``: ``bench.workload``'s plan with ``sleep_s = 0`` (``batch_nosleep``'s rounds and
      random attributes): the agent's own spans and attributes too.

``--profile FILE`` writes the runner's ``cProfile`` stats of the last repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import eventlight as agl
from bench import require_positive
from bench.stack_eventlight import BenchAgent, Stack
from bench.workload import SCENARIOS, task_name
from eventlight.settings import Settings


class NothingAgent(agl.LitAgent[str]):
    """Does nothing (no span)."""

    async def rollout_async(self, task: str, resources: dict[str, Any], rollout: Any) -> None:
        return None


class RewardAgent(agl.LitAgent[str]):
    """Does nothing and returns a reward (one span)."""

    async def rollout_async(self, task: str, resources: dict[str, Any], rollout: Any) -> float:
        return 1.0


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class _MeasuredRunner(agl.LitAgentRunner):
    """Counts CPU and NATS messages from the first claim to the last finish."""

    def __init__(self, n: int):
        super().__init__(agl.OtelTracer(), max_rollouts=n, poll_interval=0.1)
        self.first: tuple[float, int, int] | None = None

    async def _step_impl(self, rollout: Any, raise_on_exception: bool = False) -> str:
        if self.first is None:
            self.first = self._counters()
        return await super()._step_impl(rollout, raise_on_exception)

    def _counters(self) -> tuple[float, int, int]:
        stats = self.get_store().nc.stats  # type: ignore[attr-defined]
        return _cpu_s(), int(stats["out_msgs"]), int(stats["in_msgs"])


async def _serve(agent: agl.LitAgent[Any], settings: Settings, nats_url: str, n: int, prof: str) -> dict[str, Any]:
    from eventlight.store.jetstream import JetStreamLightningStore

    store = await JetStreamLightningStore(settings, nats_url=nats_url).start()
    runner = _MeasuredRunner(n)
    profiler = None
    if prof:
        import cProfile

        profiler = cProfile.Profile(time.process_time)  # CPU, not wall time: the machine is shared
        profiler.enable()
    try:
        with runner.run_context(agent=agent, store=store):
            done = await runner.iter()
            last = runner._counters()
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(prof)
        await store.close()
    first = runner.first or last
    # the first rollout's claim is outside the window: n - 1 full rollouts inside it
    k = max(1, done - 1)
    return {
        "rollouts": done,
        "cpu_ms_per_rollout": round((last[0] - first[0]) * 1000 / k, 3),
        "msgs_out_per_rollout": round((last[1] - first[1]) / k, 2),
        "msgs_in_per_rollout": round((last[2] - first[2]) / k, 2),
    }


def _child(agent: agl.LitAgent[Any], settings: Settings, nats_url: str, n: int, out: str, prof: str) -> None:
    import logging

    import uvloop

    logging.basicConfig(level=logging.WARNING)
    result = uvloop.run(_serve(agent, settings, nats_url, n, prof))
    Path(out).write_text(json.dumps(result))


def _agent(kind: str, seed: int) -> agl.LitAgent[Any]:
    if kind == "nothing":
        return NothingAgent()
    if kind == "reward":
        return RewardAgent()
    scn = SCENARIOS["batch_nosleep"]
    return BenchAgent(seed, scn.max_rounds, 0.0)


def _run_runner(agent: agl.LitAgent[Any], settings: Settings, nats_url: str, n: int, prof: str) -> dict[str, Any]:
    """One runner process over ``n`` rollouts; its measurements."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        args = (agent, settings, nats_url, n, out, prof)
        proc = multiprocessing.get_context("spawn").Process(target=_child, args=args)
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"runner process exited {proc.exitcode}")
        result: dict[str, Any] = json.loads(Path(out).read_text())
    return result


async def _repeat(stack: Stack, store: Any, agent: agl.LitAgent[Any], n: int, offset: int, prof: str) -> dict[str, Any]:
    requests = [agl.EnqueueRolloutRequest(input=task_name(offset + i), mode="train") for i in range(n)]
    rollouts = await store.enqueue_many_rollouts(requests)
    ids = [r.rollout_id for r in rollouts]
    assert stack.settings is not None and stack.services is not None
    result = await asyncio.to_thread(_run_runner, agent, stack.settings, stack.services.nats_url, n, prof)
    finished = await store.wait_for_rollouts(rollout_ids=ids, timeout=60)
    result["succeeded"] = sum(1 for r in finished if r.status == "succeeded")
    return result


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack()
    await stack.start()
    try:
        store = await stack.open_store()
        try:
            await store.add_resources({"llm": agl.LLM(endpoint="http://127.0.0.1:1/v1", model="bench")})
            agent = _agent(args.agent, args.seed)
            runs = []
            for r in range(args.repeats):
                prof = args.profile if args.profile and r == args.repeats - 1 else ""
                runs.append(await _repeat(stack, store, agent, args.rollouts, r * args.rollouts, prof))
                print(json.dumps(runs[-1]), file=sys.stderr)
        finally:
            await store.close()
    finally:
        await stack.stop()
    return {
        "agent": args.agent,
        "rollouts": args.rollouts,
        "repeats": runs,
        "median_cpu_ms_per_rollout": statistics.median(r["cpu_ms_per_rollout"] for r in runs),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.runner_cpu", description=__doc__.splitlines()[0])
    parser.add_argument("--agent", choices=("nothing", "reward", "workload"), default="reward")
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", default="", help="Write the last repeat's cProfile stats here.")
    args = parser.parse_args(argv)
    require_positive(parser, args, "rollouts", "repeats")
    load_before = [round(x, 2) for x in os.getloadavg()]
    result = asyncio.run(_main(args))
    result["load_average_before"] = load_before
    print(json.dumps(result))


if __name__ == "__main__":
    main()
