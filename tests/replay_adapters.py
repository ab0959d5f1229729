"""Adapters and reward functions named ``tests.replay_adapters:NAME``, for replays whose worker
processes import them by name (``eventlight.logreplay.parallel``)."""

from __future__ import annotations

import os
from typing import Any

from eventlight.core.types import Span


def picky(spans: list[Span]) -> list[dict[str, Any]]:
    """One record per attempt; raises on attempts whose task text holds ``"[bad]"``."""
    if any("[bad]" in str((s.attributes or {}).get("gen_ai.prompt.0.content", "")) for s in spans):
        raise RuntimeError("cannot adapt this one")
    return [{"n": len(spans)}]


def calls(spans: list[Span]) -> float:
    """A new reward: the number of LLM calls."""
    return float(sum(s.name == "openai.chat.completion" for s in spans))


def dies(spans: list[Span]) -> list[dict[str, Any]]:
    """Kills its process on "[bad]" attempts (a worker killed by the OOM killer, say)."""
    if any("[bad]" in str((s.attributes or {}).get("gen_ai.prompt.0.content", "")) for s in spans):
        os._exit(3)
    return [{"n": len(spans)}]
