"""``eventlight replay --rebuild`` and ``eventlight export`` / ``import`` on real NATS and Postgres."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import asyncpg
import pytest

import eventlight
from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.logreplay import rebuild as rebuild_module
from eventlight.logreplay.catchup import catch_up
from eventlight.logreplay.rebuild import RebuildReport, rebuild, table_sums
from eventlight.logreplay.transfer import ImportReport, export_log, import_log, read_export
from eventlight.net import free_port
from eventlight.ops import Services
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.connect import connect_nats
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


async def test_a_second_rebuild_of_a_namespace_is_refused_while_one_runs(namespace: Settings) -> None:
    """Both used ``<schema>_rebuild``: one dropped and refilled it under the other
    (``relation ..._rebuild.schema_migrations does not exist``, a reviewer)."""
    dsn = namespace.pg_dsn
    assert dsn is not None
    async with JetStreamLightningStore(namespace, pg_dsn=dsn) as store:
        await test_rebuild.workload(store)
    results = await asyncio.gather(*(rebuild(namespace, dsn, swap=True) for _ in range(2)), return_exceptions=True)
    reports = [r for r in results if isinstance(r, RebuildReport)]
    try:
        refused = [r for r in results if not isinstance(r, RebuildReport)]
        assert len(reports) == 1 and reports[0].same and reports[0].swapped_out is not None, results
        assert len(refused) == 1 and isinstance(refused[0], InvalidInputError), results
        assert str(refused[0]) == (
            f"another rebuild of schema {namespace.pg_schema} is running (it holds the rebuild lock): "
            "wait for it to finish"
        )
        assert (await rebuild(namespace, dsn)).same  # the lock went with the first one's connection
    finally:
        await _drop(dsn, *(r.swapped_out or "" for r in reports), f"{namespace.pg_schema}_rebuild")


async def test_two_swaps_within_one_second_keep_both_replaced_schemas(namespace: Settings, monkeypatch: Any) -> None:
    """The replaced schema was named by the second alone, so a second swap in that second failed."""
    dsn = namespace.pg_dsn
    assert dsn is not None
    async with JetStreamLightningStore(namespace, pg_dsn=dsn) as store:
        await test_rebuild.workload(store)
    frozen = SimpleNamespace(time=lambda: 1_900_000_000.0, perf_counter=time.perf_counter)
    monkeypatch.setattr(rebuild_module, "time", frozen)
    names: list[str] = []
    try:
        for _ in range(2):
            report = await rebuild(namespace, dsn, swap=True)
            assert report.same and report.swapped_out is not None
            names.append(report.swapped_out)
        prefix = f"{namespace.pg_schema}_replaced_"
        assert names == [f"{prefix}1900000000", f"{prefix}1900000001"]
    finally:
        await _drop(dsn, *names, f"{namespace.pg_schema}_rebuild")


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
        assert await import_log(other, part) == ImportReport(appended=total // 2)
        rest = ImportReport(appended=total - total // 2, present=total // 2)
        assert await import_log(other, whole) == rest  # only the rest
        assert await import_log(other, whole) == ImportReport(present=total)  # twice: nothing
        async with JetStreamLightningStore(other) as store:
            assert await test_rebuild.last_seq(store) == total
        a = [r async for r in eventlight.replay(namespace, adapter="messages")]
        b = [r async for r in eventlight.replay(other, adapter="messages")]
        assert a == b and len(a) == 6


async def test_export_import_catch_up_and_rebuild_find_the_embedded_servers_as_replay_does(
    namespace: Settings, services: tuple[Settings, Services], tmp_path: Path
) -> None:
    """``export_log``, ``import_log``, ``catch_up`` and ``rebuild`` asserted ``settings.nats_url``
    (an ``AssertionError``, or ``None`` passed on) where ``replay`` finds the servers ``eventlight up``
    left running; with none running they say to run it, as ``replay`` does."""
    base, svc = services
    if svc.nats_pid is None and svc.pg_pid is None:
        pytest.skip("both servers are external here: nothing embedded is recorded to be found")
    async with JetStreamLightningStore(namespace) as store:  # no Postgres: nothing projects
        await workload(store)
        total = await test_rebuild.last_seq(store)
    found = Settings(state_dir=base.state_dir, namespace=namespace.namespace)  # no URL, no DSN
    out = tmp_path / "log.jsonl"
    assert (await export_log(found, out, 0, None)).entries == total
    none = Settings(state_dir=tmp_path / "no_servers", namespace=namespace.namespace)
    says = r"is not set and no eventlight servers are running \(state folder .*no_servers\): run `eventlight up`"
    calls = (
        lambda: export_log(none, tmp_path / "x.jsonl", 0, None),
        lambda: import_log(none, out),
        lambda: catch_up(none),
        lambda: rebuild(none),
    )
    for call in calls:
        with pytest.raises(ServiceUnavailableError, match=says):
            await call()
    assert not (tmp_path / "x.jsonl").exists()
    typo = Settings(state_dir=base.state_dir, namespace="no_such_ns_transfer")
    with pytest.raises(InvalidInputError, match="has no stream .*`eventlight up -N no_such_ns_transfer`"):
        await export_log(typo, tmp_path / "x.jsonl", 0, None)
    assert await catch_up(found) == (total, total)
    assert (await rebuild(found)).same
    await _drop(str(svc.pg_dsn), f"{namespace.pg_schema}_rebuild")
    async with fresh_namespace(services) as other:
        target = Settings(state_dir=base.state_dir, namespace=other.namespace)
        assert await import_log(target, out) == ImportReport(appended=total)


def test_cli_export_and_import(namespace: Settings, services: tuple[Settings, Services], tmp_path: Path) -> None:
    out = tmp_path / "log.jsonl"
    env = env_of(namespace)
    result = cli("export", "--out", str(out), env=env)
    assert result.returncode == 0 and "0 entries" in result.stdout, result.stderr
    result = cli("import", str(out), env=env)
    assert result.returncode == 0 and "0 entries appended, 0 already present" in result.stdout, result.stderr


async def test_cli_import_leaves_a_namespace_sql_reads(
    namespace: Settings, services: tuple[Settings, Services], tmp_path: Path
) -> None:
    """After ``eventlight import``, ``eventlight sql`` counted 0 rollouts: nothing had projected the
    namespace (a fresh-user run). The import now projects it up to the head before it returns."""
    async with JetStreamLightningStore(namespace) as store:  # no Postgres: nothing projects the source either
        ids = await workload(store)
    out = tmp_path / "log.jsonl"
    assert cli("export", "--out", str(out), env=env_of(namespace)).returncode == 0
    async with fresh_namespace(services) as other:
        no_pg = {**env_of(other), "EVENTLIGHT_PG_DSN": f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"}
        result = cli("import", str(out), env=no_pg)  # appended; the read models wait for Postgres
        assert result.returncode == 0 and "18 entries appended" in result.stdout, result.stderr
        assert "warning: the read models were not brought up to date: cannot reach" in result.stderr
        result = cli("import", str(out), env=env_of(other))  # nothing to append: what is there is projected
        assert result.returncode == 0 and "0 entries appended" in result.stdout, result.stderr
        # stdout: the summary alone; no progress without a terminal, no projector INFO line, no empty line
        assert result.stderr == "" and len(result.stdout.splitlines()) == 2, (result.stdout, result.stderr)
        count = cli("sql", "SELECT rollout_id FROM v_rollouts ORDER BY 1", "-f", "csv", env=env_of(other))
        assert count.stdout.split() == ["rollout_id", *sorted(ids.values())], count.stderr
        assert "read models projected up to log position 18" in result.stdout, result.stdout


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
        assert await import_log(other, good) == ImportReport(appended=entries)  # the file as exported imports


async def _row_counts(settings: Settings) -> dict[str, int]:
    """Rows per read-model table once the namespace's projector has passed the head of its log."""
    async with JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
        await store.sync_all(timeout_s=10)
    conn = await asyncpg.connect(settings.pg_dsn)
    try:
        return {table: n for table, (n, _) in (await table_sums(conn, settings.pg_schema)).items()}
    finally:
        await conn.close()


