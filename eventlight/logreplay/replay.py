"""``eventlight.replay(...)``: old traces as new datasets, read from the log itself.

A replay reads the event log (never the read models) from position 1 up to its head when the
replay starts, so the same log gives the same records in the same order whatever was appended
since; folds it (``select.LogFold``); then for each selected attempt, in the order the attempts
started, decodes its spans, runs the adapter and yields its records (``records``). An adapter or
reward function that raises on one attempt is recorded in ``Replay.errors`` with the rollout and
attempt ids, logged, and the replay goes on. It never writes to the log: ``EventLog.scan`` reads
with an ephemeral ordered consumer.

Example::

    async for record in eventlight.replay(settings, adapter="triplets", statuses=["succeeded"]):
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import pickle
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from itertools import islice
from typing import Any, NamedTuple

import msgspec

from eventlight.adapter.stats import AdapterStats
from eventlight.core.errors import EventlightError, InvalidInputError
from eventlight.core.types import ATTEMPT_STATUSES, ROLLOUT_MODES
from eventlight.logreplay.parallel import (
    AHEAD,
    AHEAD_BYTES,
    CHUNK,
    IN_FLIGHT,
    MAX_WORKERS,
    AdaptPool,
    InThisProcess,
    Result,
    adapt_one,
)
from eventlight.logreplay.records import AdapterFn, RewardFn, records_from, resolve_adapter, resolve_reward
from eventlight.logreplay.select import Bound, Candidate, Filters, LogFold, Selected
from eventlight.settings import Settings
from eventlight.store.ports import EventLog

log = logging.getLogger(__name__)

PROGRESS_EVERY = 2000
SERIAL_UP_TO = 2 * CHUNK
"""With no attempt sent to the workers while reading, this many selected attempts or fewer are
adapted in this process: starting the worker processes would take longer."""


class ReplayWorkerError(EventlightError, RuntimeError):
    """A worker process of a replay died (``workers`` >= 2); what was yielded before is correct."""


class ReplayError(msgspec.Struct, frozen=True):
    """One attempt the adapter or the reward function failed on."""

    rollout_id: str
    attempt_id: str
    error: str


class ReplayStats(msgspec.Struct):
    """Counters of a replay: log entries read, spans in them, attempts selected, records yielded."""

    events: int = 0
    spans: int = 0
    attempts: int = 0
    records: int = 0
    head_seq: int = 0
    first_seq: int = 0
    """The log position of the first entry read (0: none)."""
    first_time: float | None = None
    last_time: float | None = None
    """The earliest and latest ``time`` of the events read (seconds since the epoch; ``None``: none)."""
    ahead: int = 0
    """Attempts whose records a worker process made while the log was still read (``workers``)."""
    unmatched: int = 0
    """Attempts in which no span matched the ``triplets`` adapter's ``llm_call_match`` (no record)."""
    left_out: int = 0
    """Attempts whose LLM calls the ``triplets`` adapter all left out (failed calls, say: no record)."""


Progress = Callable[[ReplayStats], None]


def _set(
    values: str | Iterable[str] | None, allowed: frozenset[str] | None = None, what: str = ""
) -> frozenset[str] | None:
    """The values as a set; with ``allowed``, refuse one outside it (a typo would select nothing).

    Raises:
        InvalidInputError: A value not in ``allowed``.
    """
    if values is None:
        return None
    got = frozenset([values] if isinstance(values, str) else values)
    bad = sorted(v for v in got if allowed is not None and v not in allowed)
    if allowed is not None and bad:
        raise InvalidInputError(
            f"unknown {what} {', '.join(map(repr, bad))}: expected one of {', '.join(sorted(allowed))}"
        )
    return got


