"""Reads of the JetStream log: direct gets where the stream has one replica; resources read with a claim.

``JetStreamEventLog`` reads a rollout's events, a span head, a resources snapshot and the latest
resources with JetStream's direct get (the stored message as it is) when the stream has one
replica; on a replicated stream a follower could answer a direct get from behind the leader, so
every read goes to the leader's ``STREAM.MSG.GET``. Checked here: on one stream, the two paths give the same
loads, heads, snapshots (and the same "not found"), and a replicated stream gets the leader's.

``dequeue_rollout(read_resources=True)`` sends the resources read with the claim's append, so
``claimed_resources`` then sends nothing (what it returns is checked on both backends in
``test_store_contract``).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from eventlight.core.types import PromptTemplate, Span
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.log import JetStreamEventLog


async def test_the_streams_own_replicas_decide(namespace: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct gets on the one-replica stream; the leader's reads for a replicated stream (whatever
    this process's settings say) and for a stream that does not answer. The 3-node cluster test
    (``test_cluster_faults``) checks the replicated case on a real R3 stream."""
    async with JetStreamLightningStore(namespace) as store:
        log = store.log
        assert log is not None and log.direct_gets  # learnt at start: this stream has one replica
        real = log.js.stream_info

        async def replicated(name: str, *args: Any, **kwargs: Any) -> Any:
            info = await real(name, *args, **kwargs)
            info.config.num_replicas = 3
            return info

        monkeypatch.setattr(log.js, "stream_info", replicated)
        await log.learn_replicas()
        assert not log.direct_gets
        monkeypatch.setattr(log.js, "stream_info", real)
        await log.learn_replicas()
        assert log.direct_gets
        assert store.nc is not None
        elsewhere = JetStreamEventLog(store.nc, msgspec.structs.replace(namespace, namespace="nostreamhere"), time.time)
        await elsewhere.learn_replicas()
        assert not elsewhere.direct_gets


async def _reads(log: JetStreamEventLog, rids: list[str], aids: list[str], res_id: str) -> list[Any]:
    out: list[Any] = []
    for rid, aid in zip(rids, aids, strict=True):
        state, version = await log.load(rid)
        out.append((state, version, await log.span_head(rid, aid), await log.span_counter(rid, aid)))
    out.append(await log.resources(res_id))
    out.append(await log.resources("rs-nosuch"))
    out.append(await log.resources(None))
    out.append(await log.last_event(f"{log.prefix}.r.ro-nosuch.>"))
    out.append(await log.span_counter(rids[0], "at-nosuch"))
    log.forget_latest_resources()
    out.append(await log.latest_resources())
    out.append([seq for seq, _ in [item async for item in log.read(0)]])
    for rid in rids:  # each state event's next one, past a span batch; none after the last
        _, version = await log.load(rid)
        out.append([await log.state_event_after(rid, seq) for seq in (0, 1, version - 1, version)])
    out.append(await log.state_event_after("ro-nosuch", 0))
    return out


async def test_direct_and_leader_reads_agree(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace) as store:
        res = await store.add_resources({"prompt": PromptTemplate(template="{x}")})
        await store.update_resources(res.resources_id, {"prompt": PromptTemplate(template="{y}")})
        rids, aids = [], []
        for i in range(3):
            started = await store.start_rollout({"i": i})
            rids.append(started.rollout_id)
            aids.append(started.attempt.attempt_id)
        span = Span(
            rollout_id=rids[0],
            attempt_id=aids[0],
            sequence_id=1,
            trace_id="0" * 32,
            span_id="1" * 16,
            parent_id=None,
            name="s",
            attributes={"k": "v"},
        )
        await store.add_spans_numbered(rids[0], aids[0], [span])
        await store.update_attempt(rids[1], aids[1], status="succeeded")

        log = store.log
        assert log is not None
        assert log.direct_gets
        direct = await _reads(log, rids, aids, res.resources_id)
        log.direct_gets = False
        leader = await _reads(log, rids, aids, res.resources_id)
    assert direct == leader
    assert direct[3].version == 2  # the updated snapshot, through both paths
    assert direct[4] is None and direct[6] is None  # an unknown id, an empty subject
    assert direct[0][2].has_spans and not direct[1][2].has_spans
    after = direct[-4:-1]
    assert [x[-1] for x in after] == [None, None, None] and direct[-1] is None
    assert [x[0] is not None and x[0][1].__class__.__name__ for x in after] == ["RolloutCreated"] * 3
    assert after[1][2] is not None and after[1][2][1].__class__.__name__ == "AttemptUpdated"


async def test_the_resources_read_leaves_with_the_claim(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace) as store:
        res = await store.add_resources({"prompt": PromptTemplate(template="{x}")})
        for i in range(2):
            await store.enqueue_rollout({"i": i}, resources_id=res.resources_id)
        assert store.nc is not None
        stats = store.nc.stats
        claimed = await store.dequeue_rollout(worker_id="w", read_resources=True)
        assert claimed is not None
        sent = stats["out_msgs"]
        found = await store.claimed_resources(claimed)
        assert found is not None and found.resources_id == res.resources_id
        assert stats["out_msgs"] == sent  # nothing more: the read went out with the claim
        plain = await store.dequeue_rollout(worker_id="w")
        assert plain is not None
        sent = stats["out_msgs"]
        assert await store.claimed_resources(plain) == found
        assert stats["out_msgs"] == sent + 1  # without it, a read of its own


async def test_the_queue_ack_leaves_with_the_next_pull(namespace: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner's finish acknowledges its queue entry, and its next dequeue's pull goes out in the
    same write (one write a rollout fewer); an ack still in flight when the store closes is sent."""
    async with JetStreamLightningStore(namespace) as store:
        for i in range(3):
            await store.enqueue_rollout({"i": i})
        first = await store.dequeue_rollout(worker_id="w", wait_s=1.0)
        assert first is not None and store.nc is not None
        transport = store.nc._transport  # nats-py 2.16's writer: one call per write to the socket
        real = transport.writelines
        writes: list[bytes] = []

        def recording(payload: list[bytes]) -> None:
            writes.append(b"".join(bytes(p) for p in payload))
            real(payload)

        monkeypatch.setattr(transport, "writelines", recording)
        await store.update_attempt(first.rollout_id, first.attempt.attempt_id, status="succeeded")
        second = await store.dequeue_rollout(worker_id="w", wait_s=1.0)
        assert second is not None
        acks = [w for w in writes if b"$JS.ACK." in w]
        assert len(acks) == 1 and b"$JS.API.CONSUMER.MSG.NEXT." in acks[0], writes
        await store.update_attempt(second.rollout_id, second.attempt.attempt_id, status="succeeded")
    async with JetStreamLightningStore(namespace) as other:
        assert other.log is not None
        info = await other.log.js.consumer_info(other.log.stream, "runners")
        assert info.num_ack_pending == 0 and info.num_pending == 1  # both acknowledged; the third waits
