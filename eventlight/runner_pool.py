"""Runner processes: ``RunnerPool`` starts, restarts and stops them; ``serve`` is one process's loop.

A runner process (``_runner_main``) runs one runner, or several as asyncio tasks on one store
(``RunnerPool(runners_per_process=K)``, ``serve_many``). It is forked from a ``forkserver`` that imported the runner's
modules once (``FORKSERVER_PRELOAD``), so the processes share those pages instead of each
importing them again (``spawn`` where there is no forkserver). It takes the environment of the
pool's process at ``start`` (as a spawned process would), not the forkserver's. It:

* opens a write-only ``JetStreamLightningStore`` and runs each runner's ``LitAgentRunner.iter`` on it. When the
  NATS connection closes for good (nats-py gives up after ``max_reconnect_attempts``, about 10 s of
  outage), it closes that store and opens a new one, retrying every ``Backoff`` delay (0.1 s
  doubling to 5 s) until the server answers, then goes on consuming. An explicit loop rather than
  nats-py's ``max_reconnect_attempts=-1``: the store's connection settings stay what the projector,
  the CLI and the algorithm's store use, and a connection closed for any other reason (a server in
  lame-duck mode, a slow-consumer disconnect) is recovered the same way. The attempt in flight when
  the connection closes is cancelled and recorded ``failed`` (``NATS_LOST_REASON``) once a store
  answers again (its spans from the outage are lost either way);
* on SIGTERM stops claiming and gives the attempts in flight the pool's ``graceful_s``, then (or on
  a second SIGTERM, or at once when the pool sends it after its own grace) cancels them, which the
  runner records ``failed`` with ``SIGTERM_REASON`` (the rollout is then requeued or failed by its
  ``RolloutConfig``: under the default one it fails, so nothing stays ``running``), and exits 0.
  So a SIGTERM sent to the whole process group (``kill -TERM -- -PGID``, systemd, ``timeout``)
  gives the same grace as one the pool relays; the forkserver ignores SIGTERM (it exits with the
  pool's process), else the pool would read every runner process as exited (code 255). A SIGTERM
  after the cancel kills at once. SIGINT is ignored: the parent coordinates shutdown (peer failure C06);
* stops at once when the pool's process dies (it checks every ``PARENT_CHECK_S`` that this pid
  still runs and is not a zombie; the process's OS parent is the forkserver; ``PARENT_GONE_REASON``),
  so a kill -9 of ``eventlight runner`` or of a trainer leaves no orphan working, and exits hard
  when that stop takes longer than ``GRACEFUL_STOP_S`` (a synchronous agent blocks the event loop).
  Not ``PR_SET_PDEATHSIG``: Linux ties it to the parent *thread*, and the parent is the forkserver;
* writes the attempts its runners claim on the pool's ``ClaimBoard`` (shared memory), each before
  the store appends its claim (``dequeue_rollout(on_claim=)``), and wipes each once its status is
  recorded (or at once, a claim that was not made).

``RunnerPool.stop`` sets the processes' stop event (each finishes its attempt in flight, if it can
within ``graceful_s``), then sends SIGTERM (the attempts still running are recorded ``failed``), then
SIGKILL. Until then the pool restarts a process that exits: after ``restart_delay_s`` (1 s, doubling
to ``RESTART_MAX_S`` while a slot's processes keep dying within ``RESTART_STABLE_S`` of their start),
each restart one warning line. A process of a runner with ``max_rollouts`` that exits 0 has done
its share and is not restarted; ``finished()`` tells when all have.

A process that exits holding attempts on the claim board (``kill -9``, the OOM killer, a crash, a
process killed after ignoring SIGTERM) cannot record them; the pool does, before it restarts the
process: ``failed``, with ``eventlight.status_reason`` "runner process <pid> exited with code -9
(SIGKILL) while the attempt ran" (the store's ``abandon_attempt``; an attempt that finished is
left alone), so the rollout's ``RolloutConfig`` retries or fails it and the algorithm's wait ends.
The restarted process claims under a new worker id (its pid and tag). An attempt whose claim the
store recorded in the instant before the process died, before the claim reached the runner, is
covered too: its entry was written before the append (an entry for a claim never appended is
passed over). Not covered: a claim the process published as it was killed that the server stores
only after the pool has looked for it (the pool looks once the process is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Coroutine, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

from eventlight import instrumentation
from eventlight.agent import LitAgent
from eventlight.core.errors import ServiceUnavailableError
from eventlight.runner import Backoff, Hook, LitAgentRunner
from eventlight.runner.claims import ClaimBoard, abandon_attempts
from eventlight.runner.metrics import RunnerMetrics
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.tracer import OtelTracer

log = logging.getLogger(__name__)

GRACEFUL_STOP_S = 10.0  # what a stop leaves attempts in flight to finish before SIGTERM fails them
KILL_AFTER_S = 3.0  # SIGTERM to SIGKILL
PARENT_CHECK_S = 0.5
FORKSERVER_PRELOAD = ["eventlight.runner_pool", "uvloop"]
"""Imported once by the forkserver, before it forks runner processes (what every runner imports)."""
CONNECTION_CHECK_S = 0.5
SUPERVISE_S = 0.5
RESTART_MIN_S = 1.0
RESTART_MAX_S = 60.0
RESTART_STABLE_S = 60.0  # a process that lived this long resets its slot's restart delay
SIGTERM_REASON = "the runner stopped (SIGTERM) while the attempt ran"
"""The ``eventlight.status_reason`` of an attempt a runner process records failed on SIGTERM."""
PARENT_GONE_REASON = "the runner's pool process died while the attempt ran"
NATS_LOST_REASON = "the runner's NATS connection closed for good while the attempt ran"
_PARENT_GONE = threading.Event()  # set in a runner process by _watch_parent


def _in_forkserver() -> bool:
    """Whether this module is being imported by ``multiprocessing``'s forkserver (its preload)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


