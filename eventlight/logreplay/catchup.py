"""Bring a namespace's read models up to its log's head (``eventlight import`` does it before it returns).

The read models are a projection of the log that a store with Postgres (``pg_dsn``) makes while it
is open. Events appended by anything else (``eventlight import``, runners, which need no Postgres)
stay unprojected until such a store opens the namespace, so a query right after an import saw an
empty namespace. ``catch_up`` opens one, with its projector (or as standby behind a projector
another process runs: the checkpoint moves all the same), and waits until the projection has
passed the log's head as it was when it started, reporting progress as it goes. Its watchdog does
not run meanwhile: it projects, it does not time attempts out.

Example::

    checkpoint, head = await catch_up(settings, on_progress=lambda done, head: ...)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from eventlight.settings import Settings

POLL_S = 0.25
"""Seconds between two reads of the checkpoint."""
STALLED_S = 60.0
"""Seconds without progress after which ``catch_up`` gives up waiting."""
NO_WATCHDOG_S = 3600.0
"""The watchdog's interval while catching up: it never ticks."""


async def catch_up(
    settings: Settings,
    pg_dsn: str | None = None,
    *,
    on_progress: Callable[[int, int], None] | None = None,
    stalled_s: float = STALLED_S,
) -> tuple[int, int]:
    """Project the namespace's log until the read models have reached its head as it is now.

    Args:
        settings: The namespace, on ``settings.nats_url``, else on the embedded servers under
            ``settings.state_dir`` (``eventlight.logreplay.servers``: as the commands find them;
            none is started).
        pg_dsn: The Postgres holding the namespace's schema (made and migrated by ``eventlight up -N``);
            default ``settings.pg_dsn``, else the embedded one.
        on_progress: Called with ``(checkpoint, head)`` (log positions) as the projection advances.
        stalled_s: Give up after this many seconds without progress.

    Returns:
        ``(checkpoint, head)``: the projection's position and the head it aimed at; the checkpoint
        is below the head only when it stalled for ``stalled_s`` seconds.

    Raises:
        ServiceUnavailableError: NATS or Postgres cannot be reached, or one is not set and no
            embedded server runs.
        InvalidInputError: The namespace has no stream, or no tables in Postgres, or is recorded
            with another projector partition count.
    """
    from eventlight.logreplay.servers import nats_url_of, pg_dsn_of, stream_info
    from eventlight.store.jetstream import JetStreamLightningStore
    from eventlight.store.jetstream.pg_errors import pg_errors

    url = await nats_url_of(settings)
    dsn = await pg_dsn_of(settings, pg_dsn)
    store = JetStreamLightningStore(settings, nats_url=url, pg_dsn=dsn, watchdog_interval_s=NO_WATCHDOG_S)
    async with store:
        assert store.nc is not None and store.pool is not None
        head = int((await stream_info(store.nc, url, settings)).state.last_seq)
        checkpoint, moved = -1, time.monotonic()
        while True:
            with pg_errors(dsn, "read the projection's checkpoint"):
                now = int(await store.pool.fetchval("SELECT min(last_seq) FROM projector_checkpoint") or 0)
            if now != checkpoint:
                checkpoint, moved = now, time.monotonic()
                if on_progress is not None:
                    on_progress(min(checkpoint, head), head)
            if checkpoint >= head or time.monotonic() - moved > stalled_s:
                return checkpoint, head
            await asyncio.sleep(POLL_S)
