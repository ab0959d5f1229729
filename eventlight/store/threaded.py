"""``LightningStoreThreaded``: one store shared by threads and event loops (Agent-lightning 0.3.0's name).

0.3.0's wrapper guards a store with a lock so that threads can share it. eventlight's stores are
asyncio objects whose connections belong to the loop that started them (a JetStream store called
from another loop raises ``WrongEventLoopError``), so this wrapper owns a loop in a thread of its
own, opens the store there, and runs every call on it: a coroutine method of the wrapper can be
awaited from any event loop in any thread, and each call is one coroutine on the store's loop (so
every method stays as atomic as the store makes it).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from eventlight.store.base import LightningStore, LightningStoreCapabilities

__all__ = ["LightningStoreThreaded"]

T = TypeVar("T")


class LightningStoreThreaded:
    """Wraps ``store`` so that any thread or event loop may call it.

    Args:
        store: The store to share; it is started (``__aenter__``) on the wrapper's own loop, and closed
            by ``close()``.

    Every coroutine method of ``LightningStore`` is available with the same signature.
    """

    def __init__(self, store: LightningStore):
        self.store = store
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="eventlight-store", daemon=True)
        self._thread.start()
        self._started: Future[Any] | None = None
        self._closed = False

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        return {**self.store.capabilities, "thread_safe": True}

    def otlp_traces_endpoint(self) -> str:
        return self.store.otlp_traces_endpoint()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _call(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        if self._closed:
            raise RuntimeError("this LightningStoreThreaded is closed")
        if self._started is None:
            self._started = self._submit(self.store.__aenter__())
        await asyncio.wrap_future(self._started)
        return await asyncio.wrap_future(self._submit(make()))

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr

        @functools.wraps(attr)
        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self._call(lambda: attr(*args, **kwargs))

        return call

    async def __aenter__(self) -> LightningStoreThreaded:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the store on its loop and stop the loop's thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._started is not None:
            await asyncio.wrap_future(self._submit(self.store.close()))
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join, 10)
        self._loop.close()
