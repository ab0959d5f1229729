"""``eventlight.store.futures.wait_done``: one future's wait, as ``asyncio.wait([f], timeout=)``."""

from __future__ import annotations

import asyncio

import pytest

from eventlight.store.futures import wait_done


async def test_done_work_answers_true() -> None:
    work: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(work.set_result, 7)
    assert await wait_done(work, 30.0) is True
    assert work.result() == 7
    assert await wait_done(work) is True  # already done: at once


async def test_timeout_answers_false_and_leaves_the_work_running() -> None:
    work: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    assert await wait_done(work, 0.01) is False
    assert not work.done() and not work.cancelled()
    work.set_result(None)


async def test_a_wake_future_ends_the_wait_early() -> None:
    work: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    wake: set[asyncio.Future[None]] = set()
    waiting = asyncio.ensure_future(wait_done(work, wake=wake))
    await asyncio.sleep(0)  # the wait starts
    assert len(wake) == 1
    for waiter in list(wake):
        waiter.set_result(None)  # what a store beginning to close does
    assert await waiting is False
    assert not wake  # the waiter left the set
    assert not work.done()
    work.cancel()


async def test_a_cancelled_caller_leaves_the_work_running() -> None:
    work: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    wake: set[asyncio.Future[None]] = set()
    waiting = asyncio.ensure_future(wait_done(work, 30.0, wake=wake))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not work.done() and not wake
    work.set_result(None)  # no callback of the ended wait is left to run on it
    await asyncio.sleep(0)
