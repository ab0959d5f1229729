"""The algorithm killed between enqueue and wait (issue 12): kill -9, restart, nothing lost or doubled.

The algorithm runs alone in its process (``tests/fault_algorithm.py``: a store with the projector,
a fixed plan of rollouts); two runners work the queue in this process. The test kills the algorithm
with SIGKILL at seeded points — after a seeded number of acknowledged enqueues, or while it waits —
and starts it again; each start finds what it made by reading it back through the store and
enqueues only the rest. Afterwards: every acknowledged rollout is in the log once, no input was
enqueued twice, every rollout ended as its ``RolloutConfig`` says (retried ones succeeded on their
second attempt, the others failed or succeeded on their first), every succeeded attempt has all its
spans, none twice, and the read model equals a rebuild of the log. Prints its figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import fault_agents
import pytest
from fault_algorithm import RETRY, plan
from faults import KILLS, Ledger, check_log_and_read_model, seeded, stream_last_seq, wait_projected

import eventlight as agl
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore

pytestmark = pytest.mark.faults

N = 24
SCRIPT = Path(__file__).with_name("fault_algorithm.py")


class Algorithm:
    """One run of ``fault_algorithm.py``; ``lines`` collects what it printed."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.lines: list[list[str]] = []

    @classmethod
    async def start(cls, settings: Settings) -> Algorithm:
        env = {
            **os.environ,
            "EL_FAULT_NATS": settings.nats_url or "",
            "EL_FAULT_PG": settings.pg_dsn or "",
            "EL_FAULT_NS": settings.namespace,
            "EL_FAULT_N": str(N),
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT), env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        return cls(proc)

    async def until(self, word: str, count: int = 1, timeout_s: float = 60) -> bool:
        """Read lines until ``count`` lines start with ``word`` (``False`` if the process ended first)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while sum(line[0] == word for line in self.lines) < count:
            raw = await asyncio.wait_for(self.proc.stdout.readline(), max(0.1, deadline - time.monotonic()))
            if not raw:
                return False
            self.lines.append(raw.decode().strip().split(maxsplit=2))
        return True

    async def kill9(self) -> bool:
        """SIGKILL, then read what it printed before it died (acknowledged enqueues among it);
        ``False`` (nothing read) if it had already ended by itself."""
        assert self.proc.stdout is not None
        try:
            self.proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            return False
        out = await asyncio.wait_for(self.proc.stdout.read(), 10)
        self.lines += [line.split(maxsplit=2) for line in out.decode().splitlines()]
        await self.proc.wait()
        return True

    async def finish(self) -> tuple[int, str]:
        out, err = await asyncio.wait_for(self.proc.communicate(), 30)
        self.lines += [line.split(maxsplit=2) for line in out.decode().splitlines()]
        return self.proc.returncode or 0, err.decode(errors="replace")


async def _runner(ns: Settings, index: int, stop: asyncio.Event) -> int:
    async with JetStreamLightningStore(ns) as store:  # a runner's store: NATS only
        runner = agl.LitAgentRunner(agl.OtelTracer(), poll_interval=0.2, heartbeat_interval=1)
        with runner.run_context(agent=fault_agents.flaky, store=store, worker_id=index):
            return await runner.iter(event=stop)


def _expected(i: int) -> tuple[str, int]:
    """Rollout ``i``'s final status and number of attempts, by its plan and ``RolloutConfig``."""
    task, config = plan(i)
    if not task["fail_first"]:
        return "succeeded", 1
    return ("succeeded", 2) if config == RETRY else ("failed", 1)


