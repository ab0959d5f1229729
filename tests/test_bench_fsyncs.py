"""bench/fsyncs.py leaves nothing behind: its temporary state dir goes once its nats-server is stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import fsyncs


async def test_the_temporary_state_dir_is_removed_after_nats_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Path, bool]] = []

    async def ensure_nats(settings: Any, state: Path) -> tuple[str, int, bool]:
        (state / "nats").mkdir()  # what the embedded server keeps there
        return "nats://127.0.0.1:1", 123, True

    async def connect_nats(url: str) -> Any:
        raise ConnectionRefusedError(url)

    async def stop_nats(state: Path) -> None:
        seen.append((state, _has_nats_data(state)))

    monkeypatch.setattr(fsyncs, "ensure_nats", ensure_nats)
    monkeypatch.setattr(fsyncs, "connect_nats", connect_nats)
    monkeypatch.setattr(fsyncs, "stop_nats", stop_nats)
    with pytest.raises(ConnectionRefusedError):
        await fsyncs.main(1, 1, 1)
    [(state, existed)] = seen
    assert existed  # the server was stopped first, its data still there
    assert not state.exists()


def _has_nats_data(state: Path) -> bool:
    return (state / "nats").is_dir()
