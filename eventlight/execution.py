"""Agent-lightning 0.3.0's execution strategies (``agentlightning.execution``): their settings.

In 0.3.0 a strategy decides how the algorithm and the runners share one store: threads around an
in-memory store (``"shm"``) or processes around a REST store server (``"cs"``). ``Trainer`` reads
the same settings, from the same arguments and ``AGL_*`` environment variables, and places the
runners as queue consumers (``eventlight.trainer_strategies``):

* ``"shm"``: the algorithm on the main thread, ``n_runners`` runner threads, all on one store
  (``InMemoryLightningStore()`` unless ``Trainer(store=...)``), wrapped in ``LightningStoreThreaded``
  unless ``managed_store`` is false;
* ``"cs"``: runner processes on the namespace's JetStream queue and the algorithm in this process;
  ``role`` (``AGL_CURRENT_ROLE``) ``"algorithm"`` or ``"runner"`` runs one side only, so the two
  sides run on different machines sharing ``EVENTLIGHT_NATS_URL``, ``EVENTLIGHT_PG_DSN`` and
  ``EVENTLIGHT_NAMESPACE``; ``server_host``/``server_port`` (``AGL_SERVER_HOST``/``PORT``) are
  kept but unused: there is no store server to reach, NATS is the meeting point.

``execute`` itself is not how eventlight runs a job: it raises, naming ``Trainer``.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterable
from typing import Any, Literal, Protocol, cast

from eventlight.core.errors import InvalidInputError, InvalidTypeError
from eventlight.env_var import LightningEnvVar, resolve_bool_env_var, resolve_int_env_var, resolve_str_env_var

__all__ = [
    "ClientServerExecutionStrategy",
    "ExecutionEvent",
    "ExecutionStrategy",
    "ExecutionStrategyRegistry",
    "MultiprocessingEvent",
    "SharedMemoryExecutionStrategy",
    "ThreadingEvent",
    "check_n_runners",
]

Role = Literal["algorithm", "runner", "both"]


def check_n_runners(value: Any) -> int:
    """``value`` when it is a whole number >= 1 (``n_runners`` of ``Trainer`` and of both strategies).

    Raises:
        InvalidTypeError: Not an ``int`` (a bool, a float, a string).
        InvalidInputError: 0 or less (a run without runners would wait for ever).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"n_runners must be a whole number >= 1, got {value!r:.80}")
    if value < 1:
        raise InvalidInputError(f"n_runners must be a whole number >= 1, got {value!r}")
    return value


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
            NotImplementedError: Always; pass the strategy to ``Trainer(strategy=...)``, or run
                ``eventlight runner module:agent -n N`` on other machines with the same NATS URL and
                Postgres DSN.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.execute: eventlight runs runners as queue consumers; use "
            "Trainer(strategy=...).fit(...) or `eventlight runner module:agent -n N` with the same "
            "EVENTLIGHT_NATS_URL and EVENTLIGHT_PG_DSN"
        )


class SharedMemoryExecutionStrategy(ExecutionStrategy):
    """0.3.0's ``"shm"`` strategy: the algorithm and ``n_runners`` runner threads in one process.

    Args (0.3.0's):
        n_runners: Runner threads (a whole number >= 1).
        main_thread: Validated as in 0.3.0 (``"runner"`` needs ``n_runners == 1``); eventlight runs
            the algorithm on the main thread either way.
        join_timeout: Seconds to wait for the runner threads to end once their attempts in flight
            were cancelled.
        graceful_delay: Seconds the attempts in flight get to finish once the runner threads are
            stopped (they take no new rollout) before they are cancelled and recorded ``failed``,
            as 0.3.0 cancels its bundles then (default 5).
        poll_interval: Accepted; runners stop within one poll of the stop event.
        managed_store: Wrap the store in ``LightningStoreThreaded`` (default ``AGL_MANAGED_STORE``,
            else true); false shares the given store across threads as it is.

    Raises:
        InvalidTypeError: ``n_runners`` is not an ``int``.
        InvalidInputError: ``n_runners`` is below 1.
        ValueError: An invalid ``main_thread``, or ``"runner"`` with several runners; a non-boolean
            ``AGL_MANAGED_STORE``.
    """

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
        check_n_runners(n_runners)
        if main_thread not in ("algorithm", "runner"):
            raise ValueError("main_thread must be 'algorithm' or 'runner'")
        if main_thread == "runner" and n_runners != 1:
            raise ValueError(
                "When main_thread is 'runner', n_runners must be 1. "
                "Set main_thread to 'algorithm' to run multiple runners."
            )
        self.n_runners = n_runners
        self.main_thread = main_thread
        self.join_timeout = join_timeout
        self.graceful_delay = graceful_delay
        self.poll_interval = poll_interval
        self.managed_store = bool(resolve_bool_env_var(LightningEnvVar.AGL_MANAGED_STORE, managed_store, True))


