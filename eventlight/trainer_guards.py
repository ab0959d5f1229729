"""What stops a training run early: its runners gone while rollouts wait (``NoRunnersError``), or
most calls through its LLM proxy failing (``LLMUnavailableError``). ``Trainer`` wraps the
algorithm's run in both."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from eventlight.core.errors import LLMUnavailableError, NoRunnersError
from eventlight.store.liveness import LIVE_HEARTBEAT_S, waiting_without_workers

if TYPE_CHECKING:
    from eventlight.llm_proxy import LLMProxy
    from eventlight.runner import LitAgentRunner
    from eventlight.runner_pool import RunnerPool

__all__ = ["RUNNERS_CHECK_S", "stop_when_llm_fails", "stop_when_runners_gone"]

log = logging.getLogger("eventlight.trainer")


RUNNERS_CHECK_S = 10.0
"""Seconds between the trainer's checks that its runners are alive while rollouts wait."""
DEFAULT_HEARTBEAT_S = 10.0  # LitAgentRunner's default heartbeat_interval


async def stop_when_runners_gone(
    run: Coroutine[Any, Any, Any], store: Any, pool: RunnerPool | None, runner: LitAgentRunner | None
) -> None:
    """Await ``run``; cancel it and raise ``NoRunnersError`` when rollouts wait and none of the
    runners this trainer started is alive (``waiting_without_workers``: no heartbeat within
    ``max(LIVE_HEARTBEAT_S, 3 heartbeats)``, while some of its processes are down). Checked every
    ``RUNNERS_CHECK_S`` after that much grace; not when the runners are elsewhere (role
    ``algorithm``) or send no heartbeats."""
    beats = runner.heartbeat_interval if runner is not None else DEFAULT_HEARTBEAT_S
    if pool is None or beats <= 0:
        await run
        return
    live_s = max(LIVE_HEARTBEAT_S, 3 * beats)

    async def watch() -> str:
        await asyncio.sleep(live_s)
        while True:
            message = await waiting_without_workers(store, live_s=live_s)
            if message is not None and pool.alive() < len(pool.procs):
                return f"{message} ({pool.alive()} of {len(pool.procs)} runner processes up, {pool.restarts} restarts)"
            await asyncio.sleep(RUNNERS_CHECK_S)

    task = asyncio.ensure_future(run)
    gone = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
            return
        log.error("stopping the run: %s", gone.result())
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise NoRunnersError(gone.result())
    finally:
        gone.cancel()


async def stop_when_llm_fails(run: Coroutine[Any, Any, Any], proxy: LLMProxy | None) -> None:
    """Await ``run``; cancel it and raise ``LLMUnavailableError`` once most calls through ``proxy`` fail."""
    if proxy is None:
        await run
        return
    task = asyncio.ensure_future(run)
    failing = asyncio.ensure_future(proxy.health.wait_failing())
    try:
        await asyncio.wait({task, failing}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
            return
        log.error("stopping the run: %s", failing.result())
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        backends = sorted({str(e["litellm_params"].get("api_base") or "?") for e in proxy.model_list})
        where = f"{proxy.endpoint} (backend {', '.join(backends)})"
        raise LLMUnavailableError(where, f"{failing.result()}; the run was stopped, its results are void")
    finally:
        failing.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
