"""Retirement's selection of what is due (``retire._SELECT``), by the number of rollouts retired before.

    python -m bench.retire_select [--rollouts 10000,100000,800000] [--rounds 5]

For each size, a fresh schema gets the migrations and, generated in SQL, that many finished
rollouts (one attempt each, a ``timeout_seconds`` limit) all retired already (listed in
``retired_rollouts``, ``retired`` set), and the same rows on every size: 200 finished and due, 100
finished within the retention window, 64 running. Then, alternately for ``--rounds`` rounds,
*before*: the form ``retire`` read until migration 015, without that migration's
``rollouts_retirable_idx``, JIT as the server has it; *after*: ``_SELECT`` with the index and JIT
off, as ``retire`` reads it (``_due``). Both with the leader's batch (``LIMIT 500``). Prints, for
each, Postgres's execution time (``EXPLAIN ANALYZE``, JIT's share of it apart) and the blocks it
touched, and the time of the whole read from asyncpg, medians and [min-max]. Uses
``EVENTLIGHT_PG_DSN`` when set, else the embedded Postgres of a temporary state dir; the schemas are
dropped at the end.
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
from eventlight.core.types import TERMINAL_ROLLOUT_STATUSES
from eventlight.settings import Settings
from eventlight.store.jetstream.retire import _SELECT, _due

OLD_FORM = """
SELECT r.rollout_id FROM rollouts r
 WHERE r.status = ANY($1::text[]) AND r.end_time IS NOT NULL AND r.end_time < $2 AND r.last_seq <= $3
   AND NOT EXISTS (SELECT 1 FROM retired_rollouts x WHERE x.rollout_id = r.rollout_id)
   AND NOT (
     (r.config->>'timeout_seconds' IS NOT NULL OR r.config->>'unresponsive_seconds' IS NOT NULL)
     AND EXISTS (SELECT 1 FROM attempts a WHERE a.rollout_id = r.rollout_id
                   AND a.status IN ('preparing', 'running') AND a.attempt_id <> r.latest_attempt_id))
 ORDER BY r.last_seq LIMIT $4
"""
"""``retire._SELECT`` until migration 015."""
INDEX = next(
    line
    for line in (data_dir("migrations") / "015_retirable_rollouts_index.sql").read_text().split(";")
    if "CREATE INDEX" in line
)
"""Migration 015's ``rollouts_retirable_idx``."""

NOW = 2e9
"""The clock of the round: the history ended at 1e9 + i, the rows within the window end after NOW - 60."""
BATCH = 500

HISTORY = """
INSERT INTO rollouts (rollout_id, input, start_time, end_time, mode, resources_id, status, config, metadata,
                      latest_attempt_id, num_attempts, created_seq, last_seq, retired)
SELECT 'ro-' || lpad(i::text, 8, '0'), jsonb_build_object('task', i, 'prompt', repeat('x', 40)),
       1e9 + i, 1e9 + i + 5, 'train', 'rs-1', 'succeeded',
       '{"max_attempts": 1, "timeout_seconds": 30.0}'::jsonb, '{}'::jsonb,
       'at-' || lpad(i::text, 8, '0'), 1, i * 10, i * 10 + 5, i <= $2
  FROM generate_series(1, $1::int) i;
"""
ATTEMPTS = """
INSERT INTO attempts (rollout_id, attempt_id, sequence_id, start_time, end_time, status, worker_id,
                      last_heartbeat_time, metadata)
SELECT rollout_id, latest_attempt_id, 1, start_time, end_time, 'succeeded', 'w1', end_time, '{}'::jsonb FROM rollouts
"""
RETIRED = "INSERT INTO retired_rollouts SELECT rollout_id, 1.5e9, 1 FROM rollouts WHERE retired"
TAIL = [  # {r}: the retired history; after it 200 due, 100 within the window, 64 running
    "UPDATE rollouts SET end_time = {now} - 10"
    " WHERE created_seq > ({r} + 200) * 10 AND created_seq <= ({r} + 300) * 10",
    "UPDATE rollouts SET status = 'running', end_time = NULL WHERE created_seq > ({r} + 300) * 10",
    "UPDATE attempts a SET status = 'running', end_time = NULL FROM rollouts r WHERE r.rollout_id = a.rollout_id"
    " AND r.status = 'running'",
]


