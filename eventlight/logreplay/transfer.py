"""``eventlight export`` / ``eventlight import``: a slice of the log to a file and into another namespace.

The file is JSON lines: a header ``{"eventlight_export": 2, "namespace", "since", "until"}``, one
entry a line, ``{"seq", "subject", "data"}``, with ``subject`` below ``el.<ns>.`` and the payload
embedded verbatim (``data_b64`` for one that is not JSON), so an import appends exactly the bytes
the source holds, old event shapes included (readers upcast them), and last the count
``{"eventlight_export_entries": N}``. The file is written beside ``--out`` and renamed over it once
whole (``files.replacing``). Entries that are not eventlight events are written as stored and
counted (``ExportReport.non_events``; the CLI warns, naming ``eventlight import --skip-non-events``).
An import refuses a file whose last line is not that count, or whose count differs from the entries
it holds (one cut at a line boundary, say): it would append part of the slice as if it were all.
A format-1 file (written before the count) is imported with a warning that a cut one cannot be told.

Import checks every entry first: an entry that is not an eventlight event (a message the source's
projector dead-lettered, an event of a newer eventlight) refuses the file, saying how many there
are, unless ``skip_non_events`` leaves them out and counts them. It then finds what the target
already holds per aggregate (a rollout's subject tree, an attempt's span subject, a resources id,
a worker): an aggregate the target lacks is appended whole without a look; for one it has, the
digests of its stored messages are read once, and for a retired rollout those of its archived
ones (one read of the archive), and entries already there are skipped. It refuses the file,
appending nothing, when a rollout's entries would not fold to the source's history appended after
what the target holds: a rollout whose beginning (``RolloutCreated``) neither the target holds nor
the file brings first (a slice that starts inside it), one the target holds a later entry of than
an entry to append (by the file's order, or by the source position an earlier import recorded in
the ``Eventlight-Imported`` header), or a retired one. The rest is appended in file order under
the target's prefix, each with ``Nats-Msg-Id`` set to a digest of its subject and payload
(JetStream drops a repeat inside its duplicate window) and ``Eventlight-Imported: <source
namespace> <position>``. So importing the same file twice appends nothing the second time
(retired or not), and importing into a namespace that holds a slice of the same log up to some
position appends only the rest. Slices of one log go in in order: an export that starts after
position 0 records in its count line (``BEFORE``), for each rollout aggregate it holds, the position
and digest of its last entry before the slice, and an import refuses, up front, a slice whose first
entry of an aggregate it would append follows an entry the target does not hold (a gap), naming
the rollout and the positions missing. That entry is looked up in the source's hot stream, so a
rollout retired in the source, or one whose entry there is not an event, is not checked; nor is a
file written before the record (it is appended after the gap, and the gap is refused when it
comes, as a rollout the target holds later entries of).
"""

from __future__ import annotations

import base64
import hashlib
import logging
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from eventlight.core.errors import InvalidInputError
from eventlight.settings import Settings

FORMAT = 2
"""2: the file ends with ``{"eventlight_export_entries": N}``; 1 (still read): without it."""
ENTRIES = "eventlight_export_entries"
BEFORE = "before"
"""In the count line of a slice that starts after position 0: for each rollout aggregate the slice
holds (``r.<rid>.>``, ``s.<rid>.<aid>``), its last entry at or before ``since`` in the source, as
``[log position, digest]`` (none: it has none there, it is retired in the source, or that entry is
not an event). Older readers ignore it."""

log = logging.getLogger(__name__)


IMPORTED = "Eventlight-Imported"
"""The header of an imported message: ``<source namespace> <its position in the source's log>``."""

_NO_DATA = msgspec.Raw(b"null")


class _Entry(msgspec.Struct, omit_defaults=True):
    seq: int
    subject: str
    data: msgspec.Raw = _NO_DATA
    data_b64: str | None = None

    def payload(self) -> bytes:
        if self.data_b64 is not None:
            return base64.b64decode(self.data_b64)
        return bytes(self.data)


