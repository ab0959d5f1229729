"""Unit tests of the pure decider: one rule per test, the clock passed in."""

from __future__ import annotations

import msgspec
import pytest

from eventlight.core import decider as d
from eventlight.core import events
from eventlight.core.commands import RolloutState
from eventlight.core.errors import AttemptNotFoundError, InvalidInputError, InvalidTransitionError
from eventlight.core.events import (
    AttemptStarted,
    AttemptUpdated,
    RolloutCreated,
    RolloutUpdated,
    SpansAdded,
    WorkerHeartbeat,
    WorkerIdle,
    decode_event,
    encode_event,
    enters_queue,
)
from eventlight.core.evolve import evolve, evolve_worker, updated_attempt
from eventlight.core.types import RolloutConfig, Span
from eventlight.store.jetstream.layout import subject_for

T0 = 1_000.0


def apply(state: RolloutState | None, events: list) -> RolloutState:
    for e in events:
        state = evolve(state, e)
    assert state is not None
    return state


def created(config: RolloutConfig | None = None) -> RolloutState:
    return apply(None, d.decide(None, d.CreateRollout(rollout_id="ro-1", input={"q": 1}, config=config), T0))


def claimed(state: RolloutState, attempt_id: str = "at-1", worker: str | None = "w", now: float = T0 + 1):
    return apply(state, d.decide(state, d.StartAttempt(attempt_id=attempt_id, worker_id=worker, claim=True), now))


def update(state: RolloutState, attempt_id: str, status: str, now: float = T0 + 2) -> RolloutState:
    return apply(state, d.decide(state, d.UpdateAttempt(attempt_id=attempt_id, status=status), now))


def test_enqueue_creates_a_queued_rollout_on_the_queue_subject() -> None:
    events = d.decide(None, d.CreateRollout(rollout_id="ro-1", input=1), T0)
    assert len(events) == 1 and isinstance(events[0], RolloutCreated)
    assert events[0].rollout.status == "queuing" and events[0].rollout.start_time == T0
    assert enters_queue(events[0]) and subject_for("el.x", events[0]) == "el.x.r.ro-1.q"


def test_start_rollout_creates_rollout_and_first_attempt() -> None:
    events = d.decide(None, d.CreateRollout(rollout_id="ro-1", input=1, queued=False, attempt_id="at-1"), T0)
    state = apply(None, events)
    assert state.rollout.status == "preparing" and state.latest.sequence_id == 1
    assert not any(enters_queue(e) for e in events)


def test_creating_an_existing_rollout_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="already exists"):
        d.decide(created(), d.CreateRollout(rollout_id="ro-1", input=1), T0)


def test_claim_moves_rollout_to_preparing_with_numbered_attempt() -> None:
    state = claimed(created())
    assert state.rollout.status == "preparing"
    assert (state.latest.sequence_id, state.latest.status, state.latest.worker_id) == (1, "preparing", "w")


def test_claim_of_a_rollout_that_is_not_queued_is_refused() -> None:
    state = claimed(created())
    with pytest.raises(InvalidTransitionError, match="not queued"):
        d.decide(state, d.StartAttempt(attempt_id="at-2", claim=True), T0)


def test_first_span_moves_attempt_and_rollout_to_running() -> None:
    state = claimed(created())
    span = Span.from_attributes(attributes={}, rollout_id="ro-1", attempt_id="at-1", sequence_id=1)
    state = evolve(state, SpansAdded(time=T0 + 3, rollout_id="ro-1", attempt_id="at-1", spans=[span]))
    assert state.rollout.status == "running" and state.latest.status == "running"
    assert state.latest.last_heartbeat_time == T0 + 3


def test_success_sets_end_times() -> None:
    state = update(claimed(created()), "at-1", "succeeded", now=T0 + 5)
    assert state.rollout.status == "succeeded" and state.rollout.end_time == T0 + 5
    assert state.latest.end_time == T0 + 5


