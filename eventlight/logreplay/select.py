"""Which attempts a replay reads, folded from the raw log in one pass.

``LogFold`` takes ``(position, subject, payload)`` entries in log order (``EventLog.scan``) and keeps
what selecting and adapting attempts needs: each rollout's state (folded with the pure
``eventlight.core.evolve``, span batches included as heartbeats the way ``EventLog.load`` folds
them), the position each attempt started at, the resources snapshots by position, and, for every
attempt that can still be selected, its span batches as the raw bytes the log holds (decoded only
once the attempt is known to be selected: a replay of a few attempts does not decode every span of
the log). Worker events are skipped undecoded.

``Filters`` are the ``eventlight replay`` options: ``since``/``until`` select attempts by where they
started (a log position, or a time compared with the attempt's ``start_time``), ``statuses`` by the
attempt's status once the log is read, ``modes`` and ``resources_ids`` by the rollout's. When one
end is a position and the other a time, the fold keeps the entry at that position (or the last one
before it), whose ``time`` the replay compares with the other end (``LogFold.position_time``).
"""

from __future__ import annotations

import contextlib

import msgspec

from eventlight.core.commands import RolloutState
from eventlight.core.events import ResourcesPut, decode_event, rollout_id_of
from eventlight.core.evolve import evolve, spans_arrived
from eventlight.core.types import TERMINAL_ATTEMPT_STATUSES, Attempt, Rollout


class Bound(msgspec.Struct, frozen=True):
    """One end of a range: a log position (``seq``) or seconds since the epoch (``time``)."""

    seq: int | None = None
    time: float | None = None

    def after(self, seq: int, time: float) -> bool:
        """Whether ``(seq, time)`` is at or after this bound."""
        return seq >= self.seq if self.seq is not None else time >= (self.time or 0.0)

    def before(self, seq: int, time: float) -> bool:
        """Whether ``(seq, time)`` is at or before this bound."""
        return seq <= self.seq if self.seq is not None else time <= (self.time or 0.0)


class Filters(msgspec.Struct, frozen=True, kw_only=True):
    """What to select (every field ``None``: everything)."""

    since: Bound | None = None
    until: Bound | None = None
    statuses: frozenset[str] | None = None
    modes: frozenset[str] | None = None
    resources_ids: frozenset[str] | None = None

    def started_in_range(self, seq: int, start_time: float) -> bool:
        if self.since is not None and not self.since.after(seq, start_time):
            return False
        return self.until is None or self.until.before(seq, start_time)

    def mixed_position(self) -> int | None:
        """The log position that ends a range whose other end is a time, else ``None``."""
        if self.since is None or self.until is None or (self.since.seq is None) == (self.until.seq is None):
            return None
        return self.since.seq if self.since.seq is not None else self.until.seq

    def rollout_matches(self, rollout: Rollout) -> bool:
        if self.modes is not None and rollout.mode not in self.modes:
            return False
        return self.resources_ids is None or rollout.resources_id in self.resources_ids


class _Head(msgspec.Struct):
    """The fields of a span batch a fold needs (the spans' bodies are skipped, not decoded)."""

    class _Seq(msgspec.Struct):
        pass

    spans: list[_Seq]
    type: str = ""
    time: float = 0.0


_head = msgspec.json.Decoder(_Head)


class _Time(msgspec.Struct):
    time: float


_time = msgspec.json.Decoder(_Time)


class Candidate(msgspec.Struct, kw_only=True):
    """An attempt that started in range: where it started and its raw span batches."""

    rollout_id: str
    attempt_id: str
    started_seq: int
    batches: list[tuple[int, bytes]] = msgspec.field(default_factory=list)


class Selected(msgspec.Struct, frozen=True, kw_only=True):
    """An attempt a replay adapts: its rollout and attempt as the log leaves them, and its batches."""

    rollout: Rollout
    attempt: Attempt
    started_seq: int
    resources_version: int | None
    batches: list[tuple[int, bytes]]


