"""A replay's adapter in worker processes, started on attempts while the log is still being read.

Adapting is Python work per span (unflattening attributes, building the span tree and the
records) and takes most of a replay's time; one process reading the log and adapting every
attempt in turn uses one core. ``AdaptPool`` runs ``records.adapt_batches`` in ``workers`` processes
(forked from a ``forkserver`` that imported this module once; ``spawn`` where there is none), and
``Replay`` hands it work in two ways:

* **ahead**: while the log is read, each attempt that reaches a terminal status is sent with the
  span batches read so far (its spans are most likely all in). At most ``AHEAD`` attempts, and
  answers of at most ``AHEAD_BYTES`` in all, are adapted ahead and held, so memory stays bounded
  whatever the log's size or the records' (then the rest waits for the end of the read).
* **after**: once the log is read, every selected attempt is taken in order; one adapted ahead is
  used only if no span batch of it arrived since it was sent (batches only ever append, so an equal
  count means equal input), otherwise it is sent again. Up to ``IN_FLIGHT`` chunks run at once.

The records are therefore the ones the one-process replay gives, in the same order: the adapter
sees the same batches, and the provenance (status, resources version, ...) is taken from the log
as read to its end, in this process (``records.records_from``).

Only adapters and reward functions named by a string (a built-in name or ``MODULE:CALLABLE``) go
to workers: each worker builds its own from the name, so one that keeps state from attempt to
attempt (a counter, a cache that changes its output) gives other records with workers: replay it
with ``workers=1``. An adapter object is used in this process (it may keep state its caller reads,
like ``CountingAdapter.stats``). An attempt whose records do not pickle (a lock, a lambda in an
item) is adapted again in this process, so it gives what it gives there.

Workers ignore SIGINT, and so does the forkserver, from the start (``_start_forkserver_ignoring_sigint``):
a Ctrl-C reaches the whole process group, and the parent, which stops them
(``AdaptPool.close(abort=True)``), is the one to act on it.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import signal
import threading
from concurrent.futures import Future, InvalidStateError, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import msgspec

from eventlight.logreplay.records import Adapted, AdapterFn, RewardFn, adapt_batches, resolve_adapter, resolve_reward

CHUNK = 16
"""Attempts per task sent to a worker (fewer round trips; a worker's answer stays small)."""
AHEAD = 4096
"""Most attempts adapted ahead of the end of the read and held for it."""
AHEAD_BYTES = 256 * 2**20
"""Most bytes of answers (pickled records) held for the end of the read."""
MAX_WORKERS = 256
IN_FLIGHT = 4
"""Chunks per worker sent and not yet answered, once the log is read."""
WORKER_GC_THRESHOLD = (20_000, 20, 20)
"""``gc.set_threshold`` in a worker (Python's default is 700, 10, 10)."""
WORKER_NICE = 10
"""Workers run at a lower priority: on a machine with few cores they would otherwise starve the
read they run beside (this process and the NATS server), which measured slower overall."""

Batches = list[tuple[int, bytes]]


class InThisProcess(msgspec.Struct, frozen=True):
    """A worker's answer for an attempt whose records it could not send (they do not pickle)."""

    why: str


Result = Adapted | str | InThisProcess
"""What a worker gives for one attempt: its ``Adapted``, the error as ``"TypeName: message"``, or
``InThisProcess`` (adapt it in the parent)."""

_adapter: AdapterFn | None = None
_reward: RewardFn | None = None


def default_workers() -> int:
    """The CPUs this process may use (``os.sched_getaffinity``), at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def _init(adapter: str, reward: str | None, llm_call_match: str | None) -> None:
    global _adapter, _reward
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent acts on a Ctrl-C (module docstring)
    # the forkserver ignores SIGTERM once it imported eventlight.runner_pool (a process-group
    # SIGTERM must not kill it), and its children inherit that: an early stop terminates workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(OSError):  # where it may not: at the parent's priority
        os.nice(WORKER_NICE)
    # A worker only adapts: what it imported stays, and what an attempt makes is garbage once its
    # answer is sent (a span tree holds no cycles), so the cyclic collector is told to skip the
    # former and to run less often (in a one-process replay it took ~20% of the time).
    gc.freeze()
    gc.set_threshold(*WORKER_GC_THRESHOLD)
    _adapter = resolve_adapter(adapter, llm_call_match)
    _reward = resolve_reward(reward)


def adapt_one(batches: Batches, adapter: AdapterFn, reward: RewardFn | None) -> Result:
    """``adapt_batches``, its error (the adapter's or reward function's) as ``"TypeName: message"``."""
    try:
        return adapt_batches(batches, adapter, reward)
    except (Exception, SystemExit) as e:  # the user's adapter or reward function: reported, not raised
        return f"{type(e).__name__}: {e}"


def _adapt_chunk(chunk: list[Batches]) -> bytes:
    """The chunk's ``Result`` list, pickled here: the parent unpickles each chunk only when it
    yields its records, so what waits meanwhile is one ``bytes`` per chunk, not objects its
    garbage collector walks again and again (that cost the parent more than the unpickling)."""
    assert _adapter is not None, "worker not initialised"
    results = [adapt_one(batches, _adapter, _reward) for batches in chunk]
    try:
        return pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # some attempt's records do not pickle: those are adapted in the parent
        return pickle.dumps([_picklable(r) for r in results], protocol=pickle.HIGHEST_PROTOCOL)


def _picklable(result: Result) -> Result:
    try:
        pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        return InThisProcess(f"{type(e).__name__}: {e}")
    return result


def _context() -> Any:
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "eventlight.adapter"])  # imported once, not by each worker
    _start_forkserver_ignoring_sigint()
    return ctx


def _start_forkserver_ignoring_sigint() -> None:
    """Start ``multiprocessing``'s forkserver now, with SIGINT ignored, so that it and every worker
    it forks ignore a Ctrl-C from their first instruction (an ignored signal stays ignored across
    ``exec`` and ``fork``, and the forkserver gives its children the handlers it started with).

    Left to the pool, it started with Python's handler and ignored SIGINT only once it had imported
    what it preloads (``eventlight``, about a second): a Ctrl-C meanwhile printed its
    ``KeyboardInterrupt`` traceback. Only from the main thread (``signal.signal``); elsewhere the
    pool starts it as before. A Ctrl-C in the few milliseconds of the start is ignored here too.
    """
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()  # a no-op when it runs already
    finally:
        signal.signal(signal.SIGINT, previous)


class AdaptPool:
    """``workers`` processes adapting chunks of attempts (see the module docstring).

    Args:
        adapter, reward: The names (``resolve_adapter`` / ``resolve_reward`` specs) each worker
            builds its adapter and reward function from.
        workers: Processes, at least 2 (one would only add the cost of sending the batches).
        llm_call_match: ``resolve_adapter``'s, for the ``triplets`` adapter.

    The processes start at once, in the background: ``ProcessPoolExecutor.submit`` starts one
    when none is idle and waits, holding the executor's lock, until the forkserver has imported
    what it preloads (about half a second: ``eventlight`` imports its SDK). So every submit goes
    through one thread of its own, and the read in the event loop never waits for it.
    """

    def __init__(self, adapter: str, reward: str | None, workers: int, llm_call_match: str | None = None):
        self.workers = workers
        self.executor = ProcessPoolExecutor(
            workers, mp_context=_context(), initializer=_init, initargs=(adapter, reward, llm_call_match)
        )
        self._submitter = ThreadPoolExecutor(1, thread_name_prefix="eventlight-replay-submit")
        for _ in range(workers):  # one process started per task while none is idle
            self._submitter.submit(self.executor.submit, _warm)

    def submit(self, chunk: list[Batches]) -> Future[bytes]:
        """Adapt ``chunk`` in a worker; the future's result is the pickled ``list[Result]``."""
        answer: Future[bytes] = Future()

        def send() -> None:
            try:
                task = self.executor.submit(_adapt_chunk, chunk)
            except BaseException as e:  # a broken or shut-down pool: the caller sees it on the future
                answer.set_exception(e)
                return
            task.add_done_callback(lambda done: _copy(done, answer))

        self._submitter.submit(send)
        return answer

    def close(self, abort: bool = False) -> None:
        """Stop the workers: after their tasks, or (``abort``: the replay stopped early, a Ctrl-C)
        at once, dropping what is queued."""
        self._submitter.shutdown(wait=not abort, cancel_futures=abort)
        if abort:
            for process in list(getattr(self.executor, "_processes", {}).values()):  # no public way
                with contextlib.suppress(Exception):
                    process.terminate()
        self.executor.shutdown(wait=True, cancel_futures=True)


def _warm() -> None:
    """A task that only makes the pool start a process."""


def _copy(done: Future[bytes], into: Future[bytes]) -> None:
    if into.done():  # cancelled by its waiter (the replay stopped)
        return
    with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
        if done.cancelled():
            into.cancel()
        elif (e := done.exception()) is not None:
            into.set_exception(e)
        else:
            into.set_result(done.result())
