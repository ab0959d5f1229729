"""The command loop, written once: load → decide (pure) → append with the expected version → retry.

Every write to a rollout goes through ``CommandLoop.execute``: it decides on the rollout's state as
the log holds it (a cached state first; a refused append or a decision the cached state cannot
make reloads it from the log), appends the events expecting the version it decided on, and folds
them into the state it returns. The cache is a hint: a stale entry costs one reload.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import msgspec

from eventlight.core import decider
from eventlight.core.commands import Command, CreateRollout, RolloutState
from eventlight.core.errors import ConcurrencyError, EventlightError
from eventlight.core.events import RolloutEvent
from eventlight.core.evolve import evolve, spans_arrived
from eventlight.core.types import generate_id
from eventlight.store.ports import EventLog, SpanHead, StaleStateError

MAX_APPEND_TRIES = 16
RECENT_ROLLOUTS = 512  # rollout states cached (a missing one costs one reload from the log)


class Outcome(msgspec.Struct, frozen=True):
    """What ``execute`` did: the state it decided on (``before``, at ``before_version``), the events
    it appended, the state after them and its version, and whether it loaded from the log."""

    before: RolloutState
    before_version: int
    events: list[RolloutEvent]
    state: RolloutState
    version: int
    loaded: bool


class CommandLoop:
    """Decides and appends commands on rollouts of one event log.

    Args:
        log: The event log.
        clock: Wall-clock seconds, passed to the decider.
        on_write: Called with the log position of every append (read-your-writes).
    """

    def __init__(self, log: EventLog, clock: Callable[[], float], on_write: Callable[[int], None]):
        self.log = log
        self.clock = clock
        self.on_write = on_write
        self._states: OrderedDict[str, tuple[RolloutState, int]] = OrderedDict()

    def cached(self, rollout_id: str) -> tuple[RolloutState, int] | None:
        """The cached state and version of a rollout, or ``None``."""
        return self._states.get(rollout_id)

    def remember(self, rollout_id: str, state: RolloutState, version: int) -> None:
        """Cache a rollout's state and version (a hint: a stale one costs one reload)."""
        self._states[rollout_id] = (state, version)
        self._states.move_to_end(rollout_id)
        while len(self._states) > RECENT_ROLLOUTS:
            self._states.popitem(last=False)

    def forget(self, rollout_id: str) -> None:
        """Drop a rollout's cached state (the next command on it reloads it from the log)."""
        self._states.pop(rollout_id, None)

    async def load(self, rollout_id: str) -> RolloutState:
        """The rollout's state as the log holds it now (cached afterwards).

        Raises:
            RolloutNotFoundError: Unknown rollout.
        """
        state, version = await self.log.load(rollout_id)
        self.remember(rollout_id, state, version)
        return state

    async def state(self, rollout_id: str) -> RolloutState:
        """The cached state, else the log's."""
        cached = self._states.get(rollout_id)
        return cached[0] if cached is not None else await self.load(rollout_id)

    def spans_written(self, rollout_id: str, attempt_id: str, at: float) -> None:
        """Fold a span batch this process wrote into the cached state (the log's fold does the same)."""
        cached = self._states.get(rollout_id)
        if cached is not None:
            self._states[rollout_id] = (spans_arrived(cached[0], attempt_id, at), cached[1])

    def head_seen(self, outcome: Outcome, attempt_id: str, head: SpanHead) -> RolloutState:
        """Fold an attempt's last span batch, read concurrently with ``outcome``'s append, into its
        state in log order (before or after the appended events); the result is cached."""
        if outcome.loaded or not head.has_spans or head.seq <= 0:
            return outcome.state
        before = outcome.before.attempt(attempt_id)
        if before.status == "unresponsive" and head.seq < outcome.before_version:
            return outcome.state  # the batch came before the state's last event: already folded
        if head.seq > outcome.version:
            state = spans_arrived(outcome.state, attempt_id, head.time)
        else:
            folded: RolloutState | None = spans_arrived(outcome.before, attempt_id, head.time)
            for event in outcome.events:
                folded = evolve(folded, event)
            assert folded is not None
            state = folded
        self.remember(state.rollout.rollout_id, state, outcome.version)
        return state

    async def create(self, command: CreateRollout, *, resources_seq: int | None = None) -> RolloutState:
        """Append a new rollout's events (expecting an empty rollout; with ``resources_seq``, expecting
        the latest resources at that position: ``EventLog.append``).

        Raises:
            StaleStateError: The log refused the fence (the caller decides again).
        """
        events = decider.decide(None, command, self.clock())
        version = await self.log.append(command.rollout_id, events, 0, generate_id("", 32), resources_seq=resources_seq)
        state: RolloutState | None = None
        for event in events:
            state = evolve(state, event)
        assert state is not None
        self.remember(command.rollout_id, state, version)
        self.on_write(version)
        return state

    async def execute(
        self,
        rollout_id: str,
        command: Command,
        *,
        hint: tuple[RolloutState, int] | None = None,
        max_tries: int = MAX_APPEND_TRIES,
    ) -> Outcome:
        """Decide ``command`` on the rollout and append its events; retry on a stale version.

        Args:
            rollout_id: The rollout.
            command: What to do.
            hint: A state and version to try first (else the cache, else the log).
            max_tries: Appends to try before giving up.

        Raises:
            RolloutNotFoundError: Unknown rollout.
            ConcurrencyError: Still stale after ``max_tries`` appends.
            InvalidTransitionError / AttemptNotFoundError / InvalidInputError: From the decider, on
                the log's current state.
        """
        command_id = generate_id("", 32)
        found = hint or self._states.get(rollout_id)
        loaded = False
        for attempt in range(max_tries):
            if found is None:
                found = await self.log.load(rollout_id)
                loaded = True
            state, version = found
            fresh = loaded
            try:
                events = decider.decide(state, command, self.clock())
            except EventlightError:
                if fresh:
                    raise
                found = None  # a cached state may be stale: decide again on the log's
                continue
            if not events:
                if fresh:
                    self.remember(rollout_id, state, version)
                    return Outcome(state, version, [], state, version, loaded)
                found = None
                continue
            try:
                new_version = await self.log.append(rollout_id, events, version, f"{command_id}:{attempt}")
            except StaleStateError:
                found = None
                continue
            new: RolloutState | None = state
            for event in events:
                new = evolve(new, event)
            assert new is not None
            self.remember(rollout_id, new, new_version)
            self.on_write(new_version)
            return Outcome(state, version, events, new, new_version, loaded)
        raise ConcurrencyError(f"rollout {rollout_id}: {max_tries} conflicting appends in a row")
