"""bench/projector_rate.py runs on real NATS and Postgres and its numbers agree with each other
(no timed assertion: only what every case must give whatever the machine's speed)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from bench import projector_rate
from bench.projector_rate import measure, report, summary
from eventlight.ops import Services
from eventlight.settings import MAX_PARTITIONS, Settings


async def test_every_case_projects_the_same_log_to_the_head(services: tuple[Settings, Services]) -> None:
    base, svc = services
    rollouts, spans = 12, 3
    result = await measure(svc, Path(base.state_dir), rollouts, spans, partitions=[1, 2], processes=[1, 2])
    cases = result["cases"]
    assert [(c["partitions"], c["processes"]) for c in cases] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert result["spans"] == rollouts * spans
    assert result["messages"] == 4 * rollouts  # what start_rollout, the spans' batch and the finish write
    # each case rebuilt the read model from sequence 0 in a fresh schema: the same rows every time
    assert len({c["rows"] for c in cases}) == 1
    assert cases[0]["rows"] >= rollouts * spans + 2 * rollouts  # spans, rollouts, attempts, ...
    for c in cases:
        # at most one leader per partition (one may be changing hands when the head is reached)
        assert len(c["led"]) == c["processes"] and sum(c["led"]) <= c["partitions"]
        assert c["spans_per_s"] == round(rollouts * spans / c["catchup_s"])
        assert c["messages_per_s"] == round(result["messages"] / c["catchup_s"])
        assert c["projector_cpu_s"] > 0 and c["postgres_cpu_s"] >= 0  # 0: Postgres on another machine
    table = report(result)
    assert len(summary(result)) == 4 and table.count("\n| ") == 5  # the header and a row per case
    assert f"durability {result['durability']}" in table and "load average" in table


def test_a_partition_count_past_the_limit_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def started(args: argparse.Namespace) -> None:
        raise AssertionError("servers started")

    monkeypatch.setattr(projector_rate, "main_async", started)
    for bad in (f"1,{MAX_PARTITIONS + 1}", "0"):
        with pytest.raises(SystemExit) as exit_:
            projector_rate.main(["--partitions", bad])
        assert exit_.value.code == 2
        assert "--partitions: expected" in capsys.readouterr().err


@pytest.mark.parametrize("fails", [False, True])
async def test_the_temporary_state_dir_is_removed_after_the_servers_stop(
    monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    seen: list[tuple[str, Path, bool]] = []

    async def ensure_services(base: Settings) -> Services:
        (Path(base.state_dir) / "nats").mkdir()  # what embedded servers leave there
        return Services(nats_url="nats://x", pg_dsn="postgresql://x/y")

    async def measure(svc: Services, state: Path, *_: Any) -> dict[str, Any]:
        if fails:
            raise RuntimeError("a case failed")
        return {}

    async def stop_services(base: Settings) -> None:
        seen.append(("stopped", Path(base.state_dir), _has_nats_data(Path(base.state_dir))))

    monkeypatch.setattr(projector_rate, "ensure_services", ensure_services)
    monkeypatch.setattr(projector_rate, "measure", measure)
    monkeypatch.setattr(projector_rate, "stop_services", stop_services)
    args = argparse.Namespace(rollouts=1, spans=1, partitions=[1], processes=[1], repeat=1, timeout_s=1.0)
    if fails:
        with pytest.raises(RuntimeError):
            await projector_rate.main_async(args)
    else:
        assert await projector_rate.main_async(args) == {}
    [(_, state, existed)] = seen
    assert existed  # the servers were stopped first, their data still there
    assert not state.exists()


def _has_nats_data(state: Path) -> bool:
    return (state / "nats").is_dir()