@pytest.mark.parametrize("status", ["failed", "timeout", "unresponsive"])
def test_retryable_status_requeues_while_attempts_remain(status: str) -> None:
    state = claimed(created(RolloutConfig(max_attempts=2, retry_condition=[status])))
    events = d.decide(state, d.UpdateAttempt(attempt_id="at-1", status=status), T0 + 2)
    assert isinstance(events[0], AttemptUpdated) and events[0].rollout_status == "requeuing"
    assert enters_queue(events[0])
    state = apply(state, events)
    state = claimed(state, "at-2")
    assert state.latest.sequence_id == 2
    assert update(state, "at-2", status).rollout.status == "failed"


def test_status_not_in_retry_condition_fails_the_rollout() -> None:
    state = claimed(created(RolloutConfig(max_attempts=3, retry_condition=["timeout"])))
    assert update(state, "at-1", "failed").rollout.status == "failed"


def test_only_the_latest_attempt_moves_the_rollout() -> None:
    """peer_failures C01: only the latest attempt's status moves the rollout; a stale one is refused."""
    state = update(claimed(created()), "at-1", "succeeded")
    state = apply(state, d.decide(state, d.StartAttempt(attempt_id="at-2"), T0 + 3))
    assert state.rollout.status == "preparing"
    events = d.decide(state, d.UpdateAttempt(attempt_id="at-2", status="running"), T0 + 4)
    assert events[0].rollout_status == "running"
    with pytest.raises(InvalidTransitionError):
        d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="failed"), T0 + 4)


def test_finished_attempt_cannot_change_status_but_repeat_is_a_noop() -> None:
    state = update(claimed(created()), "at-1", "failed")
    assert d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="failed"), T0 + 9) == []
    with pytest.raises(InvalidTransitionError, match="already finished"):
        d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="succeeded"), T0 + 9)


def test_attempt_never_goes_back_to_preparing() -> None:
    state = update(claimed(created()), "at-1", "running")
    with pytest.raises(InvalidTransitionError, match="preparing"):
        d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="preparing"), T0)


def test_span_revives_unresponsive_but_not_timeout() -> None:
    state = update(claimed(created()), "at-1", "unresponsive")
    span = Span.from_attributes(attributes={}, rollout_id="ro-1", attempt_id="at-1", sequence_id=1)
    revived = evolve(state, SpansAdded(time=T0 + 9, rollout_id="ro-1", attempt_id="at-1", spans=[span]))
    assert revived.latest.status == "running"
    assert revived.rollout.status == "failed"  # a failed rollout is never un-failed by a span
    timed_out = update(claimed(created()), "at-1", "timeout")
    after = evolve(timed_out, SpansAdded(time=T0 + 9, rollout_id="ro-1", attempt_id="at-1", spans=[span]))
    assert after.latest.status == "timeout"


def test_cancel_is_sticky() -> None:
    state = claimed(created())
    state = apply(state, d.decide(state, d.UpdateRollout(status="cancelled"), T0 + 3))
    assert state.rollout.status == "cancelled" and state.rollout.end_time == T0 + 3
    with pytest.raises(InvalidTransitionError, match="already finished"):  # the cancel ended it
        d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="succeeded"), T0 + 4)
    events = d.decide(state, d.UpdateAttempt(attempt_id="at-1", last_heartbeat_time=T0 + 4), T0 + 4)
    assert events[0].rollout_status is None
    assert apply(state, events).rollout.status == "cancelled"
    with pytest.raises(InvalidTransitionError):
        d.decide(state, d.UpdateRollout(status="running"), T0 + 5)
    requeued = d.decide(state, d.UpdateRollout(status="queuing"), T0 + 5)
    assert isinstance(requeued[0], RolloutUpdated) and enters_queue(requeued[0])