_entry = msgspec.json.Decoder(_Entry)
_enc = msgspec.json.Encoder()


def _is_json(data: bytes) -> bool:
    try:
        msgspec.json.decode(data, type=msgspec.Raw)
    except msgspec.DecodeError:
        return False
    return bool(data)


class ExportReport(NamedTuple):
    """What ``export_log`` wrote."""

    entries: int
    first: int
    """The log position of the first entry written (0: none)."""
    last: int
    non_events: list[int]
    """The log positions of entries written that are not eventlight events this version reads (a
    message the projector dead-lettered, an event of a newer eventlight): ``import_log`` refuses the
    file for them unless ``skip_non_events``."""


async def export_log(settings: Settings, out: Path, since: int, until: int | None) -> ExportReport:
    """Write entries after ``since`` up to ``until`` (default: the head now) of the namespace's log.

    Every entry is written as stored; those that are not eventlight events are counted too.

    Args:
        settings: The namespace, on ``settings.nats_url``, else on the embedded servers under
            ``settings.state_dir`` (``eventlight.logreplay.servers``: as ``eventlight export``
            finds them; none is started).
        out: The file to write (JSON lines).
        since, until: Log positions: entries after ``since`` up to ``until``.

    Returns:
        The entries written, the first and last positions, and the positions of non-events.

    Raises:
        ServiceUnavailableError: NATS cannot be reached or fails midway (``out`` is then left as
            it was: the file is written beside it and renamed over it once whole), or no URL is
            set and no embedded server runs.
        InvalidInputError: The namespace has no stream.
        OSError: ``out``'s folder cannot be written.
    """
    from eventlight.logreplay.files import replacing
    from eventlight.logreplay.servers import log_of

    n, first, last = 0, 0, 0
    non_events: list[int] = []
    aggregates: set[str] = set()  # the rollout aggregates of the slice
    async with log_of(settings, "eventlight-export") as log_:
        head = await log_.head_seq()
        until = head if until is None else min(until, head)
        header = {"eventlight_export": FORMAT, "namespace": settings.namespace, "since": since, "until": until}
        with replacing(out) as part, part.open("wb") as f:
            f.write(_enc.encode(header) + b"\n")
            async for seq, subject, data in log_.scan(since, until):
                entry = (
                    _Entry(seq, subject, data=msgspec.Raw(data))
                    if _is_json(data)
                    else _Entry(seq, subject, data_b64=base64.b64encode(data).decode())
                )
                f.write(_enc.encode(entry) + b"\n")
                n, first, last = n + 1, first or seq, seq
                if not _is_event(data):
                    non_events.append(seq)
                if since and _rollout_id(subject) is not None:
                    aggregates.add(_aggregate(subject))
            before = await _before(log_, sorted(aggregates), since) if aggregates else {}
            trailer: dict[str, Any] = {ENTRIES: n, BEFORE: before} if before else {ENTRIES: n}
            f.write(_enc.encode(trailer) + b"\n")  # last: a file without it was cut short
    return ExportReport(n, first, last, non_events)


async def _before(log_: Any, aggregates: list[str], since: int) -> dict[str, tuple[int, str]]:
    """``BEFORE``: each aggregate's last entry at or before ``since``, as ``(position, digest)``.

    Read from the hot stream (``archive.direct_last``); the retired ledger is read after it, so a
    rollout purged meanwhile (listed before it is purged) is left out rather than seen as new.
    """
    from eventlight.store.jetstream.archive import direct_last

    cut = len(log_.prefix) + 1
    last: dict[str, tuple[int, str, bytes]] = {}
    async for seq, subject, data in direct_last(log_, [f"{log_.prefix}.{a}" for a in aggregates], since):
        agg = _aggregate(subject[cut:])
        if seq > last.get(agg, (0, "", b""))[0]:  # r.<rid>.> answers for .q and .e
            last[agg] = (seq, subject[cut:], data)
    retired = await log_.retired.read()
    return {
        agg: (seq, _digest(subject, data))
        for agg, (seq, subject, data) in last.items()
        if _rollout_id(subject) not in retired and _is_event(data)
    }


