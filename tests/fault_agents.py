"""Agents the runner fault tests start in real ``eventlight runner`` processes (``tests/fault_agents.py:quick``)."""

from __future__ import annotations

import asyncio
from typing import Any

import eventlight as agl


@agl.rollout
async def quick(task: dict, prompt_template: agl.PromptTemplate) -> float:
    return 1.0


@agl.rollout
async def env_mark(task: dict, prompt_template: agl.PromptTemplate) -> float:
    """The reward is the runner process's ``$EL_TEST_ENV_MARK`` (0 when unset)."""
    import os

    return float(os.environ.get("EL_TEST_ENV_MARK", "0"))


@agl.rollout
async def slow(task: dict, prompt_template: agl.PromptTemplate) -> float:
    await asyncio.sleep(float(task.get("sleep_s", 600)))
    return 1.0


@agl.rollout
def blocking(task: dict, prompt_template: agl.PromptTemplate) -> float:
    """A synchronous agent: one object span, then ``time.sleep(task["sleep_s"])`` (default 1)."""
    import time

    agl.emit_object({"i": task.get("i")})
    time.sleep(float(task.get("sleep_s", 1)))
    return 1.0


@agl.rollout
async def traced(task: dict, prompt_template: agl.PromptTemplate) -> float:
    """``task["spans"]`` object spans (default 3), then the reward span of the returned value."""
    for k in range(int(task.get("spans", 3))):
        agl.emit_object({"k": k, "i": task.get("i")})
        await asyncio.sleep(0)
    return 1.0


@agl.rollout
async def flaky(task: dict, prompt_template: agl.PromptTemplate, rollout: agl.AttemptedRollout) -> float:
    """Like ``traced``, taking ``task["sleep_s"]``; raises in its first attempt when ``task["fail_first"]``."""
    for k in range(int(task.get("spans", 3))):
        agl.emit_object({"k": k, "i": task.get("i")})
    await asyncio.sleep(float(task.get("sleep_s", 0)))
    if task.get("fail_first") and rollout.attempt.sequence_id == 1:
        raise RuntimeError("the first attempt fails")
    return 1.0


class DyingRunner(agl.LitAgentRunner):  # type: ignore[type-arg]
    """A runner whose process fails as it starts (a broken install, an import that fails in the
    child): it never heartbeats and never claims, however often its pool restarts it."""

    async def iter(self, *, event: Any = None) -> int:
        raise RuntimeError("this runner cannot start (on purpose, for the test)")


@agl.rollout
async def slow_first(task: dict, prompt_template: agl.PromptTemplate, rollout: agl.AttemptedRollout) -> float:
    """Sleeps ``task["sleep_s"]`` (default 600) in its first attempt only; later attempts return at once."""
    if rollout.attempt.sequence_id == 1:
        await asyncio.sleep(float(task.get("sleep_s", 600)))
    return 1.0


class DiesAfterItsFirstClaim(agl.LitAgentRunner):  # type: ignore[type-arg]
    """A runner whose process kills itself (SIGKILL) as the store hands it an attempt that is its
    rollout's first: the claim is recorded, the runner loop never hears of it (the instant a
    ``kill -9`` could hit between a claim's append and the runner writing it on its claim board)."""

    async def _dequeue(self, store: Any) -> agl.AttemptedRollout | None:
        import os
        import signal

        claimed = await super()._dequeue(store)
        if claimed is not None and claimed.attempt.sequence_id == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return claimed
