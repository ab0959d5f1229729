"""GRPO's arithmetic: group-relative advantages and the clipped surrogate loss.

Follows DeepSeekMath's GRPO (Shao et al. 2024) as VERL implements it (``compute_grpo_outcome_advantage``,
``compute_policy_loss`` with ``loss_agg_mode="token-mean"``): each rollout's outcome reward is
compared with the other rollouts of the same task, and every response token of the rollout gets
that advantage. No KL term and no reference model (as DAPO and Dr. GRPO), which halves memory.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

__all__ = ["group_advantages", "policy_loss", "sequence_logprobs"]


def group_advantages(
    rewards: Sequence[float], groups: Sequence[Hashable], *, scale_by_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """Advantage of each rollout: its reward minus its group's mean, over the group's std.

    Args:
        rewards: One outcome reward per rollout.
        groups: The group of each rollout (the task it answered); same length as ``rewards``.
        scale_by_std: Divide by the group's population standard deviation (GRPO); ``False`` keeps
            the centred reward only (Dr. GRPO).
        eps: Added to the std.

    Returns:
        One advantage per rollout; 0.0 for a group of one and for a group whose rewards are all equal
        (it carries no signal).

    Raises:
        ValueError: The two sequences differ in length.
    """
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards but {len(groups)} group ids")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        values = torch.tensor([float(rewards[i]) for i in idx], dtype=torch.float64)
        if len(idx) < 2:
            continue
        centred = values - values.mean()
        if scale_by_std:
            std = values.std(unbiased=False)
            centred = centred / (std + eps) if std > 0 else torch.zeros_like(centred)
        for i, a in zip(idx, centred.tolist(), strict=True):
            out[i] = a
    return out


def sequence_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each token given the ones before it.

    Args:
        logits: ``[batch, seq, vocab]`` from the model on ``input_ids``.
        input_ids: ``[batch, seq]``.

    Returns:
        ``[batch, seq]``: position ``t`` holds ``log p(input_ids[t] | input_ids[:t])``; position 0
        (which nothing predicts) holds 0.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    chosen = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(chosen, (1, 0), value=0.0)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    n_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """PPO-clip surrogate averaged over response tokens (VERL ``token-mean``).

    Args:
        logprobs: ``[batch, seq]`` under the current weights (with grad).
        old_logprobs: ``[batch, seq]`` under the weights that sampled (no grad). With one update per
            batch they equal ``logprobs.detach()`` and the ratio is 1.
        advantages: ``[batch]`` (one per sequence) or ``[batch, seq]``.
        response_mask: ``[batch, seq]``, 1 on the model's own tokens, 0 on prompt and padding.
        clip_eps: Ratio clip range.
        n_tokens: Divide by this many tokens instead of the mask's sum (micro-batches of one step
            share the step's token count, so their gradients add up to the step's mean).

    Returns:
        ``(loss, stats)``: the scalar loss and ``{"clip_fraction", "tokens"}``.

    Raises:
        ValueError: The mask selects no token (a zero-size batch must not reach the optimizer).
    """
    mask = response_mask.to(logprobs.dtype)
    tokens = int(mask.sum().item())
    if tokens == 0:
        raise ValueError("policy_loss got no response tokens")
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1).expand_as(logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped)
    loss = (per_token * mask).sum() / float(n_tokens or tokens)
    clip_fraction = float((((clipped > unclipped).to(mask.dtype)) * mask).sum().item() / tokens)
    return loss, {"clip_fraction": clip_fraction, "tokens": tokens}
