"""From the adapters' triplets to the token tensors one GRPO step trains on.

A triplet (``TracerTraceToTriplet`` or ``LlmProxyTraceToTriplet``) holds the token ids the policy
saw (``prompt["token_ids"]``) and the ones it produced (``response["token_ids"]``), exactly as
the policy server returned them through the LLM proxy. Each becomes one row: prompt then response,
right-padded; the response mask is 1 on the response ids only, so templates, padding and anything
the agent added never receive gradient (VERL's ``response_mask``). Triplets that cannot train are
skipped and counted by reason, never padded into zero-length rows; so are those with an id the
model has no embedding for (another tokenizer's), which would stop the step with an ``IndexError``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Sample", "TokenBatch", "collate", "samples_from_triplets"]


@dataclass(frozen=True)
class Sample:
    """One trainable sequence: what the policy saw, what it produced, and that output's advantage."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    advantage: float
    rollout_id: str = ""


@dataclass
class TokenBatch:
    """Right-padded tensors of a list of samples.

    Attributes:
        input_ids: ``[batch, seq]`` prompt + response + padding.
        attention_mask: ``[batch, seq]``, 1 on real tokens.
        response_mask: ``[batch, seq]``, 1 on response tokens only.
        advantages: ``[batch]``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_response_tokens(self) -> int:
        return int(self.response_mask.sum().item())


def _ids(part: Any) -> list[int]:
    ids = part.get("token_ids") if isinstance(part, dict) else None
    if isinstance(ids, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return list(ids)
    return []


def samples_from_triplets(
    triplets: Iterable[Any],
    advantage: float,
    *,
    max_seq_len: int,
    rollout_id: str = "",
    skipped: Counter[str] | None = None,
    vocab_size: int | None = None,
) -> list[Sample]:
    """The samples of one rollout: each of its LLM calls, all with the rollout's advantage.

    Args:
        triplets: ``Triplet`` objects of one attempt, in order.
        advantage: The rollout's group-relative advantage.
        max_seq_len: Longest prompt + response kept, in tokens.
        rollout_id: Kept on each sample for logs.
        skipped: Counts skipped triplets by reason (``"no_token_ids"``, ``"too_long"``,
            ``"token_id_out_of_range"``).
        vocab_size: The model's number of token embeddings; a triplet with an id outside
            ``[0, vocab_size)`` is skipped (``None``: not checked).

    Returns:
        One sample per usable triplet.
    """
    skipped = skipped if skipped is not None else Counter()
    out: list[Sample] = []
    for t in triplets:
        prompt, response = _ids(t.prompt), _ids(t.response)
        if not prompt or not response:
            skipped["no_token_ids"] += 1
        elif len(prompt) + len(response) > max_seq_len:
            skipped["too_long"] += 1
        elif vocab_size is not None and not all(0 <= i < vocab_size for i in (*prompt, *response)):
            skipped["token_id_out_of_range"] += 1
        else:
            out.append(Sample(tuple(prompt), tuple(response), float(advantage), rollout_id))
    return out


def collate(samples: Sequence[Sample], pad_id: int) -> TokenBatch:
    """Pad ``samples`` to one batch.

    Raises:
        ValueError: ``samples`` is empty.
    """
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    resp = torch.zeros((len(samples), width), dtype=torch.long)
    for row, s in enumerate(samples):
        n_p, n = len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids)
        ids[row, :n] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attn[row, :n] = 1
        resp[row, n_p:n] = 1
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return TokenBatch(input_ids=ids, attention_mask=attn, response_mask=resp, advantages=adv)
