"""``VERL``'s config: a VERL/Hydra-style dict of overrides, validated once into ``VerlSettings``.

The dict is what Agent-lightning's ``VERL(config)`` takes: the keys of VERL's ``ppo_trainer``
config (``data.*``, ``actor_rollout_ref.*``, ``algorithm.*``, ``trainer.*``) plus an
``agentlightning`` section (``trace_aggregator``). ``VerlSettings.from_config`` reads what the
store side needs (it imports neither verl nor torch); ``verl_config`` merges the dict over VERL's
packaged defaults with Hydra (it needs verl and hydra-core) for the GPU trainer.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eventlight.core.errors import InvalidInputError

__all__ = ["AGL_DEFAULTS", "VerlSettings", "verl_config"]

AGL_DEFAULTS: dict[str, Any] = {
    "agentlightning": {
        "trace_aggregator": {
            "level": "transition",
            "trajectory_max_prompt_length": 2048,
            "trajectory_max_response_length": 8192,
        },
        "reward_fillna_value": 0.0,
    },
    "data": {"filter_overlong_prompts": False},
    "actor_rollout_ref": {"rollout": {"name": "vllm", "mode": "async"}},
}
"""Agent-lightning's additions to VERL's defaults (its packaged ``config.yaml``)."""


def _merged(config: Mapping[str, Any]) -> dict[str, Any]:
    def merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
        for key, value in over.items():
            if isinstance(value, Mapping) and isinstance(base.get(key), dict):
                merge(base[key], value)
            else:
                base[key] = copy.deepcopy(value)
        return base

    return merge(copy.deepcopy(AGL_DEFAULTS), config)


def _get(config: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _positive_int(config: Mapping[str, Any], dotted: str, default: int | None = None) -> int:
    value = _get(config, dotted, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"VERL config {dotted} must be a positive integer, got {value!r}")
    return value


def _number(
    config: Mapping[str, Any], dotted: str, default: float, *, low: float | None = None, positive: bool = False
) -> float:
    value = _get(config, dotted, default)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (positive and value <= 0) or (low is not None and value < low):
        want = "a number > 0" if positive else f"a number >= {low:g}" if low is not None else "a finite number"
        raise InvalidInputError(f"VERL config {dotted} must be {want}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class VerlSettings:
    """What the store side of ``VERL`` reads from its config.

    Attributes:
        model_path: ``actor_rollout_ref.model.path`` (a local folder or a hub name vLLM can load).
        n: ``actor_rollout_ref.rollout.n``, rollouts per training task (the GRPO group).
        train_batch_size: ``data.train_batch_size``, tasks per step.
        max_prompt_length: ``P`` of the batch at the configured level, in tokens.
        max_response_length: ``R`` likewise.
        level: ``agentlightning.trace_aggregator.level``: ``"transition"`` or ``"trajectory"``.
        temperature: ``actor_rollout_ref.rollout.temperature`` (1.0 when absent), for train and val.
        reward_fillna_value: Reward of a rollout that recorded none.
        total_epochs: ``trainer.total_epochs``.
        total_training_steps: ``trainer.total_training_steps`` (``None``: epochs decide).
        rollout_timeout_s: Longest wait for one step's rollouts (``agentlightning.rollout_timeout_s``).
    """

    model_path: str
    n: int
    train_batch_size: int
    max_prompt_length: int
    max_response_length: int
    level: str
    temperature: float
    reward_fillna_value: float
    total_epochs: int
    total_training_steps: int | None
    rollout_timeout_s: float

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VerlSettings:
        """Validate ``config`` (over ``AGL_DEFAULTS``).

        Raises:
            InvalidInputError: A missing model path, a non-positive size or length, an unknown
                aggregation level, a rollout engine other than vLLM; one line naming the key.
        """
        if not isinstance(config, Mapping):
            raise InvalidInputError(f"VERL config must be a dict of VERL overrides, got {type(config).__name__}")
        c = _merged(config)
        model_path = _get(c, "actor_rollout_ref.model.path")
        if not isinstance(model_path, str) or not model_path:
            raise InvalidInputError("VERL config actor_rollout_ref.model.path must name the model to train")
        engine = _get(c, "actor_rollout_ref.rollout.name")
        if engine != "vllm":
            raise InvalidInputError(f"VERL config actor_rollout_ref.rollout.name must be 'vllm', got {engine!r}")
        level = _get(c, "agentlightning.trace_aggregator.level")
        if level not in ("transition", "trajectory"):
            raise InvalidInputError(
                f"VERL config agentlightning.trace_aggregator.level must be 'transition' or 'trajectory', got {level!r}"
            )
        prefix = "agentlightning.trace_aggregator.trajectory_" if level == "trajectory" else "data."
        steps = _get(c, "trainer.total_training_steps")
        return cls(
            model_path=model_path,
            n=_positive_int(c, "actor_rollout_ref.rollout.n", 1),
            train_batch_size=_positive_int(c, "data.train_batch_size"),
            max_prompt_length=_positive_int(c, prefix + "max_prompt_length"),
            max_response_length=_positive_int(c, prefix + "max_response_length"),
            level=level,
            temperature=_number(c, "actor_rollout_ref.rollout.temperature", 1.0, low=0.0),
            reward_fillna_value=_number(c, "agentlightning.reward_fillna_value", 0.0),
            total_epochs=_positive_int(c, "trainer.total_epochs", 1),
            total_training_steps=None if steps is None else _positive_int(c, "trainer.total_training_steps"),
            rollout_timeout_s=_number(c, "agentlightning.rollout_timeout_s", 1200.0, positive=True),
        )


def verl_config(config: Mapping[str, Any]) -> Any:
    """VERL's full ``ppo_trainer`` config with ``AGL_DEFAULTS`` and ``config`` merged over it.

    Returns:
        An OmegaConf ``DictConfig`` (struct mode off, so keys VERL does not know are kept, as in
        Agent-lightning).

    Raises:
        ImportError: verl or hydra-core is not installed (the ``verl`` extra).
        InvalidInputError: ``config`` fails ``VerlSettings.from_config``.
    """
    VerlSettings.from_config(config)
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    folder = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=folder, version_base=None):
        base = compose(config_name="ppo_trainer")
    OmegaConf.set_struct(base, False)
    return OmegaConf.merge(base, OmegaConf.create(_merged(config)))
