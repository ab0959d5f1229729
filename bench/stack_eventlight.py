"""The eventlight side of the benchmark: embedded NATS + Postgres, RunnerPool runners, uvloop.

Imported only by drivers started with ``--stack eventlight`` (eventlight's venv).

* Servers: ``prepare_services`` in a fresh temporary state dir (the embedded nats-server with
  ``sync_interval: always`` and Postgres), a fresh namespace, both stopped and deleted at the end.
* Algorithm: ``JetStreamLightningStore`` with Postgres, which runs the projector and the watchdog
  in the driver's process (as ``Trainer`` does).
* Runners: ``eventlight.trainer.RunnerPool`` (processes forked from a forkserver, one per core
  unless ``$BENCH_RUNNERS_PER_PROCESS`` says how many runners share one, each process a write-only
  store and its runners' ``LitAgentRunner(OtelTracer())``), with a ``LitAgentRunner`` subclass that
  only adds a ready file, dequeue timings and a stats file.

"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any

import eventlight as agl
from bench import bench_durability
from bench.workload import RUNNER_POLL_S, plan_task, run_plan
from eventlight.core.types import AttemptedRollout, Span, TraceStatus
from eventlight.ops import Services, drop_namespace, prepare_services, stop_services
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.trainer import RunnerPool

NAME = "eventlight"
VERSION = version("eventlight")
LOOP = "uvloop"
get_reward_value = agl.get_reward_value
find_final_reward = agl.find_final_reward
LLM = agl.LLM
EnqueueRolloutRequest = agl.EnqueueRolloutRequest


def run(coro: Any) -> Any:
    """Run the driver's coroutine on eventlight's loop (``Trainer.fit`` uses uvloop)."""
    import uvloop

    return uvloop.run(coro)


class BenchAgent(agl.LitAgent[str]):
    """Runs a task's plan (``bench.workload.run_plan``) with the process's OpenTelemetry tracer."""

    def __init__(self, seed: int, max_rounds: int, sleep_s: float):
        super().__init__()
        self.seed, self.max_rounds, self.sleep_s = seed, max_rounds, sleep_s

    async def rollout_async(self, task: str, resources: dict[str, Any], rollout: Any) -> None:
        from opentelemetry import trace

        plan = plan_task(self.seed, task, self.max_rounds, self.sleep_s)
        await run_plan(plan, trace.get_tracer("bench"), agl.emit_reward, asyncio.sleep)


class BenchRunner(agl.LitAgentRunner):
    """``LitAgentRunner`` plus a ready file, dequeue timings and a stats file at the end."""

    def __init__(self, stats_dir: str, **kwargs: Any):
        super().__init__(agl.OtelTracer(), **kwargs)
        self.stats_dir = stats_dir
        self.claim_s: list[float] = []
        self.empty_polls = 0
        self.call_s: dict[str, list[float]] = {}

    def init_worker(self, worker_id: int, store: Any, **kwargs: Any) -> None:
        super().init_worker(worker_id, store, **kwargs)
        # runners sharing a process share its store: the first one's wrappers time them all
        self.call_s = _time_store_calls(store) if not hasattr(store, "_bench_timed") else {}
        store._bench_timed = True
        (Path(self.stats_dir) / f"ready-{worker_id}").write_text(str(os.getpid()))

    async def _dequeue(self, store: Any) -> AttemptedRollout | None:
        called = time.time()
        claimed = await super()._dequeue(store)
        if claimed is None:
            self.empty_polls += 1
        else:
            self.claim_s.append(time.time() - max(called, claimed.start_time))
        return claimed

    async def iter(self, *, event: Any = None) -> int:
        if os.environ.get("BENCH_DEBUG_TASKS"):
            _install_task_dump()
        try:
            return await super().iter(event=event)
        finally:
            stats = {
                "claim_s": self.claim_s,
                "empty_polls": self.empty_polls,
                "pid": os.getpid(),
                "store_calls": {k: [len(v), sum(v)] for k, v in self.call_s.items()},
            }
            (Path(self.stats_dir) / f"stats-{self.worker_id}.json").write_text(json.dumps(stats))


TIMED_CALLS = (
    "dequeue_rollout",
    "get_resources_by_id",
    "get_latest_resources",
    "get_many_span_sequence_ids",
    "add_many_spans",
    "update_attempt",
    "update_worker",
)


def _time_store_calls(store: Any) -> dict[str, list[float]]:
    """Wrap the runner store's methods to record each call's wall time (a diagnostic: where a
    runner's time goes between its agent's sleeps)."""
    import functools

    calls: dict[str, list[float]] = {}
    for name in TIMED_CALLS:
        method = getattr(store, name)
        spent = calls.setdefault(name, []) if name != "dequeue_rollout" else []

        @functools.wraps(method)
        async def timed(
            *args: Any, _m: Any = method, _spent: list[float] = spent, _name: str = name, **kwargs: Any
        ) -> Any:
            t = time.perf_counter()
            result = None
            try:
                result = await _m(*args, **kwargs)
                return result
            finally:
                if _name == "dequeue_rollout":  # an empty long poll is idle time, not a store cost
                    key = "dequeue_rollout (claimed)" if result is not None else "dequeue_rollout (empty)"
                    calls.setdefault(key, []).append(time.perf_counter() - t)
                else:
                    _spent.append(time.perf_counter() - t)

        setattr(store, name, timed)
    return calls


def _install_task_dump() -> None:
    """Debugging aid: on SIGUSR1, print every asyncio task's stack to stderr."""
    import signal
    import sys

    def dump() -> None:
        for task in asyncio.all_tasks():
            sys.stderr.write(f"--- pid {os.getpid()} {task!r}\n")
            task.print_stack(file=sys.stderr)
        sys.stderr.flush()

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)