class Replay(AsyncIterator[dict[str, Any]]):
    """An async iterator of replayed records (see the module docstring); ``errors`` and ``stats``
    fill in as it runs. Build it with ``eventlight.replay``."""

    def __init__(
        self,
        source: Settings | EventLog | Any,
        adapter: str | AdapterFn,
        filters: Filters,
        min_reward: float | None,
        reward: str | RewardFn | None,
        on_progress: Progress | None,
        workers: int = 1,
        llm_call_match: str | None = None,
    ):
        self.source = source
        self.adapter = resolve_adapter(adapter, llm_call_match)  # an unknown adapter fails here, before any read
        self.reward = resolve_reward(reward)
        by_name = isinstance(adapter, str) and (reward is None or isinstance(reward, str))
        self.workers = workers if by_name else 1
        """Processes adapting attempts (``parallel``); 1 (this process) for an adapter or reward
        function given as an object."""
        self._specs = (adapter, reward) if by_name else None
        self._llm_call_match = llm_call_match
        self.filters = filters
        self.min_reward = min_reward
        self.on_progress = on_progress
        self.errors: list[ReplayError] = []
        self.log_first_skip = True
        """Log a warning for the first attempt skipped (``eventlight replay`` prints each itself)."""
        self.log_range_outside = True
        """Log a warning for a range outside the log, ``range_outside_log`` (``eventlight replay``
        prints it itself)."""
        self.log_unmatched = True
        """Log one warning at the end for the attempts in which no span matched the ``triplets``
        adapter's ``llm_call_match``, ``unmatched_warning`` (``eventlight replay`` prints it itself)."""
        self.unmatched_names: Counter[str] = Counter()
        self.log_left_out = True
        """Log one warning at the end for the attempts whose LLM calls the ``triplets`` adapter all
        left out, ``left_out_warning`` (``eventlight replay`` prints it itself)."""
        self.left_out_stats = AdapterStats()
        """The adapter's counts over those attempts."""
        """Span names of those attempts: in how many of them each was seen."""
        self.stats = ReplayStats()
        self._it: AsyncIterator[dict[str, Any]] | None = None

    def __aiter__(self) -> Replay:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._it is None:
            self._it = self._run()
        return await self._it.__anext__()

    async def aclose(self) -> None:
        """Stop early and release the connection a ``Settings`` source opened."""
        if self._it is not None and hasattr(self._it, "aclose"):
            await self._it.aclose()

    async def _run(self) -> AsyncIterator[dict[str, Any]]:
        pool = (
            AdaptPool(*self._specs, workers=self.workers, llm_call_match=self._llm_call_match)  # type: ignore[arg-type]
            if self.workers > 1 and self._specs
            else None
        )
        finished = False
        try:
            async with _open_log(self.source) as log_:
                fold, ahead = await self._read(log_, pool)
            check_mixed_range(self.filters, fold.position_time(), self.stats.head_seq)
            for outside in range_outside_log(self.filters, self.stats) if self.log_range_outside else ():
                log.warning("replay: %s", outside)
            unknown = sorted((self.filters.resources_ids or frozenset()) - fold.resources.keys())
            if unknown:  # most likely a typo: say so rather than write an empty file without a word
                log.warning("replay: no resources snapshot in the log is named %s (--resources-id)", ", ".join(unknown))
            async for selected, answer in self._adapted(fold.selected(), pool, ahead):
                result = answer
                if isinstance(answer, InThisProcess):  # its records do not pickle: made here, as with workers=1
                    result = adapt_one(selected.batches, self.adapter, self.reward)
                if isinstance(result, InThisProcess):
                    raise AssertionError("adapt_one does not answer InThisProcess")
                if isinstance(result, str):  # the user's adapter or reward function raised: report, go on
                    err = ReplayError(selected.rollout.rollout_id, selected.attempt.attempt_id, result)
                    if not self.errors and self.log_first_skip:  # once; ``errors`` holds them all
                        log.warning(
                            "replay: rollout %s attempt %s skipped: %s (the first skipped; the run's errors list all)",
                            err.rollout_id,
                            err.attempt_id,
                            err.error,
                        )
                    self.errors.append(err)
                    continue
                if result.unmatched is not None:
                    self.stats.unmatched += 1
                    self.unmatched_names.update(result.unmatched)
                if result.left_out is not None:
                    self.stats.left_out += 1
                    self.left_out_stats.add(result.left_out)
                final = result.final_reward if result.items else None  # an attempt without records has none
                if self.min_reward is not None and not _at_least(final, self.min_reward):
                    continue
                records = records_from(selected, result)
                self.stats.attempts += 1
                for record in records:
                    self.stats.records += 1
                    if self.on_progress is not None and self.stats.records % 100 == 0:
                        self.on_progress(self.stats)
                    yield record
            if self.on_progress is not None:
                self.on_progress(self.stats)
            if self.log_unmatched and (unmatched := unmatched_warning(self)) is not None:
                log.warning("replay: %s", unmatched)
            if self.log_left_out and (left_out := left_out_warning(self)) is not None:
                log.warning("replay: %s", left_out)
            finished = True
        finally:
            if pool is not None:
                pool.close(abort=not finished)  # stopped early, failed or interrupted: drop what is queued

    async def _read(self, log_: EventLog, pool: AdaptPool | None) -> tuple[LogFold, dict[tuple[str, str], _Ahead]]:
        """Fold the log to its head; with a pool, attempts that finish are sent to it as they do."""
        fold = LogFold(self.filters, track_finished=pool is not None)
        ahead: dict[tuple[str, str], _Ahead] = {}
        waiting: list[Candidate] = []
        held = _Held(AHEAD_BYTES)
        self.stats.head_seq = await log_.head_seq()
        async for seq, subject, data in log_.scan(0, self.stats.head_seq):
            fold.add(seq, subject, data)
            if fold.finished and pool is not None:
                for cand in fold.finished:
                    if len(ahead) + len(waiting) < AHEAD and self._worth_ahead(fold, cand):
                        waiting.append(cand)
                fold.finished.clear()
                while len(waiting) >= CHUNK and held.room(pool.workers):
                    _send_ahead(pool, waiting[:CHUNK], ahead, held)
                    del waiting[:CHUNK]
            if self.on_progress is not None and fold.events % PROGRESS_EVERY == 0:
                self.stats.events, self.stats.spans = fold.events, fold.spans
                self.on_progress(self.stats)
        self.stats.events, self.stats.spans, self.stats.first_seq = fold.events, fold.spans, fold.first_seq
        self.stats.first_time, self.stats.last_time = fold.first_time, fold.last_time
        for seq, why in fold.malformed:
            log.warning(
                "replay: the entry at log position %d is not an event this version reads (%s); skipped", seq, why
            )
        return fold, ahead

    def _worth_ahead(self, fold: LogFold, cand: Candidate) -> bool:
        """Whether a finished attempt would be selected if the log ended here."""
        state = fold.states[cand.rollout_id]
        statuses = self.filters.statuses
        return self.filters.rollout_matches(state.rollout) and (
            statuses is None or state.attempt(cand.attempt_id).status in statuses
        )

    async def _adapted(
        self, selected: list[Selected], pool: AdaptPool | None, ahead: dict[tuple[str, str], _Ahead]
    ) -> AsyncIterator[tuple[Selected, Result]]:
        """Each selected attempt with what the adapter made of it, in order (see ``parallel``)."""
        if pool is None or (not ahead and len(selected) <= SERIAL_UP_TO):  # no processes for a few
            for sel in selected:
                yield sel, adapt_one(sel.batches, self.adapter, self.reward)
                await asyncio.sleep(0)  # a Ctrl-C (asyncio.run cancels the task) is taken here
            return
        sent_ahead = {a.future for a in ahead.values()}
        groups: deque[list[tuple[Selected, _Ahead]]] = deque()
        uses: dict[Future[bytes], int] = {}  # entries queued per chunk, to drop its results after the last
        results: dict[Future[bytes], list[Result]] = {}
        todo = iter(selected)
        while True:
            while len(groups) < IN_FLIGHT * pool.workers:
                chunk = list(islice(todo, CHUNK))
                if not chunk:
                    break
                group = _group(pool, chunk, ahead)
                for _, sent in group:
                    uses[sent.future] = uses.get(sent.future, 0) + 1
                groups.append(group)
            if not groups:
                return
            for sel, (_, future, place) in groups.popleft():
                if future not in results:
                    try:
                        answer = await asyncio.wrap_future(future)
                    except BrokenProcessPool as e:
                        raise ReplayWorkerError(
                            "a replay worker process died (killed, out of memory, or started from a script "
                            'without an `if __name__ == "__main__":` guard?); replay in this process with '
                            "workers=1 (eventlight replay --workers 1)"
                        ) from e
                    results[future] = pickle.loads(answer)  # noqa: S301 - our own workers' answer
                got = results[future][place]
                uses[future] -= 1
                if not uses[future]:
                    del uses[future], results[future]
                self.stats.ahead += future in sent_ahead
                yield sel, got


