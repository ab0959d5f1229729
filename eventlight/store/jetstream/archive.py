"""The archive stream and reading archive + hot stream as one ordered log.

With ``Settings.retention_s`` set, ``apply_streams`` creates ``EL_<NS>_ARCHIVE``
(``_data/streams/004_archive.json``): JetStream itself sources every rollout and span event of the
hot stream ``EL_<NS>`` (``el.<ns>.r.<rid>.*`` and ``el.<ns>.s.<rid>.*``, what retirement purges)
into it, transformed onto one subject per kind (``elarc.<ns>.r``, ``elarc.<ns>.s``), so its
per-subject state stays constant however many rollouts it holds. Each archived message keeps its
origin in the ``Nats-Stream-Source`` header (``EL_<NS> <sequence> <filters> <transforms> <original
subject> <hash>``, nats-server 2.15). Retired rollouts (``retire``) are listed on the archive's own
subject ``elarc.<ns>.retired`` (the ledger), one message per retirement batch.

The source has one subject filter (``el.<ns>.*.*.*``). With one filter per kind (four, as before),
nats-server 2.15.1 sourced and took publishes 10-30x slower once rollouts had several messages
each (2,600 against 33,000 publishes/s, 100,000 messages archived in 68-95 s against 3 s;
``bench/README.md``). Resources and worker events (``el.<ns>.res.*``, ``el.<ns>.w.*``) are not
archived: nothing purges them from the hot stream.

``scan_log`` merges, by original stream sequence, the archive's rollout and span events up to the
last position it holds (``archived_until``; a position seen twice kept once) with the hot stream's
resources and worker events up to there (batched direct gets), then reads the hot stream after it:
one ordered log. An archive made by an older eventlight also holds resources and worker events
(``elarc.<ns>.res`` / ``.w``); those are skipped, as the hot stream has them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from nats.js.api import ConsumerConfig, DeliverPolicy

from eventlight.core.errors import ServiceUnavailableError
from eventlight.store.futures import cancels, raise_if_cancelled
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
    """The last hot-stream position the archive holds (0: none, or no archive): every rollout and
    span event at or before it is archived (the source delivers in order), so retirement may purge
    them."""
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


async def archive_lag(log: JetStreamEventLog) -> int:
    """Hot-stream positions between the last one the archive holds and the hot stream's last
    rollout or span event (0: caught up, or nothing to archive).

    Raises:
        ServiceUnavailableError: NATS did not answer.
    """
    archived = await archived_until(log)
    with nats_errors(log.server, f"reading {log.stream}"):
        try:
            msg = await log.js.get_msg(log.stream, subject=f"{log.prefix}.*.*.*")
        except JsNotFoundError:
            return 0
    return max(0, int(msg.seq or 0) - archived)


def _is_archived(subject: str, prefix: str) -> bool:
    """Whether the archive's source takes ``subject`` (five tokens: ``el.<ns>.<kind>.<id>.<x>``)."""
    return subject.startswith(prefix + ".") and subject.count(".") == 4


async def _archived_events(
    log: JetStreamEventLog, from_seq: int, until: int, head: int
) -> AsyncGenerator[tuple[int, str, bytes]]:
    """The archive's rollout and span events with positions in ``(from_seq, until]``, ascending."""
    last = from_seq
    async for msg in ordered(log, log.settings.archive_stream_name, f"{log.settings.archive_prefix}.>", 0, head):
        found = source_position(msg.headers)
        if found is None or found[0] <= last or not _is_archived(found[1], log.prefix):
            continue  # the ledger, a position already read (a source resumed twice), an old archive's res/w
        if found[0] > until:
            break
        last = found[0]
        yield last, found[1], msg.data
        if last >= until:
            return


DIRECT_BATCH = 256
"""Messages per batched direct get (nats-server >= 2.11)."""


