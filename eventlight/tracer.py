"""Tracers: record an attempt's OpenTelemetry spans and stream them to the store in batches.

``OtelTracer`` owns an OpenTelemetry SDK ``TracerProvider`` with a ``StreamSpanProcessor``. Inside
``trace_context(rollout_id=..., attempt_id=...)`` every span that ends is buffered; a flusher task
sends the buffer every ``flush_interval_s`` seconds (and once more when the context exits): it
reserves one sequence id per span from the store, in the order the spans ended, converts them and
publishes them with ``add_many_spans``, which on the JetStream backend is one stream message per
batch. Spans therefore reach the stream while the agent still runs (they are its heartbeat), at
the cost of a few store calls per batch rather than per span.

Unlike Agent-lightning 0.3.0, the active tracer and the current attempt are context variables, so
concurrent rollouts in one process (asyncio tasks) do not collide (``seed_runtime.md`` §8 #19). A
thread the agent starts does not inherit them; while a single trace context is open in the process,
spans and emitters there go to it, as with 0.3.0's process-wide tracer (``get_active_tracer``). In
the rollout's own thread only the context counts, so an in-process server on the same event loop
(the LLM proxy) does not record its spans into the rollout. A
span that ends after its attempt finished (a task the agent left running) is not recorded, and the
first one is logged as a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.sdk.resources import Resource as OtelSdkResource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import Status, StatusCode

from eventlight import instrumentation
from eventlight.core.errors import InvalidInputError
from eventlight.core.types import Span, TraceStatus
from eventlight.otel import span_from_readable
from eventlight.recording import SpanCoreFields as SpanCoreFields  # re-exported: its import path stays
from eventlight.recording import _core, _Recording
from eventlight.store.base import LightningStore
from eventlight.unavailable import unavailable_class

log = logging.getLogger(__name__)

_active_tracer: contextvars.ContextVar[Tracer | None] = contextvars.ContextVar("eventlight_tracer", default=None)
_current_attempt: contextvars.ContextVar[_AttemptBuffer | None] = contextvars.ContextVar(
    "eventlight_attempt", default=None
)


def set_active_tracer(tracer: Tracer) -> None:
    """Make ``tracer`` the active tracer of the current context (0.3.0: of the process; here a
    context variable, so concurrent rollouts in one process keep their own)."""
    _active_tracer.set(tracer)


def clear_active_tracer() -> None:
    """Forget the active tracer of the current context."""
    _active_tracer.set(None)


def get_active_tracer() -> Tracer | None:
    """The tracer whose ``trace_context`` the caller runs in, or ``None``.

    A thread the agent starts (``ThreadPoolExecutor``, ``loop.run_in_executor``) does not inherit
    the rollout's context; there, while exactly one trace context is open in the process (one
    runner per process, as 0.3.0's process-wide active tracer assumes), its tracer is the answer.
    With several open (``--per-process K``), a thread must carry the context itself
    (``contextvars.copy_context().run``, ``asyncio.to_thread``). In the thread whose event loop
    runs the rollout only the context counts: a task there that the agent did not start (an
    in-process server) has no active tracer.
    """
    tracer = _active_tracer.get()
    if tracer is None and (sole := _sole_open()) is not None:
        return sole[0]
    return tracer


_open: list[tuple[Tracer, _AttemptBuffer | None, int]] = []  # trace contexts open here, with their loop's thread
_open_lock = threading.Lock()


def open_trace_contexts() -> int:
    """How many trace contexts are open in this process."""
    return len(_open)


def _sole_open() -> tuple[Tracer, _AttemptBuffer | None] | None:
    """The only trace context open in this process, if exactly one is and the caller runs in another
    thread than the one it was opened in.

    In the rollout's own thread the context variables are the answer: a task there without the
    attempt in its context was not started by the agent (an in-process server such as the LLM
    proxy, serving on the same event loop), and its spans are not the rollout's.
    """
    open_now = _open
    if len(open_now) != 1:
        return None
    tracer, buf, thread = open_now[0]
    return None if thread == threading.get_ident() else (tracer, buf)


class Tracer:
    """Base class of tracers (Agent-lightning ``Tracer``)."""

    def __init__(self) -> None:
        self.worker_id: int | None = None
        self._store: LightningStore | None = None

    def init(self, *args: Any, **kwargs: Any) -> None:
        """Called once in the main process."""

    def init_worker(self, worker_id: int, store: LightningStore | None = None) -> None:
        """Called once in each runner process with the store traces go to."""
        self.worker_id = worker_id
        self._store = store

    def teardown_worker(self, worker_id: int) -> None:
        """Called once in each runner process at the end."""

    def teardown(self) -> None:
        """Called once in the main process at the end."""

    def trace_context(
        self, name: str | None = None, *, rollout_id: str | None = None, attempt_id: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[Any]:
        raise NotImplementedError

    def get_last_trace(self) -> list[Span]:
        return []

    def undelivered_spans(self) -> int:
        """Spans of the most recent trace context that never reached the store (0: all did)."""
        return 0

    def create_span(
        self,
        name: str,
        attributes: dict[str, Any] | None = None,
        timestamp: float | None = None,
        status: TraceStatus | None = None,
    ) -> SpanCoreFields:
        raise NotImplementedError

    def operation_context(self, name: str, attributes: dict[str, Any] | None = None) -> Any:
        raise NotImplementedError


class DummyTracer(Tracer):
    """Records nothing anywhere; emitters with ``propagate=False`` use it to build span fields."""

    def create_span(
        self,
        name: str,
        attributes: dict[str, Any] | None = None,
        timestamp: float | None = None,
        status: TraceStatus | None = None,
    ) -> SpanCoreFields:
        at = timestamp if timestamp is not None else time.time()
        return SpanCoreFields(
            name=name,
            status=status or TraceStatus(status_code="OK"),
            attributes=dict(attributes or {}),
            start_time=at,
            end_time=at,
        )


class _AttemptBuffer:
    def __init__(self, store: LightningStore, rollout_id: str, attempt_id: str):
        self.store = store
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id
        self.pending: list[ReadableSpan] = []
        self.recorded: list[Span] = []
        self.wake = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.thread = threading.get_ident()  # the loop's
        self.closing = False
        self.done = False  # the attempt's spans were sent for the last time
        self.late = 0  # spans that ended after that (a task the agent left running): not recorded
        self.undelivered = 0  # still pending after the last flush
        self.refused = 0  # refused by the store as bad input
        self.refusal = ""

    async def flush(self) -> None:
        """Send the spans that ended so far; they leave the buffer only once the store has them.

        A batch the store refuses as bad input (``InvalidInputError``: e.g. a span over the 8 MiB an
        event may hold) is sent again span by span; the spans it still refuses are dropped, counted
        in ``refused`` and logged with the store's reason, the others are stored.
        """
        if not self.pending:
            return
        batch = list(self.pending)
        spans = [span_from_readable(s, self.rollout_id, self.attempt_id, 0) for s in batch]
        try:
            await self.store.add_spans_numbered(self.rollout_id, self.attempt_id, spans)
        except InvalidInputError as exc:
            if len(spans) == 1:
                self._refuse(spans[0], exc)
            else:
                await self._one_by_one(spans)
        else:
            self.recorded.extend(spans)
        del self.pending[: len(batch)]  # spans that ended meanwhile stay for the next flush

    async def _one_by_one(self, spans: list[Span]) -> None:
        for span in spans:
            try:
                await self.store.add_spans_numbered(self.rollout_id, self.attempt_id, [span])
            except InvalidInputError as exc:
                self._refuse(span, exc)
            else:
                self.recorded.append(span)

    def _refuse(self, span: Span, exc: Exception) -> None:
        self.refused += 1
        self.refusal = str(exc)
        log.error(
            "rollout %s attempt %s: the store refused span %r: %s", self.rollout_id, self.attempt_id, span.name, exc
        )


class StreamSpanProcessor(SpanProcessor):
    """Buffers spans that end inside a trace context; the context's flusher sends them."""

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        buf = _current_attempt.get()
        if buf is None and (sole := _sole_open()) is not None:  # a thread the agent started (0.3.0 takes it too)
            buf = sole[1]
        if buf is None or not span.context.trace_flags.sampled:
            return
        if buf.done:  # e.g. from a task the agent left running: the attempt has finished
            buf.late += 1
            if buf.late == 1:
                log.warning(
                    "rollout %s attempt %s: span %r ended after the attempt finished (a task or thread the agent"
                    " left running?); it is not recorded, nor are later ones of this attempt",
                    buf.rollout_id,
                    buf.attempt_id,
                    span.name,
                )
            return
        buf.pending.append(span)
        if len(buf.pending) >= 256:
            if threading.get_ident() == buf.thread:
                buf.wake.set()
            else:  # a synchronous agent's thread (``LitAgentRunner.sync_agent_in_thread``)
                buf.loop.call_soon_threadsafe(buf.wake.set)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class OtelTracer(Tracer):
    """A plain OpenTelemetry tracer whose spans stream to the store.

    Args:
        flush_interval_s: Longest time a finished span waits before it is sent while the attempt
            runs; all are sent when its trace context exits. The OpenTelemetry SDK's
            ``BatchSpanProcessor`` waits 5 s; 1 s keeps spans live for anyone watching while a
            short rollout sends one or two batches instead of one every few rounds (the bench's
            ``single`` scenario: 25 % less CPU per rollout than with 0.05 s).
        instrument: Frameworks to instrument in each runner process with this tracer's provider,
            undone at ``teardown_worker`` (``eventlight.instrumentation.Instrumented``); an unknown
            name raises ``InvalidInputError`` at once, a missing package at ``init_worker``.

    Its provider becomes the process's global OpenTelemetry provider when none is set yet, so
    libraries instrumented with OpenTelemetry report into it too.
    """

    def __init__(self, *, flush_interval_s: float = 1.0, instrument: str | Sequence[str] = ()):
        super().__init__()
        self.flush_interval_s = flush_interval_s
        self.instrumented = instrumentation.Instrumented(instrument)
        self.provider: TracerProvider | None = None
        self._otel: trace_api.Tracer | None = None
        self._last: list[Span] = []
        self._undelivered = 0
        self._refusal = ""

    def init_worker(self, worker_id: int, store: LightningStore | None = None) -> None:
        super().init_worker(worker_id, store)
        if self.provider is None:
            self.provider = TracerProvider(resource=OtelSdkResource.create({"service.name": "eventlight-runner"}))
            self.provider.add_span_processor(StreamSpanProcessor())
            if isinstance(trace_api.get_tracer_provider(), trace_api.ProxyTracerProvider):
                trace_api.set_tracer_provider(self.provider)
            self._otel = self.provider.get_tracer("eventlight")
        self.instrumented.switch_on(self.provider)

    def teardown_worker(self, worker_id: int) -> None:
        self.instrumented.switch_off()

    def _tracer(self) -> trace_api.Tracer:
        if self._otel is None:
            raise RuntimeError("OtelTracer is not initialized; call init_worker() first")
        return self._otel

    @contextlib.asynccontextmanager
    async def trace_context(
        self,
        name: str | None = None,
        *,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        store: LightningStore | None = None,
    ) -> AsyncIterator[trace_api.Tracer]:
        """Record the spans of one attempt and stream them to the store.

        Raises:
            ValueError: Only one of ``rollout_id``/``attempt_id`` was given, or ids without a store.
        """
        tracer = self._tracer()
        if (rollout_id is None) != (attempt_id is None):
            raise ValueError("rollout_id and attempt_id must be either all provided or all None")
        store = store or self._store
        if rollout_id is not None and store is None:
            raise ValueError("store is required to be initialized when rollout_id and attempt_id are provided")
        buf = _AttemptBuffer(store, rollout_id, attempt_id) if rollout_id and store else None  # type: ignore[arg-type]
        tracer_token = _active_tracer.set(self)
        attempt_token = _current_attempt.set(buf)
        entry = (self, buf, threading.get_ident())
        with _open_lock:
            _open.append(entry)
        flusher = asyncio.create_task(self._flush_loop(buf)) if buf else None
        try:
            yield tracer
        finally:
            with _open_lock:
                _open.remove(entry)
            _current_attempt.reset(attempt_token)
            _active_tracer.reset(tracer_token)
            if flusher is not None and buf is not None:
                # Stop the flusher by asking, not by cancelling: a cancellation could land inside a
                # store call (and Python 3.11's wait_for may even swallow it), losing or hanging a batch.
                buf.closing = True
                buf.wake.set()
                try:
                    await asyncio.shield(flusher)
                except asyncio.CancelledError:
                    flusher.cancel()
                    raise
                finally:
                    buf.done = True
                    if buf.pending and flusher.done() and not flusher.cancelled() and not buf.undelivered:
                        buf.late += len(buf.pending)  # ended between the last flush and now
                    self._last = buf.recorded
                    lost = buf.undelivered if not flusher.cancelled() else len(buf.pending)
                    self._undelivered = lost + buf.refused
                    self._refusal = buf.refusal

    async def _flush_loop(self, buf: _AttemptBuffer | None) -> None:
        """Send the buffer every ``flush_interval_s`` (or when it fills); a last time when closing."""
        assert buf is not None
        while not buf.closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(buf.wake.wait(), self.flush_interval_s)
            buf.wake.clear()
            await self._flush_logged(buf)
        for delay in (0.0, 0.2, 1.0):  # the attempt ends after this: try harder before giving up
            await asyncio.sleep(delay)
            await self._flush_logged(buf)
            if not buf.pending:
                return
        buf.undelivered = len(buf.pending)
        log.error("dropped %d spans of rollout %s attempt %s", len(buf.pending), buf.rollout_id, buf.attempt_id)

    @staticmethod
    async def _flush_logged(buf: _AttemptBuffer) -> None:
        try:
            await buf.flush()
        except Exception:
            log.exception(
                "could not send %d spans of rollout %s attempt %s; will retry",
                len(buf.pending),
                buf.rollout_id,
                buf.attempt_id,
            )

    def get_last_trace(self) -> list[Span]:
        """Spans recorded (with their store sequence ids) by the most recent trace context."""
        return list(self._last)

    def undelivered_spans(self) -> int:
        """Spans of the most recent trace context that the store refused as bad input, or that were
        still unsent after the last flush's three tries (0 s, 0.2 s, 1 s); the runner then records
        the attempt ``failed`` with that reason."""
        return self._undelivered

    def last_refusal(self) -> str:
        """The store's reason for the last span it refused in the most recent trace context (or "")."""
        return self._refusal

    def create_span(
        self,
        name: str,
        attributes: dict[str, Any] | None = None,
        timestamp: float | None = None,
        status: TraceStatus | None = None,
    ) -> SpanCoreFields:
        """Start and end an instantaneous span (emitters use this); it nests under the current span."""
        ts = int(timestamp * 1e9) if timestamp is not None else None
        span = self._tracer().start_span(name, attributes=attributes or {}, start_time=ts)
        if status is not None and status.status_code != "UNSET":
            span.set_status(Status(StatusCode[status.status_code], status.description))
        span.end(end_time=ts)
        return _core(span)

    @contextlib.contextmanager
    def operation_context(self, name: str, attributes: dict[str, Any] | None = None) -> Iterator[_Recording]:
        """Record a span over a block; exceptions mark it ``ERROR`` and propagate."""
        with self._tracer().start_as_current_span(
            name, attributes=attributes or {}, record_exception=True, set_status_on_exception=True
        ) as span:
            rec = _Recording(span)
            yield rec
        rec.done = _core(span)


AgentOpsTracer = unavailable_class(
    "AgentOpsTracer",
    "eventlight does not run AgentOps' server manager; use OtelTracer (the default tracer of "
    "LitAgentRunner), which records the same OpenTelemetry spans, AgentOps-instrumented ones included",
    __name__,
)