async def _slices(namespace: Settings, tmp_path: Path) -> tuple[dict[str, str], Path, Path, int]:
    """The workload's rollouts, the whole log exported, and a slice of it that starts just after the
    second rollout's ``RolloutCreated`` (its later events are in the slice, its beginning is not)."""
    async with JetStreamLightningStore(namespace) as store:
        ids = await workload(store)
    whole, tail = tmp_path / "whole.jsonl", tmp_path / "tail.jsonl"
    total = (await export_log(namespace, whole, 0, None))[0]
    _, entries, _ = read_export(whole)
    begin = next(e.seq for e in entries if e.subject == f"r.{ids['val']}.q")
    await export_log(namespace, tail, begin, None)
    return ids, whole, tail, total


async def test_a_slice_that_starts_inside_a_rollout_is_refused_and_the_whole_log_then_imports(
    namespace: Settings, services: tuple[Settings, Services], tmp_path: Path
) -> None:
    """A reviewer: a middle slice went in (its rollouts' later events, which the projector dropped),
    then the whole log appended the beginnings after them; the read model lost rollouts and spans
    and runners ran two rollouts again."""
    ids, whole, tail, total = await _slices(namespace, tmp_path)
    async with fresh_namespace(services) as other:
        why = f"nothing imported: 1 rollout\\(s\\) .* rollout {ids['val']} begins before this file"
        with pytest.raises(InvalidInputError, match=why):
            await import_log(other, tail)
        async with JetStreamLightningStore(other) as store:
            assert await test_rebuild.last_seq(store) == 0  # nothing appended
        assert await import_log(other, whole) == ImportReport(appended=total)
        assert await import_log(other, tail) == ImportReport(present=len(read_export(tail)[1]))
        assert await _row_counts(other) == await _row_counts(namespace)
        a = [r async for r in eventlight.replay(namespace, adapter="messages")]
        b = [r async for r in eventlight.replay(other, adapter="messages")]
        assert a == b and len(a) == 6