async def direct_range(
    log: JetStreamEventLog, subject: str, from_seq: int, until: int, batch: int = DIRECT_BATCH
) -> AsyncGenerator[tuple[int, str, bytes]]:
    """The hot stream's messages on ``subject`` (one filter, wildcards allowed) with sequences in
    ``(from_seq, until]``, ascending, as ``(sequence, subject, payload)``: batched direct gets
    (``next_by_subj`` + ``batch`` + ``up_to_seq``), each answered by up to ``batch`` messages and an
    end-of-batch status, so memory stays at one batch however long the range.

    Raises:
        ServiceUnavailableError: NATS did not answer, or answered an error status.
    """
    nc = log.nc
    api = f"$JS.API.DIRECT.GET.{log.stream}"
    seq = from_seq
    inbox = await nc.subscribe(nc.new_inbox())
    try:
        while seq < until:
            request = msgspec.json.encode({"seq": seq + 1, "next_by_subj": subject, "batch": batch, "up_to_seq": until})
            with nats_errors(log.server, f"reading {subject}"):
                await nc.publish(api, request, reply=inbox.subject)
                got = 0
                while True:
                    status, headers, msg = await _next_answer(log, inbox, subject)
                    if status == "404":
                        return  # nothing more on the subject
                    if status == "204":  # end of this batch
                        break
                    seq = int(headers["Nats-Sequence"])
                    got += 1
                    yield seq, headers["Nats-Subject"], msg.data
            if got < batch or headers.get("Nats-Num-Pending") == "0":
                return
    except TimeoutError as e:
        raise ServiceUnavailableError(log.server(), f"no answer for {SCAN_IDLE_S:g} s reading {subject}") from e
    finally:
        with contextlib.suppress(Exception):
            await inbox.unsubscribe()


async def _next_answer(log: JetStreamEventLog, inbox: Any, what: str) -> tuple[str | None, dict[str, str], Any]:
    """The next message of a direct get's answer on ``inbox``, with its status: ``None`` for a
    stored message, ``"204"`` at the end of a batch, ``"404"`` when nothing (more) matches.

    Raises:
        ServiceUnavailableError: Another status (named with ``what``, the subject asked for).
        TimeoutError: No message within ``SCAN_IDLE_S``.
    """
    base = cancels()
    msg = await inbox.next_msg(timeout=SCAN_IDLE_S)
    raise_if_cancelled(base)  # a cancel nats-py's wait_for swallowed
    headers = msg.headers or {}
    status = headers.get("Status")
    if status not in (None, "404", "204"):
        raise ServiceUnavailableError(log.server(), f"direct get of {what} answered {headers}")
    return status, headers, msg


MULTI_LAST_FILTERS = 64
"""Subject filters per ``multi_last`` direct get (each ``r.<rid>.>`` answers up to two subjects)."""


async def direct_last(
    log: JetStreamEventLog, filters: list[str], up_to_seq: int, per_request: int = MULTI_LAST_FILTERS
) -> AsyncGenerator[tuple[int, str, bytes]]:
    """The hot stream's last message on each subject that ``filters`` match, at or before
    ``up_to_seq``, as ``(sequence, subject, payload)``: direct gets with ``multi_last`` +
    ``up_to_seq`` (nats-server >= 2.11), ``per_request`` filters each, every one answered by the
    messages found and an end-of-batch status (404: none).

    Raises:
        ServiceUnavailableError: NATS did not answer, or answered an error status.
    """
    nc = log.nc
    api = f"$JS.API.DIRECT.GET.{log.stream}"
    inbox = await nc.subscribe(nc.new_inbox())
    try:
        for i in range(0, len(filters), per_request):
            request = msgspec.json.encode({"multi_last": filters[i : i + per_request], "up_to_seq": up_to_seq})
            with nats_errors(log.server, "reading the last messages before a position"):
                await nc.publish(api, request, reply=inbox.subject)
                while True:
                    status, headers, msg = await _next_answer(log, inbox, f"{filters[i]}…")
                    if status is not None:  # none found / the end of this answer
                        break
                    yield int(headers["Nats-Sequence"]), headers["Nats-Subject"], msg.data
    except TimeoutError as e:
        raise ServiceUnavailableError(log.server(), f"no answer for {SCAN_IDLE_S:g} s reading last messages") from e
    finally:
        with contextlib.suppress(Exception):
            await inbox.unsubscribe()


async def _merge(
    a: AsyncIterator[tuple[int, str, bytes]], b: AsyncIterator[tuple[int, str, bytes]]
) -> AsyncIterator[tuple[int, str, bytes]]:
    """Two ascending iterators of ``(position, ...)`` as one, ascending."""
    x = await anext(a, None)
    y = await anext(b, None)
    while x is not None or y is not None:
        if y is None or (x is not None and x[0] < y[0]):
            assert x is not None
            yield x
            x = await anext(a, None)
        else:
            yield y
            y = await anext(b, None)


