"""``ClaimBoard``: which attempts each runner of a ``RunnerPool`` holds, in memory its processes share.

A runner writes an attempt onto its row as it claims it, before the store appends the claim
(``dequeue_rollout(on_claim=)`` names the attempt id it is about to record), and wipes it once the
attempt's final status is recorded (or refused), or at once when the claim is not made (refused,
or the dequeue failed). When a runner process dies (``kill -9``, the OOM killer, a crash in native
code), what its rows still show are the attempts nobody will finish: the pool records them
``failed`` (the store's ``abandon_attempt``), so the rollouts are retried or failed by their
``RolloutConfig`` instead of staying ``preparing`` for ever. That includes a claim the store
recorded in the instant before the process died, before it reached the runner; a process killed
before the append leaves an attempt that does not exist, which ``abandon_attempts`` passes over.
Shared memory, not a pipe: writing never blocks the runner, and the pool reads it only after a
death.

Each row has ``ENTRIES`` entries (an attempt whose status could not be recorded yet keeps its entry
while the runner claims the next); an entry is a flag byte and ``<rollout_id> <attempt_id>``. The
flag is written last and wiped first, so a process killed in the middle of a write leaves either
the old entry or none, never a torn one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from eventlight.core.errors import NotFoundError
from eventlight.core.types import STATUS_REASON

if TYPE_CHECKING:
    from eventlight.settings import Settings

log = logging.getLogger(__name__)

__all__ = ["ABANDON_TIMEOUT_S", "ClaimBoard", "abandon_attempts"]

ABANDON_TIMEOUT_S = 15.0
"""Seconds ``abandon_attempts`` gives the store to record the attempts (NATS may be down)."""

ENTRIES = 4
"""Attempts one runner can hold at once: the one it runs and up to three whose status waits to be recorded."""
ENTRY_BYTES = 1 + 200 + 1 + 200  # flag, rollout id, space, attempt id (ids are tokens of 1-200 characters)


class ClaimBoard:
    """Rows of attempts held, one row per runner index ``0 .. n - 1``.

    Args:
        ctx: The ``multiprocessing`` context the pool starts its processes with.
        n: Runners.
    """

    def __init__(self, ctx: Any, n: int) -> None:
        self.n = n
        self._mem = ctx.RawArray("c", n * ENTRIES * ENTRY_BYTES)

    def _entry(self, index: int, k: int) -> int:
        return (index * ENTRIES + k) * ENTRY_BYTES

    def hold(self, index: int, rollout_id: str, attempt_id: str) -> None:
        """Write that runner ``index`` holds the attempt (into a free entry of its row)."""
        text = f"{rollout_id} {attempt_id}".encode()[: ENTRY_BYTES - 1]
        for k in range(ENTRIES):
            at = self._entry(index, k)
            if self._mem[at] == b"\x00":
                self._mem[at + 1 : at + 1 + len(text)] = text
                self._mem[at + 1 + len(text)] = b"\x00"
                self._mem[at] = b"\x01"  # last: the entry is complete
                return
        log.warning(
            "runner %d holds %d attempts; %s of %s is not on the claim board", index, ENTRIES, attempt_id, rollout_id
        )

    def release(self, index: int, rollout_id: str, attempt_id: str) -> None:
        """Wipe the attempt from runner ``index``'s row (nothing when it is not there)."""
        text = f"{rollout_id} {attempt_id}"
        for k in range(ENTRIES):
            if self._read(index, k) == text:
                self._mem[self._entry(index, k)] = b"\x00"

    def take(self, indexes: list[int]) -> list[tuple[int, str, str]]:
        """``(runner index, rollout_id, attempt_id)`` of every attempt the rows of ``indexes`` hold,
        wiping them (the rows of a process that died, before its replacement starts)."""
        found = []
        for index in indexes:
            for k in range(ENTRIES):
                text = self._read(index, k)
                if text is not None:
                    self._mem[self._entry(index, k)] = b"\x00"
                    rollout_id, _, attempt_id = text.partition(" ")
                    found.append((index, rollout_id, attempt_id))
        return found

    def _read(self, index: int, k: int) -> str | None:
        at = self._entry(index, k)
        if self._mem[at] == b"\x00":
            return None
        raw = bytes(self._mem[at + 1 : at + ENTRY_BYTES])
        return raw.split(b"\x00", 1)[0].decode(errors="replace")


def abandon_attempts(settings: Settings, nats_url: str, held: Sequence[tuple[int, str, str]], reason: str) -> None:
    """Record each held ``(runner index, rollout_id, attempt_id)`` ``failed`` with ``reason``, unless
    it finished (``abandon_attempt`` on a write-only store of the namespace), one log line each. An
    attempt the store does not know was written on the board for a claim never appended (the
    process died first, or the claim was refused as it died): nothing to record.

    Blocks up to ``ABANDON_TIMEOUT_S`` (in a thread of its own, so it may be called from one that
    runs an event loop); what it could not record is logged.
    """

    async def record() -> None:
        from eventlight.store.jetstream import JetStreamLightningStore

        async with JetStreamLightningStore(settings, nats_url=nats_url) as store:
            for index, rollout_id, attempt_id in held:
                try:
                    attempt = await store.abandon_attempt(rollout_id, attempt_id, reason)
                except NotFoundError:
                    log.info("runner %d: attempt %s of rollout %s was never claimed", index, attempt_id, rollout_id)
                    continue
                except Exception as e:
                    log.warning("runner %d: attempt %s of rollout %s: %s", index, attempt_id, rollout_id, e)
                    continue
                if attempt.status == "failed" and (attempt.metadata or {}).get(STATUS_REASON) == reason:
                    log.warning(
                        "runner %d: attempt %s of rollout %s recorded failed: %s", index, attempt_id, rollout_id, reason
                    )

    def run() -> None:
        try:
            asyncio.run(asyncio.wait_for(record(), ABANDON_TIMEOUT_S))
        except Exception as e:
            attempts = ", ".join(f"{aid} of {rid}" for _, rid, aid in held)
            log.warning(
                "could not record the attempts of a dead runner process failed (%s): %s: %s",
                attempts,
                type(e).__name__,
                e,
            )

    thread = threading.Thread(target=run, name="eventlight-abandon", daemon=True)
    thread.start()
    thread.join()