if _in_forkserver():
    # A SIGTERM to the whole process group must not kill the forkserver: the pool would read every
    # runner process as exited (code 255) while they still run. It exits with the pool's process.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def restart_delay_s(quick_deaths: int) -> float:
    """Seconds before restarting a slot whose processes died ``quick_deaths`` times in a row, each
    within ``RESTART_STABLE_S`` of its start: 1 s, 2 s, 4 s, ... up to ``RESTART_MAX_S``."""
    return float(min(RESTART_MAX_S, RESTART_MIN_S * 2.0 ** max(0, quick_deaths - 1)))


# -- one runner process ------------------------------------------------------------------------


def _runner_main(
    agent: LitAgent[Any],
    runner: LitAgentRunner,
    hooks: Sequence[Hook],
    settings: Settings,
    nats_url: str,
    worker_indexes: Sequence[int],
    stop: Any,
    log_level: str,
    parent_pid: int,
    metrics_port: int | None = None,
    environ: dict[str, str] | None = None,
    slot: int = 0,
    claims: ClaimBoard | None = None,
    cancel_now: Any = None,
    grace_s: float = GRACEFUL_STOP_S,
) -> None:
    """Entry point of a runner process: the runners ``worker_indexes`` on one store (``/metrics``
    on ``metrics_port + slot`` when given; ``environ``: the pool process's environment, which
    replaces the forkserver's; ``claims``: the pool's claim board; ``cancel_now`` and ``grace_s``:
    as for ``serve_many``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent coordinates shutdown (peer failure C06)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the forkserver ignores it; a runner must not
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [runner-%(process)d] %(name)s: %(message)s")
    _watch_parent(parent_pid)
    if metrics_port is not None and runner.metrics is not None:
        runner.metrics.serve(metrics_port + slot)
        log.info("runner process %d: metrics on http://127.0.0.1:%d/metrics", slot, metrics_port + slot)
    slots = runner_copies(agent, runner, worker_indexes)
    for _, _, r in slots:
        r.claims = claims
    with contextlib.suppress(asyncio.CancelledError):  # SIGTERM: the attempts in flight are recorded failed
        _run(serve_many(slots, hooks, settings, nats_url, stop, grace_s=grace_s, cancel_now=cancel_now))


def runner_copies(
    agent: LitAgent[Any], runner: LitAgentRunner, worker_indexes: Sequence[int]
) -> list[tuple[int, LitAgent[Any], LitAgentRunner]]:
    """One ``(worker index, agent, runner)`` per index, for runners that share a process.

    One index: ``agent`` and ``runner`` themselves. Several: each runner gets its own copy of both
    (``copy.deepcopy``, as a process of its own would get by pickling; a ``@rollout`` function's
    agent is pickled by name, so its runners share the module's stateless object), sharing the one
    ``RunnerMetrics``; only the first runner's tracer instruments frameworks (instrumentation is
    process-wide, and every tracer's span processor routes a span to the attempt of the context it
    ended in), and a synchronous agent runs in a thread (``asyncio.to_thread``) so that it blocks
    neither the other runners nor the heartbeats.
    """
    if len(worker_indexes) == 1:
        return [(worker_indexes[0], agent, runner)]
    slots = []
    for j, index in enumerate(worker_indexes):
        memo: dict[int, Any] = {} if runner.metrics is None else {id(runner.metrics): runner.metrics}
        r = copy.deepcopy(runner, memo)
        if j > 0 and isinstance(r.tracer, OtelTracer):
            r.tracer.instrumented = instrumentation.Instrumented(())
        r.sync_agent_in_thread = True
        slots.append((index, copy.deepcopy(agent), r))
    return slots


def _run(coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        asyncio.run(coro)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it died and waits for its own parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): signal 0 tells whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _watch_parent(parent_pid: int) -> None:
    """Stop this process (SIGTERM to itself, then a hard exit) once the pool's process
    ``parent_pid`` has died."""

    def watch() -> None:
        while _alive(parent_pid):
            time.sleep(PARENT_CHECK_S)
        log.warning("runner process %d: parent %d is gone; stopping", os.getpid(), parent_pid)
        _PARENT_GONE.set()  # no grace: nobody supervises this process any more
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(GRACEFUL_STOP_S)
        os._exit(1)

    threading.Thread(target=watch, name="eventlight-parent-watch", daemon=True).start()


async def serve(
    agent: LitAgent[Any],
    runner: LitAgentRunner,
    hooks: Sequence[Hook],
    settings: Settings,
    nats_url: str,
    worker_index: int,
    stop: Any,
) -> None:
    """Run ``runner`` on the namespace's queue until ``stop`` is set (or ``max_rollouts``), opening
    a new store whenever the NATS connection closes for good (``serve_many`` with one runner).

    SIGTERM stops it as ``serve_many`` says.

    Args:
        stop: Anything with ``is_set()`` (a ``multiprocessing`` or ``threading`` event).
    """
    await serve_many([(worker_index, agent, runner)], hooks, settings, nats_url, stop)


async def serve_many(
    slots: Sequence[tuple[int, LitAgent[Any], LitAgentRunner]],
    hooks: Sequence[Hook],
    settings: Settings,
    nats_url: str,
    stop: Any,
    *,
    grace_s: float = GRACEFUL_STOP_S,
    cancel_now: Any = None,
) -> None:
    """Run each ``(worker index, agent, runner)`` of ``slots`` as a task on one store (one NATS
    connection, so their commands share atomic batches) until ``stop`` is set or every runner has
    done its ``max_rollouts``; a new store whenever the NATS connection closes for good.

    A runner that raises cancels the others (their attempts are recorded ``failed``) and the
    exception propagates: the process exits and its pool restarts it.

    SIGTERM stops them as the stop event does (no new claims) and gives the attempts in flight
    ``grace_s`` seconds to finish; then, or on a second SIGTERM, they are cancelled, recorded
    ``failed`` (``SIGTERM_REASON``) and ``CancelledError`` raised. So a SIGTERM sent to the whole
    process group (``kill -TERM -- -PGID``, systemd, ``timeout``) gives the grace that the pool's
    own stop gives. A SIGTERM when ``cancel_now`` is set (the pool's, after its grace) or after the
    pool's process died cancels at once.

    Args:
        stop: Anything with ``is_set()`` (a ``multiprocessing`` or ``threading`` event).
        grace_s: Seconds a SIGTERM leaves the attempts in flight.
        cancel_now: Anything with ``is_set()``, or ``None``.
    """
    stop = _Shutdown(stop, [r for _, _, r in slots], grace_s, cancel_now)
    stop.on_sigterm()
    backoff = Backoff()
    first = slots[0][0]
    done: set[int] = set()  # runners that did their max_rollouts
    while not stop.is_set():
        try:
            store = await JetStreamLightningStore(settings, nats_url=nats_url).start()
        except ServiceUnavailableError as e:
            delay = backoff.next()
            log.warning("runner %d: no store yet, retrying in %.1f s: %s", first, delay, e)
            await asyncio.sleep(delay)
            continue
        backoff.reset()
        try:
            with contextlib.ExitStack() as contexts:
                for index, agent, runner in slots:
                    if index not in done:
                        contexts.enter_context(
                            runner.run_context(agent=agent, store=store, hooks=hooks, worker_id=index)
                        )
                work = _all_runners([(i, r) for i, _, r in slots if i not in done], stop, done)
                if await _unless_disconnected(store, work, [r for _, _, r in slots]):
                    return
        finally:
            await store.close()
        log.warning("[%s] the NATS connection closed for good; reconnecting", slots[0][2].get_worker_id())


async def _all_runners(runners: Sequence[tuple[int, LitAgentRunner]], stop: Any, done: set[int]) -> None:
    """``iter`` of every runner, each in a task; the first to raise cancels the rest (``TaskGroup``).
    ``done`` collects the indexes of the runners whose ``iter`` returned."""

    async def one(index: int, runner: LitAgentRunner) -> None:
        await runner.iter(event=stop)
        done.add(index)

    if len(runners) == 1:
        await one(*runners[0])
        return
    async with asyncio.TaskGroup() as group:
        for index, runner in runners:
            group.create_task(one(index, runner), name=f"eventlight-runner-{index}")


class _Shutdown:
    """A runner process's stop event: the pool's ``stop``, or a SIGTERM of its own (``serve_many``)."""

    def __init__(self, stop: Any, runners: Sequence[LitAgentRunner], grace_s: float, cancel_now: Any) -> None:
        self.stop = stop
        self.runners = runners
        self.grace_s = grace_s
        self.cancel_now = cancel_now
        self.sigterm = False  # a SIGTERM came: no new claims
        self.cancelled = False

    def is_set(self) -> bool:
        return self.sigterm or self.stop.is_set()

    def on_sigterm(self) -> None:
        """Handle SIGTERM from now on, in the running task."""
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        assert main is not None
        pid = os.getpid()

        def cancel(reason: str) -> None:
            if self.cancelled:
                return
            self.cancelled = True
            log.info("runner process %d: recording the attempts in flight as failed: %s", pid, reason)
            loop.remove_signal_handler(signal.SIGTERM)  # another one kills at once
            for runner in self.runners:
                runner.cancel_reason = reason
            main.cancel()

        def sigterm() -> None:
            if _PARENT_GONE.is_set():
                cancel(PARENT_GONE_REASON)
            elif self.sigterm or (self.cancel_now is not None and self.cancel_now.is_set()):
                cancel(SIGTERM_REASON)
            else:
                self.sigterm = True
                log.info(
                    "runner process %d: SIGTERM; attempts in flight get %.0f s to finish (SIGTERM again: at once)",
                    pid, self.grace_s,
                )  # fmt: skip
                loop.call_later(self.grace_s, cancel, SIGTERM_REASON)

        loop.add_signal_handler(signal.SIGTERM, sigterm)


async def _unless_disconnected(
    store: JetStreamLightningStore, work: Coroutine[Any, Any, Any], runners: Sequence[LitAgentRunner]
) -> bool:
    """Await ``work``; return ``True`` when it ends, ``False`` (after cancelling it) when the store's
    NATS connection closes for good first (the ``runners``' attempts then fail with ``NATS_LOST_REASON``)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=CONNECTION_CHECK_S)
            if not task.done() and store.nc is not None and store.nc.is_closed:
                for runner in runners:
                    runner.cancel_reason = NATS_LOST_REASON
                task.cancel()
                await asyncio.wait({task})
                return False
        task.result()
        return True
    finally:
        if not task.done():  # we were cancelled (SIGTERM): let the runner record its attempt first
            task.cancel()
            await asyncio.wait({task})


# -- the pool ----------------------------------------------------------------------------------


def _context() -> Any:
    """``forkserver`` with the runner's modules preloaded where the platform has it, else ``spawn``.

    The preload applies when this process starts its forkserver (the first pool's first process);
    a forkserver something else already started is used as it is.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def check_runners_per_process(value: Any) -> int:
    """``value`` when it is a whole number >= 1 (``RunnerPool``'s and ``Trainer``'s ``runners_per_process``).

    Raises:
        ValueError: Anything else (a bool, a float, a string, 0 or less).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"runners_per_process must be a whole number >= 1, got {value!r}")
    return value


class RunnerPool:
    """``n`` runners consuming one namespace's queue, in processes restarted when they die.

    Args:
        agent: The agent each runner runs (pickled into its process).
        n: Number of runners.
        settings: Namespace to consume.
        nats_url: NATS server.
        runner: Template runner (copied into each process); defaults to ``LitAgentRunner(OtelTracer())``.
        hooks: Hooks every runner calls.
        log_level: Log level inside the processes.
        metrics_port: When set, process ``i`` serves Prometheus ``/metrics`` on ``127.0.0.1:metrics_port + i``
            (``eventlight.runner.metrics``); the default runner then counts into a ``RunnerMetrics``.
        runners_per_process: Runners that share one process (eventlight's; default 1, as in
            Agent-lightning): ``ceil(n / runners_per_process)`` processes, each running its
            runners as asyncio tasks on one store (``runner_copies``: each its own copy of the
            agent and runner, a synchronous agent in a thread). Fewer processes hold less memory
            and their runners' commands share atomic batches; a process that dies takes its
            runners' attempts with it (the pool records them ``failed``).
        graceful_s: Seconds ``stop`` leaves the attempts in flight by default, and what a runner
            process that gets SIGTERM itself leaves them (``serve_many``).

    Raises:
        ValueError: ``n`` or ``runners_per_process`` below 1, or ``metrics_port`` with a runner that
            does not count.
    """

    def __init__(
        self,
        agent: LitAgent[Any],
        n: int,
        settings: Settings,
        nats_url: str,
        *,
        runner: LitAgentRunner | None = None,
        hooks: Sequence[Hook] = (),
        log_level: str = "WARNING",
        metrics_port: int | None = None,
        runners_per_process: int = 1,
        graceful_s: float = GRACEFUL_STOP_S,
    ):
        if n < 1:
            raise ValueError(f"n_runners must be >= 1, got {n}")
        check_runners_per_process(runners_per_process)
        if runner is None:
            runner = LitAgentRunner(OtelTracer(), metrics=RunnerMetrics() if metrics_port is not None else None)
        elif metrics_port is not None and runner.metrics is None:
            raise ValueError("metrics_port needs a runner that counts: LitAgentRunner(metrics=RunnerMetrics())")
        self.metrics_port = metrics_port
        self.n_runners = n
        self.runners_per_process = runners_per_process
        # process i runs the runners with these worker indexes
        self.worker_indexes = [
            list(range(start, min(n, start + runners_per_process))) for start in range(0, n, runners_per_process)
        ]
        self.ctx = _context()
        self.stop_event = self.ctx.Event()
        self.cancel_now = self.ctx.Event()  # set before stop's SIGTERM: the processes cancel at once
        self.graceful_s = graceful_s
        self.claims = ClaimBoard(self.ctx, n)
        self._args = (agent, runner, tuple(hooks), settings, nats_url)
        self._finite = runner.max_rollouts is not None
        self._done: set[int] = set()  # slots whose process finished its max_rollouts
        self._log_level = log_level
        self.procs: list[BaseProcess] = [self._process(i) for i in range(len(self.worker_indexes))]
        self.restarts = 0
        self._started_at = [0.0] * len(self.procs)
        self._lock = threading.Lock()
        self._stopping = False
        self._stop_lock = threading.Lock()  # one stop at a time; a later one returns the first one's codes
        self._exit_codes: list[int | None] | None = None
        self._supervisor: threading.Thread | None = None

    def _process(self, index: int) -> BaseProcess:
        agent, runner, hooks, settings, nats_url = self._args
        return self.ctx.Process(  # type: ignore[attr-defined,no-any-return]
            target=_runner_main,
            name=f"eventlight-runner-{index}",
            daemon=True,
            args=(
                agent,
                runner,
                hooks,
                settings,
                nats_url,
                self.worker_indexes[index],
                self.stop_event,
                self._log_level,
                os.getpid(),
                self.metrics_port,
                dict(os.environ),
                index,
                self.claims,
                self.cancel_now,
                self.graceful_s,
            ),  # fmt: skip
        )

    def start(self) -> None:
        """Start the processes and the thread that restarts them."""
        for i, p in enumerate(self.procs):
            p.start()
            self._started_at[i] = time.monotonic()
        self._supervisor = threading.Thread(target=self._supervise, name="eventlight-runner-pool", daemon=True)
        self._supervisor.start()
        procs = len(self.procs)
        # debug: `eventlight runner` and the trainer's runner role print their own line for this
        log.debug("started %d runners in %d process%s", self.n_runners, procs, "es" if procs != 1 else "")

    def alive(self) -> int:
        """How many processes are running now."""
        return sum(p.is_alive() for p in self.procs)

    def runners_alive(self) -> int:
        """How many runners the running processes hold."""
        return sum(len(ix) for p, ix in zip(self.procs, self.worker_indexes, strict=True) if p.is_alive())

    def finished(self) -> bool:
        """Whether every process has finished its ``max_rollouts`` (never, without one)."""
        with self._lock:
            return len(self._done) == len(self.procs)

    def supervising(self) -> bool:
        """Whether the pool still keeps its processes running (started and not stopped)."""
        return self._supervisor is not None and self._supervisor.is_alive()

    def _supervise(self) -> None:
        quick_deaths = [0] * len(self.procs)
        due: dict[int, float] = {}  # slot -> when to restart it
        while True:
            with self._lock:
                if self._stopping or self.stop_event.is_set():  # the processes exit on the event: no restart
                    return
                procs = list(self.procs)
            now = time.monotonic()
            for i, p in enumerate(procs):
                if i in due or i in self._done or p.exitcode is None:
                    continue
                if self._finite and p.exitcode == 0:
                    log.info("runner process %d (pid %s) finished its rollouts", i, p.pid)
                    self._abandon(i, p)
                    with self._lock:
                        self._done.add(i)
                    continue
                lived = now - self._started_at[i]
                quick_deaths[i] = quick_deaths[i] + 1 if lived < RESTART_STABLE_S else 0
                due[i] = now + restart_delay_s(quick_deaths[i])
                with self._lock:
                    if self._stopping:  # it exited because of the stop: stop() sees to it
                        return
                log.warning(
                    "runner process %d (pid %s) exited with code %s after %.1f s; restarting it in %.1f s",
                    i, p.pid, _exit_code(p.exitcode), lived, due[i] - now,
                )  # fmt: skip
                self._abandon(i, p)
            for i, at in sorted(due.items()):
                if at <= now and self._restart(i):
                    del due[i]
            waits = [at - now for at in due.values() if at > now] + [SUPERVISE_S]
            sentinels = [p.sentinel for p in procs if p.exitcode is None]
            if sentinels:
                mp.connection.wait(sentinels, timeout=min(waits))
            else:
                time.sleep(min(waits))

    def _restart(self, index: int) -> bool:
        with self._lock:
            if self._stopping:
                return False
            p = self._process(index)
            p.start()
            self.procs[index] = p
            self._started_at[index] = time.monotonic()
            self.restarts += 1
        log.warning("runner process %d restarted as pid %s (restart %d of this pool)", index, p.pid, self.restarts)
        return True

    def _abandon(self, index: int, p: BaseProcess) -> None:
        """Record ``failed`` the attempts process ``index`` (``p``, which has exited) still held."""
        with self._lock:
            held = self.claims.take(self.worker_indexes[index])
        if held:
            _, _, _, settings, nats_url = self._args
            reason = f"runner process {p.pid} exited with code {_exit_code(p.exitcode)} while the attempt ran"
            abandon_attempts(settings, nats_url, held, reason)

    @property
    def stopping(self) -> bool:
        """Whether ``stop`` has been called (it may still wait for the processes)."""
        return self._stopping

    @property
    def stopped(self) -> bool:
        """Whether ``stop`` has stopped the processes."""
        return self._exit_codes is not None

    def hurry(self) -> None:
        """Cut the grace of a ``stop`` under way short: SIGTERM now, so the processes record their
        attempts in flight ``failed`` (``SIGTERM_REASON``) at once. Nothing before ``stop`` or after
        it ended; safe from a signal handler (a second Ctrl+C) while ``stop`` runs in another thread."""
        if not self._stopping or self._exit_codes is not None or self.cancel_now.is_set():
            return
        log.warning("stopping the runners now: their attempts in flight are recorded failed")
        self.cancel_now.set()
        for p in list(self.procs):
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    def stop(self, graceful_s: float | None = None) -> list[int | None]:
        """Stop the processes: stop event, then SIGTERM after ``graceful_s`` (default: the pool's;
        attempts still in flight are recorded ``failed``), then SIGKILL. No process is restarted
        from the call on; attempts that a process did not record (it was killed) are recorded
        ``failed`` here. ``hurry`` (from another thread) ends the grace at once. Idempotent: a later
        call (or one from another thread meanwhile) waits for the first to end and returns its codes.

        Returns:
            Their exit codes (``0`` after a stop event or SIGTERM).
        """
        with self._stop_lock:
            if self._exit_codes is None:
                self._exit_codes = self._stop(graceful_s)
            return list(self._exit_codes)

    def _stop(self, graceful_s: float | None) -> list[int | None]:
        with self._lock:
            self._stopping = True
            procs = [(i, p) for i, p in enumerate(self.procs) if p.pid is not None]
        self.stop_event.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=SUPERVISE_S * 4)
        grace = self.graceful_s if graceful_s is None else graceful_s
        deadline = time.monotonic() + grace  # one deadline for all, not one per process
        for _, p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.cancel_now.set()
        for _, p in procs:
            if p.is_alive():
                p.terminate()
        for _, p in procs:
            p.join(timeout=KILL_AFTER_S)
            if p.is_alive():
                log.warning("runner process pid %s ignored SIGTERM for %.0f s; killing it", p.pid, KILL_AFTER_S)
                p.kill()
                p.join(timeout=KILL_AFTER_S)
        for i, p in procs:
            self._abandon(i, p)
        return [p.exitcode for _, p in procs]


def _exit_code(code: int | None) -> str:
    """``-9 (SIGKILL)`` for a signal, else the code."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"{code} ({signal.Signals(-code).name})"
    return str(code)
