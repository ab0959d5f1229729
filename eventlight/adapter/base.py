"""The adapter base classes and the reward-matching policy of ``TracerTraceToTriplet``."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Generic, TypeVar

from opentelemetry.sdk.trace import ReadableSpan

from eventlight.adapter.stats import CountingAdapter
from eventlight.core.types import Span, Triplet

T_from = TypeVar("T_from")
T_to = TypeVar("T_to")


class Adapter(Generic[T_from, T_to]):
    """Converts data of one shape into another; calling the adapter calls ``adapt``."""

    def __call__(self, source: T_from, /) -> T_to:
        return self.adapt(source)

    def adapt(self, source: T_from, /) -> T_to:
        """Convert ``source``.

        Raises:
            NotImplementedError: Subclasses must override it.
        """
        raise NotImplementedError(f"{type(self).__name__}.adapt is not implemented")


class TraceAdapter(Adapter[Sequence[Span], T_to], Generic[T_to]):
    """An adapter from the spans of one attempt (ordered by ``sequence_id``)."""


class OtelTraceAdapter(Adapter[Sequence[ReadableSpan], T_to], Generic[T_to]):
    """An adapter from OpenTelemetry ``ReadableSpan`` objects (0.3.0's base of OTel adapters);
    ``eventlight.otel.span_from_readable`` turns one into a ``Span`` for the trace adapters."""


class TraceToTripletBase(CountingAdapter, TraceAdapter[list[Triplet]]):
    """An adapter from spans to a trajectory of ``Triplet`` (prompt, response, reward).

    ``stats`` / ``last_stats`` (``AdapterStats``) count what was skipped or marked: LLM calls whose
    span is an error, duplicates, calls with missing or incomplete token ids.
    """


class RewardMatchPolicy(StrEnum):
    """How ``TracerTraceToTriplet`` credits reward spans to LLM calls.

    Both give each reward to the latest not-yet-rewarded LLM call that **ended before the reward
    started**; they differ in which calls are candidates.
    """

    FIRST_OCCURRENCE = "first_occurrence"
    """Any LLM call of the trace, walking all spans in start-time order (the default)."""

    FIRST_SIBLING = "first_sibling"
    """Only LLM calls that are siblings of the reward span (children of the same parent)."""