def _is_event(data: bytes) -> bool:
    """Whether ``data`` is an eventlight event this version reads (what ``read_export`` checks)."""
    from eventlight.core.events import decode_event

    try:
        decode_event(data)
    except InvalidInputError:
        return False
    return True


def _aggregate(subject: str) -> str:
    """The subject filter of the aggregate an entry belongs to (below the prefix)."""
    parts = subject.split(".")
    if parts[0] == "r" and len(parts) >= 2:
        return f"r.{parts[1]}.>"
    return subject


def _digest(subject: str, data: bytes) -> str:
    return hashlib.sha256(subject.encode() + b"\x00" + data).hexdigest()[:40]


def read_export(path: Path, *, skip_non_events: bool = False) -> tuple[dict[str, Any], list[_Entry], list[_Entry]]:
    """The header (with the count line's ``BEFORE`` under that key), the entries and the entries left
    out (``skip_non_events``) of an export file.

    Args:
        path: A file ``eventlight export`` wrote.
        skip_non_events: Leave out, instead of refusing the file for, entries this eventlight does
            not read as events (a message the source's projector dead-lettered, an event of a newer
            eventlight); they are returned third.

    Raises:
        InvalidInputError: Not a file ``eventlight export`` wrote, an entry on a subject the layout
            does not give its event, (format 2) a last line that is not the entry count or a count
            that differs, or (without ``skip_non_events``) an entry that is not an event of this
            eventlight, saying how many there are (every entry is checked before any is used).
    """
    with path.open("rb") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    try:
        header = msgspec.json.decode(lines[0]) if lines else None
        if not isinstance(header, dict) or header.get("eventlight_export") not in (1, FORMAT):
            raise InvalidInputError(f"{path} is not an eventlight export (format 1 or {FORMAT})")
        counted = header["eventlight_export"] == FORMAT
        trailer = _trailer(lines[-1]) if counted and len(lines) > 1 else None
        if counted and trailer is None:
            raise InvalidInputError(
                f"{path} does not end with the entry count `eventlight export` writes last: "
                "the export was interrupted or the file cut short"
            )
        written = trailer[ENTRIES] if trailer is not None else None
        header[BEFORE] = msgspec.convert((trailer or {}).get(BEFORE, {}), dict[str, tuple[int, str]])
        entries = [_entry.decode(line) for line in lines[1 : -1 if counted else None]]
    except msgspec.DecodeError as e:
        raise InvalidInputError(f"{path} is not an eventlight export: {e}") from e
    kept: list[_Entry] = []
    left_out: list[tuple[_Entry, InvalidInputError]] = []
    for entry in entries:
        why = _check(path, entry)
        if why is None:
            kept.append(entry)
        else:
            left_out.append((entry, why))
    if left_out and not skip_non_events:
        first = left_out[0][1]
        raise InvalidInputError(
            f"{first}; {len(left_out)} of the {len(entries)} entries are not eventlight events this version reads "
            "(dead-lettered in the source, or from a newer eventlight): `eventlight import --skip-non-events` "
            "imports the others and counts these"
        ) from first.__cause__
    if counted and written != len(entries):
        raise InvalidInputError(f"{path} holds {len(entries)} entries where its export wrote {written}: cut or altered")
    if not counted:
        log.warning("%s is an export of format 1, without an entry count: a file cut short cannot be told", path)
    return header, kept, [entry for entry, _ in left_out]


def _trailer(line: bytes) -> dict[str, Any] | None:
    """An export's last line (the entry count, and ``BEFORE``), ``None`` if it is not that line."""
    try:
        last = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None
    count = last.get(ENTRIES) if isinstance(last, dict) else None
    return last if isinstance(count, int) and not isinstance(count, bool) else None


