"""What the projector writes: Postgres rows of the fold's changes, and the SQL that upserts them.

Span batches are decoded for projection with each span's JSON fields (attributes, status, events,
links, contexts, resource) kept as the event's own JSON text (``decode_for_projection``), which
Postgres parses into ``jsonb`` anyway.
"""

from __future__ import annotations

from typing import Any

import msgspec

from eventlight.core.commands import RolloutState
from eventlight.core.events import AnyEvent, SpansAdded, decode_event
from eventlight.core.types import Event, Link, OtelResource, Span, SpanContext, TraceStatus, Worker
from eventlight.store.fold import Changes
from eventlight.store.jetstream.pg import dumps, may_hold_nul, text

_enc = msgspec.json.Encoder()


class RawSpan(Span, kw_only=True):
    """A ``Span`` as the projector writes it: its JSON fields kept as the event's own JSON text,
    which Postgres parses into ``jsonb`` anyway. Decoding them into dicts and structs and encoding
    them again was ~15% of the projector's CPU with the bench's 4 KB attribute sets (the
    attributes), and 55 -> 31 µs a rollout of ``span_row`` on the bench's workload (the other six
    fields); ``decode_for_projection`` checks them against their ``Span`` types instead.
    ``context`` and ``parent`` hold ``null`` when the span has none (``span_row``: ``NULL``).
    ``status`` is its typed decode's JSON (``decode_for_projection``: the views read its
    ``status_code``); in the other fields, what another writer spelled otherwise stays as written
    in the row's ``jsonb`` (a field left out, an unknown one, ``1`` for ``1.0``), which the
    ``query_*`` reads decode to the typed span's values."""

    status: msgspec.Raw = msgspec.Raw(_enc.encode(TraceStatus()))  # type: ignore[assignment]
    attributes: msgspec.Raw = msgspec.Raw(b"{}")  # type: ignore[assignment]
    events: msgspec.Raw = msgspec.Raw(b"[]")  # type: ignore[assignment]
    links: msgspec.Raw = msgspec.Raw(b"[]")  # type: ignore[assignment]
    context: msgspec.Raw = msgspec.Raw(b"null")  # type: ignore[assignment]
    parent: msgspec.Raw = msgspec.Raw(b"null")  # type: ignore[assignment]
    resource: msgspec.Raw = msgspec.Raw(_enc.encode(OtelResource()))  # type: ignore[assignment]


class RawSpansAdded(msgspec.Struct, frozen=True, kw_only=True, tag="spans_added", tag_field="type"):
    """``SpansAdded`` (version 1) with ``RawSpan``s; anything else goes through ``decode_event``."""

    v: int = 1
    time: float
    rollout_id: str
    attempt_id: str
    spans: list[RawSpan]
    seq_high: int = 0


_raw_spans_decoder = msgspec.json.Decoder(RawSpansAdded)
_SPANS_ADDED_PREFIX = b'{"type":"spans_added"'

# The raw fields of a message's spans are checked against their ``Span`` types in one decode (a
# JSON array of one array per span), so that a payload is projected raw exactly when
# ``SpansAdded`` would decode it; the attributes only need to be a JSON object.
_fields_decoder = msgspec.json.Decoder(
    list[tuple[TraceStatus, list[Event], list[Link], SpanContext | None, SpanContext | None, OtelResource]]
)


def _fields_valid(spans: list[RawSpan]) -> bool:
    """Whether each raw field of ``spans`` decodes as its ``Span`` type (the attributes: a JSON
    object). Each span's ``status`` becomes its typed decode's JSON, as ``span_row`` writes a typed
    span's: a writer's ``{}`` or one without ``status_code`` reads ``UNSET`` in the views
    (``v_spans.status_code``), not ``NULL`` (0.4 µs a span)."""
    parts = []
    for span in spans:
        if bytes(memoryview(span.attributes)[:1]) != b"{":
            return False
        parts.append(
            b"[" + b",".join([span.status, span.events, span.links, span.context, span.parent, span.resource]) + b"]"
        )
    try:
        fields = _fields_decoder.decode(b"[" + b",".join(parts) + b"]")
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return False
    for span, (status, *_) in zip(spans, fields, strict=True):
        span.status = msgspec.Raw(_enc.encode(status))
    return True


