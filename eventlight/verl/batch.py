"""Finished attempts to VERL's training batch: ``verl.DataProto`` over a ``TensorDict``.

Agent-lightning's ``AgentModeDaemon.get_train_data_batch``, on the triplets eventlight's adapters
build from the LLM proxy's spans (token ids exactly as vLLM returned them). Per sample, with
``P = max_prompt_length`` and ``R = max_response_length``:

* ``prompts`` ``[N, P]``: prompt ids **left**-padded with ``pad_token_id``;
* ``responses`` ``[N, R]``: response ids **right**-padded;
* ``input_ids``, ``attention_mask``, ``position_ids`` ``[N, P + R]``: the two concatenated, the
  mask 1 on real tokens, positions ``cumsum(mask) - 1`` clamped at 0 (VERL's
  ``compute_position_id_with_mask``);
* ``response_mask`` ``[N, R]``: 1 exactly on the tokens the model produced. At the ``transition``
  level (one sample per LLM call) that is the whole response; at the ``trajectory`` level (one
  sample per run of turns whose token ids extend each other) the chat template, separators and tool
  outputs between turns are in the response window with mask 0;
* ``token_level_scores`` and ``rm_scores`` ``[N, R]`` float32: the rollout's final reward on the
  last response token, 0 elsewhere (Agent-lightning casts to bfloat16, where 0.1 is not exact);
* non-tensor ``uid`` (the task's data id: GRPO groups every sample of every rollout of one task),
  ``rollout_id`` and ``turn_index`` (``-1`` for a merged trajectory).

Bad input is skipped and counted in ``counters`` (never padded into a zero-length row):
``no_token_ids`` (a triplet without prompt or response ids), ``prompt_too_long`` (a prompt longer
than ``P``; Agent-lightning truncates it and drops it after the advantages, here it never enters),
``no_triplets`` (a rollout without any usable LLM call), ``llm_errors`` (LLM calls that failed,
e.g. vLLM's 400 for a prompt longer than the context: the adapter gives them no triplet, peer
failure C15); ``response_truncated`` counts responses cut
to ``R`` (kept, as in Agent-lightning), ``no_reward`` rollouts whose reward was filled with
``reward_fillna_value``, ``unmerged_turns`` turns that started a new trajectory sample because their
prompt did not extend the previous turn's tokens. A batch left with no sample raises
``EmptyBatchError`` naming the counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from eventlight.core.errors import EventlightError

__all__ = ["EmptyBatchError", "Sample", "Trajectory", "build_batch", "samples_from_trajectory"]

Level = Literal["transition", "trajectory"]


class EmptyBatchError(EventlightError):
    """No finished attempt left a trainable sample (every rollout failed, had no token ids, ...)."""


@dataclass(frozen=True)
class Trajectory:
    """One finished attempt: its task's data id, its reward and its triplets in call order.

    Attributes:
        rollout_id: The rollout.
        uid: The task's data id; every rollout of one task shares it (the GRPO group).
        triplets: ``Triplet`` objects (``prompt["token_ids"]``, ``response["token_ids"]``).
        reward: The rollout's final reward; ``None`` is filled with ``reward_fillna_value``.
        llm_errors: LLM calls of the attempt the adapter left out because they failed (an upstream
            400 for a prompt longer than the context, ...); counted as ``llm_errors``.
    """

    rollout_id: str
    uid: str
    triplets: Sequence[Any]
    reward: float | None
    llm_errors: int = 0


@dataclass(frozen=True)
class Sample:
    """One row of the batch: prompt ids, response ids and which response ids the model produced."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    model_mask: tuple[int, ...]
    reward: float
    uid: str
    rollout_id: str
    turn_index: int = -1
    extra: dict[str, Any] = field(default_factory=dict)


