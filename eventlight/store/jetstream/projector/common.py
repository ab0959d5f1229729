"""The projector's settings, its signals (``Deposed``, ``_Gap``), the error groups it retries, and ``_spawn``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncpg

from eventlight.store.jetstream.nats_errors import ANY_NATS_ERROR
from eventlight.store.jetstream.pg_errors import SERVER_FAILURES

log = logging.getLogger(__name__)

BATCH = 512
LOCK_PING_S = 0.5
"""Seconds between pings of the advisory-lock connection (its loss is also noticed at once)."""
LOCK_PING_TIMEOUT_S = 2.0
RETRY_S = 0.5
START_DECIDE_S = 5.0
RETRY_MAX_S = 5.0

TRANSIENT: tuple[type[BaseException], ...] = (*SERVER_FAILURES, asyncpg.exceptions.InternalClientError)
"""Failures of the servers or of a connection rather than of an event: a batch failing with one is
retried as it is. ``InternalClientError`` ("cannot switch to state 15; another operation (2) is in
progress") is asyncpg refusing a query on a connection whose protocol is stuck: one whose server
ended it (``pg_terminate_backend``, a restart) before asyncpg saw it close. Taken for an event's
failure, it had the batch's events tried one by one on that connection and dead-lettered (3 good
events in 50 rounds of terminating a busy store's connections)."""


class Deposed(Exception):  # noqa: N818 - a state, not a bug
    """This projector no longer leads: its lock connection is lost, or another took a newer term."""


class _Gap(Exception):  # noqa: N818 - a signal
    """The consumer skipped a delivery: read again from the checkpoint."""


NOT_THE_EVENTS: tuple[type[BaseException], ...] = (Deposed, *TRANSIENT)
"""Failures that say nothing about the events of a batch (never dead-lettered)."""
READ_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT, *ANY_NATS_ERROR)


def _spawn(coro: Any, name: str, *, quiet: bool = False) -> asyncio.Task[None]:
    """A background task whose unexpected death is logged, never silent (``quiet``: its awaiter
    handles the exception)."""

    def done(task: asyncio.Task[None]) -> None:
        if not quiet and not task.cancelled() and task.exception() is not None:
            log.error("%s stopped: %r", name, task.exception(), exc_info=task.exception())

    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(done)
    return task
