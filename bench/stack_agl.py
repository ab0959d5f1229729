"""The Agent-lightning 0.3.0 side of the benchmark (the peer), run from ``bench/.peer-venv``.

Imported only by drivers started with ``--stack agentlightning``.

* Server: ``agl store --host 127.0.0.1 --port <free> --backend memory --log-level WARNING``, a fresh
  one per scenario.
* Algorithm: ``agentlightning.LightningStoreClient``.
* Runners: forked processes (Agent-lightning's ``ClientServerExecutionStrategy`` forks its runners
  with the default multiprocessing context), each a ``LightningStoreClient`` and
  ``LitAgentRunner(OtelTracer(), poll_interval=RUNNER_POLL_S)``; spans go to the store through the
  tracer's OTLP exporter, as in any Agent-lightning runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import agentlightning as agl  # noqa: E402
from agentlightning.types import OtelResource, SpanContext, TraceStatus  # noqa: E402

from bench.workload import RUNNER_POLL_S, plan_task, run_plan  # noqa: E402

NAME = "agentlightning"
VERSION = version("agentlightning")
LOOP = "asyncio"
get_reward_value = agl.get_reward_value
find_final_reward = agl.find_final_reward
LLM = agl.LLM
EnqueueRolloutRequest = agl.EnqueueRolloutRequest
SERVER_READY_S = 180.0


def run(coro: Any) -> Any:
    return asyncio.run(coro)


class BenchAgent(agl.LitAgent[str]):
    """Runs a task's plan (``bench.workload.run_plan``) with the process's OpenTelemetry tracer."""

    def __init__(self, seed: int, max_rounds: int, sleep_s: float):
        super().__init__()
        self.seed, self.max_rounds, self.sleep_s = seed, max_rounds, sleep_s

    async def rollout_async(self, task: str, resources: Any, rollout: Any) -> None:
        from opentelemetry import trace

        plan = plan_task(self.seed, task, self.max_rounds, self.sleep_s)
        await run_plan(plan, trace.get_tracer("bench"), agl.emit_reward, asyncio.sleep)


def _runner_main(url: str, index: int, seed: int, max_rounds: int, sleep_s: float, stats_dir: str) -> None:
    """Entry point of a forked runner process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Forked from inside the driver's running loop: Python 3.11 does not reset asyncio's state in a
    # forked child, so forget the parent's loop before starting this process's own.
    asyncio.events._set_running_loop(None)
    asyncio.set_event_loop_policy(None)
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    claim_s: list[float] = []
    empty = [0]

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        store = agl.LightningStoreClient(url)
        dequeue = store.dequeue_rollout

        async def timed_dequeue(*args: Any, **kwargs: Any) -> Any:
            called = time.time()
            claimed = await dequeue(*args, **kwargs)
            if claimed is None:
                empty[0] += 1
            else:
                claim_s.append(time.time() - max(called, claimed.start_time))
            return claimed

        store.dequeue_rollout = timed_dequeue  # type: ignore[method-assign]
        runner = agl.LitAgentRunner(agl.OtelTracer(), poll_interval=RUNNER_POLL_S, interval_jitter=RUNNER_POLL_S / 2)
        try:
            with runner.run_context(agent=BenchAgent(seed, max_rounds, sleep_s), store=store, worker_id=index):
                (Path(stats_dir) / f"ready-{index}").write_text(str(os.getpid()))
                await runner.iter(event=stop)
        finally:
            stats = {"claim_s": claim_s, "empty_polls": empty[0], "pid": os.getpid()}
            (Path(stats_dir) / f"stats-{index}.json").write_text(json.dumps(stats))
            with contextlib.suppress(Exception):
                await store.close()

    asyncio.run(main())


def make_span(rollout_id: str, attempt_id: str, sequence_id: int, attributes: dict[str, Any]) -> Any:
    trace_hex, span_hex = f"{sequence_id:032x}", f"{sequence_id:016x}"
    return agl.Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        trace_id=trace_hex,
        span_id=span_hex,
        parent_id=None,
        name=f"micro-span-{sequence_id}",
        status=TraceStatus(status_code="OK"),
        attributes=attributes,
        events=[],
        links=[],
        start_time=time.time(),
        end_time=time.time(),
        context=SpanContext(trace_id=trace_hex, span_id=span_hex, is_remote=False, trace_state={}),
        parent=None,
        resource=OtelResource(attributes={}, schema_url=""),
    )


def _spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stack:
    """Agent-lightning's store server, clients and runner processes for one scenario."""

    def __init__(self) -> None:
        self.server: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.procs: list[Any] = []
        self.log_path: Path | None = None

    async def start(self) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        agl_bin = Path(sys.executable).with_name("agl")
        argv = [str(agl_bin), "store", "--host", "127.0.0.1", "--port", str(port), "--backend", "memory"]
        argv += ["--log-level", "WARNING"]
        self.log_path = Path(os.environ.get("BENCH_TMP", tempfile.gettempdir())) / f"agl-store-{port}.log"
        self.server = await asyncio.to_thread(_spawn, argv, self.log_path)
        await self._wait_ready()

    async def _wait_ready(self) -> None:
        assert self.server is not None
        deadline = time.monotonic() + SERVER_READY_S
        client = agl.LightningStoreClient(self.url, retry_delays=(), health_retry_delays=())
        try:
            while True:
                if self.server.poll() is not None:
                    raise RuntimeError(f"agl store exited with {self.server.returncode}: {self._log_tail()}")
                try:
                    await client.query_resources()
                    return
                except Exception as e:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"agl store not ready in {SERVER_READY_S:.0f} s: {e}") from e
                await asyncio.sleep(0.5)
        finally:
            with contextlib.suppress(Exception):
                await client.close()

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:] if self.log_path else ""
        except OSError:
            return ""

    def server_roles(self) -> dict[str, int]:
        """The server's root pid by role."""
        return {"store": self.server.pid} if self.server else {}

    def describe(self) -> dict[str, Any]:
        import opentelemetry.sdk.version as otel

        return {"server": "agl store --backend memory", "opentelemetry_sdk": otel.__version__}

    async def open_store(self) -> Any:
        return agl.LightningStoreClient(self.url)

    async def open_runner_store(self) -> Any:
        return agl.LightningStoreClient(self.url)

    async def sync(self, store: Any) -> None:
        return None

    def start_runners(self, n: int, seed: int, max_rounds: int, sleep_s: float, stats_dir: Path) -> None:
        ctx = mp.get_context("fork")
        for i in range(n):
            p = ctx.Process(
                target=_runner_main,
                name=f"agl-runner-{i}",
                args=(self.url, i, seed, max_rounds, sleep_s, str(stats_dir)),
                daemon=True,
            )
            p.start()
            self.procs.append(p)

    def runner_pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def runners_alive(self) -> int:
        return sum(p.is_alive() for p in self.procs)

    def stop_runners(self) -> list[int | None]:
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)
        for p in self.procs:
            p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=3)
        return [p.exitcode for p in self.procs]

    async def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(timeout=5)
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()
