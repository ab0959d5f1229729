"""The GPU half of ``VERL``: VERL's Ray workers, its vLLM servers and a PPO loop fed by the store.

Imported only by ``VERL.run`` after ``require_gpu()`` passed: it imports ray, verl's trainer and
(through verl's workers) vLLM and CUDA. ``StoreTrainer`` is verl's ``RayPPOTrainer`` (verl 0.9)
with Agent-lightning's ``AgentLightningTrainer.fit``: per step it wakes the vLLM replicas with the
current weights, has the ``VerlDaemon`` register them with the LLM proxy, enqueue the step's tasks
and build the ``DataProto`` from the finished attempts, puts the replicas to sleep, then runs
verl's own old-log-prob, reference, advantage (``algorithm.adv_estimator``, GRPO grouped by
``uid``) and actor-update steps.

Not verified on a GPU from this repository's CI (no GPU there): see the README's VERL section.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from eventlight.verl.batch import EmptyBatchError
from eventlight.verl.daemon import VerlDaemon
from eventlight.verl.requirements import VerlUnavailableError, require_gpu

log = logging.getLogger(__name__)

__all__ = ["VerlUnavailableError", "require_gpu", "run_training"]


class _Rows:
    """A map-style dataset of task rows for verl's dataloader (collated as an object array)."""

    def __init__(self, rows: Sequence[Any]):
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        return self.rows[i]


def _collate(rows: list[Any]) -> dict[str, Any]:
    import numpy as np

    out = np.empty(len(rows), dtype=object)
    out[:] = rows
    return {"rows": out}


def _fit_to_minibatch(batch: Any, mini_batch: int) -> Any:
    """Keep a multiple of ``mini_batch`` rows (Agent-lightning's floor), padding up when below one."""
    from verl.protocol import pad_dataproto_to_divisor

    n = len(batch)
    keep = n - n % mini_batch
    if keep == 0:
        padded, _ = pad_dataproto_to_divisor(batch, mini_batch)
        return padded
    return batch if keep == n else batch[:keep]


def _trainer_class() -> Any:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage

    class StoreTrainer(RayPPOTrainer):  # type: ignore[misc, valid-type]
        """``RayPPOTrainer`` whose rollouts come from the store (see the module docstring)."""

        daemon: VerlDaemon
        loop: asyncio.AbstractEventLoop
        on_step: Callable[[dict[str, Any]], None] | None

        def _store(self, coro: Any) -> Any:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

        def _rollouts(self, rows: list[Any]) -> Any:
            addresses = list(self.llm_server_manager.server_addresses)
            self._store(self.daemon.register_backends(addresses, version=f"verl-step{self.global_steps}"))
            ids = self._store(self.daemon.enqueue(rows, train=True))
            trajectories = self._store(self.daemon.collect(ids))
            reward = VerlDaemon.mean_reward(trajectories, self.daemon.settings.reward_fillna_value)
            return self.daemon.train_batch(trajectories, pad_token_id=self.tokenizer.pad_token_id), reward

        def _train_step(self, batch: Any) -> dict[str, Any]:
            c = self.config
            batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()
            batch.meta_info["temperature"] = c.actor_rollout_ref.rollout.temperature
            old_log_prob, _ = self._compute_old_log_prob(batch)
            old_log_prob.batch.pop("entropys", None)
            batch = batch.union(old_log_prob)
            if self.use_reference_policy:
                batch = batch.union(self._compute_ref_log_prob(batch))
            batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
            batch = compute_advantage(
                batch,
                adv_estimator=c.algorithm.adv_estimator,
                gamma=c.algorithm.gamma,
                lam=c.algorithm.lam,
                num_repeat=c.actor_rollout_ref.rollout.n,
                norm_adv_by_std_in_grpo=c.algorithm.get("norm_adv_by_std_in_grpo", True),
                config=c.algorithm,
            )
            batch = _fit_to_minibatch(batch, int(c.actor_rollout_ref.actor.ppo_mini_batch_size))
            output = self._update_actor(batch)
            return dict(output.meta_info.get("metrics", {}))

        def fit(self) -> None:
            import torch

            self.global_steps = 0
            self._load_checkpoint()
            self.checkpoint_manager.update_weights(self.global_steps)
            for _ in range(self.config.trainer.total_epochs):
                for batch_dict in self.train_dataloader:
                    self.global_steps += 1
                    t0 = time.monotonic()
                    torch.cuda.reset_peak_memory_stats()
                    try:
                        batch, reward = self._rollouts(list(batch_dict["rows"]))
                    except EmptyBatchError as exc:
                        log.warning("VERL step %d: %s", self.global_steps, exc)
                        self.daemon.counters["empty_steps"] += 1
                        continue
                    finally:
                        self.checkpoint_manager.sleep_replicas()
                    t1 = time.monotonic()
                    metrics = self._train_step(batch)
                    self.checkpoint_manager.update_weights(self.global_steps)
                    record = {
                        "event": "step",
                        "step": self.global_steps,
                        "train_reward": reward,
                        "samples": len(batch),
                        "rollout_s": t1 - t0,
                        "update_s": time.monotonic() - t1,
                        "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
                        "metrics": metrics,
                    }
                    if self.on_step is not None:
                        self.on_step(record)
                    if self.config.trainer.save_freq > 0 and self.global_steps % self.config.trainer.save_freq == 0:
                        self._save_checkpoint()
                    if self.global_steps >= self.total_training_steps:
                        return

    return StoreTrainer


def run_training(
    cfg: Any,
    daemon: VerlDaemon,
    loop: asyncio.AbstractEventLoop,
    train_rows: Sequence[Any],
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Start Ray and VERL's workers in this process and run ``StoreTrainer.fit`` (blocking: call it
    in a worker thread; the daemon's store calls run on ``loop``).

    Raises:
        VerlUnavailableError: ``require_gpu`` fails.
    """
    require_gpu()
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.main_ppo_v0 import BaseTaskRunner
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.config import HFModelConfig

    OmegaConf.resolve(cfg)
    if not ray.is_initialized():
        ray.init(**OmegaConf.to_container(cfg.get("ray_kwargs", {}).get("ray_init", {})))
    runner = BaseTaskRunner()
    _, worker_group_cls = runner.add_actor_rollout_worker(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model, dataclass_type=HFModelConfig)
    trainer = _trainer_class()(
        config=cfg,
        tokenizer=model_config.tokenizer,
        processor=model_config.processor,
        role_worker_mapping=runner.role_worker_mapping,
        resource_pool_manager=runner.init_resource_pool_mgr(cfg),
        ray_worker_group_cls=worker_group_cls,
        train_dataset=_Rows(train_rows),
        val_dataset=_Rows(train_rows[:1]),
        collate_fn=_collate,
    )
    trainer.daemon, trainer.loop, trainer.on_step = daemon, loop, on_step
    trainer.init_workers()
    trainer.fit()
