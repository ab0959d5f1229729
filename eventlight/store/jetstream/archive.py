"""The archive stream and reading archive + hot stream as one ordered log.

With ``Settings.retention_s`` set, ``apply_streams`` creates ``EL_<NS>_ARCHIVE``
(``_data/streams/004_archive.json``): JetStream itself sources every event of the hot stream
``EL_<NS>`` into it, transformed onto four subjects (``elarc.<ns>.{r,s,res,w}``), so its
per-subject state stays constant however many rollouts it holds. Each archived message keeps its
origin in the ``Nats-Stream-Source`` header (``EL_<NS> <sequence> <filters> <transforms> <original
subject> <hash>``, nats-server 2.15). Retired rollouts (``retire``) are listed on the archive's own
subject ``elarc.<ns>.retired`` (the ledger), one message per retirement batch.

``scan_log`` reads the archive in order (positions and subjects from the header, a position seen
twice kept once), then the hot stream after the last position the archive had: one ordered log by
original stream sequence. Only subjects of the layout (``layout``) are archived: a foreign message
at a position the archive already covers is read from neither.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from nats.js.api import ConsumerConfig, DeliverPolicy

from eventlight.core.errors import ServiceUnavailableError
from eventlight.store.jetstream.nats_errors import JsNotFoundError, nats_errors

if TYPE_CHECKING:
    from eventlight.store.jetstream.log import JetStreamEventLog

SOURCE_HEADER = "Nats-Stream-Source"
SCAN_IDLE_S = 10.0
"""How long a scan waits for the next message of a range it knows is stored."""


def source_position(headers: dict[str, str] | None) -> tuple[int, str] | None:
    """``(original stream sequence, original subject)`` of an archived message, or ``None`` (a
    message the archive holds itself, such as the ledger)."""
    value = (headers or {}).get(SOURCE_HEADER)
    parts = value.split(" ") if value else []
    if len(parts) < 5 or not parts[1].isdigit():
        return None
    return int(parts[1]), parts[4]


async def _next(sub: Any, messages: Any, server: str) -> Any:
    if sub.pending_msgs > 0:
        return await messages.__anext__()
    try:
        async with asyncio.timeout(SCAN_IDLE_S):
            return await messages.__anext__()
    except TimeoutError as e:
        raise ServiceUnavailableError(server, f"no message for {SCAN_IDLE_S:g} s while reading the stream") from e


async def ordered(log: JetStreamEventLog, stream: str, subject: str, after: int, until: int) -> AsyncIterator[Any]:
    """The messages of ``stream`` on ``subject`` with stream sequences in ``(after, until]``, read with
    an ordered consumer (ephemeral, flow-controlled; JetStream's way to read a stream fast, in order).

    Raises:
        ServiceUnavailableError: NATS did not answer.
    """
    if until <= after:
        return
    cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after + 1)
    server = log.server()
    with nats_errors(server, f"reading {stream}"):
        sub = await log.js.subscribe(subject, ordered_consumer=True, config=cfg, stream=stream)
        try:
            messages = sub.messages  # no task and timer per message, as next_msg has
            while True:
                msg = await _next(sub, messages, server)
                meta = msg.metadata
                if meta.sequence.stream > until:
                    return
                yield msg
                if meta.sequence.stream >= until or meta.num_pending == 0:
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def archive_head(log: JetStreamEventLog) -> int | None:
    """The archive stream's last sequence, or ``None`` when the namespace has no archive."""
    with nats_errors(log.server, f"stream info {log.settings.archive_stream_name}"):
        try:
            info = await log.js.stream_info(log.settings.archive_stream_name)
        except JsNotFoundError:
            return None
    return int(info.state.last_seq)


async def archived_until(log: JetStreamEventLog) -> int:
    """The last hot-stream position the archive holds (0: none, or no archive)."""
    with nats_errors(log.server, f"reading {log.settings.archive_stream_name}"):
        try:
            msg = await log.js.get_msg(log.settings.archive_stream_name, subject=f"{log.settings.archive_prefix}.*")
        except JsNotFoundError:
            return 0
    found = source_position(msg.headers)
    if found is None:  # the last message is the ledger's: look at the one before it
        return await _archived_before(log, int(msg.seq or 0))
    return found[0]


async def _archived_before(log: JetStreamEventLog, seq: int) -> int:
    while seq > 1:
        seq -= 1
        with nats_errors(log.server, f"reading {log.settings.archive_stream_name}"):
            try:
                msg = await log.js.get_msg(log.settings.archive_stream_name, seq=seq)
            except JsNotFoundError:
                continue
        found = source_position(msg.headers)
        if found is not None:
            return found[0]
    return 0


async def scan_log(log: JetStreamEventLog, from_seq: int, until: int) -> AsyncIterator[tuple[int, str, bytes]]:
    """Archive + hot stream as one log after ``from_seq`` up to ``until``, in order, as
    ``(position, subject without the el.<ns>. prefix, payload)`` (see the module docstring).

    Raises:
        ServiceUnavailableError: NATS did not answer.
    """
    cut = len(log.prefix) + 1
    last = from_seq
    head = await archive_head(log)
    if head and await archived_until(log) > from_seq:
        async for msg in ordered(log, log.settings.archive_stream_name, f"{log.settings.archive_prefix}.>", 0, head):
            found = source_position(msg.headers)
            if found is None or found[0] <= last:
                continue  # the ledger, or a position already read (a source resumed twice)
            if found[0] > until:
                break
            last = found[0]
            yield last, found[1][cut:], msg.data
    async for msg in ordered(log, log.stream, f"{log.prefix}.>", last, until):
        yield msg.metadata.sequence.stream, msg.subject[cut:], msg.data


class _Retired(msgspec.Struct, frozen=True):
    """A ledger entry: rollouts retired together, and when."""

    rollout_ids: list[str]
    time: float
    type: str = "rollouts_retired"


_retired_decoder = msgspec.json.Decoder(_Retired)


class RetiredLedger:
    """The rollouts retired from the hot stream, read from the archive's ledger subject when a
    rollout is not found (kept in memory from then on, read on from where it left)."""

    def __init__(self, log: JetStreamEventLog):
        self.log = log
        self.ids: set[str] = set()
        self.read_until = 0

    @property
    def subject(self) -> str:
        return f"{self.log.settings.archive_prefix}.retired"

    async def record(self, rollout_ids: list[str], time: float) -> None:
        """Append one ledger entry (before the rollouts are purged from the hot stream)."""
        data = msgspec.json.encode(_Retired(rollout_ids=rollout_ids, time=time))
        with nats_errors(self.log.server, f"publish to {self.subject}"):
            await self.log.js.publish(self.subject, data, stream=self.log.settings.archive_stream_name)
        self.ids.update(rollout_ids)

    async def contains(self, rollout_id: str) -> bool:
        """Whether ``rollout_id`` was retired (``False`` when the namespace has no archive)."""
        if rollout_id in self.ids:
            return True
        stream = self.log.settings.archive_stream_name
        with nats_errors(self.log.server, f"reading {self.subject}"):
            try:
                last = int((await self.log.js.get_msg(stream, subject=self.subject)).seq or 0)
            except JsNotFoundError:  # no archive, or nothing retired yet
                return False
        if last > self.read_until:
            async for msg in ordered(self.log, stream, self.subject, self.read_until, last):
                with contextlib.suppress(msgspec.DecodeError):
                    self.ids.update(_retired_decoder.decode(msg.data).rollout_ids)
            self.read_until = last
        return rollout_id in self.ids
