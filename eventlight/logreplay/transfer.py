"""``eventlight export`` / ``eventlight import``: a slice of the log to a file and into another namespace.

The file is JSON lines: a header ``{"eventlight_export": 1, "namespace", "stream", "since", "until"}``
then one entry a line, ``{"seq", "subject", "data"}``, with ``subject`` below ``el.<ns>.`` and the
payload embedded verbatim (``data_b64`` for one that is not JSON), so an import appends exactly the
bytes the source holds, old event shapes included (readers upcast them).

Import checks every entry first: an entry that is not an eventlight event (a message the source's
projector dead-lettered, an event of a newer eventlight) refuses the file, saying how many there
are, unless ``skip_non_events`` leaves them out and counts them. It appends the rest in file order
under the target's prefix, each with ``Nats-Msg-Id`` set to a digest of its subject and payload
(JetStream drops a repeat inside its duplicate window). Past the window, what the target already
holds is found per aggregate (a rollout's subject tree, an attempt's span subject, a resources id,
a worker): an aggregate the target lacks is appended whole without a look; for one it has, the
digests of its stored messages are read once and entries already there are skipped. So importing
the same file twice appends nothing the second time, and importing into a namespace that already
holds part of the slice appends only the rest.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import msgspec

from eventlight.core.errors import InvalidInputError
from eventlight.settings import Settings

FORMAT = 1


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


async def export_log(settings: Settings, out: Path, since: int, until: int | None) -> tuple[int, int, int]:
    """Write entries after ``since`` up to ``until`` (default: the head now) of the namespace's log.

    Returns:
        ``(entries written, first position, last position)``.
    """
    from eventlight.store.jetstream.connect import connect_nats
    from eventlight.store.jetstream.log import JetStreamEventLog

    assert settings.nats_url is not None
    nc = await connect_nats(settings.nats_url, auth=settings.nats_auth, name="eventlight-export")
    n, first, last = 0, 0, 0
    try:
        log_ = JetStreamEventLog(nc, settings, None)
        head = await log_.head_seq()
        until = head if until is None else min(until, head)
        header = {"eventlight_export": FORMAT, "namespace": settings.namespace, "since": since, "until": until}
        with out.open("wb") as f:
            f.write(_enc.encode(header) + b"\n")
            async for seq, subject, data in log_.scan(since, until):
                entry = (
                    _Entry(seq, subject, data=msgspec.Raw(data))
                    if _is_json(data)
                    else _Entry(seq, subject, data_b64=base64.b64encode(data).decode())
                )
                f.write(_enc.encode(entry) + b"\n")
                n, first, last = n + 1, first or seq, seq
    finally:
        await nc.close()
    return n, first, last


def _aggregate(subject: str) -> str:
    """The subject filter of the aggregate an entry belongs to (below the prefix)."""
    parts = subject.split(".")
    if parts[0] == "r" and len(parts) >= 2:
        return f"r.{parts[1]}.>"
    return subject


def _digest(subject: str, data: bytes) -> str:
    return hashlib.sha256(subject.encode() + b"\x00" + data).hexdigest()[:40]


def read_export(path: Path, *, skip_non_events: bool = False) -> tuple[dict[str, Any], list[_Entry], list[_Entry]]:
    """The header, the entries and the entries left out (``skip_non_events``) of an export file.

    Args:
        path: A file ``eventlight export`` wrote.
        skip_non_events: Leave out, instead of refusing the file for, entries this eventlight does
            not read as events (a message the source's projector dead-lettered, an event of a newer
            eventlight); they are returned third.

    Raises:
        InvalidInputError: Not a file ``eventlight export`` wrote, an entry on a subject the layout
            does not give its event, or (without ``skip_non_events``) an entry that is not an event
            of this eventlight, saying how many there are (every entry is checked before any is used).
    """
    with path.open("rb") as f:
        lines = f.read().splitlines()
    try:
        header = msgspec.json.decode(lines[0]) if lines else None
        if not isinstance(header, dict) or header.get("eventlight_export") != FORMAT:
            raise InvalidInputError(f"{path} is not an eventlight export (format {FORMAT})")
        entries = [_entry.decode(line) for line in lines[1:] if line.strip()]
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
    return header, kept, [entry for entry, _ in left_out]


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
    """Entries the namespace already held."""
    skipped: list[int] = msgspec.field(default_factory=list)
    """The source log positions of entries left out as not eventlight events (``skip_non_events``)."""


async def import_log(settings: Settings, path: Path, *, skip_non_events: bool = False) -> ImportReport:
    """Append an export file's entries to the namespace's log, skipping those it holds.

    Args:
        settings: The target namespace, with ``nats_url`` set.
        path: A file ``eventlight export`` wrote.
        skip_non_events: Leave out (and count) entries that are not eventlight events instead of
            refusing the file.

    Raises:
        InvalidInputError: Not an export file, or an entry that is not an event on its subject
            (nothing is appended then).
        ServiceUnavailableError: NATS cannot be reached or refused an append.
    """
    from eventlight.store.jetstream.connect import connect_nats
    from eventlight.store.jetstream.log import JetStreamEventLog
    from eventlight.store.jetstream.nats_errors import nats_errors

    _, entries, left_out = read_export(path, skip_non_events=skip_non_events)
    report = ImportReport(skipped=[e.seq for e in left_out])
    assert settings.nats_url is not None
    nc = await connect_nats(settings.nats_url, auth=settings.nats_auth, name="eventlight-import")
    try:
        log_ = JetStreamEventLog(nc, settings, None)
        held: dict[str, set[str]] = {}
        for e in entries:
            data = e.payload()
            agg = _aggregate(e.subject)
            if agg not in held:
                held[agg] = await _held(log_, agg)
            digest = _digest(e.subject, data)
            if digest in held[agg]:
                report.present += 1
                continue
            subject = f"{log_.prefix}.{e.subject}"
            with nats_errors(log_.server, f"publish to {subject}"):
                ack = await log_.js.publish(subject, data, headers={"Nats-Msg-Id": f"import:{digest}"})
            held[agg].add(digest)
            if ack.duplicate:
                report.present += 1
            else:
                report.appended += 1
    finally:
        await nc.close()
    return report


async def _held(log_: Any, aggregate: str) -> set[str]:
    """Digests of the messages the log holds on an aggregate's subjects (none read if it has none)."""
    subject = f"{log_.prefix}.{aggregate}"
    if await log_._last_msg(subject) is None:
        return set()
    cut = len(log_.prefix) + 1
    return {_digest(m.subject[cut:], m.data or b"") async for m in log_._messages(subject)}
