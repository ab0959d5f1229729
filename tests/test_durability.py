"""Durability is a named setting: what the embedded nats-server is configured with, refused where it
cannot hold, and never silently another level than asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from eventlight.core.errors import InvalidInputError
from eventlight.ops.nats_server import embedded_durability, ensure_nats, stop_nats
from eventlight.settings import DURABILITY, Settings


def test_the_setting_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().durability == "fsync"
    monkeypatch.setenv("EVENTLIGHT_DURABILITY", "interval")
    assert Settings.from_env().durability == "interval"
    monkeypatch.setenv("EVENTLIGHT_DURABILITY", "sometimes")
    with pytest.raises(InvalidInputError, match="durability must be one of fsync, interval, replicated"):
        Settings.from_env()
    assert Settings(durability="replicated").replicas == 3  # an R3 stream
    assert Settings(durability="replicated", stream_replicas=5).replicas == 5
    assert Settings().replicas is None
    assert set(DURABILITY) == {"fsync", "interval", "replicated"}


async def test_replicated_needs_a_cluster_url(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="needs a 3-node NATS cluster"):
        await ensure_nats(Settings(state_dir=tmp_path, durability="replicated"), tmp_path)
    assert not (tmp_path / "nats" / "nats.pid").exists()  # nothing was started


async def test_embedded_server_runs_the_level_asked_and_refuses_another(tmp_path: Path) -> None:
    state = tmp_path / "state"
    url, pid, started = await ensure_nats(Settings(state_dir=state, durability="interval"), state)
    try:
        assert started and pid
        conf = (state / "nats" / "nats.conf").read_text()
        assert "sync_interval: 2m\n" in conf and "always" not in conf
        assert embedded_durability(state) == "interval"
        again = await ensure_nats(Settings(state_dir=state, durability="interval"), state)
        assert again == (url, pid, False)  # reused
        with pytest.raises(InvalidInputError) as refused:  # it answers: no "cannot reach" (a fresh-user run)
            await ensure_nats(Settings(state_dir=state, durability="fsync"), state)
        assert str(refused.value) == (
            f"the embedded nats-server at {url} (pid {pid}) runs at durability interval, not fsync "
            "(EVENTLIGHT_DURABILITY): `eventlight down` and start again to change it, "
            "or set EVENTLIGHT_DURABILITY=interval"
        )
    finally:
        await stop_nats(state)
    url, pid, started = await ensure_nats(Settings(state_dir=state), state)  # after a stop: the new level
    try:
        assert started and embedded_durability(state) == "fsync"
        assert "sync_interval: always\n" in (state / "nats" / "nats.conf").read_text()
    finally:
        await stop_nats(state)


def test_bench_tables_name_the_level(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import bench_durability
    from bench.report import render

    monkeypatch.setenv("EVENTLIGHT_DURABILITY", "interval")
    assert bench_durability() == "interval"
    meta = {"scale": 1, "seed": 1, "vs": None, "cpu_count": 2, "durability": bench_durability()}
    assert "durability interval" in render({"meta": meta, "scenarios": {}, "micro": {}, "ceiling": None})
    monkeypatch.setenv("EVENTLIGHT_DURABILITY", "replicated")
    with pytest.raises(ValueError, match="fsync or interval"):
        bench_durability()
