"""``agentlightning.reward`` (0.3.0 keeps it as a deprecated alias of ``agentlightning.emitter.reward``)."""

from __future__ import annotations

from eventlight.emitter import emit_reward, reward
from eventlight.rewards import (
    find_final_reward,
    find_reward_spans,
    get_reward_value,
    get_rewards_from_span,
    is_reward_span,
)

__all__ = [
    "emit_reward",
    "find_final_reward",
    "find_reward_spans",
    "get_reward_value",
    "get_rewards_from_span",
    "is_reward_span",
    "reward",
]