class LogFold:
    """The state of a replay's read of the log (see the module docstring)."""

    def __init__(self, filters: Filters, track_finished: bool = False):
        self.filters = filters
        self.track_finished = track_finished
        self.states: dict[str, RolloutState] = {}
        self.candidates: dict[tuple[str, str], Candidate] = {}
        self.resources: dict[str, list[tuple[int, int]]] = {}
        """``resources_id -> [(position, version)]`` in log order."""
        self.events = 0
        self.spans = 0
        self.malformed: list[tuple[int, str]] = []
        self.first_seq = 0
        """The log position of the first entry (0: none)."""
        self.first_time: float | None = None
        self.last_time: float | None = None
        """The earliest and latest ``time`` of the events (``None``: none)."""
        self.finished: list[Candidate] = []
        """With ``track_finished``: candidates whose attempt reached a terminal status, in log order,
        for the reader to take (and clear); their spans are most likely all in (``Replay`` adapts
        them ahead)."""
        self._position = filters.mixed_position()
        self._at_position: tuple[int, bytes] | None = None

    def add(self, seq: int, subject: str, data: bytes) -> None:
        """Fold one log entry; an entry that is not an event is recorded in ``malformed``."""
        self.events += 1
        self.first_seq = self.first_seq or seq
        if self._position is not None and seq <= self._position and data:
            self._at_position = (seq, data)  # decoded once, at the end (position_time)
        kind, _, rest = subject.partition(".")
        if not data:
            return
        if kind == "w":  # only its time is read
            with contextlib.suppress(msgspec.DecodeError):
                self._saw(_time.decode(data).time)
            return
        try:
            if kind == "s":
                self._span_batch(seq, rest, data)
            else:
                self._event(seq, data)
        except (msgspec.DecodeError, ValueError) as e:  # InvalidInputError is a ValueError
            self.malformed.append((seq, f"{subject}: {e}"))

    def _span_batch(self, seq: int, rest: str, data: bytes) -> None:
        rid, _, aid = rest.partition(".")
        head = _head.decode(data)
        self._saw(head.time)
        if head.type != "spans_added" or not head.spans:
            return  # a reservation of sequence ids: no spans, not a heartbeat
        self.spans += len(head.spans)
        state = self.states.get(rid)
        if state is not None:
            self.states[rid] = spans_arrived(state, aid, head.time)
        cand = self.candidates.get((rid, aid))
        if cand is not None:
            cand.batches.append((seq, data))

    def _event(self, seq: int, data: bytes) -> None:
        event = decode_event(data)  # upcasts events written in an older shape
        self._saw(event.time)
        if isinstance(event, ResourcesPut):
            res = event.resources
            self.resources.setdefault(res.resources_id, []).append((seq, res.version))
            return
        rid = rollout_id_of(event)
        if rid is None:
            return
        new = evolve(self.states.get(rid), event)
        if new is None:
            return
        old = self.states.get(rid)
        self.states[rid] = new
        known = len(old.attempts) if old else 0
        for attempt in new.attempts[known:]:
            if self.filters.started_in_range(seq, attempt.start_time):
                self.candidates[(rid, attempt.attempt_id)] = Candidate(
                    rollout_id=rid, attempt_id=attempt.attempt_id, started_seq=seq
                )
        if not self.track_finished:
            return
        was = {a.attempt_id: a.status for a in old.attempts} if old else {}
        for attempt in new.attempts:
            if (
                attempt.status in TERMINAL_ATTEMPT_STATUSES
                and was.get(attempt.attempt_id) not in TERMINAL_ATTEMPT_STATUSES
            ):
                cand = self.candidates.get((rid, attempt.attempt_id))
                if cand is not None:
                    self.finished.append(cand)

    def _saw(self, time: float) -> None:
        if self.first_time is None or time < self.first_time:
            self.first_time = time
        if self.last_time is None or time > self.last_time:
            self.last_time = time

    def position_time(self) -> tuple[int, float] | None:
        """When a range mixes a position and a time (``Filters.mixed_position``): the log position
        and ``time`` of the entry at that position, or of the last one before it; ``None`` without
        one (or when it is no event)."""
        if self._at_position is None:
            return None
        seq, data = self._at_position
        try:
            return seq, _time.decode(data).time
        except msgspec.DecodeError:
            return None

    def selected(self) -> list[Selected]:
        """The candidates that pass every filter once the log is read, in the order they started."""
        out: list[Selected] = []
        for cand in sorted(self.candidates.values(), key=lambda c: (c.started_seq, c.attempt_id)):
            state = self.states[cand.rollout_id]
            attempt = state.attempt(cand.attempt_id)
            if self.filters.statuses is not None and attempt.status not in self.filters.statuses:
                continue
            if not self.filters.rollout_matches(state.rollout):
                continue
            out.append(
                Selected(
                    rollout=state.rollout,
                    attempt=attempt,
                    started_seq=cand.started_seq,
                    resources_version=self._version_at(state.rollout.resources_id, cand.started_seq),
                    batches=cand.batches,
                )
            )
        return out

    def _version_at(self, resources_id: str | None, seq: int) -> int | None:
        """The version of snapshot ``resources_id`` in force at position ``seq`` (the last put before
        it, else the first one after)."""
        puts = self.resources.get(resources_id or "", [])
        before = [v for s, v in puts if s <= seq]
        if before:
            return before[-1]
        return puts[0][1] if puts else None
