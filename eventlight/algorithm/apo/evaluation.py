"""Rolling a candidate prompt out on a batch of tasks and scoring it (mixed into ``APO``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Generic

import msgspec

from eventlight.adapter import OpenAIMessages, TraceToMessages
from eventlight.algorithm.apo.models import ProgressCallback, RolloutResultForAPO, T_task, VersionedPromptTemplate
from eventlight.algorithm.base import Algorithm
from eventlight.core.types import (
    EnqueueRolloutRequest,
    NamedResources,
    PromptTemplate,
    Rollout,
    RolloutConfig,
    Span,
)
from eventlight.rewards import find_final_reward
from eventlight.store.subscription import FinishedAttempt

log = logging.getLogger(__name__)


class RolloutEvaluation(Algorithm, Generic[T_task]):
    """Scores a prompt by rolling it out through the store; the evaluation half of ``APO``."""

    rollout_config: RolloutConfig | None
    rollout_batch_timeout: float
    progress: ProgressCallback | None
    history: list[tuple[str, str, float, int]]

    def get_adapter(self) -> TraceToMessages:
        """The adapter, which must turn spans into chat messages.

        Raises:
            ValueError: Unset, or not a ``TraceToMessages`` (pass ``adapter=TraceToMessages()`` to
                the trainer; its default is ``TracerTraceToTriplet``).
        """
        adapter = super().get_adapter()
        if not isinstance(adapter, TraceToMessages):
            raise ValueError(f"APO needs a TraceToMessages adapter, got {type(adapter).__name__}")
        return adapter

    def _emit(self, event: dict[str, Any]) -> None:
        if self.progress is None:
            return
        try:
            self.progress(event)
        except Exception:
            log.exception("APO progress callback failed on %s", event.get("event"))

    # -- evaluation ---------------------------------------------------------------------------

    def _resources_for(self, name: str, template: PromptTemplate) -> NamedResources:
        return {**(self.get_initial_resources() or {}), name: template}

    async def evaluate_prompt_on_batch(
        self,
        prompt: VersionedPromptTemplate,
        resource_name: str,
        dataset: Sequence[T_task],
        mode: str,
        *,
        prefix: str | None = None,
    ) -> tuple[list[RolloutResultForAPO], float]:
        """Publish ``prompt`` as resources ``prompt.version``, roll out ``dataset``, and score it.

        Args:
            prompt: The candidate.
            resource_name: The name the agent reads the template under.
            dataset: Tasks, one rollout each, all enqueued at once.
            mode: ``"train"`` or ``"val"``.
            prefix: Log prefix.

        Returns:
            ``(results, score)``: a result per rollout that finished within
            ``rollout_batch_timeout`` (in task order) and their mean final reward (``None`` = 0;
            0.0 when none finished).
        """
        store = self.get_store()
        await store.update_resources(prompt.version, self._resources_for(resource_name, prompt.prompt_template))
        requests = [
            EnqueueRolloutRequest(input=task, mode=mode, resources_id=prompt.version, config=self.rollout_config)
            for task in dataset
        ]
        subscribe = getattr(store, "subscribe_messages", None)
        if subscribe is None:  # a store without subscriptions (another LightningStore): wait, then read spans
            ids = [r.rollout_id for r in await store.enqueue_many_rollouts(requests)]
            finished = await store.wait_for_rollouts(rollout_ids=ids, timeout=self.rollout_batch_timeout)
            results = await self.get_rollout_results(finished, prefix=prefix)
        else:  # subscribed before the enqueue: each rollout's messages arrive as it finishes
            async with subscribe(self.get_adapter()) as sub:
                ids = [r.rollout_id for r in await store.enqueue_many_rollouts(requests)]
                records = await sub.collect(ids, timeout_s=self.rollout_batch_timeout)
            # cancelled before any attempt: ended, no result; collect did not wait for them, nor is there more to cancel
            finished = [r.rollout for r in records] + list(sub.unattempted.values())
            results = [self._result(r, prefix) for r in records]
        if len(finished) < len(ids):
            await self._cancel_unfinished(ids, finished, prefix or "")
        score = sum(r["final_reward"] or 0.0 for r in results) / max(1, len(results))
        self.history.append((prompt.version, mode, score, len(results)))
        self._emit(
            {
                "event": "eval",
                "version": prompt.version,
                "mode": mode,
                "score": score,
                "n": len(results),
                "requested": len(ids),
            }
        )
        return results, score

    async def _cancel_unfinished(self, ids: list[str], finished: list[Rollout], prefix: str) -> None:
        """Cancel the rollouts of ``ids`` not in ``finished`` (the batch's wait gave up on them),
        unless they ended meanwhile, each keeping its metadata with ``cancelled_by`` (pid and
        reason) added (``Algorithm._cancel_given_up``, as GRPO's); one warning line counts them."""
        done = {r.rollout_id for r in finished}
        late = [rid for rid in ids if rid not in done]
        log.warning(
            "%s %d/%d rollouts unfinished after %.0f s; cancelling them",
            prefix,
            len(late),
            len(ids),
            self.rollout_batch_timeout,
        )
        reason = f"APO evaluation: not finished within rollout_batch_timeout={self.rollout_batch_timeout:g} s"
        await self._cancel_given_up(late, reason, prefix)

    async def get_rollout_results(
        self, rollouts: Sequence[Rollout], *, prefix: str | None = None
    ) -> list[RolloutResultForAPO]:
        """Spans (latest attempt), messages, final reward and status of finished rollouts.

        Raises:
            ValueError: A reward span is malformed (see ``eventlight.rewards``).
        """
        store = self.get_store()
        results: list[RolloutResultForAPO] = []
        for rollout in rollouts:
            spans = list(await store.query_spans(rollout.rollout_id, attempt_id="latest"))
            results.append(
                RolloutResultForAPO(
                    status=rollout.status,
                    final_reward=find_final_reward(spans),
                    spans=[msgspec.to_builtins(s) for s in spans],
                    messages=self._messages(spans, rollout.rollout_id, prefix),
                )
            )
        return results

    def _result(self, record: FinishedAttempt, prefix: str | None) -> RolloutResultForAPO:
        """A subscription's record as APO's result (the messages ``TraceToMessages`` made)."""
        for error in record.errors:
            log.warning("%s rollout %s: %s", prefix or "", record.rollout_id, error)
        return RolloutResultForAPO(
            status=record.rollout.status,
            final_reward=record.final_reward,
            spans=[msgspec.to_builtins(s) for s in record.spans],
            messages=list(record.data),
        )

    def _messages(self, spans: list[Span], rollout_id: str, prefix: str | None) -> list[OpenAIMessages]:
        try:
            return self.get_adapter().adapt(spans)
        except ValueError as e:
            log.warning("%s could not turn the spans of %s into messages: %s", prefix or "", rollout_id, e)
            return []