def test_a_cancel_ends_the_attempts_not_yet_finished_so_a_requeue_is_not_taken_back() -> None:
    """``update_rollout(status="cancelled")`` records every attempt not yet finished (``running``,
    ``unresponsive``; a ``succeeded`` one is left) ``failed`` with ``CANCELLED_REASON``, after the
    cancel, so the rollout stays ``cancelled``. Requeued then, the old runner's heartbeat and span
    no longer take it back (0.3.0's revive rule did: the cancel was undone), and the next claim
    starts attempt 2."""
    from eventlight.core.types import CANCELLED_REASON, STATUS_REASON, ended_by_cancel

    cfg = RolloutConfig(max_attempts=3, retry_condition=["unresponsive"])
    state = update(claimed(created(cfg)), "at-1", "unresponsive")
    state = update(claimed(state, "at-2", now=T0 + 3), "at-2", "running", now=T0 + 4)
    state = apply(state, d.decide(state, d.UpdateAttempt(attempt_id="at-2", metadata={"k": 1}), T0 + 4))
    events = d.decide(state, d.UpdateRollout(status="cancelled"), T0 + 5)
    assert [type(e).__name__ for e in events] == ["AttemptUpdated", "AttemptUpdated", "RolloutUpdated"]
    assert [(e.rollout_status, e.rollout_end_time) for e in events[:-1]] == [(None, None), ("cancelled", T0 + 5)]
    for n in range(len(events)):  # a cancel cut short half-way (its publishes are separate) leaves a state
        part = apply(state, events[:n])  # it can be in: never in flight under an ended latest attempt
        assert part.rollout.status == "cancelled" or part.latest.status not in d.FINAL_ATTEMPT_STATUSES
    state = apply(state, events)
    assert (state.rollout.status, state.rollout.end_time) == ("cancelled", T0 + 5)
    assert [(a.status, a.end_time) for a in state.attempts] == [("failed", T0 + 5)] * 2
    assert state.latest.metadata == {"k": 1, STATUS_REASON: CANCELLED_REASON} and ended_by_cancel(state.latest)
    state = apply(state, d.decide(state, d.UpdateRollout(status="queuing"), T0 + 6))
    beat = d.decide(state, d.UpdateAttempt(attempt_id="at-2", last_heartbeat_time=T0 + 7), T0 + 7)
    assert beat[0].rollout_status is None
    state = apply(state, beat)
    span = Span.from_attributes(attributes={}, rollout_id="ro-1", attempt_id="at-2", sequence_id=1)
    state = evolve(state, SpansAdded(time=T0 + 8, rollout_id="ro-1", attempt_id="at-2", spans=[span]))
    assert (state.rollout.status, state.latest.status) == ("queuing", "failed")
    assert claimed(state, "at-3", now=T0 + 9).latest.sequence_id == 3

    done = update(claimed(created()), "at-1", "succeeded")
    done = apply(done, d.decide(done, d.UpdateRollout(status="queuing"), T0 + 3))  # a requeue ends nothing
    events = d.decide(done, d.UpdateRollout(status="cancelled"), T0 + 4)
    assert len(events) == 1 and apply(done, events).latest.status == "succeeded"  # a finished one is left


def test_a_finished_rollout_does_not_follow_a_late_update_of_its_latest_attempt() -> None:
    """``failed`` and ``succeeded`` are as sticky as ``cancelled``: a rollout failed by its latest
    attempt going ``unresponsive`` (no retry left) stays ``failed`` when that runner reports
    ``running`` or ``succeeded`` later (0.3.0 flips it); one marked ``succeeded`` by hand is not
    requeued when its attempt fails later. The attempt records the late status."""
    state = claimed(created(RolloutConfig(unresponsive_seconds=30)))
    state = apply(state, d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="unresponsive"), T0 + 40))
    assert state.rollout.status == "failed" and state.rollout.end_time == T0 + 40
    for at, status in ((T0 + 50, "running"), (T0 + 60, "succeeded")):
        events = d.decide(state, d.UpdateAttempt(attempt_id="at-1", status=status), at)
        assert events[0].rollout_status is None and events[0].rollout_end_time is None
        state = apply(state, events)
    assert (state.rollout.status, state.rollout.end_time, state.latest.status) == ("failed", T0 + 40, "succeeded")

    retry = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    state = claimed(created(retry))
    state = apply(state, d.decide(state, d.UpdateRollout(status="succeeded"), T0 + 3))
    events = d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="failed"), T0 + 4)
    assert events[0].rollout_status is None and not enters_queue(events[0])
    assert apply(state, events).rollout.status == "succeeded"