def _ids(part: Any) -> list[int]:
    ids = part.get("token_ids") if isinstance(part, dict) else None
    if isinstance(ids, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return list(ids)
    return []


def _turns(traj: Trajectory, counters: Counter[str]) -> list[tuple[int, list[int], list[int]]]:
    turns = []
    for index, t in enumerate(traj.triplets):
        prompt, response = _ids(t.prompt), _ids(t.response)
        if prompt and response:
            turns.append((index, prompt, response))
        else:
            counters["no_token_ids"] += 1
    return turns


def _merge(turns: list[tuple[int, list[int], list[int]]], counters: Counter[str]) -> list[list[Any]]:
    """Group consecutive turns whose prompt starts with the previous turn's prompt + response."""
    groups: list[list[Any]] = []
    context: list[int] = []
    for index, prompt, response in turns:
        if groups and len(prompt) >= len(context) and prompt[: len(context)] == context:
            groups[-1].append((index, prompt[len(context) :], response))
        else:
            if groups:
                counters["unmerged_turns"] += 1
            groups.append([(index, prompt, response)])
        context = prompt + response
    return groups


def samples_from_trajectory(
    traj: Trajectory,
    *,
    level: Level,
    max_prompt_length: int,
    max_response_length: int,
    reward_fillna_value: float = 0.0,
    counters: Counter[str] | None = None,
) -> list[Sample]:
    """The samples of one finished attempt (see the module docstring for the rules).

    Args:
        traj: The attempt.
        level: ``"transition"`` (one sample per LLM call) or ``"trajectory"`` (token-prefix merge).
        max_prompt_length: ``P``, in tokens; longer prompts are skipped.
        max_response_length: ``R``, in tokens; longer responses are cut to their first ``R`` tokens.
        reward_fillna_value: Reward of an attempt that recorded none.
        counters: Incremented by reason (see the module docstring).

    Returns:
        The samples, possibly none.

    Raises:
        ValueError: Unknown ``level``.
    """
    if level not in ("transition", "trajectory"):
        raise ValueError(f"trace_aggregator level must be 'transition' or 'trajectory', not {level!r}")
    counters = counters if counters is not None else Counter()
    if traj.llm_errors:
        counters["llm_errors"] += traj.llm_errors
    reward = traj.reward
    if reward is None:
        counters["no_reward"] += 1
        reward = reward_fillna_value
    turns = _turns(traj, counters)
    groups = _merge(turns, counters) if level == "trajectory" else [[turn] for turn in turns]
    out: list[Sample] = []
    for group in groups:
        index, prompt, first = group[0]
        if len(prompt) > max_prompt_length:
            counters["prompt_too_long"] += 1
            continue
        response, mask = list(first), [1] * len(first)
        for _, between, answer in group[1:]:
            response += between + answer
            mask += [0] * len(between) + [1] * len(answer)
        if len(response) > max_response_length:
            counters["response_truncated"] += 1
            response, mask = response[:max_response_length], mask[:max_response_length]
        turn_index = index if level == "transition" else -1
        out.append(
            Sample(tuple(prompt), tuple(response), tuple(mask), float(reward), traj.uid, traj.rollout_id, turn_index)
        )
    if not out:
        counters["no_triplets"] += 1
    return out


def _pad(rows: Sequence[Sequence[int]], width: int, value: int, *, left: bool) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            values = torch.tensor(row, dtype=torch.long)
            if left:
                out[i, width - len(row) :] = values
            else:
                out[i, : len(row)] = values
    return out


def build_batch(
    trajectories: Sequence[Trajectory],
    *,
    max_prompt_length: int,
    max_response_length: int,
    pad_token_id: int,
    level: Level = "transition",
    reward_fillna_value: float = 0.0,
    counters: Counter[str] | None = None,
) -> Any:
    """The ``verl.DataProto`` of a step's finished attempts (shapes in the module docstring).

    Args:
        trajectories: The finished attempts, in any order.
        max_prompt_length: ``P`` (``data.max_prompt_length``, or the trajectory level's
            ``trajectory_max_prompt_length``).
        max_response_length: ``R`` (likewise).
        pad_token_id: The tokenizer's pad id.
        level: ``"transition"`` or ``"trajectory"``.
        reward_fillna_value: Reward of an attempt that recorded none.
        counters: Incremented by reason; the batch's ``meta_info["counters"]`` holds this step's.

    Returns:
        A ``DataProto`` of ``N >= 1`` rows.

    Raises:
        EmptyBatchError: No attempt left a sample.
        ValueError: A length is not positive, or ``level`` is unknown.
        ImportError: verl is not installed.
    """
    from verl import DataProto
    from verl.utils.model import compute_position_id_with_mask

    if max_prompt_length < 1 or max_response_length < 1:
        raise ValueError(f"max lengths must be >= 1, got prompt {max_prompt_length}, response {max_response_length}")
    step: Counter[str] = Counter()
    samples = [
        s
        for traj in trajectories
        for s in samples_from_trajectory(
            traj,
            level=level,
            max_prompt_length=max_prompt_length,
            max_response_length=max_response_length,
            reward_fillna_value=reward_fillna_value,
            counters=step,
        )
    ]
    step["rollouts"] += len(trajectories)
    if counters is not None:
        counters.update(step)
    if not samples:
        raise EmptyBatchError(f"no trainable sample in {len(trajectories)} finished attempts ({dict(step)})")
    prompts = _pad([s.prompt_ids for s in samples], max_prompt_length, pad_token_id, left=True)
    responses = _pad([s.response_ids for s in samples], max_response_length, pad_token_id, left=False)
    prompt_mask = _pad([[1] * len(s.prompt_ids) for s in samples], max_prompt_length, 0, left=True)
    response_attn = _pad([[1] * len(s.response_ids) for s in samples], max_response_length, 0, left=False)
    response_mask = _pad([s.model_mask for s in samples], max_response_length, 0, left=False)
    attention_mask = torch.cat([prompt_mask, response_attn], dim=1)
    scores = torch.zeros((len(samples), max_response_length), dtype=torch.float32)
    for row, s in enumerate(samples):
        scores[row, len(s.response_ids) - 1] = s.reward
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": response_mask,
        "token_level_scores": scores,
        "rm_scores": scores.clone(),
    }
    non_tensors = {
        "uid": np.array([s.uid for s in samples], dtype=object),
        "rollout_id": np.array([s.rollout_id for s in samples], dtype=object),
        "turn_index": np.array([s.turn_index for s in samples], dtype=np.int64),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"counters": dict(step)})
