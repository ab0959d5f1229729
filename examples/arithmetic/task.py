"""Sums for a 135M model to learn: generated items, a held-out split, a graded reward, the agent.

Items are ``a + b`` with ``a`` in 0..29 and ``b`` in 0..9 (300 pairs; single-digit sums alone are
only 100). Every pair is assigned to ``train`` or ``held-out`` by a fixed hash, so held-out items
never appear in training; held-out items are reported in two splits, ``held-out 1-digit`` (both
operands below 10) and ``held-out 2-digit`` (the harder ones, ``a`` >= 10).

The reward gives partial credit so that a group of samples differs even when all are right or
all are wrong (learning stops when every group scores alike):

* 1.0 for the bare number;
* a correct final number inside a longer answer: 0.5 plus up to 0.4 more the shorter the answer
  (``0.5 + 0.4 * (1 - (words - 1) / 12)``, floored at 0.5), so shorter correct answers keep
  winning after correctness saturates;
* 0.0 otherwise (wrong, no number, or cut off by the token limit).

The prompt is fixed (``PROMPT``): any gain comes from the weights.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import eventlight as agl

PROMPT = "What is {a} + {b}? Answer with the number only."
"""The one prompt, never changed by training."""

HELD_OUT_PERCENT = 25
MAX_TOKENS = 16
_NUMBER = re.compile(r"-?\d+")


def _held_out(a: int, b: int) -> bool:
    return zlib.crc32(f"{a}+{b}".encode()) % 100 < HELD_OUT_PERCENT


def make_items(max_a: int = 29, max_b: int = 9) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, held_out)``: every pair ``a + b`` (0 <= a <= max_a, 0 <= b <= max_b), split by hash."""
    train: list[dict[str, Any]] = []
    held: list[dict[str, Any]] = []
    for a in range(max_a + 1):
        for b in range(max_b + 1):
            digits = "1-digit" if a < 10 else "2-digit"
            if _held_out(a, b):
                held.append({"a": a, "b": b, "answer": a + b, "split": f"held-out {digits}"})
            else:
                train.append({"a": a, "b": b, "answer": a + b, "split": f"train {digits}"})
    return train, held


def grade(answer: str, expected: int) -> float:
    """Reward of one answer (see the module docstring)."""
    text = answer.strip()
    if text.rstrip(".") == str(expected):
        return 1.0
    numbers = _NUMBER.findall(text)
    if not numbers or int(numbers[-1]) != expected:
        return 0.0
    words = len(text.split())
    return round(max(0.5, 0.5 + 0.4 * (1 - (words - 1) / 12)), 4)


@agl.rollout
async def adder(task: dict[str, Any], llm: agl.LLM, rollout: agl.Rollout) -> float:
    """One chat completion through the LLM proxy; training rollouts sample, held-out ones are greedy."""
    import openai

    params = dict(llm.sampling_parameters or {})
    temperature = float(params.get("temperature", 1.0)) if rollout.mode == "train" else 0.0
    async with openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "local", max_retries=0) as client:
        r = await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": PROMPT.format(a=task["a"], b=task["b"])}],
            temperature=temperature,
            max_tokens=int(params.get("max_tokens", MAX_TOKENS)),
        )
    return grade(r.choices[0].message.content or "", int(task["answer"]))