def _check(path: Path, entry: _Entry) -> InvalidInputError | None:
    """An entry must hold an event this eventlight reads (older shapes upcast) on the subject the
    layout gives it, so an import appends nothing the projector would dead-letter.

    Returns:
        ``None``, or why the entry is not an event this eventlight reads (naming its log position).

    Raises:
        InvalidInputError: An event on another subject than the layout gives it.
    """
    from eventlight.core.events import decode_event
    from eventlight.store.jetstream.layout import subject_for

    where = f"{path}: the entry at log position {entry.seq} ({entry.subject})"
    try:
        event = decode_event(entry.payload())
    except (InvalidInputError, ValueError) as e:  # ValueError: bad base64
        why = str(e) if isinstance(e, InvalidInputError) else f"not an eventlight event: {e}"  # says it once
        not_an_event = InvalidInputError(f"{where}: {why}")
        not_an_event.__cause__ = e
        return not_an_event
    expected = subject_for("", event)[1:]  # "r.<rid>.q", "s.<rid>.<aid>", "res.<id>", "w.<id>"
    if entry.subject != expected:
        raise InvalidInputError(f"{where} holds a {type(event).__name__} that belongs on {expected}")
    return None


class ImportReport(msgspec.Struct, kw_only=True):
    """What ``import_log`` did."""

    appended: int = 0
    present: int = 0
    """Entries the namespace already held (its hot stream, or its archive for a retired rollout)."""
    skipped: list[int] = msgspec.field(default_factory=list)
    """The source log positions of entries left out as not eventlight events (``skip_non_events``)."""


async def import_log(settings: Settings, path: Path, *, skip_non_events: bool = False) -> ImportReport:
    """Append an export file's entries to the namespace's log, skipping those it holds.

    Args:
        settings: The target namespace, on ``settings.nats_url``, else on the embedded servers
            under ``settings.state_dir`` (as ``export_log`` finds them).
        path: A file ``eventlight export`` wrote.
        skip_non_events: Leave out (and count) entries that are not eventlight events instead of
            refusing the file.

    Raises:
        InvalidInputError: Not an export file, an entry that is not an event on its subject, or
            entries of a rollout that would not fold to the source's history in the namespace
            (``_refuse_out_of_order``); nothing is appended then. The namespace has no stream.
        ServiceUnavailableError: NATS cannot be reached or refused an append, or no URL is set
            and no embedded server runs.
    """
    from eventlight.logreplay.servers import log_of
    from eventlight.store.jetstream.nats_errors import nats_errors

    header, entries, left_out = read_export(path, skip_non_events=skip_non_events)
    source = str(header.get("namespace", ""))
    report = ImportReport(skipped=[e.seq for e in left_out])
    async with log_of(settings, "eventlight-import") as log_:
        todo = await _plan(log_, path, entries, header)
        report.present = len(entries) - len(todo)
        for e, data, digest in todo:
            subject = f"{log_.prefix}.{e.subject}"
            with nats_errors(log_.server, f"publish to {subject}"):
                headers = {"Nats-Msg-Id": f"import:{digest}", IMPORTED: f"{source} {e.seq}"}
                ack = await log_.js.publish(subject, data, headers=headers)
            if ack.duplicate:
                report.present += 1
            else:
                report.appended += 1
    return report