class _Ahead(NamedTuple):
    """An attempt sent to a worker: how many span batches it had then, the chunk's future, and its
    place in the chunk."""

    batches: int
    future: Future[bytes]
    place: int


class _Held:
    """What was sent ahead and what came back, to hold at most ``AHEAD_BYTES`` of answers.

    An answer's size is known only once it is back (the pool's threads add to it), so what is still
    out is reckoned at the mean size so far; before any is back, at most ``FIRST_AHEAD`` chunks per
    worker are out.
    """

    FIRST_AHEAD = 2

    def __init__(self, budget: int | None = None) -> None:
        self.budget = AHEAD_BYTES if budget is None else budget
        self.sent = self.answered = self.bytes = 0

    def room(self, workers: int) -> bool:
        out = self.sent - self.answered
        if not self.answered:
            return out < self.FIRST_AHEAD * workers * CHUNK
        return self.bytes + out * self.bytes / self.answered < self.budget

    def add(self, future: Future[bytes], attempts: int) -> None:
        """An answer for ``attempts`` attempts is back."""
        self.answered += attempts
        if not future.cancelled() and future.exception() is None:
            self.bytes += len(future.result())


def _send_ahead(pool: AdaptPool, chunk: list[Candidate], ahead: dict[tuple[str, str], _Ahead], held: _Held) -> None:
    future = pool.submit([list(c.batches) for c in chunk])  # copies: the read goes on appending
    held.sent += len(chunk)
    future.add_done_callback(lambda done: held.add(done, len(chunk)))
    for i, c in enumerate(chunk):
        ahead[(c.rollout_id, c.attempt_id)] = _Ahead(len(c.batches), future, i)


