"""What a subscription yields: one ``FinishedAttempt`` per attempt as it finishes."""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec

from eventlight.core.errors import InvalidInputError
from eventlight.core.types import Attempt, Rollout, Span
from eventlight.logreplay.records import AdapterFn, spans_of_batches
from eventlight.rewards import find_final_reward

log = logging.getLogger(__name__)

_DURABLE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_durable(name: Any) -> str | None:
    """A subscription's durable name, or ``None``: 1-64 letters, digits, ``_`` or ``-`` (a valid
    JetStream consumer name on every backend: no dots, spaces, wildcards or path separators).

    Raises:
        InvalidInputError: Anything else.
    """
    if name is None:
        return None
    if not isinstance(name, str) or not _DURABLE.match(name):
        raise InvalidInputError(
            f"durable={name!r} is not a valid subscription name: use 1-64 letters, digits, '_' or '-' "
            "(JetStream consumer names allow no dots, spaces, wildcards or slashes)"
        )
    return name


class FinishedAttempt(msgspec.Struct, frozen=True, kw_only=True):
    """An attempt that has finished, with the adapter's output for it.

    Attributes:
        rollout: The rollout as the log had it at ``position`` (``rollout.status`` terminal and
            ``latest``: its last attempt; otherwise a retry may follow).
        attempt: The attempt at ``position`` as the read model has it there, spans included
            (``status`` ``succeeded``, ``failed``, ``timeout``, or, when the rollout ended first,
            ``unresponsive``/``running``/``preparing``).
        latest: Whether ``attempt`` was its rollout's latest at ``position`` (the one its status
            follows). ``False``: an earlier attempt, superseded by a retry (its runner went silent,
            say), that finished late or was still live when its rollout ended; its spans are not
            the rollout's result (peer failures C03, C16).
        data: The adapter's output for the attempt's spans: triplets (``TracerTraceToTriplet``),
            conversations (``TraceToMessages``), ...; ``[]`` when there were no spans or it failed.
        spans: The attempt's spans in the log before ``position``, ordered by ``sequence_id``.
        final_reward: ``find_final_reward(spans)`` (``None``: no reward span).
        position: The log position (stream sequence) of the event that finished the attempt:
            increasing along a subscription; what a consumer records to drop a redelivery. From
            ``collect`` for a rollout that ended after its latest attempt finished (cancelled while
            it waited for its retry): the event that ended the rollout.
        started_position: The log position of the attempt's ``AttemptStarted``.
        span_positions: Log positions of the span batches ``spans`` came from.
        redelivered: This subscription's name delivered it before without an acknowledgement (its
            previous holder died or closed with it in hand).
        errors: What went wrong with this attempt's data (a malformed span batch, by log position;
            the adapter's exception); ``data`` then holds what could be made.
    """

    rollout: Rollout
    attempt: Attempt
    data: Any
    spans: list[Span]
    final_reward: float | None
    position: int
    latest: bool
    started_position: int | None
    span_positions: list[int]
    redelivered: bool = False
    errors: list[str] = msgspec.field(default_factory=list)

    @property
    def rollout_id(self) -> str:
        return self.rollout.rollout_id

    @property
    def attempt_id(self) -> str:
        return self.attempt.attempt_id

    @property
    def resources_id(self) -> str | None:
        return self.rollout.resources_id

    @property
    def status(self) -> str:
        """The attempt's status."""
        return self.attempt.status


class SubscriptionError(msgspec.Struct, frozen=True):
    """Something a subscription skipped or could not adapt, with where it is in the log."""

    position: int
    rollout_id: str | None
    attempt_id: str | None
    error: str


def adapt(
    rollout: Rollout,
    attempt: Attempt,
    latest: bool,
    batches: list[tuple[int, bytes]],
    adapter: AdapterFn,
    position: int,
    started: int | None,
    redelivered: bool,
) -> tuple[FinishedAttempt, list[SubscriptionError]]:
    """The ``FinishedAttempt`` of an attempt from its raw span batches; a malformed batch or an
    adapter or reward failure is recorded (in the record and as errors) and the rest kept."""
    bad: list[tuple[int, str]] = []
    spans, positions = spans_of_batches(batches, bad)
    why = [f"log position {pos}: span batch skipped: {e}" for pos, e in bad]
    at = [pos for pos, _ in bad]
    final: float | None = None
    try:
        final = find_final_reward(spans)
    except Exception as e:  # a malformed reward span
        why.append(f"reward: {type(e).__name__}: {e}")
        at.append(position)
    data: Any = []
    try:
        data = adapter(spans) if spans else []
    except Exception as e:  # the adapter (the user's, maybe), whatever it raises
        why.append(f"adapter {type(adapter).__name__}: {type(e).__name__}: {e}")
        at.append(position)
    rid, aid = rollout.rollout_id, attempt.attempt_id
    errors = [SubscriptionError(pos, rid, aid, w) for pos, w in zip(at, why, strict=True)]
    for w in why:
        log.warning("subscription: rollout %s attempt %s (finished at %d): %s", rid, aid, position, w)
    record = FinishedAttempt(
        rollout=rollout,
        attempt=attempt,
        data=data,
        spans=spans,
        final_reward=final,
        position=position,
        latest=latest,
        started_position=started,
        span_positions=positions,
        redelivered=redelivered,
        errors=why,
    )
    return record, errors