def test_a_rollout_back_in_the_queue_is_not_failed_by_its_last_attempt() -> None:
    """``update_rollout(status="queuing")`` while the attempt runs: the attempt's late ``failed``
    is recorded, the rollout stays ``queuing`` for its next run (it went to ``failed``, the requeue
    lost); a ``requeuing`` rollout whose ``unresponsive`` attempt reports ``failed`` late keeps its
    retry. A late ``running`` still takes the rollout back (the attempt revived, as in 0.3.0),
    unless a cancel before the requeue ended the attempt: a runner that stopped the agent of a
    cancelled rollout then records only its reason."""
    state = claimed(created())
    state = apply(state, d.decide(state, d.UpdateRollout(status="queuing"), T0 + 3))
    events = d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="failed"), T0 + 4)
    assert events[0].rollout_status is None and not enters_queue(events[0])
    after = apply(state, events)
    assert (after.rollout.status, after.latest.status) == ("queuing", "failed") and d.is_claimable(after)
    revived = d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="running"), T0 + 4)
    assert revived[0].rollout_status == "running"

    state = claimed(created())
    for status in ("cancelled", "queuing"):
        state = apply(state, d.decide(state, d.UpdateRollout(status=status), T0 + 3))
    reason = {"eventlight.status_reason": "the rollout was cancelled while the attempt ran; the runner stopped"}
    events = d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="failed", metadata=reason), T0 + 4)
    assert [(e.status, e.metadata, e.rollout_status) for e in events] == [(msgspec.UNSET, reason, None)]
    assert d.is_claimable(apply(state, events))
    with pytest.raises(InvalidTransitionError, match="already finished"):
        d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="running"), T0 + 4)

    cfg = RolloutConfig(max_attempts=2, retry_condition=["unresponsive"])
    state = claimed(created(cfg))
    state = apply(state, d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="unresponsive"), T0 + 3))
    assert state.rollout.status == "requeuing"
    state = apply(state, d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="failed"), T0 + 4))
    assert (state.rollout.status, state.latest.status) == ("requeuing", "failed")


def test_unknown_statuses_and_attempts_are_refused() -> None:
    state = claimed(created())
    with pytest.raises(InvalidInputError):
        d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="done"), T0)
    with pytest.raises(InvalidInputError):
        d.decide(state, d.UpdateRollout(status="paused"), T0)
    with pytest.raises(AttemptNotFoundError):
        d.decide(state, d.UpdateAttempt(attempt_id="at-9", status="failed"), T0)
    with pytest.raises(AttemptNotFoundError, match="no attempts"):
        created().attempt("latest")


def test_watchdog_timeout_counts_from_attempt_start() -> None:
    state = claimed(created(RolloutConfig(timeout_seconds=10)), now=T0 + 100)
    assert d.decide(state, d.CheckHealth(), T0 + 109) == []
    events = d.decide(state, d.CheckHealth(), T0 + 111)
    assert events[0].status == "timeout" and events[0].rollout_status == "failed"


def test_watchdog_unresponsive_uses_last_heartbeat_then_start() -> None:
    state = claimed(created(RolloutConfig(unresponsive_seconds=5)), now=T0)
    assert d.decide(state, d.CheckHealth(), T0 + 6)[0].status == "unresponsive"
    span = Span.from_attributes(attributes={}, rollout_id="ro-1", attempt_id="at-1", sequence_id=1)
    beat = evolve(state, SpansAdded(time=T0 + 4, rollout_id="ro-1", attempt_id="at-1", spans=[span]))
    assert d.decide(beat, d.CheckHealth(), T0 + 8) == []
    assert d.decide(beat, d.CheckHealth(), T0 + 10)[0].status == "unresponsive"


def test_watchdog_ignores_finished_and_queued_rollouts() -> None:
    cfg = RolloutConfig(timeout_seconds=1)
    assert d.decide(created(cfg), d.CheckHealth(), T0 + 100) == []
    assert d.decide(update(claimed(created(cfg)), "at-1", "succeeded"), d.CheckHealth(), T0 + 100) == []