def _group(
    pool: AdaptPool, chunk: list[Selected], ahead: dict[tuple[str, str], _Ahead]
) -> list[tuple[Selected, _Ahead]]:
    """The chunk's attempts, each with its result's future: the one sent ahead if no batch of it
    arrived since, else a new task for those without."""
    got = {}
    for sel in chunk:
        sent = ahead.pop((sel.rollout.rollout_id, sel.attempt.attempt_id), None)
        if sent is not None and sent.batches == len(sel.batches):
            got[id(sel)] = sent
    missing = [sel for sel in chunk if id(sel) not in got]
    if missing:
        future = pool.submit([sel.batches for sel in missing])
        got.update((id(sel), _Ahead(len(sel.batches), future, i)) for i, sel in enumerate(missing))
    return [(sel, got[id(sel)]) for sel in chunk]


def _at_least(final: float | None, threshold: float) -> bool:
    return final is not None and final >= threshold


class _open_log:  # noqa: N801 - used as a context manager
    """The event log of a source: a ``Settings`` (its own NATS connection, ``servers.log_of``, closed
    after), an event log, or a started store (its log)."""

    def __init__(self, source: Any):
        self.source = source
        self.exits = contextlib.AsyncExitStack()

    async def __aenter__(self) -> EventLog:
        if isinstance(self.source, Settings):
            from eventlight.logreplay.servers import log_of

            return await self.exits.enter_async_context(log_of(self.source, "eventlight-replay"))  # type: ignore[no-any-return]
        log_ = getattr(self.source, "log", self.source)
        if not hasattr(log_, "scan"):
            raise InvalidInputError(
                f"cannot replay from a {type(self.source).__name__}: give Settings, a store or its log"
            )
        return log_  # type: ignore[no-any-return]

    async def __aexit__(self, *exc: object) -> None:
        await self.exits.aclose()


