"""``eventlight export`` / ``eventlight import``: a slice of the log to a file and into another namespace.

The file is JSON lines: a header ``{"eventlight_export": 2, "namespace", "since", "until"}``, one
entry a line, ``{"seq", "subject", "data"}``, with ``subject`` below ``el.<ns>.`` and the payload
embedded verbatim (``data_b64`` for one that is not JSON), so an import appends exactly the bytes
the source holds, old event shapes included (readers upcast them), and last the count
``{"eventlight_export_entries": N}``. The file is written beside ``--out`` and renamed over it once
whole (``files.replacing``). An import refuses a file whose last line is not that count, or whose
count differs from the entries it holds (one cut at a line boundary, say): it would append part of
the slice as if it were all. A format-1 file (written before the count) is imported with a warning
that a cut one cannot be told.

Import appends the entries in file order under the target's prefix, each with ``Nats-Msg-Id``
set to a digest of its subject and payload (JetStream drops a repeat inside its duplicate window).
Past the window, what the target already holds is found per aggregate (a rollout's subject tree,
an attempt's span subject, a resources id, a worker): an aggregate the target lacks is appended
whole without a look; for one it has, the digests of its stored messages are read once and
entries already there are skipped. So importing the same file twice appends nothing the second
time, and importing into a namespace that already holds part of the slice appends only the rest.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from pathlib import Path
from typing import Any

import msgspec

from eventlight.core.errors import InvalidInputError
from eventlight.settings import Settings

FORMAT = 2
"""2: the file ends with ``{"eventlight_export_entries": N}``; 1 (still read): without it."""
ENTRIES = "eventlight_export_entries"

log = logging.getLogger(__name__)


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

    Raises:
        ServiceUnavailableError: NATS cannot be reached or fails midway (``out`` is then left as
            it was: the file is written beside it and renamed over it once whole).
        OSError: ``out``'s folder cannot be written.
    """
    from eventlight.logreplay.files import replacing
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
            f.write(_enc.encode({ENTRIES: n}) + b"\n")  # last: a file without it was cut short
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


def read_export(path: Path) -> tuple[dict[str, Any], list[_Entry]]:
    """The header and entries of an export file.

    Raises:
        InvalidInputError: Not a file ``eventlight export`` wrote, an entry that is not an event
            of this eventlight on its layout subject (checked for every entry before any is used),
            or (format 2) a last line that is not the entry count or a count that differs.
    """
    with path.open("rb") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    try:
        header = msgspec.json.decode(lines[0]) if lines else None
        if not isinstance(header, dict) or header.get("eventlight_export") not in (1, FORMAT):
            raise InvalidInputError(f"{path} is not an eventlight export (format 1 or {FORMAT})")
        counted = header["eventlight_export"] == FORMAT
        written = _count(lines[-1]) if counted and len(lines) > 1 else None
        if counted and written is None:
            raise InvalidInputError(
                f"{path} does not end with the entry count `eventlight export` writes last: "
                "the export was interrupted or the file cut short"
            )
        entries = [_entry.decode(line) for line in lines[1 : -1 if counted else None]]
    except msgspec.DecodeError as e:
        raise InvalidInputError(f"{path} is not an eventlight export: {e}") from e
    for entry in entries:
        _check(path, entry)
    if counted and written != len(entries):
        raise InvalidInputError(f"{path} holds {len(entries)} entries where its export wrote {written}: cut or altered")
    if not counted:
        log.warning("%s is an export of format 1, without an entry count: a file cut short cannot be told", path)
    return header, entries


def _count(line: bytes) -> int | None:
    """The entry count of an export's last line, ``None`` if it is not that line."""
    try:
        last = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None
    count = last.get(ENTRIES) if isinstance(last, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def _check(path: Path, entry: _Entry) -> None:
    """An entry must hold an event this eventlight reads (older shapes upcast) on the subject the
    layout gives it, so an import appends nothing the projector would dead-letter.

    Raises:
        InvalidInputError: Naming the entry's log position and what is wrong.
    """
    from eventlight.core.events import decode_event
    from eventlight.store.jetstream.layout import subject_for

    where = f"{path}: the entry at log position {entry.seq} ({entry.subject})"
    try:
        event = decode_event(entry.payload())
    except (InvalidInputError, ValueError) as e:  # ValueError: bad base64
        why = str(e) if isinstance(e, InvalidInputError) else f"not an eventlight event: {e}"  # says it once
        raise InvalidInputError(f"{where}: {why}") from e
    expected = subject_for("", event)[1:]  # "r.<rid>.q", "s.<rid>.<aid>", "res.<id>", "w.<id>"
    if entry.subject != expected:
        raise InvalidInputError(f"{where} holds a {type(event).__name__} that belongs on {expected}")


async def import_log(settings: Settings, path: Path) -> tuple[int, int]:
    """Append an export file's entries to the namespace's log, skipping those it holds.

    Returns:
        ``(entries appended, entries already there)``.

    Raises:
        InvalidInputError: Not an export file, or an entry that is not an event on its subject
            (nothing is appended then).
        ServiceUnavailableError: NATS cannot be reached or refused an append.
    """
    from eventlight.store.jetstream.connect import connect_nats
    from eventlight.store.jetstream.log import JetStreamEventLog
    from eventlight.store.jetstream.nats_errors import nats_errors

    _, entries = read_export(path)
    assert settings.nats_url is not None
    nc = await connect_nats(settings.nats_url, auth=settings.nats_auth, name="eventlight-import")
    added = present = 0
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
                present += 1
                continue
            subject = f"{log_.prefix}.{e.subject}"
            with nats_errors(log_.server, f"publish to {subject}"):
                ack = await log_.js.publish(subject, data, headers={"Nats-Msg-Id": f"import:{digest}"})
            held[agg].add(digest)
            if ack.duplicate:
                present += 1
            else:
                added += 1
    finally:
        await nc.close()
    return added, present


async def _held(log_: Any, aggregate: str) -> set[str]:
    """Digests of the messages the log holds on an aggregate's subjects (none read if it has none)."""
    subject = f"{log_.prefix}.{aggregate}"
    if await log_._last_msg(subject) is None:
        return set()
    cut = len(log_.prefix) + 1
    return {_digest(m.subject[cut:], m.data or b"") async for m in log_._messages(subject)}