def test_watchdog_marks_a_live_latest_attempt_of_a_rollout_not_in_flight_and_moves_nothing_else() -> None:
    """The latest attempt, revived by a late span after its rollout ``failed`` (or still running
    under a rollout marked ``succeeded`` by hand, or sent back to the queue), whose runner then
    vanished: the watchdog marks it by the config (0.3.0 watches a latest attempt only while its
    rollout is in flight: it stayed ``running`` for ever); the rollout keeps its status and end."""
    from eventlight.store.fold import watched

    cfg = RolloutConfig(unresponsive_seconds=5, timeout_seconds=100)
    span = Span.from_attributes(attributes={}, rollout_id="ro-1", attempt_id="at-1", sequence_id=1)
    failed = update(claimed(created(cfg)), "at-1", "unresponsive")
    revived = evolve(failed, SpansAdded(time=T0 + 3, rollout_id="ro-1", attempt_id="at-1", spans=[span]))
    assert (revived.rollout.status, revived.latest.status) == ("failed", "running")
    running = claimed(created(cfg))
    beat = d.UpdateAttempt(attempt_id="at-1", status="running", last_heartbeat_time=T0 + 3)
    running = apply(running, d.decide(running, beat, T0 + 3))
    by_hand = [apply(running, d.decide(running, d.UpdateRollout(status=s), T0 + 3)) for s in ("succeeded", "queuing")]
    for state in (revived, *by_hand):
        assert watched(state) and d.decide(state, d.CheckHealth(), T0 + 7) == []
        for at, status in ((T0 + 9, "unresponsive"), (T0 + 102, "timeout")):
            [event] = d.decide(state, d.CheckHealth(), at)
            assert (event.status, event.rollout_status, event.rollout_end_time) == (status, None, None)
            after = apply(state, [event])
            assert after.rollout == state.rollout and not watched(after)
    assert not watched(update(revived, "at-1", "succeeded", now=T0 + 4))


def test_an_abandoned_attempt_in_flight_fails_with_the_reason_and_a_finished_one_is_left_alone() -> None:
    """``AbandonAttempt`` (a runner process died): ``failed`` with the reason merged into the
    attempt's metadata, so the rollout is retried by its config; a finished attempt, ``failed``
    included, keeps its status and reason (an ``UpdateAttempt`` would overwrite the reason)."""
    cfg = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    state = claimed(created(cfg))
    state = apply(state, d.decide(state, d.UpdateAttempt(attempt_id="at-1", metadata={"k": 1}), T0 + 2))
    events = d.decide(state, d.AbandonAttempt(attempt_id="at-1", reason="process 7 died"), T0 + 3)
    after = apply(state, events)
    assert after.latest.status == "failed" and after.rollout.status == "requeuing"
    assert after.latest.metadata == {"k": 1, "eventlight.status_reason": "process 7 died"}
    assert d.decide(after, d.AbandonAttempt(attempt_id="at-1", reason="again"), T0 + 4) == []
    done = update(claimed(created()), "at-1", "succeeded")
    assert d.decide(done, d.AbandonAttempt(attempt_id="at-1", reason="late"), T0 + 4) == []


def test_worker_status_is_derived() -> None:
    state = claimed(created(RolloutConfig(max_attempts=2, retry_condition=["timeout"])))
    started = d.decide(created(), d.StartAttempt(attempt_id="at-1", worker_id="w", claim=True), T0)[0]
    w = evolve_worker(None, started, "w")
    assert w.status == "busy" and w.current_attempt_id == "at-1"
    done = d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="timeout"), T0 + 2)[0]
    attempt = updated_attempt(evolve(state, done), done)  # an update names the attempt, not its worker
    w2 = evolve_worker(w, done, "w", attempt)
    assert w2.status == "unknown" and w2.current_rollout_id is None
    idle = evolve_worker(w2, WorkerIdle(time=T0 + 3, worker_id="w"), "w")
    assert idle.status == "idle" and idle.last_idle_time == T0 + 3
    beat = evolve_worker(idle, WorkerHeartbeat(time=T0 + 4, worker_id="w", heartbeat_stats={"cpu": 1}), "w")
    assert beat.status == "idle" and beat.last_heartbeat_time == T0 + 4 and beat.heartbeat_stats == {"cpu": 1}
    assert evolve_worker(None, done, "someone-else", attempt) is None


