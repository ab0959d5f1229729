"""Group commit on the pinned nats-server: concurrent appends of one process travel as one atomic batch.

A core NATS subscription on the namespace sees every message as published, with its headers, so
the tests count batches (``Nats-Batch-Id``) without looking inside the appender. What is checked:
many concurrent commands land with the versions they were given; a stale command inside a batch
fails alone while its neighbours land; a repeated command id is not stored twice; a batch over the
limits is split; NATS going away mid-batch is a ``ServiceUnavailableError`` and every command
acknowledged before is still there. One test pins the server behaviour that makes "never two
commands of one rollout in one batch" necessary.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from eventlight.core import decider
from eventlight.core.commands import CreateRollout
from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.core.events import RolloutEvent
from eventlight.ops import apply_streams
from eventlight.ops.nats_server import ensure_nats, stop_nats
from eventlight.settings import Settings
from eventlight.store.jetstream import appender
from eventlight.store.jetstream.appender import PLAIN_WINDOW
from eventlight.store.jetstream.connect import connect_nats
from eventlight.store.jetstream.log import JetStreamEventLog
from eventlight.store.ports import StaleStateError

NOW = 1_800_000_000.0


def _small_batches(log: JetStreamEventLog) -> JetStreamEventLog:
    """One plain publish in flight at a time, and a batch from two waiting messages on."""
    log.appender.plain_window = 1
    log.appender.min_batch_messages = 2
    return log


def _created(rid: str) -> list[RolloutEvent]:
    return decider.decide(None, CreateRollout(rollout_id=rid, input={"task": rid}), NOW)


class _Seen:
    """Every message published on the namespace's subjects, as the core subscription got it."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []

    async def cb(self, msg: Any) -> None:
        self.headers.append(dict(msg.headers or {}))

    def batches(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self.headers:
            if "Nats-Batch-Id" in h:
                out[h["Nats-Batch-Id"]] = out.get(h["Nats-Batch-Id"], 0) + 1
        return out


@pytest.fixture
async def opened(namespace: Settings) -> AsyncIterator[tuple[JetStreamEventLog, _Seen]]:
    nc = await connect_nats(namespace.nats_url or "")
    seen = _Seen()
    sub = await nc.subscribe(f"{namespace.subject_prefix}.>", cb=seen.cb)
    log = JetStreamEventLog(nc, namespace, lambda: NOW)
    try:
        yield log, seen
    finally:
        await sub.unsubscribe()
        await nc.close()


async def _append_all(log: JetStreamEventLog, items: Sequence[tuple[str, list[RolloutEvent], int]]) -> list[Any]:
    return await asyncio.gather(
        *(log.append(rid, events, expected, uuid.uuid4().hex) for rid, events, expected in items),
        return_exceptions=True,
    )


async def _settle(nc: Any) -> None:
    await nc.flush()
    await asyncio.sleep(0.05)


async def test_concurrent_commands_share_batches_and_land_with_their_versions(
    opened: tuple[JetStreamEventLog, _Seen],
) -> None:
    log, seen = opened
    rids = [f"ro-{i}" for i in range(60)]
    versions = await _append_all(log, [(rid, _created(rid), 0) for rid in rids])
    assert all(isinstance(v, int) for v in versions), versions
    for rid, version in zip(rids, versions, strict=True):
        state, loaded = await log.load(rid)
        assert loaded == version and state.rollout.rollout_id == rid
    assert len(set(versions)) == len(rids)
    await _settle(log.nc)
    batches = seen.batches()
    assert batches, "no atomic batch was sent"  # one publish per command before group commit
    assert sum(batches.values()) >= len(rids) - PLAIN_WINDOW  # only the first few went alone
    assert log.appender.stats.plain_publishes <= PLAIN_WINDOW


async def test_a_lone_command_or_a_few_are_plain_publishes(opened: tuple[JetStreamEventLog, _Seen]) -> None:
    log, seen = opened
    for i in range(3):
        await log.append(f"solo-{i}", _created(f"solo-{i}"), 0, uuid.uuid4().hex)
    few = await _append_all(log, [(f"few-{i}", _created(f"few-{i}"), 0) for i in range(PLAIN_WINDOW + 2)])
    assert all(isinstance(v, int) for v in few), few
    await _settle(log.nc)
    assert seen.batches() == {} and len(seen.headers) == 3 + PLAIN_WINDOW + 2  # a batch costs 4 fsyncs


async def test_a_stale_command_inside_a_batch_fails_alone(opened: tuple[JetStreamEventLog, _Seen]) -> None:
    log, seen = opened
    _small_batches(log)
    first = await log.append("old", _created("old"), 0, uuid.uuid4().hex)
    blocker = asyncio.ensure_future(log.append("lead", _created("lead"), 0, uuid.uuid4().hex))
    await asyncio.sleep(0)  # the lead is in flight: what follows waits and goes as one batch
    items = [(f"n-{i}", _created(f"n-{i}"), 0) for i in range(5)]
    items.insert(2, ("old", _created("old"), 0))  # stale: "old" is at `first`, not 0
    results = await _append_all(log, items)
    await blocker
    assert isinstance(results[2], StaleStateError)
    assert all(isinstance(r, int) for i, r in enumerate(results) if i != 2), results
    for (rid, _, _), r in zip(items, results, strict=True):
        if rid != "old":
            assert (await log.load(rid))[1] == r
    assert (await log.load("old"))[1] == first  # nothing of the stale command was stored
    await _settle(log.nc)
    assert log.appender.stats.resubmitted == len(items)
    assert log.appender.stats.batches == 0  # the rejected batch stored nothing


async def test_a_repeated_command_id_is_stored_once(opened: tuple[JetStreamEventLog, _Seen]) -> None:
    """A command sent again (same id, same fence) inside a batch is refused alone: nats-server 2.15.1
    checks the fence before its duplicate window, so the repeat is stale, and its neighbours land."""
    log, _ = opened
    _small_batches(log)
    events = _created("dup")
    first = await log.append("dup", events, 0, "cmd-1")
    blocker = asyncio.ensure_future(log.append("lead", _created("lead"), 0, uuid.uuid4().hex))
    await asyncio.sleep(0)
    again, other = await asyncio.gather(
        log.append("dup", events, 0, "cmd-1"),
        log.append("other", _created("other"), 0, uuid.uuid4().hex),
        return_exceptions=True,
    )
    await blocker
    assert isinstance(again, StaleStateError), again
    assert len(await log.rollout_entries("dup", first + 100)) == len(events)
    assert (await log.load("dup"))[1] == first
    assert (await log.load("other"))[1] == other


async def test_a_repeated_unfenced_message_is_stored_once_in_a_batch(opened: tuple[JetStreamEventLog, _Seen]) -> None:
    """Inside a batch a message id already in the duplicate window rejects the batch (10201); sent
    alone, the server answers "duplicate" with the first sequence."""
    log, _ = opened
    _small_batches(log)
    events = _created("undup")
    first = await log.appender.send(log.appender.command(events, None, "cmd-u"))
    blocker = asyncio.ensure_future(log.append("lead", _created("lead"), 0, uuid.uuid4().hex))
    await asyncio.sleep(0)
    again, other = await asyncio.gather(
        log.appender.send(log.appender.command(events, None, "cmd-u")),
        log.append("other", _created("other"), 0, uuid.uuid4().hex),
    )
    await blocker
    assert again == first
    assert len(await log.rollout_entries("undup", first + 100)) == len(events)
    assert (await log.load("other"))[1] == other
    assert log.appender.stats.resubmitted == 2


async def test_a_batch_over_the_limits_is_split(opened: tuple[JetStreamEventLog, _Seen]) -> None:
    log, seen = opened
    log.appender.max_messages = 7
    log.appender.plain_window = 1
    rids = [f"big-{i}" for i in range(40)]
    versions = await _append_all(log, [(rid, _created(rid), 0) for rid in rids])
    assert all(isinstance(v, int) for v in versions), versions
    await _settle(log.nc)
    sizes = list(seen.batches().values())
    assert len(sizes) >= 5 and max(sizes) <= 7  # 39 waiting commands, at most 7 messages a batch
    for rid, version in zip(rids, versions, strict=True):
        assert (await log.load(rid))[1] == version


async def test_an_event_over_max_payload_fails_alone(opened: tuple[JetStreamEventLog, _Seen]) -> None:
    log, _ = opened
    _small_batches(log)
    huge = decider.decide(None, CreateRollout(rollout_id="huge", input="x" * (log.nc.max_payload + 1)), NOW)
    blocker = asyncio.ensure_future(log.append("lead", _created("lead"), 0, uuid.uuid4().hex))
    await asyncio.sleep(0)
    results = await _append_all(log, [("huge", huge, 0), ("fine", _created("fine"), 0)])
    await blocker
    assert isinstance(results[0], InvalidInputError) and "max_payload" in str(results[0])
    assert isinstance(results[1], int)


def _stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Wait until every thread of ``pid`` is stopped (``T`` in /proc/<pid>/task/*/stat)."""
    deadline = time.monotonic() + timeout_s
    tasks = Path(f"/proc/{pid}/task")
    while time.monotonic() < deadline:
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
        if all(state == "T" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"nats-server pid {pid} did not stop within {timeout_s} s")


async def test_nats_going_away_mid_batch_is_service_unavailable(tmp_path: Path) -> None:
    """The server stops answering (SIGSTOP) while a batch is in flight, then is killed (SIGKILL):
    every command of the batch gets ``ServiceUnavailableError``, and after a restart every command
    acknowledged before (plain and batched) is in the log, and nothing is doubled. Stopping first
    makes it certain the batch's commit is never answered (a bare SIGKILL can lose the race)."""
    settings = Settings(state_dir=tmp_path, namespace="gone")
    url, pid, _ = await ensure_nats(settings, tmp_path)
    assert pid
    try:
        nc = await connect_nats(url)
        await apply_streams(nc, settings)
        log = JetStreamEventLog(nc, settings, lambda: NOW)
        log.js = nc.jetstream(timeout=1.0)
        log.appender.timeout_s = 1.0
        _small_batches(log)
        acked = {"kept": await log.append("kept", _created("kept"), 0, uuid.uuid4().hex)}
        before = [(f"a-{i}", _created(f"a-{i}"), 0) for i in range(4)]
        lead = asyncio.ensure_future(log.append("lead", _created("lead"), 0, uuid.uuid4().hex))
        await asyncio.sleep(0)
        acked.update(zip([b[0] for b in before], await _append_all(log, before), strict=True))
        acked["lead"] = await lead
        assert all(isinstance(v, int) for v in acked.values()), acked
        assert log.appender.stats.batches >= 1  # some of the acknowledged commands went as a batch
        os.kill(pid, signal.SIGSTOP)
        await asyncio.to_thread(_stopped, pid)  # kill() returns before every thread has stopped: on a busy machine
        rids = ["lead2", *(f"w-{i}" for i in range(4))]  # the server still stored a publish after it
        waiting = [asyncio.ensure_future(log.append(r, _created(r), 0, uuid.uuid4().hex)) for r in rids]
        await asyncio.sleep(0.2)  # the lead's publish and the batch of the other four are written
        os.kill(pid, signal.SIGKILL)
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, ServiceUnavailableError) for r in results), results
        await nc.close()
        url, _, _ = await ensure_nats(settings, tmp_path)  # the same store directory
        nc = await connect_nats(url)
        log = JetStreamEventLog(nc, settings, lambda: NOW)
        for rid, version in acked.items():
            assert (await log.load(rid))[1] == version
        for rid in [*rids, *acked]:
            assert len(await log.rollout_entries(rid, 10_000)) <= 1  # never doubled
        await nc.close()
    finally:
        await stop_nats(tmp_path)


async def test_the_pinned_server_checks_fences_against_the_stream_before_the_batch(namespace: Settings) -> None:
    """Why two commands of one rollout never share a batch: nats-server 2.15.1 accepts both when
    each expects the rollout's version before the batch, though the first changes it."""
    nc = await connect_nats(namespace.nats_url or "")
    try:
        prefix, rid = namespace.subject_prefix, "twice"
        fence = {
            "Nats-Expected-Last-Subject-Sequence": "0",
            "Nats-Expected-Last-Subject-Sequence-Subject": f"{prefix}.r.{rid}.>",
        }
        await nc.publish(
            f"{prefix}.r.{rid}.q", b"{}", headers={**fence, "Nats-Batch-Id": "b1", "Nats-Batch-Sequence": "1"}
        )
        commit = {**fence, "Nats-Batch-Id": "b1", "Nats-Batch-Sequence": "2", "Nats-Batch-Commit": "1"}
        reply = json.loads((await nc.request(f"{prefix}.r.{rid}.e", b"{}", headers=commit, timeout=5)).data)
        assert reply.get("count") == 2 and "error" not in reply, reply
    finally:
        await nc.close()


class _Unreadable:
    def decode(self, data: bytes) -> Any:
        raise msgspec.DecodeError("not an ack")


class _Broken:
    def decode(self, data: bytes) -> Any:
        raise RuntimeError("a bug in the appender")


@pytest.mark.parametrize(("decoder", "error"), [(_Unreadable(), ServiceUnavailableError), (_Broken(), RuntimeError)])
async def test_a_batch_whose_ack_fails_answers_every_command(
    opened: tuple[JetStreamEventLog, _Seen], monkeypatch: pytest.MonkeyPatch, decoder: Any, error: type
) -> None:
    """Every command of a batch gets an answer, also when its ack cannot be read or handling it
    raises (an appender that left them waiting hung a whole APO run in CI), and the log goes on."""
    log, _ = opened
    _small_batches(log)
    monkeypatch.setattr(appender, "_ack_decoder", decoder)
    blocker = asyncio.ensure_future(log.append("lead", _created("lead"), 0, uuid.uuid4().hex))
    await asyncio.sleep(0)
    results = await asyncio.wait_for(_append_all(log, [(f"u-{i}", _created(f"u-{i}"), 0) for i in range(4)]), 10)
    await blocker
    assert all(isinstance(r, error) for r in results), results
    monkeypatch.undo()
    assert isinstance(await log.append("after", _created("after"), 0, uuid.uuid4().hex), int)
    assert log.appender._writer is None and not log.appender._pending


async def test_at_durability_interval_concurrent_commands_go_as_plain_publishes(namespace: Settings) -> None:
    """At ``interval`` a plain publish costs no fsync and an atomic batch still costs 3 and ~3 ms to
    commit (nats-server 2.15.1), so the appender never batches there: the same 60 concurrent
    creates that share batches at ``fsync`` (the test above) all go as plain publishes."""
    settings = msgspec.structs.replace(namespace, durability="interval")
    nc = await connect_nats(settings.nats_url or "")
    seen = _Seen()
    sub = await nc.subscribe(f"{settings.subject_prefix}.>", cb=seen.cb)
    try:
        log = _small_batches(JetStreamEventLog(nc, settings, lambda: NOW))
        rids = [f"iv-{i}" for i in range(60)]
        versions = await _append_all(log, [(rid, _created(rid), 0) for rid in rids])
        assert all(isinstance(v, int) for v in versions) and len(set(versions)) == len(rids), versions
        for rid, version in zip(rids, versions, strict=True):
            assert (await log.load(rid))[1] == version
        await _settle(nc)
        assert seen.batches() == {}, "an atomic batch was sent at durability interval"
        assert log.appender.stats.plain_publishes == len(rids)
    finally:
        await sub.unsubscribe()
        await nc.close()


async def test_publish_acked_answers_as_nats_pys_publish(opened: tuple[JetStreamEventLog, _Seen]) -> None:
    """``publish_acked`` decodes the ack itself: each error answer the server gives a plain publish
    (an expected-sequence, expected-stream or expected-message-id mismatch, no stream for the
    subject) is raised as nats-py's ``JetStreamContext.publish`` raises it, the same class with the
    same codes and text, and an ack (a duplicate too) reads the same."""
    import nats.js.errors

    log, _ = opened
    prefix = log.prefix

    async def both(subject: str, headers: dict[str, str]) -> list[Any]:
        out: list[Any] = []
        for call in ("ours", "nats-py"):
            try:
                if call == "ours":
                    _, dup = await appender.publish_acked(log.nc, subject, b"{}", dict(headers), 5.0)
                else:
                    dup = bool((await log.js.publish(subject, b"{}", headers=dict(headers))).duplicate)
                out.append(("ack", dup))
            except Exception as e:  # compared below
                codes = (getattr(e, "code", None), getattr(e, "err_code", None), getattr(e, "description", None))
                out.append((type(e), codes))
        return out

    subject = f"{prefix}.r.ro-pub.e"
    first = await appender.publish_acked(log.nc, subject, b"{}", {"Nats-Msg-Id": "m-1"}, 5.0)
    assert first[1] is False
    cases: list[tuple[str, dict[str, str]]] = [
        (subject, {"Nats-Msg-Id": "m-1"}),  # a duplicate: both read duplicate=True
        (subject, {"Nats-Expected-Last-Subject-Sequence": str(first[0] + 7)}),
        (
            subject,
            {
                "Nats-Expected-Last-Subject-Sequence": "0",
                "Nats-Expected-Last-Subject-Sequence-Subject": f"{prefix}.r.ro-pub.>",
            },
        ),
        (subject, {"Nats-Expected-Stream": "not-this-stream"}),
        (subject, {"Nats-Expected-Last-Msg-Id": "not-the-last"}),
        (subject, {"Nats-Expected-Last-Sequence": "999999"}),
        ("no-stream-takes.this", {}),
    ]
    for subj, headers in cases:
        ours, theirs = await both(subj, headers)
        assert ours == theirs, (headers, ours, theirs)
        assert ours[0] != "ack" or ours[1] is True or "Nats-Msg-Id" not in headers
        if "Nats-Msg-Id" not in headers:
            assert ours[0] != "ack", headers
            assert issubclass(ours[0], nats.js.errors.Error)
