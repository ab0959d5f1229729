"""Adapters and reward functions named ``tests.replay_adapters:NAME``, for replays whose worker
processes import them by name (``eventlight.logreplay.parallel``)."""

from __future__ import annotations

import os
import sys
import threading
import time
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


def unpicklable(spans: list[Span]) -> list[dict[str, Any]]:
    """Items holding a lock (which does not pickle) on "[bad]" attempts."""
    bad = any("[bad]" in str((s.attributes or {}).get("gen_ai.prompt.0.content", "")) for s in spans)
    return [{"n": len(spans), "lock": threading.Lock() if bad else None}]


def slow(spans: list[Span]) -> list[dict[str, Any]]:
    """0.2 s per attempt (an LLM judge, say)."""
    time.sleep(0.2)
    return [{"n": len(spans)}]


def exits(spans: list[Span]) -> list[dict[str, Any]]:
    """``sys.exit(4)`` on "[bad]" attempts."""
    if any("[bad]" in str((s.attributes or {}).get("gen_ai.prompt.0.content", "")) for s in spans):
        sys.exit(4)
    return [{"n": len(spans)}]


def big(spans: list[Span]) -> list[dict[str, Any]]:
    """A 1 MB record per attempt."""
    return [{"blob": "x" * 2**20}]


def int_keys(spans: list[Span]) -> list[dict[str, Any]]:
    """Two items per attempt; on "[bad]" attempts the second holds a dict with int keys, which no
    record file can hold."""
    bad = any("[bad]" in str((s.attributes or {}).get("gen_ai.prompt.0.content", "")) for s in spans)
    return [{"n": len(spans)}, {"n": 0, "extra": {2: "b"} if bad else {"2": "b"}}]


def str_reward(spans: list[Span]) -> list[dict[str, Any]]:
    """Two items per attempt; on "[bad]" attempts the second's ``reward`` is the string "high"."""
    bad = any("[bad]" in str((s.attributes or {}).get("gen_ai.prompt.0.content", "")) for s in spans)
    return [{"n": len(spans), "reward": 0.5}, {"n": 0, "reward": "high" if bad else 1}]


def late_key(spans: list[Span]) -> list[dict[str, Any]]:
    """64 items per attempt; from task 70 on (past Parquet's first row group of 4,096 records, in
    ``test_replay_parallel.workload``) each has a field ``late`` the earlier ones lack."""
    text = str((spans[0].attributes or {}).get("gen_ai.prompt.0.content", ""))  # "q task 17 [bad]"
    late = {"late": 1} if int(text.split()[2]) >= 70 else {}
    return [{"k": k, **late} for k in range(64)]


class AdaptOnly:
    """An adapter class with ``adapt`` but no ``__call__`` (not a ``TraceAdapter``)."""

    def adapt(self, spans: list[Span]) -> list[dict[str, Any]]:
        return [{"n": len(spans)}]