async def test_algorithm_killed_between_enqueue_and_wait_loses_and_doubles_nothing(namespace: Settings) -> None:
    rng = seeded(21)
    ledger = Ledger()
    kills: list[str] = []
    found: list[tuple[int, int]] = []  # (found by the restarted algorithm, acknowledged before it)
    recover_s: list[float] = []
    stop = asyncio.Event()
    runners = [asyncio.create_task(_runner(namespace, i, stop)) for i in range(2)]
    t_start = time.monotonic()
    try:
        for k in range(KILLS + 1):
            t0 = time.monotonic()
            ended = False
            algo = await Algorithm.start(namespace)
            assert await algo.until("found"), "the algorithm did not start"
            if k:
                recover_s.append(time.monotonic() - t0)
            found.append((int(algo.lines[0][1]), len(ledger.rollouts)))
            if k == KILLS:  # the last run goes to the end
                code, err = await algo.finish()
            else:
                missing = N - found[-1][0]
                during_enqueue = missing > 1 and rng.random() < 0.6
                if during_enqueue:
                    reached = await algo.until("enqueued", rng.randint(1, missing - 1))
                else:
                    reached = await algo.until("waiting")
                    await asyncio.sleep(rng.uniform(0.05, 0.8))  # mid-wait: runners are working
                assert reached, "the algorithm ended before its kill"
                ended = not await algo.kill9()
                if ended:  # the runners finished its rollouts first: it ran to the end
                    code, err = await algo.finish()
                else:
                    kills.append("enqueue" if during_enqueue else "wait")
            for line in algo.lines:
                if line[0] == "enqueued":
                    ledger.rollouts[line[2]] = 0
            if ended:
                break
        assert code == 0, err
        done: dict[str, str] = json.loads(" ".join(algo.lines[-1][1:]))
    finally:
        stop.set()
        processed = await asyncio.wait_for(asyncio.gather(*runners, return_exceptions=True), 30)
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as reader:
        await wait_projected(namespace.pg_dsn, namespace.pg_schema, await stream_last_seq(reader))
        rollouts = {r.rollout_id: r for r in await reader.query_rollouts()}
        outcome: dict[str, tuple[str, int]] = {}
        for rid, r in rollouts.items():
            outcome[rid] = (r.status, len(await reader.query_attempts(rid)))
        ledger.finished = {rid for rid in ledger.rollouts if _expected(int(rollouts[rid].input["i"]))[0] == "succeeded"}
        verdict = await check_log_and_read_model(reader, namespace, ledger)
        async with reader.pool.acquire() as conn:
            per_attempt = Counter(
                int(n)
                for n in await conn.fetchval(
                    "SELECT array_agg(n) FROM (SELECT count(s.span_id) AS n FROM attempts a"
                    " LEFT JOIN spans s USING (attempt_id) WHERE a.status = 'succeeded' GROUP BY a.attempt_id) c"
                )
            )
        inputs = Counter(int(r.input["i"]) for r in rollouts.values())
    wrong = {rid: (got, _expected(int(rollouts[rid].input["i"]))) for rid, got in outcome.items()}
    wrong = {rid: v for rid, v in wrong.items() if v[0] != v[1]}
    doubled_inputs = sum(1 for n in inputs.values() if n > 1)
    not_found = sum(1 for got, acked in found if got < acked)
    print(
        f"\n[fault] algorithm kill -9 between enqueue and wait: runs={len(found)}, kills={len(kills)} "
        f"({dict(Counter(kills))}), events={verdict.events}, rollouts={len(rollouts)} "
        f"({dict(Counter(s for s, _ in outcome.values()))}), attempts={sum(n for _, n in outcome.values())}, "
        f"acknowledged={len(ledger.rollouts)}, found_on_restart={[f for f, _ in found]}, spans={verdict.spans}, "
        f"lost={verdict.lost}, doubled={verdict.doubled}, doubled_inputs={doubled_inputs}, stuck={verdict.stuck}, "
        f"not_as_configured={len(wrong)}, spans_per_succeeded_attempt={dict(per_attempt)}, "
        f"restart_max_s={max(recover_s, default=0):.1f}, processed={processed}, wall_s={time.monotonic() - t_start:.0f}"
    )
    assert kills and not_found == 0, (kills, found)
    assert sorted(inputs) == list(range(N)) and doubled_inputs == 0, inputs
    assert set(done) == set(rollouts) and set(ledger.rollouts) <= set(rollouts)
    assert (verdict.lost, verdict.doubled, verdict.stuck) == (0, 0, 0)
    assert not wrong, wrong
    assert len(per_attempt) == 1 and min(per_attempt) >= 3, per_attempt  # two objects and the reward, each once
