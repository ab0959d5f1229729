"""The read models against the log, for ``eventlight sql`` and ``eventlight import``.

``warn_if_behind``: one ``warning:`` line when the namespace's projection is behind its log (one
stream-info request and the checkpoint row; nothing printed when it is caught up, or when it reaches
the head within ``LAG_SETTLE_S``, as a running projector does while writes go on).
``project_to_head``: bring the read models up to the log's head (``eventlight.logreplay.catchup``),
as ``eventlight import`` and ``eventlight sql --catch-up`` do, with a progress bar on stderr when it
is a terminal. Their stdout carries only their result: the projector's own INFO lines (which
partition it leads) are not logged meanwhile unless ``EVENTLIGHT_LOG_LEVEL`` asks for them, and
without a terminal nothing is shown of the progress (rich's bar left an empty line there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from eventlight.cli.common import CliError, err
from eventlight.settings import Settings

LAG_CHECK_S = 3.0
"""Seconds ``warn_if_behind`` waits for NATS before it says the lag is unknown (the query runs anyway)."""

LAG_SETTLE_S = 1.0
"""Seconds ``warn_if_behind`` gives a projector that is running to reach the head it read before it
warns: while something writes, the read models trail the log by a few events for milliseconds."""

LAG_STILL_S = 0.3
"""Seconds without progress after which ``warn_if_behind`` stops waiting: nothing is projecting."""

WHAT_PROJECTS = "a trainer, `eventlight serve` or another store with Postgres"
"""What projects a namespace while it has it open."""


async def log_head(settings: Settings) -> int | None:
    """The namespace's last log position (its stream's last sequence), found as ``status`` finds NATS.

    Returns:
        ``None`` when no NATS is configured or recorded, or the namespace has no stream.

    Raises:
        ServiceUnavailableError: The configured or recorded server does not answer.
        InvalidInputError: ``EVENTLIGHT_NATS_URL`` names no server.
    """
    from eventlight.cli.status import _stream_state
    from eventlight.ops.discovery import find_nats

    found = await find_nats(settings)
    if found is None:
        return None
    state = await _stream_state(found.url, settings)
    return None if state is None else state[1]


async def warn_if_behind(settings: Settings, conn: Any) -> None:
    """Print one warning when the projection (``projector_checkpoint``, read on ``conn``, a
    connection to the namespace's schema) is behind the log's head, saying by how many events and
    what brings it up to date; or, when NATS does not answer, that the lag is unknown. Never raises
    for the check: a query needs only Postgres. The head is read first, and a projection behind it
    gets ``LAG_SETTLE_S`` to reach it, so a projector running meanwhile (a live run writing) is
    not counted behind; one that does not reach it in that time is, by how many events it still lacks."""
    import asyncpg

    from eventlight.core.errors import EventlightError

    try:
        head = await asyncio.wait_for(log_head(settings), LAG_CHECK_S)
        if head is None:
            return
        projected = int(await conn.fetchval("SELECT min(last_seq) FROM projector_checkpoint") or 0)
    except (EventlightError, OSError, TimeoutError, asyncpg.PostgresError) as e:
        why = str(e) or f"NATS did not answer within {LAG_CHECK_S:g} s"
        err.print(f"[yellow]warning:[/yellow] whether the read models are behind the log is unknown: {escape(why)}")
        return
    if projected < head:
        projected = await _settled(conn, head, projected)
    if projected < head:
        err.print(
            f"[yellow]warning:[/yellow] the read models are {_events(head - projected)} behind the log (projected "
            f"up to event {projected} of {head}), so this result may be stale: `eventlight sql --catch-up` "
            f"projects up to the head first (they also catch up while {WHAT_PROJECTS} has the namespace open)"
        )


async def _settled(conn: Any, head: int, projected: int) -> int:
    """The projection's position once it reached ``head``, ``LAG_SETTLE_S`` passed, or it did not
    move for ``LAG_STILL_S`` (a projector running meanwhile commits every few milliseconds; with
    none running the check costs ``LAG_STILL_S``)."""
    now = time.monotonic()
    deadline, moved = now + LAG_SETTLE_S, now
    while projected < head and now < deadline and now - moved < LAG_STILL_S:
        await asyncio.sleep(0.05)
        was, projected = projected, int(await conn.fetchval("SELECT min(last_seq) FROM projector_checkpoint") or 0)
        now = time.monotonic()
        if projected != was:
            moved = now
    return projected


def _events(n: int) -> str:
    """``1 event``, ``18 events``."""
    return f"{n} event" if n == 1 else f"{n} events"


async def project_to_head(settings: Settings, pg_dsn: str) -> int | None:
    """Project the namespace up to its log's head (``logreplay.catchup``), with a progress bar on
    stderr when it is a terminal.

    Returns:
        The head reached; ``None`` when the read models could not be brought up to date, which is
        told in one warning line, not raised (what uses them still runs, on what is projected).
    """
    from eventlight.core.errors import EventlightError
    from eventlight.logreplay.catchup import STALLED_S, catch_up

    try:
        with _quiet_projector(), _progress_bar() as on_progress:
            checkpoint, head = await catch_up(settings, pg_dsn, on_progress=on_progress)
    except (EventlightError, CliError) as e:
        err.print(f"[yellow]warning:[/yellow] the read models were not brought up to date: {escape(str(e))}")
        return None
    if checkpoint < head:
        err.print(
            f"[yellow]warning:[/yellow] the read models are {_events(head - checkpoint)} behind the log "
            f"(projected up to {checkpoint} of {head}, no progress for {STALLED_S:.0f} s): "
            f"they catch up while {WHAT_PROJECTS} has the namespace open"
        )
        return None
    return head


PROJECTOR_LOGGER = "eventlight.store.jetstream.projector"
"""The projector's loggers: INFO lines of its lifecycle, which a catch-up does not show by default."""


@contextlib.contextmanager
def _quiet_projector() -> Iterator[None]:
    """Log only the projector's warnings and errors meanwhile, unless ``EVENTLIGHT_LOG_LEVEL`` is set
    (the CLI's default INFO would print which partition the catch-up's projector leads)."""
    if os.environ.get("EVENTLIGHT_LOG_LEVEL"):
        yield
        return
    logger = logging.getLogger(PROJECTOR_LOGGER)
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _progress_bar() -> Iterator[Callable[[int, int], None] | None]:
    """A ``catch_up`` progress callback drawing a transient bar on stderr; ``None`` (nothing shown)
    when stderr is not a terminal."""
    if not err.is_terminal:
        yield None
        return
    with _progress() as bar:
        task = bar.add_task("projecting", total=None, done=0, head=0)
        yield lambda done, head: bar.update(task, done=done, head=head, total=head)


def _progress() -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[done]:>10,} of {task.fields[head]:,} log positions"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )
