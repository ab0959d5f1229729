"""Postgres read models: connection pools, row <-> struct conversion and the ``query_*`` SQL.

The tables are created by ``migrations/001_read_models.sql`` inside schema ``el_<ns>``. JSON columns
are written as text produced by msgspec and cast with ``::jsonb``; reads decode them with msgspec.
Filters are bound parameters; ``sort_by`` is checked against the struct's fields before it becomes
an identifier, so no caller string reaches SQL unquoted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import asyncpg
import msgspec

from eventlight.core.types import (
    Attempt,
    AttemptedRollout,
    Event,
    Link,
    OtelResource,
    PaginatedResult,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    Span,
    SpanContext,
    TraceStatus,
    Worker,
)
from eventlight.store.jetstream.pg_errors import dsn_errors, pg_errors
from eventlight.store.query import check_paging, check_sort_field, check_values, is_text_field

_enc = msgspec.json.Encoder()


def dumps(value: Any) -> str:
    """JSON text for a ``jsonb`` column. Postgres cannot store NUL (``\\u0000``) in ``jsonb`` or
    ``text``, so NUL characters in strings become U+FFFD (the event in the stream keeps them)."""
    data = _enc.encode(value)
    if may_hold_nul(data):
        data = _enc.encode(_without_nul(msgspec.to_builtins(value)))
    return data.decode()


def may_hold_nul(json_text: bytes | str) -> bool:
    """Whether JSON text may hold a NUL character (it contains ``\\u0000``). Looks for a backslash
    first, with one ``memchr``: a search for the six characters runs at about 1 byte a nanosecond
    on CPython 3.11 (18 µs for a span's 18 KB of attributes), and most JSON has no escape at all."""
    if isinstance(json_text, str):
        return "\\" in json_text and "\\u0000" in json_text
    return b"\\" in json_text and b"\\u0000" in json_text


def text(value: str | None) -> str | None:
    """A ``text`` column's value, NUL characters replaced by U+FFFD (see ``dumps``)."""
    return value.replace("\x00", "\ufffd") if value is not None and "\x00" in value else value


def texts(value: Any) -> Any:
    """A query argument as the read model stores text: NUL characters in a string, or in the strings
    of a list, become U+FFFD (``text``). Postgres refuses a NUL in a ``text`` argument with an error;
    this way a filter holding one matches what the stored value became, as the in-memory backend's
    filter matches the value as written."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, list) and any(isinstance(v, str) and "\x00" in v for v in value):
        return [text(v) if isinstance(v, str) else v for v in value]
    return value


def _without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_without_nul(k): _without_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_nul(v) for v in value]
    return value


def loads(text: str | None, type_: Any = Any) -> Any:
    """Decode a ``jsonb`` column's text. Postgres keeps JSON numbers as ``numeric``, so a value a
    foreign writer put in a span's raw attributes can be out of msgspec's range (``1e400`` comes
    back as a 401-digit integer): such text is decoded with the standard library instead, integers
    of more than 4,000 digits becoming ``float`` (``inf``)."""
    if text is None:
        return None
    try:
        return msgspec.json.decode(text, type=type_)
    except msgspec.DecodeError:
        value = json.loads(text, parse_int=_lenient_int)
        return value if type_ is Any else msgspec.convert(value, type=type_)


def _lenient_int(digits: str) -> int | float:
    return int(digits) if len(digits) <= 4000 else float(digits)


async def _reset(conn: asyncpg.Connection) -> None:
    """What a connection needs when it goes back to the pool: eventlight sets no session state
    (no LISTEN, no cursors, no settings; the projector unlocks its advisory lock itself), so only
    an unfinished transaction is rolled back, saving asyncpg's default ``RESET ALL`` round trip."""
    if conn.is_in_transaction():
        await conn.execute("ROLLBACK")


async def create_pool(dsn: str, schema: str, *, max_size: int = 4) -> asyncpg.Pool:
    """A small pool whose connections use ``schema`` (bounded: see peer failure C25).

    It opens one connection at once (so a server that cannot be reached fails here) and keeps no
    floor of open connections (``min_size=0``): a connection lost (Postgres restarted, its backend
    terminated) is opened again by the next call that needs one, which reports a failure as the
    store's own error, rather than by asyncpg's background "floor" task, which logs each failed try
    (1 s, 2 s, ... 60 s apart while Postgres is away) as a warning with its whole traceback.

    Raises:
        ServiceUnavailableError: Postgres refused or did not answer.
        InvalidInputError: ``dsn`` cannot be parsed (``pg_errors.dsn_errors``).
    """
    with dsn_errors(dsn), pg_errors(dsn, "connect"):
        pool: asyncpg.Pool = await asyncpg.create_pool(
            dsn,
            init_size=1,
            min_size=0,
            max_size=max_size,
            timeout=5,
            # Custom plans: a generic plan guesses filter selectivity (e.g. ``status = $1``) and then
            # walks the wrong index once most rollouts are finished (bench/growth.py).
            server_settings={"search_path": schema, "plan_cache_mode": "force_custom_plan"},
            reset=_reset,
        )
        return pool


# -- rows -> structs -----------------------------------------------------------------------

ROLLOUT_COLS = "rollout_id, input::text, start_time, end_time, mode, resources_id, status, config::text, metadata::text"
ATTEMPT_COLS = (
    "rollout_id, attempt_id, sequence_id, start_time, end_time, status, worker_id, last_heartbeat_time, metadata::text"
)
SPAN_COLS = (
    "rollout_id, attempt_id, sequence_id, trace_id, span_id, parent_id, name, status::text, attributes::text, "
    "events::text, links::text, start_time, end_time, context::text, parent::text, resource::text"
)
WORKER_COLS = (
    "worker_id, status, heartbeat_stats::text, last_heartbeat_time, last_dequeue_time, last_busy_time, "
    "last_idle_time, current_rollout_id, current_attempt_id"
)


def rollout_from_row(row: Sequence[Any]) -> Rollout:
    return Rollout(
        rollout_id=row[0],
        input=loads(row[1]),
        start_time=row[2],
        end_time=row[3],
        mode=row[4],
        resources_id=row[5],
        status=row[6],
        config=loads(row[7], RolloutConfig),
        metadata=loads(row[8]),
    )


def attempt_from_row(row: Sequence[Any]) -> Attempt:
    return Attempt(
        rollout_id=row[0],
        attempt_id=row[1],
        sequence_id=row[2],
        start_time=row[3],
        end_time=row[4],
        status=row[5],
        worker_id=row[6],
        last_heartbeat_time=row[7],
        metadata=loads(row[8]),
    )


_SPAN_FIELDS = (
    "rollout_id",
    "attempt_id",
    "sequence_id",
    "trace_id",
    "span_id",
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
)
_SPAN_JSON = {"status", "attributes", "events", "links", "context", "parent", "resource"}


_status_decoder = msgspec.json.Decoder(TraceStatus)
_attributes_decoder = msgspec.json.Decoder(dict[str, Any])
_events_decoder = msgspec.json.Decoder(list[Event])
_links_decoder = msgspec.json.Decoder(list[Link])
_context_decoder = msgspec.json.Decoder(SpanContext)
_resource_decoder = msgspec.json.Decoder(OtelResource)


def span_from_row(row: Sequence[Any]) -> Span:
    """A ``SPAN_COLS`` row as a ``Span``: each JSON column decoded straight into its field's type
    (a third less CPU than decoding to Python objects and converting the whole, with the bench's
    4 KB attribute sets); a row that path refuses (a number out of msgspec's range, a ``NULL``)
    goes through ``loads`` and ``msgspec.convert``, which explain what is wrong."""
    try:
        if None not in (row[7], row[8], row[9], row[10], row[15]):
            return Span(
                rollout_id=row[0],
                attempt_id=row[1],
                sequence_id=row[2],
                trace_id=row[3],
                span_id=row[4],
                parent_id=row[5],
                name=row[6],
                status=_status_decoder.decode(row[7]),
                attributes=_attributes_decoder.decode(row[8]),
                events=_events_decoder.decode(row[9]),
                links=_links_decoder.decode(row[10]),
                start_time=row[11],
                end_time=row[12],
                context=None if row[13] is None else _context_decoder.decode(row[13]),
                parent=None if row[14] is None else _context_decoder.decode(row[14]),
                resource=_resource_decoder.decode(row[15]),
            )
    except msgspec.DecodeError:
        pass
    doc = {k: (loads(v) if k in _SPAN_JSON else v) for k, v in zip(_SPAN_FIELDS, row, strict=True)}
    return msgspec.convert(doc, Span)


_SPAN_SCALARS = [f for f in _SPAN_FIELDS if f not in _SPAN_JSON]
_SPAN_PLACEHOLDERS = {"sequence_id": "0", "parent_id": "null", "start_time": "null", "end_time": "null"}


def _span_json_object() -> str:
    """A span row's JSON columns as one JSON object's text, built by Postgres from each column's
    ``::text`` form with ``concat`` alone, after placeholders for the fields ``Span`` requires (the
    real values come as columns of their own and replace them). Measured against the alternatives
    (``EXPLAIN ANALYZE`` of a 20-span rollout with 2.3 kB attributes): ``SPAN_COLS`` 142 us, this
    153 us, ``to_json`` of the text columns inside the object 212 us, ``||`` in place of
    ``concat`` 178 us, ``json_build_object``/``json_agg`` twice the first's. ``attributes``, the
    long one, is last."""
    head = ",".join(f'"{f}":{_SPAN_PLACEHOLDERS.get(f, chr(34) * 2)}' for f in _SPAN_SCALARS)
    parts: list[str] = []
    for col in ["status", "events", "links", "context", "parent", "resource", "attributes"]:
        value = f"coalesce({col}::text, 'null')" if col in ("context", "parent") else col
        parts.append(f"'{'{' + head if not parts else ''},\"{col}\":', {value}")
    return f"concat({', '.join(parts)}, '}}')"


SPAN_JSON_COLS = f"{', '.join(_SPAN_SCALARS)}, {_span_json_object()}"
"""A span row as its scalar columns (the times as ``double precision``: exact whatever the server's
``extra_float_digits``) and its JSON columns as one JSON object (``spans_from_json_rows``): one
msgspec decode a row where ``SPAN_COLS`` takes seven, and nine fewer Python objects."""

_span_decoder = msgspec.json.Decoder(Span)


def spans_from_json_rows(rows: Sequence[Sequence[Any]]) -> list[Span] | None:
    """``SPAN_JSON_COLS`` rows as ``Span``s, or ``None`` if msgspec refuses one (a number out of its
    range in raw attributes): the caller then reads ``SPAN_COLS`` rows, which ``span_from_row``
    decodes leniently or explains."""
    decode = _span_decoder.decode
    spans = []
    try:
        for row in rows:
            span = decode(row[9])
            span.rollout_id, span.attempt_id, span.sequence_id = row[0], row[1], row[2]
            span.trace_id, span.span_id, span.parent_id, span.name = row[3], row[4], row[5], row[6]
            span.start_time, span.end_time = row[7], row[8]  # the order of ``_SPAN_FIELDS``
            spans.append(span)
    except msgspec.DecodeError:
        return None
    return spans


def worker_from_row(row: Sequence[Any]) -> Worker:
    return Worker(
        worker_id=row[0],
        status=row[1],
        heartbeat_stats=loads(row[2]),
        last_heartbeat_time=row[3],
        last_dequeue_time=row[4],
        last_busy_time=row[5],
        last_idle_time=row[6],
        current_rollout_id=row[7],
        current_attempt_id=row[8],
    )


def resources_from_row(row: Sequence[Any]) -> ResourcesUpdate:
    return msgspec.convert(
        {
            "resources_id": row[0],
            "create_time": row[1],
            "update_time": row[2],
            "version": row[3],
            "resources": loads(row[4]),
        },
        ResourcesUpdate,
    )


def attach(rollout: Rollout, attempt: Attempt | None) -> Rollout:
    if attempt is None:
        return rollout
    return AttemptedRollout(**msgspec.structs.asdict(rollout), attempt=attempt)


# -- query building ------------------------------------------------------------------------


class Where:
    """Collects bound conditions; ``must`` ones are always ANDed, the rest join by ``logic``."""

    def __init__(self) -> None:
        self.args: list[Any] = []
        self.must: list[str] = []
        self.pool: list[str] = []

    def arg(self, value: Any) -> str:
        self.args.append(texts(value))
        return f"${len(self.args)}"

    def within(self, col: str, values: Sequence[Any] | None, *, must: bool = False) -> None:
        values = check_values(f"{col}_in", values)
        if values is None:
            return
        if len(values) == 1:  # an equality can walk a (col, order) index in order
            cond = f"{col} = {self.arg(values[0])}"
        else:
            cond = f"{col} = ANY({self.arg(values)}::text[])"
        (self.must if must else self.pool).append(cond)

    def contains(self, col: str, needle: str | None) -> None:
        if needle is not None:
            self.pool.append(f"strpos({col}, {self.arg(needle)}) > 0")

    def exact(self, col: str, value: Any | None, *, must: bool = False) -> None:
        if value is not None:
            (self.must if must else self.pool).append(f"{col} = {self.arg(value)}")

    def sql(self, logic: str) -> str:
        parts = list(self.must)
        if self.pool:
            parts.append("(" + f" {'OR' if logic == 'or' else 'AND'} ".join(self.pool) + ")")
        return "WHERE " + " AND ".join(parts) if parts else ""


def order_page(
    cls: type, where: Where, sort_by: str | None, sort_order: str, limit: int, offset: int, default: str
) -> str:
    check_paging(limit, offset, sort_order)
    check_sort_field(cls, sort_by)
    if sort_by is None:
        order = f"ORDER BY {default}"
    else:
        direction = "DESC NULLS FIRST" if sort_order == "desc" else "ASC NULLS LAST"
        # Strings in code point order, as Python (the in-memory backend) compares them, whatever
        # the database's collation (``en_US`` would put "a" before "B").
        collate = ' COLLATE "C"' if is_text_field(cls, sort_by) else ""
        order = f'ORDER BY "{sort_by}"{collate} {direction}, {default}'
    page = f" OFFSET {where.arg(offset)}"
    if limit != -1:
        page += f" LIMIT {where.arg(limit)}"
    return order + page


async def fetch_rows(
    conn: asyncpg.Connection, table: str, cols: str, where: Where, logic: str, tail: str
) -> list[asyncpg.Record]:
    """The rows of one page (``tail`` from ``order_page``)."""
    rows: list[asyncpg.Record] = await conn.fetch(f"SELECT {cols} FROM {table} {where.sql(logic)} {tail}", *where.args)
    return rows


async def fetch_page(
    conn: asyncpg.Connection,
    table: str,
    cols: str,
    where: Where,
    logic: str,
    tail: str,
    n_filter_args: int,
    limit: int,
    offset: int,
) -> tuple[list[asyncpg.Record], int]:
    """Rows of one page and the total number of matches before paging.

    The total needs no second query when the page is the last one (``limit=-1``, or fewer rows
    than ``limit`` with rows or ``offset=0``): it is ``offset + len(rows)``.
    """
    rows = await fetch_rows(conn, table, cols, where, logic, tail)
    cond = where.sql(logic)
    if (limit == -1 or len(rows) < limit) and (rows or offset == 0):
        return rows, offset + len(rows)
    total = await conn.fetchval(f"SELECT count(*) FROM {table} {cond}", *where.args[:n_filter_args])
    return rows, int(total)


def paginated(items: list[Any], limit: int, offset: int, total: int) -> PaginatedResult[Any]:
    return PaginatedResult(items, limit=limit, offset=offset, total=total)
