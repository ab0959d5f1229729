"""Which workers are alive, by the age of their last heartbeat, and whether waiting rollouts have none.

A runner heartbeats every ``heartbeat_interval`` seconds (10 by default, ``LitAgentRunner``); a
worker whose last heartbeat is older than ``LIVE_HEARTBEAT_S`` (three intervals) is taken for gone.
A runner with ``heartbeat_interval <= 0`` sends none: it looks gone while it runs, and it never
notices a cancel of the rollout it runs (its heartbeats ask), so that agent runs to its end.
A runner that stops in an orderly way (its ``iter`` returns or is cancelled: a trainer's run ends,
``eventlight runner`` is stopped) sends one last heartbeat whose ``heartbeat_stats`` hold
``STOPPED_AT``: that worker is stopped, not alive, from then on (``stopped_at``). Agent-lightning's
worker statuses (``idle``, ``busy``, ``unknown``) have no stopped one, and ``update_worker`` never
changes the status, so the mark lives in the stats it replaces; a killed runner sends none and ages
out. ``eventlight status`` shows this; a trainer can stop on ``waiting_without_workers(store)``
instead of waiting for ever on rollouts nobody runs::

    message = await waiting_without_workers(store)
    if message is not None:
        raise RuntimeError(message)
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from eventlight.core.types import Worker
from eventlight.store.base import LightningStore

__all__ = [
    "LIVE_HEARTBEAT_S",
    "QUEUED_STATUSES",
    "STOPPED_AT",
    "is_alive",
    "no_live_worker",
    "stopped_at",
    "waiting_without_workers",
]

LIVE_HEARTBEAT_S = 30.0
"""A worker is alive while its last heartbeat is at most this many seconds old."""

QUEUED_STATUSES = ("queuing", "requeuing")
"""Rollout statuses that wait for a runner: the queue depth counts them."""


STOPPED_AT = "stopped_at"
"""The ``heartbeat_stats`` key of a runner's last heartbeat as it stops: when (wall-clock seconds)."""


def stopped_at(worker: Worker) -> float | None:
    """When ``worker`` said it stopped (wall-clock seconds): its last heartbeat's ``STOPPED_AT``;
    ``None`` while it runs or when it ended without saying so (killed)."""
    value = (worker.heartbeat_stats or {}).get(STOPPED_AT)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def is_alive(worker: Worker, now: float, live_s: float = LIVE_HEARTBEAT_S) -> bool:
    """Whether ``worker`` sent a heartbeat within ``live_s`` seconds of ``now`` (wall-clock seconds)
    and has not said it stopped (``stopped_at``)."""
    beat = worker.last_heartbeat_time
    return beat is not None and now - beat <= live_s and stopped_at(worker) is None


def no_live_worker(waiting: int, workers: Sequence[Worker], now: float, live_s: float = LIVE_HEARTBEAT_S) -> str | None:
    """A one-line explanation when ``waiting`` rollouts wait and no worker is alive; else ``None``."""
    if waiting <= 0 or any(is_alive(w, now, live_s) for w in workers):
        return None
    stopped = sum(stopped_at(w) is not None for w in workers)
    if stopped:
        seen = f"{len(workers)} known: {stopped} stopped, the others sent no heartbeat in the last {live_s:.0f} s"
    else:
        seen = f"{len(workers)} known, none" if workers else "none has ever"
        seen += f" sent a heartbeat in the last {live_s:.0f} s"
    return (
        f"{waiting} rollout(s) wait in the queue and no runner is alive ({seen}): start runners "
        "(`eventlight runner module:agent`) or check why they died"
    )


async def waiting_without_workers(
    store: LightningStore, now: float | None = None, live_s: float = LIVE_HEARTBEAT_S
) -> str | None:
    """``no_live_worker`` over ``store``'s queued rollouts and workers (two queries).

    Raises:
        ServiceUnavailableError: The store did not answer.
    """
    waiting = await store.query_rollouts(status_in=list(QUEUED_STATUSES), limit=1)
    total = waiting.total
    if total == 0:
        return None
    workers = await store.query_workers()
    return no_live_worker(total, list(workers), time.time() if now is None else now, live_s)
