"""``eventlight replay --rebuild`` and ``eventlight export`` / ``import`` on real NATS and Postgres."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest

import eventlight
from eventlight.core.errors import InvalidInputError
from eventlight.logreplay.rebuild import rebuild
from eventlight.logreplay.transfer import export_log, import_log
from eventlight.ops import Services
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from tests import test_rebuild
from tests.conftest import fresh_namespace
from tests.test_cli import cli, env_of
from tests.test_replay import workload


async def _drop(dsn: str, *schemas: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for s in schemas:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{s}" CASCADE')
    finally:
        await conn.close()


async def test_rebuild_compares_equal_and_swaps_only_without_a_projector(namespace: Settings) -> None:
    dsn = namespace.pg_dsn
    assert dsn is not None
    async with JetStreamLightningStore(namespace, pg_dsn=dsn) as store:
        await test_rebuild.workload(store)
        report = await rebuild(namespace, dsn)
        assert report.same, report.tables
        assert report.rebuilt_checkpoint == report.live_checkpoint == await test_rebuild.last_seq(store)
        assert all(t.live_rows > 0 for t in report.tables)
        with pytest.raises(InvalidInputError, match="projector .* is running"):
            await rebuild(namespace, dsn, swap=True)
    report = await rebuild(namespace, dsn, swap=True)
    try:
        assert report.same and report.swapped_out is not None
        conn = await asyncpg.connect(dsn)
        try:
            names = {r[0] for r in await conn.fetch("SELECT nspname FROM pg_namespace")}
        finally:
            await conn.close()
        assert namespace.pg_schema in names and report.swapped_out in names
        assert f"{namespace.pg_schema}_rebuild" not in names
        async with JetStreamLightningStore(namespace, pg_dsn=dsn) as store:  # the swapped-in schema serves
            assert len(await store.query_rollouts()) == 3
    finally:
        await _drop(dsn, report.swapped_out or "", f"{namespace.pg_schema}_rebuild")


def test_cli_rebuild_prints_the_comparison(namespace: Settings) -> None:
    result = cli("replay", "--rebuild", env=env_of(namespace))
    assert result.returncode == 0, result.stderr
    assert "identical" in result.stdout and "rollouts" in result.stdout


async def test_export_then_import_twice_appends_once(
    namespace: Settings, services: tuple[Settings, Services], tmp_path: Path
) -> None:
    async with JetStreamLightningStore(namespace) as store:
        await workload(store)
        total = await test_rebuild.last_seq(store)
    part, whole = tmp_path / "part.jsonl", tmp_path / "whole.jsonl"
    assert (await export_log(namespace, part, 0, total // 2))[0] == total // 2
    assert (await export_log(namespace, whole, 0, None))[0] == total
    async with fresh_namespace(services) as other:
        assert await import_log(other, part) == (total // 2, 0)
        assert await import_log(other, whole) == (total - total // 2, total // 2)  # only the rest
        assert await import_log(other, whole) == (0, total)  # twice: nothing
        async with JetStreamLightningStore(other) as store:
            assert await test_rebuild.last_seq(store) == total
        a = [r async for r in eventlight.replay(namespace, adapter="messages")]
        b = [r async for r in eventlight.replay(other, adapter="messages")]
        assert a == b and len(a) == 6


def test_cli_export_and_import(namespace: Settings, services: tuple[Settings, Services], tmp_path: Path) -> None:
    out = tmp_path / "log.jsonl"
    env = env_of(namespace)
    result = cli("export", "--out", str(out), env=env)
    assert result.returncode == 0 and "0 entries" in result.stdout, result.stderr
    result = cli("import", str(out), env=env)
    assert result.returncode == 0 and "0 entries appended, 0 already present" in result.stdout, result.stderr


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"seq": 99, "subject": "r.ro-x.e", "data": {"type": "nonsense"}}', "position 99 .* not an eventlight event"),
        ('{"seq": 99, "subject": "r.ro-x.e", "data_b64": "bm90IGpzb24="}', "position 99 .* not an eventlight event"),
        ("moved", "belongs on r\\."),
    ],
    ids=["unknown-type", "not-json", "wrong-subject"],
)
async def test_an_import_with_a_bad_entry_appends_nothing(
    namespace: Settings, services: tuple[Settings, Services], tmp_path: Path, bad: str, message: str
) -> None:
    """Each entry is checked before any is appended: an entry that is no event (it was appended and
    then dead-lettered, a fresh-user run) or one on another rollout's subject refuses the file."""
    async with JetStreamLightningStore(namespace) as store:
        await workload(store)
    good, tampered = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    await export_log(namespace, good, 0, None)
    lines = good.read_text().splitlines()
    entries = len(lines) - 2  # between the header and the count
    if bad == "moved":  # the first rollout event, put on a subject of another rollout
        i = next(i for i, line in enumerate(lines) if '"subject":"r.' in line)
        lines[i] = lines[i].replace('"subject":"r.', '"subject":"r.ro-elsewhere', 1)
    else:
        lines.insert(len(lines) // 2, bad)
    tampered.write_text("\n".join(lines) + "\n")
    async with fresh_namespace(services) as other:
        with pytest.raises(InvalidInputError, match=message):
            await import_log(other, tampered)
        async with JetStreamLightningStore(other) as store:
            assert await test_rebuild.last_seq(store) == 0  # nothing appended
        assert await import_log(other, good) == (entries, 0)  # the file as exported still imports
