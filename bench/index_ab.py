"""One index, before and after, on a history generated in a scratch schema: the shared part of
``bench.leader_reload`` and ``bench.retire_select``.

Each size gets a fresh schema with the migrations and its history (``fill``); then, alternately for
``rounds`` rounds, *before* runs without the index (dropped) and *after* with it (re-created from
its migration's statement). Both return a dict of figures per run (``exec_ms``, ``read_ms``,
``rows``, ``blocks``, and any others); ``summary`` gives median, min and max of each timed one. The
schema is dropped at the end, and the embedded servers of a temporary state dir are used unless
``EVENTLIGHT_PG_DSN`` names a Postgres.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg

from eventlight.ops import apply_migrations, drop_namespace, ensure_services, stop_services
from eventlight.settings import Settings

Figures = dict[str, float]
Run = Callable[[asyncpg.Connection], Awaitable[Figures]]


def summary(runs: list[Figures], timed: tuple[str, ...]) -> dict[str, Any]:
    """``rows`` and ``blocks`` of the first run; median, min, max and every value of each ``timed`` key."""
    out: dict[str, Any] = {"rows": runs[0]["rows"], "blocks": runs[0]["blocks"]}
    for key in timed:
        xs = [r[key] for r in runs]
        out[key] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}
    return out


async def one_size(
    dsn: str,
    base: Settings,
    namespace: str,
    fill: Callable[[asyncpg.Connection], Awaitable[int]],
    index: tuple[str, str],
    before: Run,
    after: Run,
    rounds: int,
    timed: tuple[str, ...],
) -> tuple[int, dict[str, Any]]:
    """``fill``'s count and the summaries of ``before`` and ``after``; ``index``: its name and the
    statement that creates it."""
    settings = Settings(pg_dsn=dsn, state_dir=base.state_dir, namespace=f"{namespace}_{uuid.uuid4().hex[:6]}")
    await apply_migrations(dsn, settings.pg_schema)
    conn = await asyncpg.connect(dsn, server_settings={"search_path": settings.pg_schema})
    try:
        made = await fill(conn)
        runs: dict[str, list[Figures]] = {"before": [], "after": []}
        for _ in range(rounds):
            await conn.execute(f"DROP INDEX {index[0]}")
            runs["before"].append(await before(conn))
            await conn.execute(index[1])
            runs["after"].append(await after(conn))
    finally:
        await conn.close()
        await drop_namespace(None, dsn, settings)
    return made, {k: summary(v, timed) for k, v in runs.items()}


async def over_sizes(
    namespace: str, sizes: list[int], one: Callable[[str, Settings, int], Awaitable[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """``one(dsn, settings, size)`` for each size, on ``EVENTLIGHT_PG_DSN`` or embedded servers."""
    state = Path(tempfile.mkdtemp(prefix=f"eventlight-{namespace}-"))
    try:
        base = Settings.from_env(state_dir=state, namespace=namespace)
        svc = await ensure_services(base)
        try:
            return [await one(svc.pg_dsn, base, n) for n in sizes]
        finally:
            await stop_services(base)
    finally:
        shutil.rmtree(state, ignore_errors=True)