async def scan_log(log: JetStreamEventLog, from_seq: int, until: int) -> AsyncIterator[tuple[int, str, bytes]]:
    """Archive + hot stream as one log after ``from_seq`` up to ``until``, in order, as
    ``(position, subject without the el.<ns>. prefix, payload)`` (see the module docstring).

    Raises:
        ServiceUnavailableError: NATS did not answer.
    """
    cut = len(log.prefix) + 1
    last = from_seq
    head = await archive_head(log)
    archived = await archived_until(log) if head else 0
    if archived > from_seq:
        last = min(archived, until)
        async with (
            contextlib.aclosing(_archived_events(log, from_seq, last, head or 0)) as archive,
            # resources and worker events (four tokens): never archived, never purged
            contextlib.aclosing(direct_range(log, f"{log.prefix}.*.*", from_seq, last)) as others,
        ):
            async for position, subject, data in _merge(archive, others):
                yield position, subject[cut:], data
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
        return rollout_id in await self.read()

    async def read(self) -> set[str]:
        """Every retired rollout, the ledger read on from where it was left (empty when the
        namespace has no archive)."""
        stream = self.log.settings.archive_stream_name
        with nats_errors(self.log.server, f"reading {self.subject}"):
            try:
                last = int((await self.log.js.get_msg(stream, subject=self.subject)).seq or 0)
            except JsNotFoundError:  # no archive, or nothing retired yet
                return self.ids
        if last > self.read_until:
            async for msg in ordered(self.log, stream, self.subject, self.read_until, last):
                with contextlib.suppress(msgspec.DecodeError):
                    self.ids.update(_retired_decoder.decode(msg.data).rollout_ids)
            self.read_until = last
        return self.ids


ARCHIVED_ROLLOUTS_KEPT = 64
"""Retired rollouts whose archived events (span batches included) ``ArchivedRollouts`` keeps in
memory: a retired rollout never changes, so what was read stays true; twice the rollouts
``Subscription.collect`` reads at once, which reads a rollout's state events, then its spans."""


class ArchivedRollouts:
    """The events of retired rollouts, read back from the archive (``rollout_entries`` and
    ``span_entries`` of a rollout the hot stream no longer holds: ``Subscription.collect`` of a
    rollout retired before the subscription started).

    The archive has one subject per kind, so one rollout's events are found by reading the archive
    through (``_archived_events``): the rollouts asked for while a read runs are found together by
    the next one, and the last ``ARCHIVED_ROLLOUTS_KEPT`` rollouts read are kept, so the rollout's
    state events and then its attempts' span batches cost one read.
    """

    def __init__(self, log: JetStreamEventLog):
        self.log = log
        self.kept: dict[str, list[tuple[int, str, bytes]]] = {}
        self._asked: set[str] = set()
        self._lock = asyncio.Lock()

    async def entries(self, rollout_id: str) -> list[tuple[int, str, bytes]]:
        """The archived events of ``rollout_id`` (state and span events), ascending, as
        ``(original position, original subject, payload)``; empty when the archive has none.

        Raises:
            ServiceUnavailableError: NATS did not answer.
        """
        found = self.kept.get(rollout_id)
        if found is not None:
            return found
        self._asked.add(rollout_id)
        async with self._lock:
            found = self.kept.get(rollout_id)  # read by the read before ours
            if found is not None:
                return found
            wanted = self._asked | {rollout_id}  # a read that failed took ours out of ``_asked``
            self._asked = set()
            read = await self._read(wanted)
            for rid in wanted:
                self.kept[rid] = read.get(rid, [])
            while len(self.kept) > ARCHIVED_ROLLOUTS_KEPT:
                del self.kept[next(iter(self.kept))]
            return read.get(rollout_id, [])

    async def _read(self, wanted: set[str]) -> dict[str, list[tuple[int, str, bytes]]]:
        head = await archive_head(self.log)
        out: dict[str, list[tuple[int, str, bytes]]] = {}
        if not head:
            return out
        async with contextlib.aclosing(_archived_events(self.log, 0, 1 << 62, head)) as archived:
            async for position, subject, data in archived:
                rid = subject.split(".", 4)[3]
                if rid in wanted:
                    out.setdefault(rid, []).append((position, subject, data))
        return out
