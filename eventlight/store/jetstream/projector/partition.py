"""Partitions of a namespace's projection (issue 17): which partition a message is, the locks, the record.

A rollout's partition is ``zlib.crc32(rollout_id.encode()) % partitions``: CRC-32 as zlib computes
it, the same in every process, Python version and machine (Python's ``hash()`` of a string is
salted per process). It is read from the subject (``el.<ns>.r.<rid>.*``, ``el.<ns>.s.<rid>.<aid>``,
see ``layout``) without decoding the payload; every other subject (resources ``res.*``, workers
``w.*``) is partition 0's.

**Filtering: every partition reads the whole stream and skips other partitions' rollouts by
subject.** A JetStream-native split was not taken: a consumer cannot map subjects (JetStream's
``partition(n, wildcards)`` mapping exists only as a stream's or a source's subject transform, which
would rewrite the stored subjects that the per-rollout expected-sequence fence and every other
reader use), and a consumer filtered to one partition's share would not deliver the others'
sequences, so its checkpoint would stop being a position in the one stream: read-your-writes
(``min(last_seq)`` over the partitions) would then wait for a partition that has nothing new.
Reading everything costs each partition the delivery of the whole stream (measured in
``bench/projector_rate.py``); a skipped message costs a subject split and a CRC-32.

**Workers** (the ``workers`` table) are partition 0's: a worker's record follows its heartbeats and
the attempts it runs, which belong to any partition, so partition 0 also folds the worker side of
every rollout's attempt events in log order (``workers``) and the others leave workers alone.

The count is fixed per namespace: the first projector records it (``projector_partitions``,
migration 011) and a projector started with another count is refused (``record_partitions``).
"""

from __future__ import annotations

import zlib

import asyncpg

from eventlight.core.errors import InvalidInputError

MEMBER_CLASS = 0xFFFF
"""The high 32 bits of the advisory-lock key every projector process holds shared while it runs
(``pg_locks`` then lists the live processes: ``members``)."""

_ROLLOUT_KINDS = ("r", "s")


def partition_of(rollout_id: str, partitions: int) -> int:
    """The partition (``0`` to ``partitions - 1``) of a rollout: ``crc32(rollout_id) % partitions``."""
    return zlib.crc32(rollout_id.encode()) % partitions


def subject_partition(subject: str, partitions: int) -> int:
    """The partition of a message by its subject (``el.<ns>.<kind>.<id>...``): its rollout's for
    ``r``/``s`` subjects, 0 for any other."""
    if partitions == 1:
        return 0
    tokens = subject.split(".", 4)
    if len(tokens) >= 4 and tokens[2] in _ROLLOUT_KINDS:
        return zlib.crc32(tokens[3].encode()) % partitions
    return 0


def lock_key(schema: str, partition: int) -> int:
    """The advisory-lock key (bigint) of a partition: partition 0's is the one-projector key of
    earlier releases (``crc32(schema)``), partition ``p``'s has ``p`` in its high 32 bits."""
    return zlib.crc32(schema.encode()) + (partition << 32)


def member_key(schema: str) -> int:
    """The advisory-lock key every projector process of the namespace holds shared."""
    return lock_key(schema, MEMBER_CLASS)


async def record_partitions(conn: asyncpg.Connection, partitions: int) -> None:
    """Record the namespace's partition count, or check it against the one recorded.

    The first record of a namespace projected so far by one partition (every namespace before
    migration 011, or a fresh one) adds the checkpoint rows of partitions 1..n-1 at partition 0's
    position (which covered every rollout up to there), seeds ``projector_attempt_workers`` from
    ``attempts`` and takes a new term on partition 0's row, so a projector that led before the
    record cannot commit after it. Serialized by a table lock.

    Raises:
        InvalidInputError: Another count is recorded for the namespace.
    """
    async with conn.transaction():
        await conn.execute("LOCK TABLE projector_partitions IN SHARE ROW EXCLUSIVE MODE")
        recorded = await conn.fetchval("SELECT partitions FROM projector_partitions")
        if recorded is None:
            at = await conn.fetchval("SELECT last_seq FROM projector_checkpoint WHERE id = 0 FOR UPDATE")
            await conn.execute("INSERT INTO projector_partitions (partitions) VALUES ($1)", partitions)
            if partitions > 1:
                await conn.execute(
                    "INSERT INTO projector_checkpoint (id, last_seq, term)"
                    " SELECT p, $1, 0 FROM generate_series(1, $2 - 1) AS p",
                    at,
                    partitions,
                )
                await conn.execute(
                    "INSERT INTO projector_attempt_workers (attempt_id, worker_id, status)"
                    " SELECT attempt_id, worker_id, status FROM attempts ON CONFLICT DO NOTHING"
                )
                await conn.execute("UPDATE projector_checkpoint SET term = term + 1 WHERE id = 0")
            return
        if recorded != partitions:
            raise InvalidInputError(
                f"this namespace is projected in {recorded} partitions, not {partitions} "
                f"(EVENTLIGHT_PROJECTOR_PARTITIONS); the count is fixed once recorded: start every "
                f"projector with {recorded}, or rebuild into a fresh namespace to change it"
            )


async def members(conn: asyncpg.Connection, schema: str) -> list[int]:
    """Backend pids of the live projector processes of the namespace (holders of ``member_key``),
    in order."""
    key = member_key(schema)
    rows = await conn.fetch(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " AND classid::bigint = $1 AND objid::bigint = $2 ORDER BY pid",
        key >> 32,
        key & 0xFFFFFFFF,
    )
    return [int(r[0]) for r in rows]


def fair_share(partitions: int, members_: list[int], me: int) -> int:
    """How many partitions process ``me`` (a backend pid) should hold: ``partitions`` split evenly
    over ``members_`` (sorted pids), the remainder to the lowest pids; ``me`` missing from the list
    (its member lock is being taken again) counts as the last member."""
    ranked = members_ if me in members_ else [*members_, me]
    rank = ranked.index(me)
    base, extra = divmod(partitions, len(ranked))
    return base + (1 if rank < extra else 0)