class ClientServerExecutionStrategy(ExecutionStrategy):
    """0.3.0's ``"cs"`` strategy: runner processes on the JetStream queue, the algorithm in this process.

    Args (0.3.0's, each falling back to its ``AGL_*`` variable as 0.3.0 does):
        role: ``"algorithm"``, ``"runner"`` or ``"both"`` (``AGL_CURRENT_ROLE``, default ``"both"``).
        server_host, server_port: 0.3.0's store server address (``AGL_SERVER_HOST``, default
            ``"localhost"``; ``AGL_SERVER_PORT``, default 4747); kept, unused by eventlight.
        n_runners: Runner processes (roles ``"runner"`` and ``"both"``; a whole number >= 1).
        graceful_timeout: Seconds runner processes get to finish the attempt in flight at the stop.
        terminate_timeout: Accepted (SIGTERM to SIGKILL is ``runner_pool.KILL_AFTER_S``).
        main_process: Validated as in 0.3.0 (``"runner"`` only with ``role="both"`` and one runner).
        managed_store: True (``AGL_MANAGED_STORE``, default true): the trainer finds or starts NATS and
            Postgres and stops those it started. False: it starts nothing and uses ``Trainer(store=...)``
            or ``EVENTLIGHT_NATS_URL`` and ``EVENTLIGHT_PG_DSN``.
        allowed_exit_codes: Runner exit codes that are not reported as failures.

    Raises:
        InvalidTypeError: ``n_runners`` is not an ``int``.
        InvalidInputError: ``n_runners`` is below 1.
        ValueError: An invalid role or ``main_process``, or an ``AGL_*`` value of the wrong type.
    """

    alias = "cs"

    def __init__(
        self,
        role: Role | None = None,
        server_host: str | None = None,
        server_port: int | None = None,
        n_runners: int = 1,
        graceful_timeout: float = 10.0,
        terminate_timeout: float = 10.0,
        main_process: Literal["algorithm", "runner"] = "algorithm",
        managed_store: bool | None = None,
        allowed_exit_codes: Iterable[int] = (0, -15),
    ) -> None:
        check_n_runners(n_runners)
        resolved = resolve_str_env_var(LightningEnvVar.AGL_CURRENT_ROLE, role, "both")
        if resolved not in ("algorithm", "runner", "both"):
            raise ValueError("role must be one of 'algorithm', 'runner', or 'both'")
        if main_process not in ("algorithm", "runner"):
            raise ValueError("main_process must be 'algorithm' or 'runner'")
        if main_process == "runner" and (resolved != "both" or n_runners != 1):
            raise ValueError("main_process='runner' requires role='both' and n_runners=1")
        self.role = cast(Role, resolved)
        self.server_host = resolve_str_env_var(LightningEnvVar.AGL_SERVER_HOST, server_host, "localhost")
        self.server_port = resolve_int_env_var(LightningEnvVar.AGL_SERVER_PORT, server_port, 4747)
        self.n_runners = n_runners
        self.graceful_timeout = graceful_timeout
        self.terminate_timeout = terminate_timeout
        self.main_process = main_process
        self.managed_store = bool(resolve_bool_env_var(LightningEnvVar.AGL_MANAGED_STORE, managed_store, True))
        self.allowed_exit_codes = tuple(allowed_exit_codes)


ExecutionStrategyRegistry: dict[str, str] = {
    "shm": "eventlight.execution.SharedMemoryExecutionStrategy",
    "cs": "eventlight.execution.ClientServerExecutionStrategy",
}
"""Aliases ``Trainer(strategy=...)`` accepts, as 0.3.0's ``trainer.registry``."""
