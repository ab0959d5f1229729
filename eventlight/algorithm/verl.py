"""``VERL``: Agent-lightning's VERL algorithm on the event store (the ``verl`` extra, GPUs only).

``VERL(config)`` takes the same dict as Agent-lightning's: VERL/Hydra overrides (``data.*``,
``actor_rollout_ref.*``, ``algorithm.*``, ``trainer.*``) plus ``agentlightning.trace_aggregator``.
It expects no initial resources: VERL starts vLLM servers for ``actor_rollout_ref.model.path``;
each step they are registered with the trainer's LLM proxy (``hosted_vllm/``, token ids through
``return_token_ids``) under the resource key ``main_llm``, the step's tasks are enqueued
``rollout.n`` times, and the finished attempts become verl's ``DataProto``
(``eventlight.verl.batch``) for verl's GRPO/PPO update. Agent-lightning's ``trainer_cls`` and
``daemon_cls`` overrides are kept.

The config is validated at construction, on any machine (a clear ``InvalidInputError``);
``run`` checks for a CUDA GPU and the extra first and stops with ``VerlUnavailableError``
otherwise, before it starts anything.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from eventlight.algorithm.base import Algorithm, Dataset
from eventlight.algorithm.checks import check_callable
from eventlight.verl.config import VerlSettings

log = logging.getLogger(__name__)

__all__ = ["VERL"]


class VERL(Algorithm):
    """VERL-powered reinforcement learning (Agent-lightning ``agentlightning.algorithm.verl.VERL``).

    Args:
        config: VERL overrides as a nested dict (see the module docstring); validated here.
        trainer_cls: Replaces ``eventlight.verl.gpu.run_training`` (called with the same arguments).
        daemon_cls: Replaces ``eventlight.verl.daemon.VerlDaemon`` (same constructor).
        progress: Called with one dict per training step (``"step"``, ``"train_reward"``,
            ``"samples"``, ``"rollout_s"``, ``"update_s"``, ``"peak_gpu_bytes"``, ``"metrics"``).

    Raises:
        InvalidInputError: ``config`` is not a valid VERL config (one line naming the key).
        InvalidTypeError: ``trainer_cls``, ``daemon_cls`` or ``progress`` is neither callable nor ``None``.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        trainer_cls: Callable[..., Any] | None = None,
        daemon_cls: type[Any] | None = None,
        *,
        progress: Callable[[dict[str, Any]], None] | None = None,
    ):
        for name, value in (("trainer_cls", trainer_cls), ("daemon_cls", daemon_cls), ("progress", progress)):
            check_callable(f"VERL.{name}", value)
        self.settings = VerlSettings.from_config(config)
        self.config = dict(config)
        self.trainer_cls = trainer_cls
        self.daemon_cls = daemon_cls
        self.progress = progress
        self.daemon: Any = None

    def make_daemon(self) -> Any:
        """The store side (``VerlDaemon``) bound to the trainer's store, proxy and adapter.

        Raises:
            ValueError: The trainer gave no LLM proxy (the spans and token ids come from it).
        """
        from eventlight.verl.daemon import VerlDaemon

        proxy = self.get_llm_proxy()
        if proxy is None:
            raise ValueError("VERL serves vLLM through the LLM proxy; give the Trainer an llm_proxy")
        cls = self.daemon_cls or VerlDaemon
        return cls(self.settings, self.get_store(), proxy, self.get_adapter())

    async def run(self, train_dataset: Dataset[Any] | None = None, val_dataset: Dataset[Any] | None = None) -> None:
        """Train with VERL on this machine's GPUs; returns when ``trainer.total_training_steps`` or
        ``trainer.total_epochs`` are done.

        Raises:
            VerlUnavailableError: No CUDA GPU, or the ``verl`` extra is not installed.
            ValueError: No training task, or no LLM proxy.
        """
        from eventlight.verl.requirements import require_gpu

        require_gpu()
        train = [train_dataset[i] for i in range(len(train_dataset))] if train_dataset is not None else []
        if not train:
            raise ValueError("VERL needs a non-empty train_dataset")
        self.daemon = self.make_daemon()
        from eventlight.verl.config import verl_config
        from eventlight.verl.gpu import run_training

        proxy = self.get_llm_proxy()
        if not proxy.is_running():
            await proxy.start()
        train_fn = self.trainer_cls or run_training
        cfg = verl_config(self.config)
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(train_fn, cfg, self.daemon, loop, train, self.progress)
        log.info("VERL finished: %s", dict(self.daemon.counters))
