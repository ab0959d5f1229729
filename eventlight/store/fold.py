"""The projector's fold: a batch of log events → the read-model changes it implies.

Pure and synchronous, shared by both read models (the in-memory one applies the changes to dicts,
the Postgres one writes them as rows with the checkpoint in one transaction). It folds rollouts
with ``eventlight.core.evolve`` and workers with ``evolve_worker``; what a batch needs that is not
in it comes from ``lookup_rollout`` / ``lookup_worker``, which report a miss by raising ``Missing``
so that an async caller can fetch it and fold the batch again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eventlight.core.commands import RolloutState
from eventlight.core.decider import LIVE_ATTEMPT_STATUSES
from eventlight.core.events import AnyEvent, ResourcesPut, RolloutCreated, SpansAdded, rollout_id_of
from eventlight.core.evolve import evolve, evolve_worker, updated_attempt, workers_of
from eventlight.core.types import TERMINAL_ROLLOUT_STATUSES, ResourcesUpdate, Worker


class Missing(Exception):  # noqa: N818 - a signal, not an error
    """A lookup does not have what the fold needs: ``kind`` (``"rollout"``/``"worker"``) and ``key``."""

    def __init__(self, kind: str, key: str):
        super().__init__(kind, key)
        self.kind = kind
        self.key = key


class Changes:
    """What one batch changes, keyed for upserts.

    Attributes:
        rollouts: New states by rollout id.
        rollout_seq: Log position of each changed rollout's last rollout event (spans excluded).
        created_seq: Log position of the creation of rollouts created in the batch.
        spans: ``(span, position)`` in log order (duplicates are dropped by the read model).
        resources: ``resources_id -> (snapshot, first position in the batch, last position)``.
        workers: New worker records by id.
        worker_created_seq: Log position of the event that first recorded each worker new in the batch
            (the read model's insertion order of workers, which a rebuild reproduces).
        terminal: Rollouts in a terminal status after the batch.
        last_seq: The batch's last position (the checkpoint).
    """

    def __init__(self) -> None:
        self.rollouts: dict[str, RolloutState] = {}
        self.rollout_seq: dict[str, int] = {}
        self.created_seq: dict[str, int] = {}
        self.spans: list[tuple[Any, int]] = []
        self.resources: dict[str, tuple[ResourcesUpdate, int, int]] = {}
        self.workers: dict[str, Worker] = {}
        self.worker_created_seq: dict[str, int] = {}
        self.terminal: set[str] = set()
        self.last_seq = 0


LookupRollout = Callable[[str], RolloutState | None]
LookupWorker = Callable[[str], Worker | None]


def fold_batch(
    events: list[tuple[int, AnyEvent]], lookup_rollout: LookupRollout, lookup_worker: LookupWorker
) -> Changes:
    """Fold ``(position, event)`` pairs (in log order) into the changes they make.

    Raises:
        Missing: A lookup lacks a rollout or worker the batch touches.
    """
    changes = Changes()
    for seq, event in events:
        fold_event(changes, seq, event, lookup_rollout, lookup_worker)
    return changes


def fold_event(
    b: Changes, seq: int, event: AnyEvent, lookup_rollout: LookupRollout, lookup_worker: LookupWorker
) -> None:
    """Fold one event at log position ``seq`` into ``b``."""
    b.last_seq = max(b.last_seq, seq)
    rid = rollout_id_of(event)
    new: RolloutState | None = None
    if rid is not None:
        if isinstance(event, RolloutCreated):
            old = None  # ids are unique and creation expects an empty rollout: no lookup
        else:
            old = b.rollouts[rid] if rid in b.rollouts else lookup_rollout(rid)
        new = evolve(old, event)
        if new is not None:
            b.rollouts[rid] = new
            if old is None:
                b.created_seq[rid] = seq
            if not isinstance(event, SpansAdded):
                b.rollout_seq[rid] = seq
            if new.rollout.status in TERMINAL_ROLLOUT_STATUSES:
                b.terminal.add(rid)
            else:
                b.terminal.discard(rid)
            if isinstance(event, SpansAdded):
                b.spans.extend((s, seq) for s in event.spans)
    elif isinstance(event, ResourcesPut):
        res_id = event.resources.resources_id
        first = b.resources[res_id][1] if res_id in b.resources else seq
        b.resources[res_id] = (event.resources, first, seq)
    attempt = updated_attempt(new, event)
    for wid in workers_of(event, attempt):
        current = b.workers[wid] if wid in b.workers else lookup_worker(wid)
        w = evolve_worker(current, event, wid, attempt)
        if w is not None:
            if current is None:
                b.worker_created_seq[wid] = seq
            b.workers[wid] = w


def watched(state: RolloutState) -> bool:
    """Whether the watchdog watches a rollout: it is in flight (``preparing``/``running``), or one
    of its attempts is still live (``preparing``/``running``: a late span revived it after its
    rollout finished or its retry was claimed, or it runs under a rollout sent back to the queue)
    and its ``RolloutConfig`` has a limit the watchdog can enforce."""
    if state.rollout.status in ("preparing", "running"):
        return True
    cfg = state.rollout.config
    if cfg.timeout_seconds is None and cfg.unresponsive_seconds is None:
        return False
    return any(a.status in LIVE_ATTEMPT_STATUSES for a in state.attempts)


def in_flight(states: dict[str, RolloutState]) -> list[str]:
    """The rollouts among ``states`` the watchdog watches (``watched``)."""
    return [rid for rid, s in states.items() if watched(s)]
