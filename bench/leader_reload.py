"""A new leader's reload of the rollouts in flight (``Projector._load_in_flight``), by history size.

    python -m bench.leader_reload [--attempts 10000,100000,1000000] [--rounds 5]

For each size, a fresh schema gets the migrations and, generated in SQL, a finished history of
that many attempts (4/5 as many rollouts, one in four retried once) with the same rows in flight on
every size: 64 running rollouts, 100 queuing and 5 finished ones whose superseded attempt is still
running. ``IN_FLIGHT_SQL`` reads the rollouts in flight and those with any attempt still live (the
watchdog checks every live attempt, a finished rollout's latest one too, not only superseded ones).
Then, alternately for ``--rounds`` rounds, *before*: the same rows read in the ``OR`` form the
projector used until migration 014 (``WHERE status IN (...) OR rollout_id IN (SELECT ... FROM
attempts ...)``), without that migration's ``attempts_live_idx``; *after*: ``IN_FLIGHT_SQL`` with
the index. Prints, for each, Postgres's execution time (``EXPLAIN ANALYZE``) and the blocks
it touched, and the time of the whole read from asyncpg (planning, rows and round trip included),
medians and [min-max]. Uses ``EVENTLIGHT_PG_DSN`` when set, else the embedded Postgres of a
temporary state dir; the schemas are dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import asyncpg

from bench import index_ab, positive_ints
from eventlight._data import data_dir
from eventlight.settings import Settings
from eventlight.store.jetstream.pg import ROLLOUT_COLS
from eventlight.store.jetstream.projector.leader import IN_FLIGHT_SQL

OR_FORM = (
    f"SELECT {ROLLOUT_COLS}, last_seq FROM rollouts WHERE status IN ('preparing', 'running') "
    "OR rollout_id IN (SELECT a.rollout_id FROM attempts a WHERE a.status IN ('preparing', 'running'))"
)
"""``IN_FLIGHT_SQL``'s rows in the ``OR`` form (``tests/test_projector_reload.py``'s); until the watchdog
checked every live attempt, both forms also left out a live attempt that is its rollout's latest."""
INDEX = (data_dir("migrations") / "014_live_attempts_index.sql").read_text()
"""Migration 014: ``attempts_live_idx``."""

HISTORY = """
INSERT INTO rollouts (rollout_id, input, start_time, end_time, mode, resources_id, status, config, metadata,
                      latest_attempt_id, num_attempts, created_seq, last_seq)
SELECT 'ro-' || lpad(i::text, 8, '0'), jsonb_build_object('task', i, 'prompt', repeat('x', 40)),
       1e9 + i, 1e9 + i + 5, 'train', 'rs-1', 'succeeded',
       '{"max_attempts": 2, "timeout_seconds": 30.0, "retry_condition": ["failed"]}'::jsonb, '{}'::jsonb,
       'at-' || lpad(i::text, 8, '0') || CASE WHEN i % 4 = 0 THEN '-2' ELSE '-1' END,
       CASE WHEN i % 4 = 0 THEN 2 ELSE 1 END, i * 10, i * 10 + 5
  FROM generate_series(1, $1::int) i;
"""
ATTEMPTS = """
INSERT INTO attempts (rollout_id, attempt_id, sequence_id, start_time, end_time, status, worker_id,
                      last_heartbeat_time, metadata)
SELECT 'ro-' || lpad(i::text, 8, '0'), 'at-' || lpad(i::text, 8, '0') || '-' || k, k, 1e9 + i, 1e9 + i + 5,
       CASE WHEN i % 4 = 0 AND k = 1 THEN 'failed' ELSE 'succeeded' END, 'w' || (i % 16), 1e9 + i + 4, '{}'::jsonb
  FROM generate_series(1, $1::int) i, generate_series(1, 2) k WHERE k = 1 OR i % 4 = 0 ORDER BY i, k;
"""
IN_FLIGHT = [  # {r}: the number of rollouts; the newest 64 run, the 100 before them queue
    "UPDATE rollouts SET status = 'running', end_time = NULL WHERE created_seq > ({r} - 64) * 10",
    "UPDATE attempts a SET status = 'running', end_time = NULL FROM rollouts r WHERE r.rollout_id = a.rollout_id"
    " AND r.status = 'running' AND a.attempt_id = r.latest_attempt_id",
    "DELETE FROM attempts WHERE rollout_id IN (SELECT rollout_id FROM rollouts"
    " WHERE created_seq > ({r} - 164) * 10 AND created_seq <= ({r} - 64) * 10)",
    "UPDATE rollouts SET status = 'queuing', end_time = NULL, latest_attempt_id = NULL, num_attempts = 0"
    " WHERE created_seq > ({r} - 164) * 10 AND created_seq <= ({r} - 64) * 10",
    "UPDATE attempts SET status = 'running', end_time = NULL WHERE sequence_id = 1 AND rollout_id IN (SELECT"
    " rollout_id FROM rollouts WHERE num_attempts = 2 AND status = 'succeeded' ORDER BY created_seq DESC LIMIT 5)",
]


async def fill(conn: asyncpg.Connection, attempts: int) -> int:
    """The history and the rows in flight; the number of attempts generated."""
    rollouts = attempts * 4 // 5
    await conn.execute("ALTER TABLE rollouts DISABLE TRIGGER USER")  # the status counts: not measured here
    for sql in (HISTORY, ATTEMPTS):
        await conn.execute(sql, rollouts)
    for sql in IN_FLIGHT:
        await conn.execute(sql.format(r=rollouts))
    await conn.execute("ALTER TABLE rollouts ENABLE TRIGGER USER")
    await conn.execute("VACUUM ANALYZE rollouts")
    await conn.execute("VACUUM ANALYZE attempts")
    return int(await conn.fetchval("SELECT count(*) FROM attempts"))


async def read(conn: asyncpg.Connection, sql: str) -> dict[str, float]:
    plan = json.loads(await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql))[0]
    t0 = time.perf_counter()
    rows = await conn.fetch(sql)
    top = plan["Plan"]
    return {
        "exec_ms": plan["Execution Time"],
        "read_ms": (time.perf_counter() - t0) * 1e3,
        "rows": len(rows),
        "blocks": top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0),
    }


async def one_size(dsn: str, base: Settings, attempts: int, rounds: int) -> dict[str, Any]:
    made, ab = await index_ab.one_size(
        dsn,
        base,
        f"reload{attempts}",
        lambda conn: fill(conn, attempts),
        ("attempts_live_idx", INDEX),
        lambda conn: read(conn, OR_FORM),
        lambda conn: read(conn, IN_FLIGHT_SQL),
        rounds,
        ("exec_ms", "read_ms"),
    )
    return {"attempts": made, **ab}


async def main_async(sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    return await index_ab.over_sizes("reload", sizes, lambda dsn, base, n: one_size(dsn, base, n, rounds))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.leader_reload", description=__doc__.splitlines()[0])
    ap.add_argument("--attempts", type=positive_ints, default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    for r in asyncio.run(main_async(args.attempts, args.rounds)):
        for k in ("before", "after"):
            s = r[k]
            e, t = s["exec_ms"], s["read_ms"]
            print(
                f"{r['attempts']:>9,} attempts {k:6s}: {s['rows']} rows, {s['blocks']:,} blocks, "
                f"execution {e['median']:.2f} ms [{e['min']:.2f}-{e['max']:.2f}], "
                f"read {t['median']:.2f} ms [{t['min']:.2f}-{t['max']:.2f}]"
            )


if __name__ == "__main__":
    main()