def make_span(rollout_id: str, attempt_id: str, sequence_id: int, attributes: dict[str, Any]) -> Span:
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        trace_id=f"{sequence_id:032x}",
        span_id=f"{sequence_id:016x}",
        parent_id=None,
        name=f"micro-span-{sequence_id}",
        status=TraceStatus(status_code="OK"),
        attributes=attributes,
        start_time=time.time(),
        end_time=time.time(),
    )


async def stream_subjects(store: JetStreamLightningStore, stream: str) -> int | None:
    """The stream's ``num_subjects`` (from the raw API answer: nats-py's ``StreamState`` drops it);
    ``None`` when there is no such stream."""
    answer = json.loads((await store._log().nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=10)).data)
    return None if "error" in answer else int(answer["state"].get("num_subjects", 0))


RUNNERS_PER_PROCESS_ENV = "BENCH_RUNNERS_PER_PROCESS"


def runners_per_process(n: int) -> int:
    """Runners per process (``RunnerPool(runners_per_process=...)``) for ``n`` runners:
    ``$BENCH_RUNNERS_PER_PROCESS``, else one process per core (``ceil(n / cores)``; 16 runners on 2
    cores: 8 to a process). ``BENCH_RUNNERS_PER_PROCESS=1`` gives each runner its own process, as
    the peer's runners have and ``Trainer`` does by default.

    Raises:
        ValueError: The variable is not a whole number >= 1.
    """
    raw = os.environ.get(RUNNERS_PER_PROCESS_ENV, "").strip()
    if not raw:
        return -(-n // (os.cpu_count() or 1))
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"${RUNNERS_PER_PROCESS_ENV}={raw!r}: expected a whole number >= 1")
    return min(n, int(raw))


