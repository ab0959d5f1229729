"""The store side of ``VERL``: backends in the proxy, tasks in, finished attempts out as a batch.

Agent-lightning's ``AgentModeDaemon`` (v1 mode) on eventlight's store, proxy and adapters, with no
GPU and no verl import until ``train_batch``:

1. ``register_backends(addresses)``: the vLLM servers VERL started become the proxy's model list
   (``hosted_vllm/<model>``, so the proxy asks for ``return_token_ids``), and a resources
   version ``main_llm`` = the proxy, with the rollout temperature, is recorded;
2. ``enqueue(rows, train=...)``: each row gets a ``data_id``; a training row is enqueued ``n``
   times (mode ``"train"``), a validation row once (``"val"``), all under that resources id;
3. ``collect(rollout_ids)``: waits for them (event-driven), reads each finished attempt's spans
   (``query_spans(..., attempt_id="latest")``), turns them into triplets with the trainer's
   adapter, and takes the final reward (last non-null triplet reward, else the last reward span);
4. ``train_batch(trajectories)``: ``eventlight.verl.batch.build_batch`` at the configured level.

Counters (``VerlDaemon.counters``) say what was skipped: ``unfinished_rollouts``,
``failed_rollouts``, ``no_spans`` and the data path's own reasons (``llm_errors``: calls the
adapter left out because the LLM answered an error, e.g. a 400 for an over-long prompt).
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

from eventlight.adapter.stats import AdapterStats
from eventlight.core.types import EnqueueRolloutRequest, ProxyLLM, Rollout, RolloutConfig
from eventlight.rewards import find_final_reward
from eventlight.verl.batch import Trajectory, build_batch
from eventlight.verl.config import VerlSettings

log = logging.getLogger(__name__)

__all__ = ["VerlDaemon"]


class VerlDaemon:
    """Moves one VERL step's tasks through the store (see the module docstring).

    Args:
        settings: The validated config.
        store: The ``LightningStore``.
        llm_proxy: The ``LLMProxy`` the runners call (it records the spans, with token ids).
        adapter: A ``TraceToTripletBase`` (the trainer's; ``TracerTraceToTriplet`` by default).
        resource_name: Name of the LLM resource the agent reads (Agent-lightning: ``main_llm``).
    """

    def __init__(
        self, settings: VerlSettings, store: Any, llm_proxy: Any, adapter: Any, *, resource_name: str = "main_llm"
    ):
        self.settings = settings
        self.store = store
        self.llm_proxy = llm_proxy
        self.adapter = adapter
        self.resource_name = resource_name
        self.counters: Counter[str] = Counter()
        self.resources_id: str | None = None

    async def register_backends(self, addresses: Sequence[str], *, version: str | None = None) -> str:
        """Route the model name to ``addresses`` (``host:port`` of each vLLM server) and publish it.

        Returns:
            The resources id under which the next rollouts run.

        Raises:
            ValueError: No address.
        """
        if not addresses:
            raise ValueError("VERL started no vLLM server: there is no backend to register with the LLM proxy")
        model = self.settings.model_path
        self.llm_proxy.update_model_list(
            [
                {
                    "model_name": model,
                    "litellm_params": {
                        "model": f"hosted_vllm/{model}",
                        "api_base": f"http://{a}/v1",
                        "api_key": "EMPTY",
                    },
                }
                for a in addresses
            ]
        )
        llm = ProxyLLM(
            endpoint=self.llm_proxy.endpoint,
            model=model,
            sampling_parameters={"temperature": self.settings.temperature},
        )
        resources = {self.resource_name: llm}
        if version is None:
            update = await self.store.add_resources(resources)
        else:
            update = await self.store.update_resources(version, resources)
        self.resources_id = str(update.resources_id)
        return self.resources_id

    async def enqueue(self, rows: Sequence[Any], *, train: bool) -> list[str]:
        """Enqueue ``rows`` (``n`` rollouts each when ``train``, else one); returns their rollout ids.

        Raises:
            RuntimeError: ``register_backends`` was not called first.
        """
        if self.resources_id is None:
            raise RuntimeError("VerlDaemon.enqueue before register_backends: the rollouts would name no model")
        copies = self.settings.n if train else 1
        reqs = []
        for row in rows:
            data_id = str(uuid.uuid4())
            task = {**row, "data_id": data_id} if isinstance(row, dict) else row
            reqs += [
                EnqueueRolloutRequest(
                    input=task,
                    mode="train" if train else "val",
                    resources_id=self.resources_id,
                    metadata={"data_id": data_id, "is_train": train},
                    config=RolloutConfig(unresponsive_seconds=1200, timeout_seconds=1200),
                )
                for _ in range(copies)
            ]
        if not reqs:
            return []
        rollouts = await self.store.enqueue_many_rollouts(reqs)
        self.counters["rollouts_enqueued"] += len(rollouts)
        return [r.rollout_id for r in rollouts]

    async def collect(self, rollout_ids: Sequence[str], *, timeout_s: float | None = None) -> list[Trajectory]:
        """The finished attempts of ``rollout_ids`` as trajectories (failed ones skipped and counted)."""
        if not rollout_ids:
            return []
        wait = self.settings.rollout_timeout_s if timeout_s is None else timeout_s
        done = await self.store.wait_for_rollouts(rollout_ids=list(rollout_ids), timeout=wait)
        self.counters["unfinished_rollouts"] += len(set(rollout_ids) - {r.rollout_id for r in done})
        out = []
        for rollout in done:
            traj = await self._trajectory(rollout)
            if traj is not None:
                out.append(traj)
        return out

    async def _trajectory(self, rollout: Rollout) -> Trajectory | None:
        if rollout.status != "succeeded":
            self.counters["failed_rollouts"] += 1
            return None
        spans = list(await self.store.query_spans(rollout.rollout_id, attempt_id="latest"))
        if not spans:
            self.counters["no_spans"] += 1
            return None
        triplets = self.adapter.adapt(spans)
        rewards = [t.reward for t in triplets if t.reward is not None]
        reward = rewards[-1] if rewards else find_final_reward(spans)
        uid = (rollout.metadata or {}).get("data_id", rollout.rollout_id)
        stats = getattr(self.adapter, "last_stats", None)  # a user's adapter may not count
        errors = stats.errors if isinstance(stats, AdapterStats) else 0
        return Trajectory(rollout.rollout_id, str(uid), triplets, None if reward is None else float(reward), errors)

    def train_batch(self, trajectories: Sequence[Trajectory], *, pad_token_id: int) -> Any:
        """The step's ``verl.DataProto`` (``eventlight.verl.batch.build_batch``).

        Raises:
            EmptyBatchError: Nothing to train on (the counts say why).
        """
        s = self.settings
        return build_batch(
            trajectories,
            max_prompt_length=s.max_prompt_length,
            max_response_length=s.max_response_length,
            pad_token_id=pad_token_id,
            level="trajectory" if s.level == "trajectory" else "transition",
            reward_fillna_value=s.reward_fillna_value,
            counters=self.counters,
        )

    @staticmethod
    def mean_reward(trajectories: Sequence[Trajectory], fill: float = 0.0) -> float:
        """Mean final reward (missing ones count as ``fill``); NaN for none."""
        if not trajectories:
            return float("nan")
        return sum(fill if t.reward is None else t.reward for t in trajectories) / len(trajectories)