def replay(
    source: Settings | EventLog | Any,
    *,
    adapter: str | AdapterFn = "triplets",
    since: Bound | int | float | str | None = None,
    until: Bound | int | float | str | None = None,
    statuses: str | Iterable[str] | None = None,
    modes: str | Iterable[str] | None = None,
    resources_ids: str | Iterable[str] | None = None,
    min_reward: float | None = None,
    reward: str | RewardFn | None = None,
    on_progress: Progress | None = None,
    workers: int = 1,
    llm_call_match: str | None = None,
) -> Replay:
    """Replay stored traces into records, as an async iterator (``eventlight replay`` from Python).

    Args:
        source: ``Settings`` (the namespace's stream on ``settings.nats_url``, else on the
            embedded servers ``eventlight up`` or a trainer left running under
            ``settings.state_dir``, as ``eventlight replay`` finds them), a started store
            (``InMemoryLightningStore``, ``JetStreamLightningStore``) or its event log.
        adapter: ``"triplets"`` (``TracerTraceToTriplet``), ``"messages"`` (``TraceToMessages``),
            ``"proxy-triplets"`` (``LlmProxyTraceToTriplet``), ``"module:callable"``, or a callable
            of an attempt's spans returning a list of items.
        since, until: Select attempts that started at or after / at or before a bound: an ``int``
            is a log position (stream sequence), a ``float`` seconds since the epoch, a ``str`` as
            ``parse_bound`` reads it, or a ``Bound``.
        statuses: Attempt statuses to keep (e.g. ``"succeeded"``).
        modes, resources_ids: The rollout's ``mode`` / ``resources_id`` to keep.
        min_reward: Keep attempts whose final reward is at least this (none: dropped).
        reward: A function of an attempt's spans returning its new reward (relabelling), or its
            ``"module:callable"``: a finite number or ``None``; anything else (NaN, a string)
            fails that attempt, as an exception it raises does.
        on_progress: Called now and then with the ``ReplayStats``.
        workers: Processes that run the adapter (``eventlight.logreplay.parallel``): with 2 or more,
            attempts are adapted in worker processes, starting while the log is still read, and
            the records are the same, in the same order. Only for an adapter and reward function
            given by name (a string); with objects the adapter runs in this process. The
            processes start with ``multiprocessing``'s ``forkserver``, so a script calling this
            needs the usual ``if __name__ == "__main__":`` guard.
        llm_call_match: With ``adapter="triplets"`` only: the regex (``re.search`` on span names)
            that marks LLM calls, instead of Agent-lightning's ``openai\\.chat\\.completion``; e.g.
            ``r"^chat "`` for spans named in OpenTelemetry's GenAI conventions (``chat gpt-4o``).
            In the worker processes too.

    Returns:
        A ``Replay``: iterate it for the records; ``errors`` lists the attempts that failed. A
        range that selects nothing whatever the log holds (``range_outside_log``: past its end,
        before its start, a time on an empty log) is logged at WARNING once the log is read, with
        the lines ``eventlight replay`` prints.

    Raises:
        InvalidInputError: An unknown adapter or reward spec, attempt status or rollout mode, a
            namespace without a stream (when iterating), a range whose start is after its end
            (when iterating, for a position and a time: ``check_mixed_range``), a ``min_reward``
            that is not a finite number,
            ``workers`` not a whole number from 1 to ``MAX_WORKERS``, or an ``llm_call_match`` that
            is no regex or given with another adapter than ``"triplets"``.
        ServiceUnavailableError: NATS cannot be reached, or (``Settings`` without ``nats_url``) no
            embedded server runs (when iterating).
    """
    lo, hi = as_bound(since), as_bound(until)
    check_range(lo, hi)
    filters = Filters(
        since=lo,
        until=hi,
        statuses=_set(statuses, ATTEMPT_STATUSES, "attempt status"),
        modes=_set(modes, ROLLOUT_MODES, "rollout mode"),
        resources_ids=_set(resources_ids),
    )
    if min_reward is not None and (
        isinstance(min_reward, bool) or not isinstance(min_reward, (int, float)) or not math.isfinite(min_reward)
    ):
        raise InvalidInputError(f"min_reward must be a finite number, got {min_reward!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise InvalidInputError(f"workers must be a whole number from 1 to {MAX_WORKERS}, got {workers!r}")
    return Replay(source, adapter, filters, min_reward, reward, on_progress, workers, llm_call_match)


def parse_bound(text: str) -> Bound:
    """``"1234"`` (a log position) or an ISO 8601 time (``"2026-05-01"``, ``"2026-05-01T12:00:00Z"``;
    without a zone, UTC).

    Raises:
        InvalidInputError: Neither.
    """
    from datetime import UTC, datetime

    text = text.strip()
    if text.isascii() and text.isdigit():  # not str.isdigit alone: "²" is a digit int() refuses
        return Bound(seq=int(text))
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidInputError(
            f"{text!r} is neither a log position (an integer) nor an ISO 8601 time (e.g. 2026-05-01T12:00:00Z)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return Bound(time=when.timestamp())


def as_bound(value: Bound | int | float | str | None) -> Bound | None:
    if value is None or isinstance(value, Bound):
        return value
    if isinstance(value, bool):
        raise InvalidInputError(f"not a range bound: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidInputError(f"a log position is at least 0, not {value}")
        return Bound(seq=value)
    if isinstance(value, float):
        return Bound(time=value)
    return parse_bound(value)


def check_range(lo: Bound | None, hi: Bound | None) -> None:
    """Refuse a range whose start is after its end (when both are positions or both are times).

    Raises:
        InvalidInputError: It is.
    """
    if lo is None or hi is None:
        return
    if lo.seq is not None and hi.seq is not None and lo.seq > hi.seq:
        raise InvalidInputError(f"bad range: --since {lo.seq} is after --until {hi.seq}")
    if lo.time is not None and hi.time is not None and lo.time > hi.time:
        raise InvalidInputError("bad range: --since is later than --until")


def check_mixed_range(filters: Filters, entry: tuple[int, float] | None, head_seq: int) -> None:
    """Refuse a range of a log position and a time whose start is after its end, as ``check_range``
    does when both are of one kind: once the log is read, the position is compared through the
    ``time`` of its entry (``entry``: that entry's position and time, or the last one's before it).
    A ``--since`` position past the end of the log is left to the caller's warning.

    Raises:
        InvalidInputError: It is.
    """
    lo, hi = filters.since, filters.until
    if entry is None or lo is None or hi is None:
        return
    seq, position_time = entry
    bound = lo.seq if lo.seq is not None else hi.seq
    last = "" if seq == bound else f", the last entry up to {bound},"
    written = f"log position {seq}{last} was written at {_iso(position_time)}"
    if lo.seq is not None and hi.time is not None and lo.seq <= head_seq and position_time > hi.time:
        raise InvalidInputError(f"bad range: --since {lo.seq} is later than --until {_iso(hi.time)} ({written})")
    if lo.time is not None and hi.seq is not None and lo.time > position_time:
        raise InvalidInputError(f"bad range: --since {_iso(lo.time)} is later than --until {hi.seq} ({written})")


UNMATCHED_NAMES_SHOWN = 20
"""Span names ``unmatched_warning`` lists; the rest are counted."""


def unmatched_warning(run: Replay) -> str | None:
    """One line for the attempts in which no span matched the ``triplets`` adapter's
    ``llm_call_match`` (they gave no record), with the span names seen in them and in how many
    attempts each, most frequent first; ``None`` when there were none. ``eventlight replay`` prints
    it as a warning; ``eventlight.replay`` logs it at WARNING once the replay ends (the adapter's
    own warning per attempt is off).
    """
    n = run.stats.unmatched
    if not n:
        return None
    pattern = getattr(run.adapter, "llm_call_match", None)
    ranked = sorted(run.unmatched_names.items(), key=lambda item: (-item[1], item[0]))
    names = ", ".join(f"{name} ({count})" for name, count in ranked[:UNMATCHED_NAMES_SHOWN])
    more = f", … ({len(ranked) - UNMATCHED_NAMES_SHOWN} more)" if len(ranked) > UNMATCHED_NAMES_SHOWN else ""
    return (
        f"no span matched llm_call_match={pattern!r} in {n} attempt(s), which gave no record; "
        f"span names seen (attempts): {names or 'none'}{more}"
    )


def left_out_warning(run: Replay) -> str | None:
    """One line for the attempts whose LLM calls the ``triplets`` adapter all left out (they gave no
    record), with its counts over them in words (``AdapterStats``); ``None`` when there were none.
    ``eventlight replay`` prints it as a warning; ``eventlight.replay`` logs it at WARNING once the
    replay ends (the adapter's own warning per attempt, which named no attempt, is off).
    """
    n = run.stats.left_out
    if not n:
        return None
    return f"no triplet from {n} attempt(s): all their LLM calls were left out ({run.left_out_stats})"


def range_outside_log(filters: Filters, stats: ReplayStats) -> list[str]:
    """Why the range selects nothing, whatever the log holds, once it is read: a ``since`` past its
    end (a position after its head, a time after its last event) or an ``until`` before its start (a
    position before its first entry, a time before its first event), or a time bound on a log of no
    event (``"... selects nothing: the log is empty"``). One line each; ``[]`` if none.
    ``eventlight replay`` prints them as warnings (it writes an empty file and exits 0);
    ``eventlight.replay`` logs them at WARNING.
    """
    lo, hi, out = filters.since, filters.until, []
    no_event = "the log is empty" if not stats.head_seq else "the log holds no event"
    for flag, bound in (("--since", lo), ("--until", hi)):
        if bound is not None and bound.time is not None and stats.last_time is None:
            out.append(f"{flag} {_iso(bound.time)} selects nothing: {no_event}")
    if lo is not None and lo.seq is not None and lo.seq > stats.head_seq:
        out.append(f"--since {lo.seq} is past the end of the log: it ends at sequence {stats.head_seq}")
    if lo is not None and lo.time is not None and stats.last_time is not None and lo.time > stats.last_time:
        out.append(
            f"--since {_iso(lo.time)} is past the end of the log: no event at or after that time; "
            f"its last event is at {_iso(stats.last_time)}"
        )
    if hi is not None and hi.seq is not None and hi.seq < stats.first_seq:
        out.append(f"--until {hi.seq} is before the start of the log: it begins at sequence {stats.first_seq}")
    if hi is not None and hi.time is not None and stats.first_time is not None and hi.time < stats.first_time:
        out.append(
            f"--until {_iso(hi.time)} is before the start of the log: no event at or before that time; "
            f"its first event is at {_iso(stats.first_time)}"
        )
    return out


def _iso(seconds: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(seconds, UTC).isoformat()
