"""The watchdog, one for every backend: it turns silence and overruns into events.

Each tick asks the decider (``CheckHealth``) about every rollout the read model has in flight
(``preparing``/``running``, with its span heartbeats folded in), and every rollout, finished or not,
with an attempt still live (``eventlight.store.fold.watched``), and appends the
``timeout``/``unresponsive`` events it decides, expecting the version the read model has seen; a
rollout that changed since is skipped (the next tick sees it). So attempts time out even when
nobody calls the store. It runs where the projection runs (the projector's leader on JetStream).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

from eventlight.core import decider
from eventlight.core.commands import CheckHealth, RolloutState
from eventlight.core.events import AnyEvent, AttemptUpdated, RolloutUpdated
from eventlight.store.ports import EventLog, StaleStateError

log = logging.getLogger(__name__)

InFlight = Callable[[], list[tuple[str, RolloutState, int]]]
"""Returns ``(rollout_id, state, version)`` of every rollout in flight."""


class Watchdog:
    """Checks rollouts in flight every ``interval_s`` seconds.

    Args:
        log_: The event log the events are appended to.
        in_flight: The rollouts to check, from the read model.
        clock: Wall-clock seconds.
        interval_s: Seconds between ticks of ``run``.

    Attributes:
        actions: Events this watchdog appended, by action: ``attempt_<status>`` and
            ``rollout_<status>`` (what ``/metrics`` reports as ``eventlight_watchdog_actions_total``).
    """

    def __init__(self, log_: EventLog, in_flight: InFlight, clock: Callable[[], float], interval_s: float = 1.0):
        self.log = log_
        self.in_flight = in_flight
        self.clock = clock
        self.interval_s = interval_s
        self.actions: Counter[str] = Counter()

    async def tick(self, now: float | None = None) -> list[AnyEvent]:
        """One pass at ``now`` (default: the clock); returns the events it appended."""
        at = self.clock() if now is None else now
        appended: list[AnyEvent] = []
        for rid, state, version in self.in_flight():
            events = decider.decide(state, CheckHealth(), at)
            if not events:
                continue
            try:
                await self.log.append(rid, events, version, f"watchdog:{rid}:{at}")
            except StaleStateError:
                continue  # something newer happened; the next tick sees it
            appended.extend(events)
            self.actions.update(_action(e) for e in events)
            first = events[0]
            if isinstance(first, AttemptUpdated):
                log.info("watchdog: rollout %s attempt %s -> %s", rid, first.attempt_id, first.status)
        return appended

    async def run(self, stopping: Callable[[], bool] = lambda: False) -> None:
        """Tick every ``interval_s`` seconds until cancelled (or ``stopping()``)."""
        while not stopping():
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except Exception:
                log.exception("watchdog pass failed")


def _action(event: AnyEvent) -> str:
    """``attempt_timeout``, ``rollout_requeuing``, ...: what one watchdog event did."""
    if isinstance(event, AttemptUpdated) and isinstance(event.status, str):
        return f"attempt_{event.status}"
    if isinstance(event, RolloutUpdated) and isinstance(event.status, str):
        return f"rollout_{event.status}"
    return type(event).__name__
