"""Rollout and attempt commands of ``EventStore``: enqueue, start, update."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from eventlight.core import commands as c
from eventlight.core.errors import (
    InvalidTransitionError,
    ResourcesNotFoundError,
)
from eventlight.core.types import (
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    EnqueueRolloutRequest,
    Rollout,
    RolloutConfig,
    RolloutStatus,
    ended_by_cancel,
    generate_id,
)
from eventlight.store.service.plumbing import UNSET, StorePlumbing, Unset, store_call
from eventlight.store.validate import (
    check_payload,
    check_rollout_config,
    check_token,
)

FINAL = ("succeeded", "failed", "timeout")
ENDED = (*FINAL, "unresponsive")


class RolloutCommands(StorePlumbing):
    """Create rollouts (queued or started) and update rollouts and attempts through the command loop.

    ``default_rollout_config`` is the ``RolloutConfig`` of rollouts created without one (``Trainer``'s
    ``rollout_config=`` sets it); ``None``: ``RolloutConfig()``.
    """

    default_rollout_config: RolloutConfig | None = None

    # -- rollouts -------------------------------------------------------------------------------

    def _create_command(
        self, input: Any, mode: str | None, resources_id: str | None, config: RolloutConfig | None, metadata: Any
    ) -> c.CreateRollout:
        config = check_rollout_config(config, "config")  # a dict of fields becomes a RolloutConfig
        cmd = c.CreateRollout(
            rollout_id=generate_id("ro-", 12),
            input=input,
            mode=mode,
            resources_id=resources_id,
            config=config if config is not None else self.default_rollout_config,
            metadata=metadata,
        )
        check_payload("enqueue_rollout", cmd)
        return cmd

    @store_call
    async def enqueue_rollout(
        self,
        input: Any,
        mode: str | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Rollout:
        cmd = self._create_command(input, mode, None, config, metadata)  # bad input fails before any read
        state = await self._create_rollout(lambda res: msgspec.structs.replace(cmd, resources_id=res), resources_id)
        return state.rollout

    @store_call
    async def enqueue_many_rollouts(self, rollouts: Sequence[EnqueueRolloutRequest]) -> list[Rollout]:
        """``enqueue_rollout`` for each request, concurrently (their events may share one atomic
        batch); results in request order. Every request is checked before any is sent."""
        cmds = [self._create_command(r.input, r.mode, None, r.config, r.metadata) for r in rollouts]
        for r in rollouts:  # an unknown explicit id fails the call before anything is appended
            if r.resources_id is not None:
                await self._resolve_resources(r.resources_id)

        def builder(cmd: c.CreateRollout) -> Callable[[str | None], c.CreateRollout]:
            return lambda res: msgspec.structs.replace(cmd, resources_id=res)

        states = await asyncio.gather(
            *(self._create_rollout(builder(cmd), r.resources_id) for cmd, r in zip(cmds, rollouts, strict=True))
        )
        return [s.rollout for s in states]

    @store_call
    async def start_rollout(
        self,
        input: Any,
        mode: str | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        worker_id: str | None = None,
    ) -> AttemptedRollout:
        if worker_id is not None:
            check_token("worker_id", worker_id)
        rollout_id, attempt_id = generate_id("ro-", 12), generate_id("at-", 8)
        config = check_rollout_config(config, "config")

        def build(res: str | None) -> c.CreateRollout:
            cmd = c.CreateRollout(
                rollout_id=rollout_id,
                input=input,
                mode=mode,
                resources_id=res,
                config=config if config is not None else self.default_rollout_config,
                metadata=metadata,
                queued=False,
                attempt_id=attempt_id,
                worker_id=worker_id,
            )
            check_payload("start_rollout", cmd)
            return cmd

        build(None)  # bad input fails before any read
        started = (await self._create_rollout(build, resources_id)).attempted_rollout()
        if worker_id is not None:
            self._idle_marks.pop(worker_id, None)
        return started

    @store_call
    async def update_rollout(
        self,
        rollout_id: str,
        input: Any | Unset = UNSET,
        mode: str | None | Unset = UNSET,
        resources_id: str | None | Unset = UNSET,
        status: RolloutStatus | Unset = UNSET,
        config: RolloutConfig | Unset = UNSET,
        metadata: dict[str, Any] | None | Unset = UNSET,
    ) -> Rollout:
        if isinstance(config, Mapping | RolloutConfig):  # None and other types: check_payload names them
            config = check_rollout_config(config, "config") or config
        cmd = c.UpdateRollout(
            input=input, mode=mode, resources_id=resources_id, status=status, config=config, metadata=metadata
        )
        check_payload("update_rollout", msgspec.structs.replace(cmd, status=UNSET))  # the decider names statuses
        if isinstance(resources_id, str) and not await self._resources_exist(resources_id):
            raise ResourcesNotFoundError(resources_id)
        return (await self._loop.execute(rollout_id, cmd)).state.rollout

    @store_call
    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: AttemptStatus | Unset = UNSET,
        worker_id: str | None | Unset = UNSET,
        last_heartbeat_time: float | None | Unset = UNSET,
        metadata: dict[str, Any] | None | Unset = UNSET,
    ) -> Attempt:
        check_payload(
            "update_attempt",
            c.UpdateAttempt(  # the status is the decider's to check (it names the valid ones)
                attempt_id=attempt_id,
                worker_id=worker_id,
                last_heartbeat_time=last_heartbeat_time,
                metadata=metadata,
            ),
        )
        cached = self._loop.cached(rollout_id)
        state = cached[0] if cached is not None else await self._loop.load(rollout_id)
        try:
            aid = state.attempt(attempt_id).attempt_id
        except ValueError:
            if cached is None:
                raise
            state, cached = await self._loop.load(rollout_id), None
            aid = state.attempt(attempt_id).attempt_id
        head = None
        unseen_spans = cached is not None and state.attempt(aid).status in ("preparing", "unresponsive")
        if unseen_spans and status not in FINAL:
            # spans of other processes may have moved it: read the span head during the append
            head = asyncio.ensure_future(self._log().span_head(rollout_id, aid))
        cmd = c.UpdateAttempt(
            attempt_id=aid,
            status=status,
            worker_id=worker_id,
            last_heartbeat_time=last_heartbeat_time,
            metadata=metadata,
        )
        try:
            outcome = await self._loop.execute(rollout_id, cmd)
        except InvalidTransitionError:
            await self._release(rollout_id, aid)
            raise
        finally:
            if head is not None and not head.done():
                await asyncio.wait([head])
        new = outcome.state if head is None else self._loop.head_seen(outcome, aid, head.result())
        if unseen_spans and head is None:
            # a final status is decided the same with or without spans of other processes; only
            # their heartbeat time is not folded in here, so the next command reloads the rollout
            self._loop.forget(rollout_id)
        attempt = new.attempt(aid)
        if attempt.status in ENDED:
            await self._release(rollout_id, aid)
        return attempt

    @store_call
    async def rollout_cancelled(self, rollout_id: str, attempt_id: str | None = None) -> bool:
        """Whether the rollout is ``cancelled`` now, as the log holds it, or (``attempt_id`` given)
        whether that attempt was ended by a cancel, even one the rollout was requeued after
        (eventlight's; a runner asks it about its attempt with each heartbeat while its agent runs,
        to stop an agent whose rollout was cancelled). A cancel records the attempts not yet
        finished ``failed`` with ``CANCELLED_REASON`` (``eventlight.core.decider``).

        A write-only store (a runner's, without Postgres) can answer it: when this store has seen
        the rollout (its claim), one read of the rollout's next state event after what it saw (one
        direct get on JetStream) tells whether anything changed; only then is the rollout loaded.

        Raises:
            RolloutNotFoundError: Unknown rollout (``RolloutRetiredError``: retired to the archive).
            AttemptNotFoundError: ``attempt_id`` is not an attempt of the rollout.
        """
        check_token("rollout_id", rollout_id)
        cached = self._loop.cached(rollout_id)
        if cached is not None and await self._log().state_event_after(rollout_id, cached[1]) is None:
            state = cached[0]
        else:
            state = await self._loop.load(rollout_id)
        attempt = state.attempt(attempt_id) if attempt_id is not None else None  # raises for another's
        return state.rollout.status == "cancelled" or (attempt is not None and ended_by_cancel(attempt))

    @store_call
    async def abandon_attempt(self, rollout_id: str, attempt_id: str, reason: str) -> Attempt:
        """Record an attempt whose runner is gone ``failed``, with ``reason`` as its
        ``eventlight.status_reason``, unless it already finished (eventlight's; ``RunnerPool`` calls
        it for the attempts of a runner process that died). Decided on the rollout's state in the
        log, so a write-only store (a runner's, without Postgres) can do it; the rollout is then
        requeued or failed by its ``RolloutConfig``, as after any failed attempt.

        Returns:
            The attempt as it is now (``failed`` with ``reason``, or as it finished before).

        Raises:
            RolloutNotFoundError / AttemptNotFoundError: Unknown ids.
        """
        check_token("rollout_id", rollout_id)
        check_token("attempt_id", attempt_id)
        outcome = await self._loop.execute(rollout_id, c.AbandonAttempt(attempt_id=attempt_id, reason=reason))
        return outcome.state.attempt(attempt_id)
