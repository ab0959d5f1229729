"""Agents the runner fault tests start in real ``eventlight runner`` processes (``tests/fault_agents.py:quick``)."""

from __future__ import annotations

import asyncio

import eventlight as agl


@agl.rollout
async def quick(task: dict, prompt_template: agl.PromptTemplate) -> float:
    return 1.0


@agl.rollout
async def slow(task: dict, prompt_template: agl.PromptTemplate) -> float:
    await asyncio.sleep(float(task.get("sleep_s", 600)))
    return 1.0