def test_events_round_trip_with_stable_tags() -> None:
    state = claimed(created())
    event = d.decide(state, d.UpdateAttempt(attempt_id="at-1", status="failed"), T0 + 2)[0]
    raw = encode_event(event)
    assert msgspec.json.decode(raw)["type"] == "attempt_updated"
    assert decode_event(raw) == event
    assert isinstance(
        decode_event(encode_event(state_started := AttemptStarted(time=1, attempt=state.latest))),
        AttemptStarted,
    )
    assert state_started.v == 1


def test_an_old_snapshot_event_is_upcast_to_the_fields_it_set() -> None:
    old = (
        b'{"type":"attempt_updated","time":1.0,"attempt":{"rollout_id":"ro-1","attempt_id":"at-1",'
        b'"sequence_id":1,"start_time":0.5,"status":"failed"}}'
    )
    event = decode_event(old)
    assert isinstance(event, AttemptUpdated) and event.rollout_status is None and event.v == 2
    assert (event.rollout_id, event.attempt_id, event.status) == ("ro-1", "at-1", "failed")
    assert event.worker_id is msgspec.UNSET  # absent from the old snapshot: left unchanged
    rollout = (
        b'{"type":"rollout_updated","time":2.0,'
        b'"rollout":{"rollout_id":"ro-1","input":1,"start_time":0.5,"status":"cancelled"}}'
    )
    upcast = decode_event(rollout)
    assert isinstance(upcast, RolloutUpdated) and upcast.status == "cancelled" and upcast.input == 1


def test_a_stale_writer_cannot_overwrite_newer_fields() -> None:
    """Events carry what changed: an update decided on an older state leaves the rest as it is."""
    state = claimed(created())
    stale = d.decide(state, d.UpdateAttempt(attempt_id="at-1", metadata={"k": 1}), T0 + 2)[0]
    span = Span.from_attributes(attributes={}, rollout_id="ro-1", attempt_id="at-1", sequence_id=1, name="s")
    running = evolve(state, SpansAdded(time=T0 + 3, rollout_id="ro-1", attempt_id="at-1", spans=[span]))
    after = evolve(running, stale)
    assert after.latest.status == "running" and after.latest.metadata == {"k": 1} and after.rollout.status == "running"


def test_an_event_of_a_version_this_code_does_not_read_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    event = AttemptStarted(time=1, attempt=claimed(created()).latest)
    newer = encode_event(event).replace(b'"v":1', b'"v":2')
    assert b'"v":2' in newer  # same fields as v1: only the version says they may mean something else
    with pytest.raises(InvalidInputError, match="attempt_started v2 .written by a newer eventlight., read v1"):
        decode_event(newer)
    with pytest.raises(InvalidInputError, match="attempt_started v0, read v1"):
        decode_event(encode_event(event).replace(b'"v":1', b'"v":0'))
    # an upcaster for that version is used even when the payload already fits the type
    monkeypatch.setitem(
        events.UPCASTERS, ("attempt_started", 0), lambda raw: {**raw, "v": 1, "rollout_status": "running"}
    )
    up = decode_event(encode_event(event).replace(b'"v":1', b'"v":0'))
    assert isinstance(up, AttemptStarted) and up.v == 1 and up.rollout_status == "running"


def test_malformed_payload_is_a_clear_error() -> None:
    with pytest.raises(InvalidInputError, match="not an eventlight event"):
        decode_event(b'{"type":"nope"}')
    with pytest.raises(InvalidInputError):
        decode_event(b"\x00garbage")
    with pytest.raises(InvalidInputError, match="not an eventlight event"):  # a type error before the syntax error
        decode_event(b'{"type":"spans_added","time":1.0,"rollout_id":["x"')
    deep = b'{"type":"spans_added","time":1.0,"rollout_id":"r","attempt_id":"a","spans":[{"attributes":{"x":'
    for payload in (
        b'{"type":["x"]}',  # an unhashable tag
        b'{"type":"spans_added","v":[1]}',
        b"",
        b"null",
        deep + b"[" * 100_000 + b"]" * 100_000 + b"}}]}",  # nested deeper than Python's recursion limit
    ):
        with pytest.raises(InvalidInputError, match="not an eventlight event"):
            decode_event(payload)