async def _plan(
    log_: Any, path: Path, entries: list[_Entry], header: dict[str, Any]
) -> list[tuple[_Entry, bytes, str]]:
    """The entries to append, in file order, as ``(entry, payload, digest)``: those the namespace
    does not hold (its hot stream, or its archive for a retired rollout), each once.

    Raises:
        InvalidInputError: See ``_refuse_out_of_order``.
    """
    source = str(header.get("namespace", ""))
    held: dict[str, set[str]] = {}
    imported_up_to: dict[str, int] = {}  # rollout -> the highest source position imported into it
    for e in entries:
        agg = _aggregate(e.subject)
        if agg not in held:
            held[agg], up_to = await _held(log_, agg, source)
            if (rid := _rollout_id(e.subject)) is not None:
                imported_up_to[rid] = max(imported_up_to.get(rid, 0), up_to)
    ledger = await log_.retired.read()  # one read of the archive's ledger
    retired = {rid for rid in _rollouts(entries) if rid in ledger}
    for agg, digests in (await _archived(log_, retired) if retired else {}).items():
        held.setdefault(agg, set()).update(digests)
    todo: list[tuple[_Entry, bytes, str]] = []
    by_rollout: dict[str, list[tuple[_Entry, bool]]] = {}  # its entries in file order: (entry, held)
    firsts: dict[str, tuple[_Entry, bool]] = {}  # each aggregate's first entry: (entry, held)
    for e in entries:
        data = e.payload()
        digest = _digest(e.subject, data)
        agg, rid = _aggregate(e.subject), _rollout_id(e.subject)
        is_held = digest in held[agg]
        firsts.setdefault(agg, (e, is_held))
        if not is_held:
            held[agg].add(digest)  # a second copy in the file is present once the first is appended
            todo.append((e, data, digest))
        if rid is not None:
            by_rollout.setdefault(rid, []).append((e, is_held))
    gaps = _gaps(firsts, held, header, imported_up_to)
    await _refuse_out_of_order(log_, path, by_rollout, retired, imported_up_to, gaps)
    return todo


def _gaps(
    firsts: dict[str, tuple[_Entry, bool]],
    held: dict[str, set[str]],
    header: dict[str, Any],
    imported_up_to: dict[str, int],
) -> dict[str, tuple[_Entry, str]]:
    """Rollouts the file would continue after a gap: an aggregate whose first entry in the file is
    to be appended while its entry before the slice (``BEFORE``) is not in the namespace, so
    entries between what the namespace holds and the file's start would be missing.

    Returns:
        ``{rollout_id: (its first such entry, why)}``.
    """
    since = int(header.get("since") or 0)
    gaps: dict[str, tuple[_Entry, str]] = {}
    for agg, (e, is_held) in firsts.items():
        found = header[BEFORE].get(agg)
        rid = _rollout_id(e.subject)
        if found is None or is_held or found[1] in held[agg] or rid is None or rid in gaps:
            continue
        why = f"would be continued after a gap: {_missing(imported_up_to.get(rid, 0), found[0], agg, since)}"
        gaps[rid] = (e, why)
    return gaps


def _missing(up_to: int, position: int, aggregate: str, since: int) -> str:
    """The source positions a gap leaves out: after ``up_to`` (the last the namespace imported of
    the rollout; 0: unknown) up to ``position`` (the aggregate's last entry before the file)."""
    if not 0 < up_to < position:
        return f"its entries up to log position {position} ({aggregate}) are in neither the namespace nor this file"
    if up_to + 1 == position:
        what = f"its entry at log position {position} ({aggregate}) is"
    else:
        what = f"its entries at log positions {up_to + 1} to {position} ({aggregate}) are"
    return (
        f"{what} in neither the namespace nor this file, which starts after {since}: "
        f"import the slice `eventlight export --since {up_to} --until {since}` writes first"
    )


def _rollout_id(subject: str) -> str | None:
    """The rollout of an ``r.<rid>.*`` or ``s.<rid>.*`` subject (below the prefix), else ``None``."""
    parts = subject.split(".")
    return parts[1] if parts[0] in ("r", "s") and len(parts) >= 3 else None


def _rollouts(entries: list[_Entry]) -> list[str]:
    """The rollouts the entries belong to, each once, in file order."""
    return list(dict.fromkeys(rid for e in entries if (rid := _rollout_id(e.subject)) is not None))


