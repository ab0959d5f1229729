"""``eventlight export`` writes a whole file or none, and ``eventlight import`` refuses one cut short.

An export ends with the count of its entries (``transfer.ENTRIES``); an import checks it before
appending anything. Real NATS, as ``tests/test_replay_rebuild.py``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.logreplay.transfer import export_log, import_log
from eventlight.ops import Services
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.log import JetStreamEventLog
from tests import test_rebuild
from tests.conftest import fresh_namespace
from tests.test_cli import assert_one_line_error, cli, env_of
from tests.test_replay import workload


def _cut(lines: list[str], how: str) -> list[str]:
    if how == "head":  # `head -n 5 full.jsonl`: whole lines, the count gone
        return lines[:5]
    if how == "mid-line":
        return [*lines[:5], lines[5][:20]]
    return [*lines[:3], *lines[4:]]  # "entry dropped": one entry less, the count kept


@pytest.mark.parametrize("how", ["head", "mid-line", "entry dropped"])
async def test_an_import_refuses_an_export_cut_short_and_appends_nothing(
    namespace: Settings, services: tuple[Settings, Services], tmp_path: Path, how: str
) -> None:
    """A file cut at a line boundary was imported as if whole, though its header said "until"."""
    async with JetStreamLightningStore(namespace) as store:
        await workload(store)
        total = await test_rebuild.last_seq(store)
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    assert (await export_log(namespace, whole, 0, None))[0] == total
    lines = whole.read_text().splitlines()
    assert json.loads(lines[-1]) == {"eventlight_export_entries": total} and len(lines) == total + 2
    cut.write_text("\n".join(_cut(lines, how)) + "\n")
    says = "cut or altered" if how == "entry dropped" else "does not end with the entry count"
    async with fresh_namespace(services) as other:
        with pytest.raises(InvalidInputError, match=says):
            await import_log(other, cut)
        async with JetStreamLightningStore(other) as store:
            assert await test_rebuild.last_seq(store) == 0  # nothing appended
        report = await import_log(other, whole)
        assert (report.appended, report.present) == (total, 0)


async def test_an_export_of_format_1_without_a_count_imports_with_a_warning(
    namespace: Settings, services: tuple[Settings, Services], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with JetStreamLightningStore(namespace) as store:
        await workload(store)
        total = await test_rebuild.last_seq(store)
    new, old = tmp_path / "new.jsonl", tmp_path / "old.jsonl"
    await export_log(namespace, new, 0, None)
    header, *entries, _ = new.read_text().splitlines()
    old.write_text("\n".join([header.replace('"eventlight_export":2', '"eventlight_export":1'), *entries]) + "\n")
    async with fresh_namespace(services) as other:
        with caplog.at_level("WARNING", logger="eventlight.logreplay.transfer"):
            report = await import_log(other, old)
            assert (report.appended, report.present) == (total, 0)
    assert "format 1, without an entry count" in caplog.text


async def test_an_export_that_fails_midway_leaves_the_file_there_as_it_was(
    namespace: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file was overwritten from the start, and a failure left its first part behind, which an
    import took for the whole slice."""
    async with JetStreamLightningStore(namespace) as store:
        await workload(store)
    out = tmp_path / "log.jsonl"
    out.write_text("precious\n")
    scan = JetStreamEventLog.scan

    async def fails_midway(self: Any, since: int, until: int) -> AsyncIterator[tuple[int, str, bytes]]:
        async for i, entry in _numbered(scan(self, since, until)):
            if i == 3:
                raise ServiceUnavailableError("nats://127.0.0.1:4222", "NATS went away")
            yield entry

    monkeypatch.setattr(JetStreamEventLog, "scan", fails_midway)
    with pytest.raises(ServiceUnavailableError, match="went away"):
        await export_log(namespace, out, 0, None)
    assert _files(tmp_path) == ["log.jsonl"] and out.read_text() == "precious\n"  # no temporary file either


async def _numbered(items: AsyncIterator[Any]) -> AsyncIterator[tuple[int, Any]]:
    i = 0
    async for item in items:
        yield i, item
        i += 1


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_cli_export_refuses_a_file_name_other_than_jsonl(namespace: Settings, tmp_path: Path) -> None:
    """``export --out x.parquet`` wrote JSON lines into a .parquet file."""
    assert_one_line_error(
        cli("export", "--out", str(tmp_path / "x.parquet"), env=env_of(namespace)), 2, "give a .jsonl file name"
    )
    assert _files(tmp_path) == []