async def test_a_whole_log_after_a_middle_slice_went_in_is_refused_not_folded_out_of_order(
    namespace: Settings, services: tuple[Settings, Services], tmp_path: Path
) -> None:
    """What an import of a slice that starts inside a rollout appended before it was refused: the
    whole log then put that rollout's beginning after its later events."""
    ids, whole, tail, _ = await _slices(namespace, tmp_path)
    async with fresh_namespace(services) as other:
        nc = await connect_nats(other.nats_url or "")
        try:
            for e in read_export(tail)[1]:
                await nc.jetstream().publish(f"{other.subject_prefix}.{e.subject}", e.payload())
        finally:
            await nc.close()
        async with JetStreamLightningStore(other) as store:
            before = await test_rebuild.last_seq(store)
        with pytest.raises(InvalidInputError, match=f"rollout {ids['val']} has later entries in the namespace"):
            await import_log(other, whole)
        async with JetStreamLightningStore(other) as store:
            assert await test_rebuild.last_seq(store) == before  # nothing appended


async def test_entries_that_are_not_events_refuse_the_file_or_are_skipped_and_counted(
    namespace: Settings, services: tuple[Settings, Services], tmp_path: Path
) -> None:
    """A reviewer: a message that is not an eventlight event (dead-lettered by the projector) is
    exported like the rest, and the file then imported nothing, saying nothing of how many. The
    export itself said nothing either: it now counts them and names the import's flag."""
    async with JetStreamLightningStore(namespace) as store:
        await workload(store)
        seq = (await store.log.js.publish(f"{namespace.subject_prefix}.r.ro-garbage.q", b"not json at all")).seq
        await store.update_worker("w-after", {"cpu": 1})
    out = tmp_path / "log.jsonl"
    report = await export_log(namespace, out, 0, None)
    n = report.entries
    assert report.non_events == [seq]
    result = cli("export", "--out", str(tmp_path / "cli.jsonl"), env=env_of(namespace))
    assert result.returncode == 0 and f"{n} entries" in result.stdout, result.stderr
    warning = f"1 of them are not eventlight events (log positions {seq})"
    assert warning in result.stderr and "eventlight import --skip-non-events" in result.stderr, result.stderr
    async with fresh_namespace(services) as other:
        with pytest.raises(
            InvalidInputError, match=f"position {seq} .* 1 of the {n} entries are not eventlight events"
        ):
            await import_log(other, out)
        assert await import_log(other, out, skip_non_events=True) == ImportReport(appended=n - 1, skipped=[seq])
        assert await import_log(other, out, skip_non_events=True) == ImportReport(present=n - 1, skipped=[seq])
        env = env_of(other)
        result = cli("import", str(out), env=env)
        assert result.returncode != 0 and "--skip-non-events" in result.stderr, result.stdout
        result = cli("import", "--skip-non-events", str(out), env=env)
        assert result.returncode == 0 and f"0 entries appended, {n - 1} already present" in result.stdout
        assert f"1 entries that are not eventlight events (log positions {seq})" in result.stderr


