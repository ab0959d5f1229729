"""When an attempt or a rollout has finished: the one rule ``wait_for_rollouts`` and the subscribers share.

Pure. Both read the same events of the log (a rollout's ``r.<rid>.e`` subject carries every
terminal status: ``enters_queue`` never does) and decide "finished" here:

* ``terminal_status(payload)``: the rollout status a raw event carries when it is terminal
  (``succeeded``, ``failed``, ``cancelled``), decoding only the status fields; what
  ``wait_for_rollouts`` follows on the stream.
* ``attempt_done(attempt, rollout)``: an attempt is done once its status is final (``succeeded``,
  ``failed``, ``timeout``) or its rollout's is terminal (an ``unresponsive`` or running attempt of a
  cancelled or failed rollout). Both only ever move forward, so "done" does too: each attempt
  becomes done at exactly one log position, the same however the log is read.
* ``newly_done(before, after)``: the attempts an event made done (what a subscriber yields).
"""

from __future__ import annotations

import msgspec

from eventlight.core.commands import RolloutState
from eventlight.core.types import TERMINAL_ROLLOUT_STATUSES, Attempt, Rollout

FINAL_ATTEMPT_STATUSES = frozenset({"succeeded", "failed", "timeout"})
"""Attempt statuses nothing moves on from (``unresponsive`` is revived by a span)."""


class _RolloutStatus(msgspec.Struct):
    status: str | None = None


class _StatusPeek(msgspec.Struct):
    """The rollout status an event carries, if any: ``AttemptStarted``/``AttemptUpdated``'s
    ``rollout_status``, ``RolloutUpdated``'s ``status``, ``RolloutCreated``'s ``rollout.status``;
    decoding only these fields skips the rest of the event (inputs, metadata)."""

    rollout_status: str | None = None
    status: str | None = None
    rollout: _RolloutStatus | None = None
    type: str = ""


_status_peek = msgspec.json.Decoder(_StatusPeek)


def terminal_status(payload: bytes) -> str | None:
    """The terminal rollout status the encoded event ``payload`` sets, or ``None`` (none, or not an event)."""
    try:
        peek = _status_peek.decode(payload)
    except msgspec.DecodeError:
        return None
    status = peek.rollout.status if peek.rollout is not None else (peek.rollout_status or peek.status)
    return status if status in TERMINAL_ROLLOUT_STATUSES else None


def attempt_done(attempt: Attempt, rollout: Rollout) -> bool:
    """Whether ``attempt`` of ``rollout`` is done (see the module docstring)."""
    return attempt.status in FINAL_ATTEMPT_STATUSES or rollout.status in TERMINAL_ROLLOUT_STATUSES


def newly_done(before: RolloutState | None, after: RolloutState) -> list[Attempt]:
    """The attempts of ``after`` that are done and were not in ``before`` (in attempt order)."""
    was: set[str] = set()
    if before is not None:
        was = {a.attempt_id for a in before.attempts if attempt_done(a, before.rollout)}
    return [a for a in after.attempts if a.attempt_id not in was and attempt_done(a, after.rollout)]