def decode_for_projection(data: bytes) -> AnyEvent:
    """``decode_event``, except that a version-1 ``SpansAdded`` keeps its spans' JSON fields as raw
    JSON text (its ``spans`` are ``RawSpan``s; ``decider.evolve`` does not look into them). Each
    raw field is checked against its ``Span`` type (the attributes only for being a JSON object),
    so a payload with a field ``decode_event`` refuses goes to ``decode_event``, which explains.

    Raises:
        InvalidInputError: The payload is not a known event.
    """
    if data and data.startswith(_SPANS_ADDED_PREFIX):
        try:
            raw = _raw_spans_decoder.decode(data)
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):  # DecodeError includes ValidationError
            pass  # an older version, or malformed: decode_event upcasts or explains
        else:
            if raw.v == 1 and _fields_valid(raw.spans):
                return SpansAdded(
                    time=raw.time,
                    rollout_id=raw.rollout_id,
                    attempt_id=raw.attempt_id,
                    spans=raw.spans,  # type: ignore[arg-type]
                    seq_high=raw.seq_high,
                )
    return decode_event(data)


def span_row(s: Any, seq: int) -> tuple[Any, ...]:
    if type(s) is RawSpan:
        return _raw_span_row(s, seq)
    return (
        s.rollout_id,
        s.attempt_id,
        text(s.span_id),
        s.sequence_id,
        text(s.trace_id),
        text(s.parent_id),
        text(s.name),
        dumps(s.status),
        dumps(s.attributes),
        dumps(s.events),
        dumps(s.links),
        s.start_time,
        s.end_time,
        dumps(s.context) if s.context is not None else None,
        dumps(s.parent) if s.parent is not None else None,
        dumps(s.resource),
        seq,
    )


def _raw_span_row(s: RawSpan, seq: int) -> tuple[Any, ...]:
    return (
        s.rollout_id,
        s.attempt_id,
        text(s.span_id),
        s.sequence_id,
        text(s.trace_id),
        text(s.parent_id),
        text(s.name),
        _raw_json(s.status),
        _raw_json(s.attributes),
        _raw_json(s.events),
        _raw_json(s.links),
        s.start_time,
        s.end_time,
        None if s.context == _NULL else _raw_json(s.context),
        None if s.parent == _NULL else _raw_json(s.parent),
        _raw_json(s.resource),
        seq,
    )


_NULL = msgspec.Raw(b"null")


def _raw_json(raw: msgspec.Raw) -> str:
    """Raw JSON as a ``jsonb`` parameter, NUL characters replaced as ``pg.dumps`` does."""
    data = str(raw, "utf-8")
    if may_hold_nul(data):
        return dumps(msgspec.json.decode(raw))
    return data


def rollout_row(s: RolloutState, b: Changes, known_seq: dict[str, int]) -> tuple[Any, ...]:
    r = s.rollout
    rid = r.rollout_id
    return (
        rid,
        dumps(r.input),
        r.start_time,
        r.end_time,
        r.mode,
        r.resources_id,
        r.status,
        dumps(r.config),
        dumps(r.metadata),
        s.latest.attempt_id if s.latest else None,
        len(s.attempts),
        b.created_seq.get(rid, 0),
        b.rollout_seq.get(rid, known_seq.get(rid, 0)),
    )


def attempt_row(a: Any) -> tuple[Any, ...]:
    return (
        a.rollout_id,
        a.attempt_id,
        a.sequence_id,
        a.start_time,
        a.end_time,
        a.status,
        a.worker_id,
        a.last_heartbeat_time,
        dumps(a.metadata),
    )


def resources_row(r: Any, first_seq: int, last_seq: int) -> tuple[Any, ...]:
    return (r.resources_id, r.create_time, r.update_time, r.version, dumps(r.resources), first_seq, last_seq)


