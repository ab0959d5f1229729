"""What stops a training run early: its runners gone while rollouts wait (``NoRunnersError``), or
most calls through its LLM proxy failing (``LLMUnavailableError``). ``Trainer`` wraps the
algorithm's run in both, for its runner processes (``"cs"``) and its runner threads (``"shm"``);
when the run is cancelled (Ctrl+C), ``stop_runners_first`` stops its runner processes or threads
before the algorithm, whose servers their agents call, and ``ctrl_c_again_hurries`` makes a second Ctrl+C cut
their grace short rather than break into the event loop.
Before it starts runner processes, ``refuse_unguarded_main`` stops a run that each of them would
start again; ``refuse_running_loop`` stops a ``fit`` called on a running event loop."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from eventlight.core.errors import LLMUnavailableError, NoRunnersError
from eventlight.store.liveness import LIVE_HEARTBEAT_S, QUEUED_STATUSES, is_alive, waiting_without_workers
from eventlight.trainer_strategies import RunnerThreads

if TYPE_CHECKING:
    from eventlight.llm_proxy import LLMProxy
    from eventlight.runner import LitAgentRunner
    from eventlight.runner_pool import RunnerPool

__all__ = [
    "RUNNERS_CHECK_S",
    "RUNNER_THREADS_CHECK_S",
    "cancel_left_in_queue",
    "ctrl_c_again_hurries",
    "note_stop_signal",
    "refuse_running_loop",
    "refuse_unguarded_main",
    "stop_runners_first",
    "stop_signal_name",
    "stop_when_llm_fails",
    "stop_when_runners_gone",
    "stopped_early_reason",
]

log = logging.getLogger("eventlight.trainer")


RUNNERS_CHECK_S = 10.0
"""Seconds between the trainer's checks that its runner processes are alive while rollouts wait."""
RUNNER_THREADS_CHECK_S = 0.5
"""Seconds between the checks that some of the ``"shm"`` runner threads still run (a cheap test)."""
DEFAULT_HEARTBEAT_S = 10.0  # LitAgentRunner's default heartbeat_interval


async def stop_when_runners_gone(
    run: Coroutine[Any, Any, Any],
    store: Any,
    runners: RunnerPool | RunnerThreads | None,
    runner: LitAgentRunner | None,
) -> None:
    """Await ``run``; cancel it and raise ``NoRunnersError`` when rollouts wait and none of the
    runners this trainer started is alive.

    Runner processes (``RunnerPool``, ``"cs"``): ``waiting_without_workers`` (no heartbeat within
    ``max(LIVE_HEARTBEAT_S, 3 heartbeats)``) while some of its processes are down; checked every
    ``RUNNERS_CHECK_S`` after that much grace; not when the runners are elsewhere (role
    ``algorithm``, ``runners`` None) or send no heartbeats. Runner threads (``RunnerThreads``,
    ``"shm"``): every thread has stopped (each stops for good at its ``max_rollouts`` or on an
    error) and no other worker of the store sent a heartbeat within ``LIVE_HEARTBEAT_S``; checked
    every ``RUNNER_THREADS_CHECK_S``.

    Raises:
        NoRunnersError: As above; the run was cancelled.
    """
    if isinstance(runners, RunnerThreads):
        await _stop_when(run, lambda: _threads_gone(store, runners))
        return
    beats = runner.heartbeat_interval if runner is not None else DEFAULT_HEARTBEAT_S
    if runners is None or beats <= 0:
        await run
        return
    await _stop_when(run, lambda: _pool_gone(store, runners, max(LIVE_HEARTBEAT_S, 3 * beats)))


async def _pool_gone(store: Any, pool: RunnerPool, live_s: float) -> str:
    await asyncio.sleep(live_s)
    while True:
        message = await waiting_without_workers(store, live_s=live_s)
        if message is not None and pool.alive() < len(pool.procs) and not pool.stopping:  # not stopped on purpose
            return f"{message} ({pool.alive()} of {len(pool.procs)} runner processes up, {pool.restarts} restarts)"
        await asyncio.sleep(RUNNERS_CHECK_S)


async def _threads_gone(store: Any, threads: RunnerThreads) -> str:
    while True:
        if threads.alive() == 0 and not threads.stopping:  # not stopped on purpose (Ctrl+C)
            waiting = (await store.query_rollouts(status_in=list(QUEUED_STATUSES), limit=1)).total
            if waiting > 0:
                now = time.time()
                others = [w for w in await store.query_workers() if w.worker_id not in threads.worker_ids]
                if not any(is_alive(w, now, LIVE_HEARTBEAT_S) for w in others):
                    limit = threads.template.max_rollouts
                    why = "on an error" if limit is None else f"after max_rollouts={limit}, or on an error"
                    return (
                        f"{waiting} rollout(s) wait in the queue and no runner is alive: the "
                        f"{len(threads.threads)} runner thread(s) of this trainer have stopped ({why}: see "
                        f"the log) and no other runner sent a heartbeat in the last {LIVE_HEARTBEAT_S:.0f} s"
                    )
        await asyncio.sleep(RUNNER_THREADS_CHECK_S)