async def fill(conn: asyncpg.Connection, retired: int) -> int:
    """The retired history and the rows after it; the number of rollouts generated."""
    await conn.execute("ALTER TABLE rollouts DISABLE TRIGGER USER")  # the status counts: not measured here
    await conn.execute(HISTORY, retired + 364, retired)
    for sql in (ATTEMPTS, RETIRED):
        await conn.execute(sql)
    for sql in TAIL:
        await conn.execute(sql.format(r=retired, now=NOW))
    await conn.execute("ALTER TABLE rollouts ENABLE TRIGGER USER")
    for table in ("rollouts", "attempts", "retired_rollouts"):
        await conn.execute(f"VACUUM ANALYZE {table}")
    return int(await conn.fetchval("SELECT count(*) FROM rollouts"))


def _plan_figures(plan: dict[str, Any]) -> dict[str, float]:
    top = plan["Plan"]
    jit = plan.get("JIT", {}).get("Timing", {}).get("Total", 0.0)
    return {
        "exec_ms": plan["Execution Time"],
        "jit_ms": jit,
        "blocks": top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0),
    }


async def before(conn: asyncpg.Connection) -> dict[str, float]:
    args = (sorted(TERMINAL_ROLLOUT_STATUSES), NOW - 60, 2**62, BATCH)
    await conn.execute("PREPARE old(text[], float8, bigint, bigint) AS " + OLD_FORM)
    try:
        literal = "ARRAY['cancelled', 'failed', 'succeeded']"
        sql = f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE old({literal}, {NOW - 60}, {2**62}, {BATCH})"
        plan = json.loads(await conn.fetchval(sql))[0]
    finally:
        await conn.execute("DEALLOCATE old")
    t0 = time.perf_counter()
    rows = await conn.fetch(OLD_FORM, *args)
    return {**_plan_figures(plan), "read_ms": (time.perf_counter() - t0) * 1e3, "rows": len(rows)}


async def after(conn: asyncpg.Connection) -> dict[str, float]:
    async with conn.transaction():
        await conn.execute("SET LOCAL jit = off")
        await conn.execute("PREPARE due(float8, bigint, bigint) AS " + _SELECT)
        plan = json.loads(
            await conn.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE due({NOW - 60}, {2**62}, {BATCH})")
        )[0]
        await conn.execute("DEALLOCATE due")
    t0 = time.perf_counter()
    rows = await _due(conn, NOW - 60, 2**62, BATCH)
    return {**_plan_figures(plan), "read_ms": (time.perf_counter() - t0) * 1e3, "rows": len(rows)}


async def one_size(dsn: str, base: Settings, retired: int, rounds: int) -> dict[str, Any]:
    made, ab = await index_ab.one_size(
        dsn,
        base,
        f"retsel{retired}",
        lambda conn: fill(conn, retired),
        ("rollouts_retirable_idx", INDEX),
        before,
        after,
        rounds,
        ("exec_ms", "jit_ms", "read_ms"),
    )
    return {"rollouts": made, **ab}


async def main_async(sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    return await index_ab.over_sizes("retsel", sizes, lambda dsn, base, n: one_size(dsn, base, n, rounds))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.retire_select", description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=positive_ints, default=[10_000, 100_000, 800_000])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    for r in asyncio.run(main_async(args.rollouts, args.rounds)):
        for k in ("before", "after"):
            s = r[k]
            e, j, t = s["exec_ms"], s["jit_ms"], s["read_ms"]
            print(
                f"{r['rollouts']:>9,} rollouts {k:6s}: {s['rows']} rows, {s['blocks']:,} blocks, "
                f"execution {e['median']:.2f} ms [{e['min']:.2f}-{e['max']:.2f}] "
                f"(JIT {j['median']:.0f} ms [{j['min']:.0f}-{j['max']:.0f}]), "
                f"read {t['median']:.2f} ms [{t['min']:.2f}-{t['max']:.2f}]"
            )


if __name__ == "__main__":
    main()
