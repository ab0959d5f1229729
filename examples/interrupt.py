"""SIGTERM stops a demo as Ctrl+C does (``make demo``, both algorithms).

A SIGTERM (``kill PID``, ``kill -TERM -- -PGID``, systemd, ``timeout``) is handed to the SIGINT
handler in place: ``asyncio.run``'s, which cancels the run, or the trainer's while its runners stop
(``ctrl_c_again_hurries``: the grace ends at once). So the runners stop first (attempts in flight
get their grace), then the model and the servers, and the same lines are printed. Where SIGINT is
ignored (a background job of a script), ``asyncio.run`` installs no handler; the run's task is then
cancelled here, as ``asyncio.run``'s handler would, once: it cancelled a run already stopping again,
and its stop with it. ``make`` relays a SIGTERM of its process group to its child, so ``make demo``
gets two at once; the second is the same stop (``ctrl_c_again_hurries`` ignores it until the
runners begin to stop). Only the exit code differs: 143.

    stop = TermAsInterrupt().install()
    try:
        code = asyncio.run(stop.guard(main()))
    except (KeyboardInterrupt, asyncio.CancelledError):
        code = stop.exit_code
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from types import FrameType
from typing import Any, TypeVar

from eventlight.trainer_guards import note_stop_signal

T = TypeVar("T")


class TermAsInterrupt:
    """SIGTERM handled as Ctrl+C; ``exit_code`` after the run was interrupted: 143 when a SIGTERM
    stopped it, else 130 (Ctrl+C)."""

    def __init__(self) -> None:
        self.terminated = False
        self._task: asyncio.Task[Any] | None = None
        self._cancelled = False

    def install(self) -> TermAsInterrupt:
        """Handle SIGTERM from now on (call it on the main thread, before ``asyncio.run``)."""
        signal.signal(signal.SIGTERM, self._on_term)
        return self

    async def guard(self, main: Coroutine[Any, Any, T]) -> T:
        """Run ``main`` as the task a SIGTERM cancels when no SIGINT handler would."""
        self._task = asyncio.current_task()
        return await main

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        self.terminated = True
        note_stop_signal(signum)  # the trainer's lines name it: "the run was cancelled (SIGTERM)"
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler) and handler is not signal.default_int_handler:
            handler(signal.SIGINT, frame)  # asyncio.run's (cancels the run) or the trainer's (hurries)
        elif self._task is not None and not self._task.done() and not self._cancelled:
            self._cancelled = True  # again: the same stop (under `make`, its relay of a group's SIGTERM)
            self._task.cancel()  # SIGINT ignored: what asyncio.run's handler does, the first time
            self._task.get_loop().call_soon_threadsafe(lambda: None)  # wake the loop
        elif handler is signal.default_int_handler:
            raise KeyboardInterrupt

    @property
    def exit_code(self) -> int:
        """``128 + SIGTERM`` (143) after a SIGTERM, ``128 + SIGINT`` (130) otherwise."""
        return 128 + (signal.SIGTERM if self.terminated else signal.SIGINT)