class Stack:
    """eventlight's servers, stores and runner processes for one scenario."""

    def __init__(self) -> None:
        self.state_dir: Path | None = None
        self.settings: Settings | None = None
        self.services: Services | None = None
        self.pool: RunnerPool | None = None
        self.settings_overrides: dict[str, Any] = {}

    async def start(self) -> None:
        self.state_dir = Path(tempfile.mkdtemp(prefix="elbench-", dir=tempfile.gettempdir()))
        os.chmod(self.state_dir, 0o755)  # Postgres runs as `postgres` when we are root
        ns = f"b{uuid.uuid4().hex[:10]}"
        self.settings = Settings(
            state_dir=self.state_dir,
            namespace=ns,
            log_level="WARNING",
            durability=bench_durability(),  # type: ignore[arg-type]
            **self.settings_overrides,
        )
        self.services = await prepare_services(self.settings)

    def server_roles(self) -> dict[str, int]:
        """The servers' root pids by role (their children are sampled with them)."""
        assert self.services is not None
        roles = {"nats": self.services.nats_pid, "postgres": self.services.pg_pid}
        return {k: v for k, v in roles.items() if v is not None}

    def describe(self) -> dict[str, Any]:
        assert self.services is not None
        return {
            "pg_kind": self.services.pg_kind,
            "nats": f"embedded, durability {self.settings.durability if self.settings else 'fsync'}",
            "runners_per_process": os.environ.get(RUNNERS_PER_PROCESS_ENV) or "one process per core",
        }

    async def open_store(self) -> JetStreamLightningStore:
        """The algorithm's store: Postgres reads, projector and watchdog in this process."""
        assert self.settings is not None and self.services is not None
        store = JetStreamLightningStore(self.settings, nats_url=self.services.nats_url, pg_dsn=self.services.pg_dsn)
        return await store.start()

    async def open_runner_store(self) -> JetStreamLightningStore:
        """What a runner process opens: write-only, no Postgres."""
        assert self.settings is not None and self.services is not None
        return await JetStreamLightningStore(self.settings, nats_url=self.services.nats_url).start()

    async def round_trips(self, sampler: Any, concurrency: int, seconds: float) -> dict[str, Any]:
        """The raw server round trips on this stack's servers (``bench.ceiling.round_trips``)."""
        from bench.ceiling import round_trips

        assert self.services is not None
        return await round_trips(self.services.nats_url, self.services.pg_dsn, sampler, concurrency, seconds)

    async def own_stream_raw(self, concurrency: int) -> Any:
        """Raw twins of the micro operations on this stack's own stream and schema
        (``bench.raw_twins.OwnStreamRaw``, connected; the caller closes it)."""
        from bench.raw_twins import OwnStreamRaw

        assert self.settings is not None and self.services is not None
        return await OwnStreamRaw.open(self.services.nats_url, self.services.pg_dsn, self.settings, concurrency)

    async def sync(self, store: JetStreamLightningStore) -> None:
        """Wait until the projection has caught up with the whole stream."""
        await store.sync_all(timeout_s=300.0)

    def start_runners(self, n: int, seed: int, max_rounds: int, sleep_s: float, stats_dir: Path) -> None:
        assert self.settings is not None and self.services is not None
        runner = BenchRunner(str(stats_dir), poll_interval=RUNNER_POLL_S)
        self.pool = RunnerPool(
            BenchAgent(seed, max_rounds, sleep_s),
            n,
            self.settings,
            self.services.nats_url,
            runner=runner,
            runners_per_process=runners_per_process(n),
        )
        self.pool.start()

    def runner_pids(self) -> list[int]:
        return [p.pid for p in self.pool.procs if p.pid is not None] if self.pool else []

    def runners_alive(self) -> int:
        return self.pool.runners_alive() if self.pool else 0

    def stop_runners(self, graceful_s: float = 10.0) -> list[int | None]:
        """``RunnerPool.stop``: stop event, then SIGTERM, then SIGKILL, one deadline for all processes,
        and no restart from the call on (setting the stop event alone let the supervisor restart
        the processes that exited on it)."""
        return self.pool.stop(graceful_s) if self.pool is not None else []

    async def stop(self) -> None:
        try:
            if self.settings is not None and self.services is not None:
                try:
                    await drop_namespace(self.services.nats_url, self.services.pg_dsn, self.settings)
                finally:
                    await stop_services(self.settings)
        finally:
            if self.state_dir is not None:  # also when dropping the namespace failed
                shutil.rmtree(self.state_dir, ignore_errors=True)
