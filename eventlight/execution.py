"""Agent-lightning 0.3.0's execution strategies (``agentlightning.execution``), as settings.

In 0.3.0 a strategy decides how the algorithm and the runners share one store: threads around an
in-memory store (``"shm"``) or processes around a REST store server (``"cs"``). In eventlight every
process reaches the same store through NATS and Postgres, and ``Trainer`` runs its runners as
queue consumers (``n_runners`` processes); so these classes carry 0.3.0's settings and the
``ExecutionEvent`` implementations are real, but ``execute`` itself is not how eventlight runs: it
raises, naming ``Trainer`` and ``eventlight runner``.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterable
from typing import Any, Literal, Protocol

__all__ = [
    "ClientServerExecutionStrategy",
    "ExecutionEvent",
    "ExecutionStrategy",
    "MultiprocessingEvent",
    "SharedMemoryExecutionStrategy",
    "ThreadingEvent",
]


class ExecutionEvent(Protocol):
    """A stop signal shared by the algorithm and the runners."""

    def set(self) -> None: ...

    def clear(self) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class ThreadingEvent:
    """An ``ExecutionEvent`` for threads (``threading.Event``)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


class MultiprocessingEvent(ThreadingEvent):
    """An ``ExecutionEvent`` for processes (``multiprocessing.Event``)."""

    def __init__(self) -> None:
        self._event = multiprocessing.Event()  # type: ignore[assignment]


class ExecutionStrategy:
    """How the algorithm and the runners are run (0.3.0's base class)."""

    def execute(self, *args: Any, **kwargs: Any) -> None:
        """Not how eventlight runs a job.

        Raises:
            NotImplementedError: Always; use ``Trainer(n_runners=...).fit(...)``, or
                ``eventlight runner module:agent -n N`` on other machines with the same NATS URL and
                Postgres DSN.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.execute: eventlight runs runners as queue consumers; use "
            "Trainer(n_runners=...).fit(...) or `eventlight runner module:agent -n N` with the same "
            "EVENTLIGHT_NATS_URL and EVENTLIGHT_PG_DSN"
        )


class SharedMemoryExecutionStrategy(ExecutionStrategy):
    """0.3.0's ``"shm"`` strategy: algorithm and runners as threads of one process (its settings)."""

    alias = "shm"

    def __init__(
        self,
        n_runners: int = 1,
        main_thread: Literal["algorithm", "runner"] = "runner",
        join_timeout: float = 15.0,
        graceful_delay: float = 5.0,
        poll_interval: float = 0.05,
        managed_store: bool | None = None,
    ) -> None:
        self.n_runners = n_runners
        self.main_thread = main_thread
        self.join_timeout = join_timeout
        self.graceful_delay = graceful_delay
        self.poll_interval = poll_interval
        self.managed_store = managed_store


class ClientServerExecutionStrategy(ExecutionStrategy):
    """0.3.0's ``"cs"`` strategy: algorithm and runners as processes around a store server (its settings)."""

    alias = "cs"

    def __init__(
        self,
        role: Literal["algorithm", "runner", "both"] | None = None,
        server_host: str | None = None,
        server_port: int | None = None,
        n_runners: int = 1,
        graceful_timeout: float = 10.0,
        terminate_timeout: float = 10.0,
        main_process: Literal["algorithm", "runner"] = "algorithm",
        managed_store: bool | None = None,
        allowed_exit_codes: Iterable[int] = (0, -15),
    ) -> None:
        self.role = role
        self.server_host = server_host
        self.server_port = server_port
        self.n_runners = n_runners
        self.graceful_timeout = graceful_timeout
        self.terminate_timeout = terminate_timeout
        self.main_process = main_process
        self.managed_store = managed_store
        self.allowed_exit_codes = tuple(allowed_exit_codes)