def worker_row(w: Worker, created_seq: int | None = None) -> tuple[Any, ...]:
    return (
        w.worker_id,
        w.status,
        dumps(w.heartbeat_stats),
        w.last_heartbeat_time,
        w.last_dequeue_time,
        w.last_busy_time,
        w.last_idle_time,
        w.current_rollout_id,
        w.current_attempt_id,
        created_seq,
    )


UPSERT_ROLLOUT = """
INSERT INTO rollouts (rollout_id, input, start_time, end_time, mode, resources_id, status, config, metadata,
                      latest_attempt_id, num_attempts, created_seq, last_seq)
VALUES ($1, $2::jsonb, $3, $4, $5, $6, $7, $8::jsonb, $9::jsonb, $10, $11, $12, $13)
ON CONFLICT (rollout_id) DO UPDATE SET
  input = EXCLUDED.input, end_time = EXCLUDED.end_time, mode = EXCLUDED.mode,
  resources_id = EXCLUDED.resources_id, status = EXCLUDED.status, config = EXCLUDED.config,
  metadata = EXCLUDED.metadata, latest_attempt_id = EXCLUDED.latest_attempt_id,
  num_attempts = EXCLUDED.num_attempts, last_seq = GREATEST(rollouts.last_seq, EXCLUDED.last_seq)
"""

UPSERT_ATTEMPT = """
INSERT INTO attempts (rollout_id, attempt_id, sequence_id, start_time, end_time, status, worker_id,
                      last_heartbeat_time, metadata)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb)
ON CONFLICT (rollout_id, attempt_id) DO UPDATE SET
  end_time = EXCLUDED.end_time, status = EXCLUDED.status, worker_id = EXCLUDED.worker_id,
  last_heartbeat_time = EXCLUDED.last_heartbeat_time, metadata = EXCLUDED.metadata
"""

SPAN_COLUMNS = (
    "rollout_id",
    "attempt_id",
    "span_id",
    "sequence_id",
    "trace_id",
    "parent_id",
    "name",
    "status",
    "attributes",
    "events",
    "links",
    "start_time",
    "end_time",
    "context",
    "parent",
    "resource",
    "stream_seq",
)
"""The ``spans`` columns of a ``span_row``, in its order (the projector's ``COPY``)."""

_SPAN_JSONB = {"status", "attributes", "events", "links", "context", "parent", "resource"}

INSERT_SPAN = (
    f"INSERT INTO spans ({', '.join(SPAN_COLUMNS)}) VALUES ("
    + ", ".join(f"${i}::jsonb" if col in _SPAN_JSONB else f"${i}" for i, col in enumerate(SPAN_COLUMNS, 1))
    + ") ON CONFLICT (rollout_id, attempt_id, span_id) DO NOTHING"
)
"""A ``span_row`` when its span may be projected already (the ``COPY``'s fallback): the columns of ``SPAN_COLUMNS``."""

UPSERT_RESOURCES = """
INSERT INTO resources (resources_id, create_time, update_time, version, resources, created_seq, last_seq)
VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7)
ON CONFLICT (resources_id) DO UPDATE SET
  update_time = EXCLUDED.update_time, version = EXCLUDED.version, resources = EXCLUDED.resources,
  last_seq = EXCLUDED.last_seq
"""

UPSERT_WORKER = """
INSERT INTO workers (worker_id, status, heartbeat_stats, last_heartbeat_time, last_dequeue_time, last_busy_time,
                     last_idle_time, current_rollout_id, current_attempt_id, created_seq)
VALUES ($1, $2, $3::jsonb, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT (worker_id) DO UPDATE SET
  status = EXCLUDED.status, heartbeat_stats = EXCLUDED.heartbeat_stats,
  last_heartbeat_time = EXCLUDED.last_heartbeat_time, last_dequeue_time = EXCLUDED.last_dequeue_time,
  last_busy_time = EXCLUDED.last_busy_time, last_idle_time = EXCLUDED.last_idle_time,
  current_rollout_id = EXCLUDED.current_rollout_id, current_attempt_id = EXCLUDED.current_attempt_id,
  created_seq = COALESCE(workers.created_seq, EXCLUDED.created_seq)
"""