async def _stop_when(run: Coroutine[Any, Any, Any], gone_check: Callable[[], Awaitable[str]]) -> None:
    """Await ``run``, unless ``gone_check()`` returns first: then cancel ``run`` and raise ``NoRunnersError``."""
    task = asyncio.ensure_future(run)
    gone = asyncio.ensure_future(gone_check())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
            return
        log.error("stopping the run: %s", gone.result())
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise NoRunnersError(gone.result())
    finally:
        gone.cancel()
        if not task.done():  # cancelled from outside (Ctrl+C): the run stops with it, not after the store closed
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def stop_when_llm_fails(run: Coroutine[Any, Any, Any], proxy: LLMProxy | None) -> None:
    """Await ``run``; cancel it and raise ``LLMUnavailableError`` once most calls through ``proxy`` fail."""
    if proxy is None:
        await run
        return
    task = asyncio.ensure_future(run)
    failing = asyncio.ensure_future(proxy.health.wait_failing())
    try:
        await asyncio.wait({task, failing}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
            return
        log.error("stopping the run: %s", failing.result())
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        backends = sorted({str(e["litellm_params"].get("api_base") or "?") for e in proxy.model_list})
        where = f"{proxy.endpoint} (backend {', '.join(backends)})"
        raise LLMUnavailableError(where, f"{failing.result()}; the run was stopped, its results are void")
    finally:
        failing.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def stop_runners_first(run: Coroutine[Any, Any, Any], stop_runners: Callable[[], Awaitable[None]] | None) -> None:
    """Await ``run``; when the caller is cancelled (Ctrl+C), await ``stop_runners()`` before
    cancelling ``run``, which goes on meanwhile.

    The runners' agents call what the run serves: the LLM proxy and, for ``GRPO``, the policy server
    its run starts and stops. Cancelled together, those stopped first, the agents' calls in flight
    failed, and their attempts were recorded failed with the agents' connection errors (and 500s),
    as if the model had failed. Stopped first, the runners give their attempts in flight the grace
    while the model still answers, and record the rest with the stop's reason
    (``eventlight.runner_pool.SIGTERM_REASON``; ``"shm"``'s threads:
    ``eventlight.trainer_strategies.THREAD_STOP_REASON``). ``stop_runners`` ``None``: ``run`` alone.

    Raises:
        asyncio.CancelledError: After ``stop_runners()`` and ``run``'s own cancellation ended.
    """
    if stop_runners is None:
        await run
        return
    task = asyncio.ensure_future(run)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():  # cancelled from outside, not by the run itself
            await stop_runners()
        raise
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


_stop_signal: int | None = None  # the signal a program said stops this process (note_stop_signal)


def note_stop_signal(signum: int) -> None:
    """Say that signal ``signum`` stops this process, before handling it as Ctrl+C (``examples/
    interrupt.py`` for a SIGTERM): the trainer's lines then name it (``the run was cancelled
    (SIGTERM)``) instead of guessing ``(Ctrl+C?)``. For the rest of the process."""
    global _stop_signal
    _stop_signal = signum


def stop_signal_name() -> str:
    """What cancelled the run, as the trainer's lines say it: the noted signal's name
    (``"SIGTERM"``, ``note_stop_signal``), else ``"Ctrl+C?"`` (a SIGINT, or a cancel from code)."""
    if _stop_signal is None:
        return "Ctrl+C?"
    try:
        return signal.Signals(_stop_signal).name
    except ValueError:
        return f"signal {_stop_signal}"


@contextlib.contextmanager
def ctrl_c_again_hurries(pool: RunnerPool | RunnerThreads | None) -> Iterator[None]:
    """While the block runs: a Ctrl+C (SIGINT) once ``pool`` (runner processes or ``"shm"``'s
    threads) is stopping calls ``pool.hurry()`` (its attempts in flight are recorded failed at once)
    instead of the handler in place; before that, that handler acts once (``asyncio.run``'s cancels
    the run, whose stop then begins with the runners), and another Ctrl+C before that stop began is
    the same stop: ignored. ``make`` relays a SIGTERM of its process group to its child, so a demo
    under ``make`` (SIGTERM handled as Ctrl+C) got two within a millisecond: the second reached
    ``asyncio.run``'s handler, whose shutdown cancelled GRPO's run under the runners, and the
    attempts in flight failed with its policy server's 503 instead of getting their grace.

    ``asyncio.run`` raises ``KeyboardInterrupt`` into its event loop on a second Ctrl+C, and its
    shutdown then cut every task short, each printing a traceback (thousands of lines of them in
    ``make demo``). Only on the main thread, and only over a handler set from Python (not over a
    SIGINT ignored); the handler in place is restored at the end.
    """
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if pool is None or not callable(previous):
        yield
        return
    the_previous: Callable[[int, FrameType | None], Any] = previous

    passed = False  # the handler in place had one: the run is cancelled, its stop begins with the runners

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        nonlocal passed
        if pool.stopping:
            pool.hurry()
        elif not passed:
            passed = True
            the_previous(signum, frame)
        else:  # the same stop, not begun yet: `make` relays a group's SIGTERM to its child at once
            log.info("interrupted again before the runners began to stop: the same stop")

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is on_sigint:
            signal.signal(signal.SIGINT, previous)


async def cancel_left_in_queue(
    store: Any, since: float, *, reason: str = "the run stopped early", limit_s: float = 15.0
) -> int:
    """Cancel the rollouts enqueued since ``since`` (wall-clock seconds) that still wait in the
    queue: the run that enqueued them stopped early (Ctrl+C, ``NoRunnersError``, an error of its
    algorithm), so nothing will read their results, and runners of a later run on the namespace
    would otherwise spend their time on them first. Claimed rollouts are left to their runners.
    Each keeps ``metadata.cancelled_by`` (``{"pid", "reason"}``, as the algorithms' cancels record:
    ``eventlight.algorithm.base.cancel_rollouts``), ``reason`` saying why the run stopped.
    Best effort within ``limit_s`` (a store that is down cancels nothing); returns how many.
    """
    from eventlight.algorithm.base import cancel_rollouts

    async def cancel() -> int:
        with contextlib.suppress(Exception):
            await store.sync_all(timeout_s=min(5.0, limit_s))  # what this process enqueued last, too
        waiting = await store.query_rollouts(status_in=list(QUEUED_STATUSES))
        ids = [r.rollout_id for r in waiting if r.start_time >= since]
        return len(await cancel_rollouts(store, ids, reason, "the trainer", only_in=QUEUED_STATUSES)) if ids else 0

    try:
        n = await asyncio.wait_for(cancel(), limit_s)
    except Exception as e:
        log.warning("the run stopped early; its rollouts still in the queue could not be cancelled: %s", e)
        return 0
    if n:
        log.warning("the run stopped early: cancelled %d rollout(s) it had enqueued that no runner had claimed", n)
    return n


def stopped_early_reason(error: BaseException) -> str:
    """The ``cancelled_by`` reason of the rollouts a run left queued when ``error`` stopped it:
    ``"the run stopped early: it was cancelled (SIGTERM)"``, ``"… (Ctrl+C?)"``, or the error's
    type and message (``"the run stopped early: NoRunnersError: …"``)."""
    if isinstance(error, KeyboardInterrupt | asyncio.CancelledError):
        return f"the run stopped early: it was cancelled ({stop_signal_name()})"
    text = " ".join(str(error).split())[:200]
    return f"the run stopped early: {type(error).__name__}{': ' + text if text else ''}"


def refuse_running_loop(what: str) -> None:
    """Raise when ``what`` (``"Trainer.fit()"``), which runs event loops of its own, is called from a
    thread whose event loop runs: that loop would stop until the run ends, and a store open on it
    (which the ``"shm"`` runner threads call there) would never answer.

    Raises:
        RuntimeError: Saying to run it in a thread (``asyncio.to_thread``).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        f"{what} runs event loops of its own and cannot be called from a running one: "
        "from async code, run it in a thread (`await asyncio.to_thread(...)`), or use Trainer.fit_async (strategy 'cs')"
    )


def refuse_unguarded_main(what: str) -> None:
    """Raise when ``what`` (``"Trainer.fit()"``) runs from the top-level code of the program's main
    file outside ``if __name__ == "__main__":``.

    Runner processes start by multiprocessing's ``forkserver`` (or ``spawn``), which imports the
    main file again in each of them (as ``__mp_main__``): unguarded, each would start the training
    again, die at once with multiprocessing's bootstrapping ``RuntimeError`` and be restarted until
    the run ended with ``NoRunnersError``. Found from the call stack and the file's syntax tree; a
    program without a main file (``python -c``, a notebook), run as a package's ``__main__``
    (which multiprocessing does not import again) or whose file cannot be read passes.

    Raises:
        RuntimeError: Naming the file, the line and the guard.
    """
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if main is None or not file or spec_name == "__main__" or spec_name.endswith(".__main__"):
        return  # as multiprocessing.spawn: a package's __main__ is not imported again
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:  # not called from the main file's top-level code
        return
    try:
        tree = ast.parse(Path(file).read_bytes(), file)
    except (OSError, SyntaxError, ValueError):
        return
    line = frame.f_lineno
    for stmt in tree.body:
        if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno) and not _is_main_guard(stmt):
            raise RuntimeError(
                f'{what} runs at the top level of {file} (line {line}) without `if __name__ == "__main__":`; '
                "runner processes import that file again (multiprocessing's forkserver or spawn), so each "
                "would start the training again and die: put the code that trains under that guard"
            )


def _is_main_guard(stmt: ast.stmt) -> bool:
    """Whether ``stmt`` is ``if __name__ == "__main__":`` (in any spelling that names both)."""
    if not isinstance(stmt, ast.If):
        return False
    names = {n.id for n in ast.walk(stmt.test) if isinstance(n, ast.Name)}
    constants = {n.value for n in ast.walk(stmt.test) if isinstance(n, ast.Constant)}
    return "__name__" in names and "__main__" in constants