async def _refuse_out_of_order(
    log_: Any,
    path: Path,
    rollouts: dict[str, list[tuple[_Entry, bool]]],
    retired: set[str],
    imported_up_to: dict[str, int],
    gaps: dict[str, tuple[_Entry, str]],
) -> None:
    """Refuse the file when entries of a rollout, appended after what the namespace holds, would
    not fold to the source's history:

    - the namespace does not hold the rollout's beginning (its ``RolloutCreated``) and the file
      does not bring it first (a slice that starts in the middle of the rollout: the projector
      drops events of a rollout it does not know, and a later import of the beginning would land
      after them);
    - the namespace holds a later entry of the rollout than one the file would append: one the file
      also has (an import of a slice that started inside the rollout, before such a slice was
      refused), or one imported from a later position of the same source (``IMPORTED``: a slice
      imported after a gap, and now the gap);
    - the rollout is retired in the namespace (its history is closed there);
    - the file would continue the rollout after a gap (``_gaps``: the rollout's entry just before the
      slice, which the export recorded in ``BEFORE``, is not in the namespace).

    Raises:
        InvalidInputError: Naming how many rollouts, the first one and its first entry to append.
    """
    from eventlight.core.events import RolloutCreated, decode_event

    bad: dict[str, tuple[_Entry, str]] = {}
    for rid, items in rollouts.items():
        first_new = next((i for i, (_, is_held) in enumerate(items) if not is_held), None)
        if first_new is None:
            continue
        entry = items[first_new][0]
        if rid in retired:
            bad[rid] = (entry, "is retired in the namespace")
        elif any(is_held for _, is_held in items[first_new:]) or entry.seq < imported_up_to.get(rid, 0):
            bad[rid] = (entry, "has later entries in the namespace already (an earlier import of a later slice)")
        elif not isinstance(decode_event(entry.payload()), RolloutCreated) and not await _begun(log_, rid):
            bad[rid] = (entry, "begins before this file and the namespace does not hold its beginning")
        elif rid in gaps:
            bad[rid] = gaps[rid]
    if bad:
        rid, (entry, why) = next(iter(bad.items()))
        raise InvalidInputError(
            f"{path}: nothing imported: {len(bad)} rollout(s) cannot be appended in order; rollout {rid} {why} "
            f"(its entry at log position {entry.seq}, {entry.subject}). Import an export that starts before them "
            "(an earlier --since, or the whole log), or the slices of one log in order"
        )


async def _begun(log_: Any, rollout_id: str) -> bool:
    """Whether the namespace's first event of the rollout is its ``RolloutCreated``."""
    from eventlight.core.events import RolloutCreated, decode_event

    async for msg in log_._messages(f"{log_.prefix}.r.{rollout_id}.>"):
        try:
            return isinstance(decode_event(msg.data or b""), RolloutCreated)
        except InvalidInputError:
            return False
    return False


async def _archived(log_: Any, rollout_ids: set[str]) -> dict[str, set[str]]:
    """Digests of the archived messages of the given (retired) rollouts, by aggregate: one read of
    the archive, by the original subject each message keeps (``archive.source_position``)."""
    from eventlight.store.jetstream.archive import archive_head, ordered, source_position

    head = await archive_head(log_)
    out: dict[str, set[str]] = {}
    cut = len(log_.prefix) + 1
    async for msg in ordered(
        log_, log_.settings.archive_stream_name, f"{log_.settings.archive_prefix}.>", 0, head or 0
    ):
        found = source_position(msg.headers)
        if found is None or not found[1].startswith(log_.prefix + "."):
            continue  # the ledger
        subject = found[1][cut:]
        if _rollout_id(subject) in rollout_ids:
            out.setdefault(_aggregate(subject), set()).add(_digest(subject, msg.data or b""))
    return out


async def _held(log_: Any, aggregate: str, source: str) -> tuple[set[str], int]:
    """Digests of the messages the hot stream holds on an aggregate's subjects (none read if it has
    none), and the highest position of the ``source`` namespace's log imported among them (0: none)."""
    subject = f"{log_.prefix}.{aggregate}"
    if await log_._last_msg(subject) is None:
        return set(), 0
    cut = len(log_.prefix) + 1
    digests: set[str] = set()
    up_to = 0
    async for m in log_._messages(subject):
        digests.add(_digest(m.subject[cut:], m.data or b""))
        origin, _, position = (m.headers or {}).get(IMPORTED, "").rpartition(" ")
        if origin == source and position.isdigit():
            up_to = max(up_to, int(position))
    return digests, up_to
