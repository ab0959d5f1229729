"""Claims of ``EventStore``: dequeue (claim a queue entry), start an attempt, mark a worker idle."""

from __future__ import annotations

import asyncio
import logging

from eventlight.core import commands as c
from eventlight.core.errors import (
    ConcurrencyError,
    InvalidInputError,
    InvalidTransitionError,
    NotFoundError,
)
from eventlight.core.events import WorkerIdle
from eventlight.core.types import (
    AttemptedRollout,
    generate_id,
)
from eventlight.store.ports import Queued
from eventlight.store.service.plumbing import StorePlumbing
from eventlight.store.validate import (
    check_token,
)

log = logging.getLogger(__name__)

IDLE_REFRESH_S = 1.0
"""An empty poll re-marks an idle worker (``last_dequeue_time``) at most this often, in seconds."""
MAX_IDLE_MARKS = 4096  # workers whose last idle mark this store remembers


class Claims(StorePlumbing):
    """Claims from the work queue, and the worker idle/busy policy of empty polls."""

    async def dequeue_rollout(self, worker_id: str | None = None, *, wait_s: float = 0.0) -> AttemptedRollout | None:
        """Claim the oldest queued rollout.

        Args:
            worker_id: The claiming runner; becomes the attempt's ``worker_id``.
            wait_s: Seconds to wait for work when the queue is empty (eventlight extension; the
                Agent-lightning API is non-blocking, ``0``). Runners pass their poll interval so
                an idle runner sleeps in the server instead of spinning (peer failure C19).

        Raises:
            InvalidInputError: ``worker_id`` is not a token.
        """
        if worker_id is not None:
            check_token("worker_id", worker_id)
        log = self._log()
        clock = asyncio.get_running_loop().time
        deadline = clock() + wait_s if wait_s > 0 else 0.0
        while True:
            item = await log.next_queued(max(0.0, deadline - clock()) if wait_s > 0 else 0.0)
            if item is not None:
                claimed = await self._claim(item, worker_id)
                if claimed is not None:
                    if worker_id is not None:
                        self._idle_marks.pop(worker_id, None)
                    return claimed
            if item is None or (wait_s > 0 and clock() >= deadline):
                await self._mark_idle(worker_id)
                return None

    async def _claim(self, item: Queued, worker_id: str | None) -> AttemptedRollout | None:
        """Claim a queue entry: append ``AttemptStarted`` expecting the rollout's version; an entry
        whose rollout left ``queuing``/``requeuing`` since is acknowledged and skipped."""
        cmd = c.StartAttempt(attempt_id=generate_id("at-", 8), worker_id=worker_id, claim=True)
        hint = (item.created, item.seq) if item.created is not None else None
        try:
            outcome = await self._loop.execute(item.rollout_id, cmd, hint=hint, max_tries=3)
        except InvalidTransitionError:
            await item.ack()  # cancelled, revived or already claimed since it was queued
            return None
        except (NotFoundError, InvalidInputError) as e:  # a queue entry no rollout stands behind
            log.warning("dropping queue entry %d on rollout %r: %s", item.seq, item.rollout_id, e)
            await item.ack()  # else it would come back every ack wait, for ever
            return None
        except ConcurrencyError:
            await item.nak(0.1)
            return None
        self._held[(item.rollout_id, cmd.attempt_id)] = item
        return outcome.state.attempted_rollout()

    async def _mark_idle(self, worker_id: str | None) -> None:
        if worker_id is None:
            return
        now = self._clock()
        last = self._idle_marks.get(worker_id)
        if last is not None and 0.0 <= now - last < IDLE_REFRESH_S:
            return
        if len(self._idle_marks) >= MAX_IDLE_MARKS:
            self._idle_marks.pop(next(iter(self._idle_marks)))
        self._idle_marks[worker_id] = now
        self._wrote(await self._log().publish(WorkerIdle(time=now, worker_id=worker_id)))

    async def start_attempt(self, rollout_id: str, worker_id: str | None = None) -> AttemptedRollout:
        if worker_id is not None:
            check_token("worker_id", worker_id)
        cmd = c.StartAttempt(attempt_id=generate_id("at-", 8), worker_id=worker_id)
        started = (await self._loop.execute(rollout_id, cmd)).state.attempted_rollout()
        if worker_id is not None:
            self._idle_marks.pop(worker_id, None)  # busy now: its next empty poll marks it idle at once
        return started
