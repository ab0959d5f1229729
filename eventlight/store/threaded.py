"""``LightningStoreThreaded``: one store shared by threads and event loops (Agent-lightning 0.3.0's name).

0.3.0's wrapper guards a store with a lock so that threads can share it. eventlight's stores are
asyncio objects whose connections belong to the loop that started them (a JetStream store called
from another loop raises ``WrongEventLoopError``), so this wrapper owns a loop in a thread of its
own, opens the store there, and runs every call on it: a coroutine method of the wrapper can be
awaited from any event loop in any thread, and each call is one coroutine on the store's loop (so
every method stays as atomic as the store makes it). A store that is already open on a running loop
(a ``JetStreamLightningStore`` inside ``async with``: its ``home_loop``) is called on that loop
instead, and left open: whoever opens a store closes it.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from eventlight.core.errors import InvalidInputError, WrongEventLoopError
from eventlight.store.base import LightningStore, LightningStoreCapabilities

__all__ = ["LightningStoreThreaded"]

T = TypeVar("T")


class LightningStoreThreaded:
    """Wraps ``store`` so that any thread or event loop may call it.

    Args:
        store: The store to share. One that is not open is started (``__aenter__``) on the wrapper's
            own loop, and closed by ``close()``; one already open on a running loop (its
            ``home_loop``) is called on that loop, and ``close()`` leaves it open.

    Every coroutine method of ``LightningStore`` is available with the same signature; after
    ``close()`` each raises ``InvalidInputError`` and ``closing`` is ``True``.

    Raises:
        WrongEventLoopError: ``store`` is open on an event loop that does not run (its calls would
            wait for ever).
    """

    def __init__(self, store: LightningStore):
        self.store = store
        home: asyncio.AbstractEventLoop | None = getattr(store, "home_loop", None)
        self._owned = home is None  # the wrapper opens (and closes) only a store that is not open
        self._started: Future[Any] | None = None
        self._closed = False
        if home is not None:
            self._loop = home
            self._thread: threading.Thread | None = None
            self._check_home()
            return
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="eventlight-store", daemon=True)
        self._thread.start()

    def _check_home(self) -> None:
        if not self._loop.is_running():
            state = "closed" if self._loop.is_closed() else "not running"
            raise WrongEventLoopError(
                f"this {type(self.store).__name__} is open on an event loop that is {state}, and its calls "
                "must run there: share a store that is not open yet (the wrapper opens it on a loop of its "
                "own), or one open on a loop that keeps running (inside `async with store:`, call "
                "`await asyncio.to_thread(trainer.fit, ...)`)"
            )

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        return {**self.store.capabilities, "thread_safe": True}

    @property
    def closing(self) -> bool:
        """Whether ``close`` of this wrapper has begun (or is done): it refuses calls from then on
        (``InvalidInputError``), also when the store it wraps stays open (one that was open when it
        was wrapped) or was never opened; before that, what the wrapped store says (``False`` for a
        store that does not say), as ``LightningStore.closing``."""
        return self._closed or bool(getattr(self.store, "closing", False))

    def otlp_traces_endpoint(self) -> str:
        return self.store.otlp_traces_endpoint()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _call(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        if self._closed:
            raise InvalidInputError("this LightningStoreThreaded is closed; wrap the store anew to use it")
        if not self._owned:
            self._check_home()
        elif self._started is None:
            self._started = self._submit(self.store.__aenter__())
        if self._started is not None:
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
        """Close the store on its loop and stop the loop's thread; idempotent. A store that was open
        when it was wrapped is left open (its opener closes it)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        if self._started is not None:
            await asyncio.wrap_future(self._submit(self.store.close()))
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join, 10)
        self._loop.close()
