"""``AdapterStats``: what an adapter left out or marked, so that no loss passes silently."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from eventlight.core.types import Span


@dataclass
class AdapterStats:
    """Counts of one or more ``adapt`` calls (issue 15: nothing lost without a mark).

    Attributes:
        llm_calls: LLM-call spans found (before anything was skipped).
        triplets: Records produced (triplets, or message records for ``TraceToMessages``).
        missing_token_ids: Calls lacking prompt or response token ids. ``TracerTraceToTriplet``
            keeps them, marked ``metadata["token_ids_missing"] = ["prompt"|"response", ...]``
            (skipped with ``_skip_empty_token_spans``); ``LlmProxyTraceToTriplet`` skips them.
        incomplete_token_ids: Calls whose span says ``token_ids_incomplete`` (the ids do not add up
            to the usage counts); kept, marked ``metadata["token_ids_incomplete"] = True``.
        errors: Calls whose span has status ``ERROR`` (an upstream 400, a timeout): skipped, they
            hold no completion.
        duplicates: Calls skipped as another copy of a call already taken: the same response id,
            or the same output (``eventlight.adapter.dedup``); the copy with token ids is kept.
        cycles_cut: Parent-link cycles in the spans (bad input) cut to build the span tree; their
            spans are kept, the first of each cycle taken as a root.
    """

    llm_calls: int = 0
    triplets: int = 0
    missing_token_ids: int = 0
    incomplete_token_ids: int = 0
    errors: int = 0
    duplicates: int = 0
    cycles_cut: int = 0

    def __str__(self) -> str:
        """The counts in words, those at 0 left out: ``1 LLM call(s), 0 record(s); 1 failed (span
        status ERROR)`` (the dataclass ``repr`` listed every field by name)."""
        parts = [f"{n} {words}" for field, words in _IN_WORDS if (n := getattr(self, field))]
        head = f"{self.llm_calls} LLM call(s), {self.triplets} record(s)"
        return head + (f"; {', '.join(parts)}" if parts else "")

    def add(self, other: AdapterStats) -> None:
        """Add ``other``'s counts to these."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    @property
    def skipped(self) -> int:
        """Calls that gave no record."""
        return self.llm_calls - self.triplets


_IN_WORDS = (
    ("errors", "failed (span status ERROR)"),
    ("duplicates", "duplicate(s) of a call kept"),
    ("missing_token_ids", "without token ids"),
    ("incomplete_token_ids", "with incomplete token ids"),
    ("cycles_cut", "parent-link cycle(s) cut"),
)


class CountingAdapter:
    """Mixed into adapters: ``stats`` adds up every call, ``last_stats`` is the latest one's."""

    _stats: AdapterStats | None = None
    last_stats: AdapterStats | None = None

    @property
    def stats(self) -> AdapterStats:
        """Counts over every ``adapt`` call of this adapter so far."""
        if self._stats is None:
            self._stats = AdapterStats()
        return self._stats

    def reset_stats(self) -> None:
        """Start counting again from zero."""
        self._stats, self.last_stats = AdapterStats(), None

    def _counted(self, stats: AdapterStats) -> None:
        self.last_stats = stats
        self.stats.add(stats)


def is_error(span: Span) -> bool:
    """The span recorded a failed operation (OpenTelemetry status ``ERROR``)."""
    return span.status is not None and span.status.status_code == "ERROR"