@pytest.mark.parametrize("subject", ["r", "s"], ids=["events", "spans"])
async def test_a_slice_that_leaves_a_gap_is_refused_up_front(
    namespace: Settings, services: tuple[Settings, Services], tmp_path: Path, subject: str
) -> None:
    """Slices (0, a], then (b, end]: the second skips the rollout's entries in (a, b] (its next event,
    or its second span batch). It was appended after the first, and only the gap was refused when
    it came; now the export records the rollout's entry at b and the import refuses the slice."""
    ids, whole, _, total = await _slices(namespace, tmp_path)
    val = [e.seq for e in read_export(whole)[1] if e.subject.startswith(f"{subject}.{ids['val']}.")]
    a, b = val[0], val[1]  # RolloutCreated and AttemptStarted, or the first two span batches
    first, gap, last = tmp_path / "first.jsonl", tmp_path / "gap.jsonl", tmp_path / "last.jsonl"
    await export_log(namespace, first, 0, a)
    await export_log(namespace, gap, a, b)
    await export_log(namespace, last, b, None)
    async with fresh_namespace(services) as other:
        await import_log(other, first)
        async with JetStreamLightningStore(other) as store:
            before = await test_rebuild.last_seq(store)
        why = f"rollout {ids['val']} would be continued after a gap: its entry at log position {b} \\({subject}\\."
        fill = f"which starts after {b}: import the slice `eventlight export --since {a} --until {b}` writes first"
        with pytest.raises(InvalidInputError, match=f"nothing imported: 1 rollout.*{why}.*{fill}"):
            await import_log(other, last)
        async with JetStreamLightningStore(other) as store:
            assert await test_rebuild.last_seq(store) == before  # nothing appended
        await import_log(other, gap)
        await import_log(other, last)
        assert await _row_counts(other) == await _row_counts(namespace)
        a_ = [r async for r in eventlight.replay(namespace, adapter="messages")]
        assert a_ == [r async for r in eventlight.replay(other, adapter="messages")] and len(a_) == 6
        async with JetStreamLightningStore(other) as store:
            assert await test_rebuild.last_seq(store) == total


async def test_a_slice_from_before_the_gap_record_goes_in_and_the_gap_is_refused_after(
    namespace: Settings, services: tuple[Settings, Services], tmp_path: Path
) -> None:
    """A file without the count line's ``before`` (an older export) cannot show a gap: slices
    (0, a], (b, end], then (a, b]: the last would append a rollout's events after later ones."""
    ids, whole, _, _ = await _slices(namespace, tmp_path)
    entries = read_export(whole)[1]
    a = next(e.seq for e in entries if e.subject == f"r.{ids['val']}.q")  # the rollout's RolloutCreated
    b = next(e.seq for e in entries if e.subject == f"r.{ids['val']}.e")  # its next event
    first, gap, last = tmp_path / "first.jsonl", tmp_path / "gap.jsonl", tmp_path / "last.jsonl"
    await export_log(namespace, first, 0, a)
    await export_log(namespace, gap, a, b)
    await export_log(namespace, last, b, None)
    lines = last.read_text().splitlines()
    assert '"before":' in lines[-1]
    lines[-1] = json.dumps({"eventlight_export_entries": len(lines) - 2})
    last.write_text("\n".join(lines) + "\n")
    async with fresh_namespace(services) as other:
        await import_log(other, first)
        await import_log(other, last)  # the gap is not seen
        async with JetStreamLightningStore(other) as store:
            before = await test_rebuild.last_seq(store)
        with pytest.raises(InvalidInputError, match=f"rollout {ids['val']} has later entries in the namespace"):
            await import_log(other, gap)
        async with JetStreamLightningStore(other) as store:
            assert await test_rebuild.last_seq(store) == before  # nothing appended
