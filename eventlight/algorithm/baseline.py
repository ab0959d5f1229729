"""``Baseline``: run every task through the runners and log what came back (Agent-lightning ``Baseline``).

A smoke test for the plumbing (store, runners, tracer, adapter) that trains nothing. Where
Agent-lightning polls the queue and each rollout every ``polling_interval`` seconds, this one is
event-driven: each rollout has a harvest task blocked in ``store.wait_for_rollouts``, and the
enqueue loop waits on those tasks when ``max_queue_length`` rollouts are unfinished.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any, Literal, get_args

from eventlight.algorithm.base import Dataset, FastAlgorithm
from eventlight.algorithm.checks import MAX_COUNT, check_choice, check_int, check_number
from eventlight.core.errors import InvalidInputError
from eventlight.core.types import Rollout, Span

log = logging.getLogger(__name__)

__all__ = ["Baseline"]

SpanVerbosity = Literal["keys", "key_values", "none"]


def _iso(t: float | None) -> str:
    if t is None:
        return "?"
    try:
        return dt.datetime.fromtimestamp(t, tz=dt.UTC).isoformat()
    except (OverflowError, OSError, ValueError):  # no time in seconds (nanoseconds, NaN): shown as it is
        return repr(t)


def format_span(span: Span, verbosity: SpanVerbosity) -> str:
    """One log line for a span: ids, sequence, name, times and attribute keys (or values)."""
    took = "?" if span.start_time is None or span.end_time is None else f"{span.end_time - span.start_time:.3f}"
    head = (
        f"[Rollout {span.rollout_id} | Attempt {span.attempt_id} | Span {span.span_id}] #{span.sequence_id} "
        f"({span.name}) From {_iso(span.start_time)}, to {_iso(span.end_time)}, {took} seconds."
    )
    if verbosity == "key_values":
        return f"{head} Attributes: {span.attributes}"
    return f"{head} Attribute keys: {list(span.attributes)}"


class Baseline(FastAlgorithm):
    """Enqueue every train item (mode ``"train"``) then every val item (mode ``"val"``), ``n_epochs`` times.

    Initial resources, if any, are published as ``"default"`` (``store.update_resources``) and every
    rollout uses them. For each finished rollout it logs the status, each attempt, each span of
    the latest attempt and, if an adapter is set, the adapted data.

    Args:
        n_epochs: Passes over the data.
        train_split: Validated to lie strictly in (0, 1) but unused, exactly as in Agent-lightning
            0.3.0 (items are tagged by the list they came from).
        polling_interval: Accepted for compatibility; unused (waiting is event-driven).
        max_queue_length: At most this many enqueued rollouts are unfinished at any time.
        span_verbosity: ``"keys"`` (attribute keys), ``"key_values"`` (attributes) or ``"none"``.

    Raises:
        InvalidInputError: ``train_split`` not in (0, 1), ``n_epochs`` or ``max_queue_length`` below 1,
            a negative ``polling_interval``, or a ``span_verbosity`` other than the three (a
            ``ValueError``, as Agent-lightning raises for ``train_split``).
        InvalidTypeError: A number of the wrong type (``n_epochs=1.5``, ``train_split="0.8"``).
    """

    def __init__(
        self,
        *,
        n_epochs: int = 1,
        train_split: float = 0.5,
        polling_interval: float = 5.0,
        max_queue_length: int = 4,
        span_verbosity: SpanVerbosity = "keys",
    ):
        n_epochs = check_int("Baseline.n_epochs", n_epochs, 1, MAX_COUNT)
        train_split = check_number("Baseline.train_split", train_split, 0.0, above=True)
        if not train_split < 1.0:
            raise InvalidInputError(f"Baseline.train_split must be in (0, 1), got {train_split!r}")
        polling_interval = check_number("Baseline.polling_interval", polling_interval, 0.0)
        max_queue_length = check_int("Baseline.max_queue_length", max_queue_length, 1, MAX_COUNT)
        check_choice("Baseline.span_verbosity", span_verbosity, get_args(SpanVerbosity))
        self.n_epochs = n_epochs
        self.train_split = train_split
        self.polling_interval = polling_interval
        self.max_queue_length = max_queue_length
        self.span_verbosity = span_verbosity

    async def run(self, train_dataset: Dataset[Any] | None = None, val_dataset: Dataset[Any] | None = None) -> None:
        """Run all epochs; returns when every rollout finished and was logged.

        A span time that is no time in seconds (nanoseconds, NaN) is logged as it is. An error
        while a finished rollout is read back and logged (a store read failing) stops the run with
        that error, a note naming the rollout, as Agent-lightning's ``Baseline`` stops on it;
        the adapter failing on one rollout is logged and the run goes on.

        Raises:
            ValueError: The store is not set.
        """
        items = [(x, "train") for x in _items(train_dataset)] + [(x, "val") for x in _items(val_dataset)]
        if not items:
            log.error("Baseline: both train and val datasets are empty; nothing to run")
            return
        resources_id = await self._publish_resources()
        for epoch in range(self.n_epochs):
            log.info("Baseline epoch %d/%d: %d rollouts", epoch + 1, self.n_epochs, len(items))
            await self._run_epoch(items, resources_id)

    async def _publish_resources(self) -> str | None:
        resources = self.get_initial_resources()
        if not resources:
            log.warning("Baseline: no initial resources; rollouts use the store's latest resources")
            return None
        await self.get_store().update_resources("default", resources)
        return "default"

    async def _run_epoch(self, items: list[tuple[Any, str]], resources_id: str | None) -> None:
        store = self.get_store()
        pending: set[asyncio.Task[None]] = set()
        try:
            for item, mode in items:
                while len(pending) >= self.max_queue_length:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:  # a harvest that failed stops the run, as the gather below does
                        task.result()
                rollout = await store.enqueue_rollout(input=item, mode=mode, resources_id=resources_id)
                log.info("Baseline enqueued %s (mode=%s)", rollout.rollout_id, mode)
                pending.add(asyncio.create_task(self._harvest(rollout.rollout_id)))
            if pending:
                await asyncio.gather(*pending)
        finally:
            for task in pending:
                task.cancel()

    async def _harvest(self, rollout_id: str) -> None:
        store = self.get_store()
        try:
            done = await store.wait_for_rollouts(rollout_ids=[rollout_id], timeout=None)
            if not done:  # the store closed under the wait (the run is stopping): nothing finished to log
                return
            await self._log_rollout(done[0])
        except Exception as e:
            e.add_note(f"(Baseline was logging rollout {rollout_id})")
            raise

    async def _log_rollout(self, rollout: Rollout) -> None:
        store = self.get_store()
        log.info("Rollout %s finished: status=%s mode=%s", rollout.rollout_id, rollout.status, rollout.mode)
        for attempt in await store.query_attempts(rollout.rollout_id):
            log.info(
                "[Rollout %s | Attempt %s] #%d status=%s worker=%s",
                rollout.rollout_id,
                attempt.attempt_id,
                attempt.sequence_id,
                attempt.status,
                attempt.worker_id,
            )
        spans = list(await store.query_spans(rollout.rollout_id, attempt_id="latest"))
        if self.span_verbosity != "none":
            for span in spans:
                log.info("%s", format_span(span, self.span_verbosity))
        if self._adapter is not None:
            try:
                log.info("[Rollout %s] Adapted data: %s", rollout.rollout_id, self._adapter.adapt(spans))
            except Exception:
                log.exception("[Rollout %s] adapter %s failed", rollout.rollout_id, type(self._adapter).__name__)


def _items(dataset: Dataset[Any] | None) -> list[Any]:
    return [] if dataset is None else [dataset[i] for i in range(len(dataset))]
