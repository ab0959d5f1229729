"""How ``eventlight sql`` and ``eventlight status`` print values.

Three formats for query results:

* ``table`` (default): a rich table for people. Each column is at most ``MAX_COLUMN_WIDTH``
  characters wide and folds; a cell longer than ``MAX_CELL_CHARS`` is cut with ``…``; JSON is
  compact; float epoch seconds in a ``*_time`` / ``timestamp`` column and ``timestamptz`` values
  print as UTC times (``2026-05-01 12:00:03.250Z``); NULL prints as a dim ``null``. A result too
  wide for the terminal prints one record per row instead (``column  value`` lines, like psql's
  expanded mode), so no column is squeezed to a few characters.
* ``csv`` and ``json`` (one object per row, JSON lines): the values as stored, for programs:
  epoch seconds stay numbers, timestamps are ISO 8601, JSON columns stay JSON, NULL is empty / ``null``.
"""

from __future__ import annotations

import csv
import datetime as dt
import decimal
import io
import json
import math
import uuid
from collections.abc import Sequence
from typing import Any

import asyncpg
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

MAX_COLUMN_WIDTH = 60
MAX_CELL_CHARS = 240
_JSON_TYPES = frozenset({"json", "jsonb"})
_FLOAT_TYPES = frozenset({"float8", "float4", "numeric"})
_EPOCH_MIN, _EPOCH_MAX = 0.0, 32_503_680_000.0  # 1970 .. 3000


class Column:
    """A result column: its name and its Postgres type name (``int8``, ``jsonb``, ``float8``, …)."""

    def __init__(self, name: str, type_name: str):
        self.name = name
        self.type_name = type_name

    @property
    def is_json(self) -> bool:
        return self.type_name in _JSON_TYPES

    @property
    def is_epoch(self) -> bool:
        """Float seconds since the epoch, by eventlight's naming (``start_time``, ``last_heartbeat_time``)."""
        named = self.name.endswith("_time") or self.name in ("time", "timestamp")
        return named and self.type_name in _FLOAT_TYPES


def utc_time(seconds: float) -> str:
    """``2026-05-01 12:00:03.250Z`` for epoch seconds (milliseconds shown)."""
    moment = dt.datetime.fromtimestamp(seconds, dt.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def age(seconds: float) -> str:
    """A short age: ``3 s ago``, ``4 min ago``, ``2 h ago``, ``3 d ago`` (``in 2 s`` when ahead)."""
    ahead, seconds = seconds < 0, abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            text = f"{int(seconds // size)} {unit}"
            break
    else:
        text = f"{int(seconds)} s"
    return f"in {text}" if ahead else f"{text} ago"


def _table_cell(col: Column, value: Any) -> Text:
    """A cell as plain ``Text``: values are data, never Rich markup (``[/INST]`` in a prompt)."""
    if value is None:
        return Text("null", style="dim")
    if col.is_epoch and _finite_number(value) and _EPOCH_MIN < value < _EPOCH_MAX:
        return Text(utc_time(float(value)))
    if isinstance(value, dt.date) and (infinite := _infinite_time(value)):
        return Text(infinite)
    if isinstance(value, dt.datetime):
        moment = value.astimezone(dt.UTC) if value.tzinfo else value
        return Text(moment.isoformat(sep=" ", timespec="milliseconds").replace("+00:00", "Z"))
    if col.is_json:
        text = _compact_json(value)
    elif isinstance(value, list | tuple | asyncpg.Record):
        text = json.dumps(_plain(col, value), ensure_ascii=False, default=str)
    else:
        text = str(value)
    return Text(text if len(text) <= MAX_CELL_CHARS else text[: MAX_CELL_CHARS - 1] + "…")


def _finite_number(value: Any) -> bool:
    """A number that compares (a NaN ``Decimal`` raises on ``<``), and is finite."""
    if isinstance(value, decimal.Decimal):
        return value.is_finite()
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _compact_json(value: Any) -> str:
    try:
        return json.dumps(json.loads(value), separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def result_table(cols: Sequence[Column], rows: Sequence[Sequence[Any]], width: int) -> RenderableType:
    """The ``table`` format of a result for a terminal ``width`` characters wide.

    One table when every column fits at its natural width (at most ``MAX_COLUMN_WIDTH``), else
    one record per row.
    """
    cells = [[_table_cell(c, v) for c, v in zip(cols, row, strict=True)] for row in rows]
    natural = [
        min(MAX_COLUMN_WIDTH, max([len(c.name)] + [len(str(row[i])) for row in cells])) for i, c in enumerate(cols)
    ]
    if sum(natural) + 3 * len(cols) + 1 <= width or len(cols) == 1:
        table = Table(header_style="bold")
        for col in cols:
            table.add_column(Text(col.name), max_width=MAX_COLUMN_WIDTH, overflow="fold")
        for row_cells in cells:
            table.add_row(*row_cells)
        return table
    return Group(*(_record(i, cols, row_cells) for i, row_cells in enumerate(cells, 1)))


def _record(index: int, cols: Sequence[Column], cells: Sequence[Text]) -> Table:
    table = Table(box=None, show_header=False, pad_edge=False, title=f"row {index}", title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for col, cell in zip(cols, cells, strict=True):
        table.add_row(Text(col.name), cell)
    return table


def _infinite_time(value: Any) -> str | None:
    """``"infinity"`` / ``"-infinity"`` for the datetimes asyncpg gives for Postgres' infinite dates
    and timestamps (``datetime.max`` / ``datetime.min``, ``date.max`` / ``date.min``), as Postgres
    prints them; else ``None``."""
    if isinstance(value, dt.datetime):
        naive = value.replace(tzinfo=None)
        return "infinity" if naive == dt.datetime.max else "-infinity" if naive == dt.datetime.min else None
    if isinstance(value, dt.date):
        return "infinity" if value == dt.date.max else "-infinity" if value == dt.date.min else None
    return None


def _plain(col: Column, value: Any) -> Any:
    """A JSON-ready value: JSON columns parsed, times as ISO 8601, decimals and UUIDs as text;
    NaN and infinite numbers and times as Postgres' own JSON writes them (``"NaN"``,
    ``"Infinity"``, ``"infinity"``): strict JSON has no such numbers."""
    if value is None:
        return None
    if col.is_json:
        try:
            return json.loads(value)
        except (TypeError, ValueError):
            return value
    if isinstance(value, list | tuple):  # an array column
        return [_plain(col, v) for v in value]
    if isinstance(value, asyncpg.Record):  # a composite value: its fields by name
        return {k: _plain(col, v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return _infinite_time(value) or value.isoformat()
    if isinstance(value, decimal.Decimal | uuid.UUID | dt.timedelta | bytes | memoryview):
        return str(value) if not isinstance(value, bytes | memoryview) else bytes(value).hex()
    return value


def result_text(cols: Sequence[Column], rows: Sequence[Sequence[Any]], fmt: str) -> str:
    """The ``csv`` or ``json`` (JSON lines) text of a result, ending in a newline when not empty."""
    lines = ResultLines(cols, fmt)
    return lines.header() + "".join(lines.rows(rows))


class ResultLines:
    """A result as ``csv`` (a header line, then a line a row) or ``json`` (JSON lines), written a
    batch of rows at a time, so that a result larger than memory streams (``eventlight sql``)."""

    def __init__(self, cols: Sequence[Column], fmt: str) -> None:
        self.cols, self.fmt = list(cols), fmt
        self.names = _unique_names([c.name for c in cols])

    def header(self) -> str:
        """The line before the rows: the column names in ``csv``; nothing in ``json``."""
        return "" if self.fmt == "json" else self._csv([[c.name for c in self.cols]])

    def rows(self, rows: Sequence[Sequence[Any]]) -> list[str]:
        """One line (ending in a newline) per row, in order."""
        if self.fmt == "json":
            return [
                json.dumps(
                    {name: _plain(c, v) for name, c, v in zip(self.names, self.cols, row, strict=True)},
                    ensure_ascii=False,
                    default=str,
                )
                + "\n"
                for row in rows
            ]
        cells = []
        for row in rows:
            plain = [_plain(c, v) for c, v in zip(self.cols, row, strict=True)]
            cells.append(["" if v is None else _compact(c, v) for c, v in zip(self.cols, plain, strict=True)])
        return [self._csv(cells)] if cells else []

    @staticmethod
    def _csv(rows: list[list[Any]]) -> str:
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(rows)
        return out.getvalue()


def _unique_names(names: list[str]) -> list[str]:
    """Column names as JSON keys: a repeated name gets ``_2``, ``_3``, … (``SELECT *`` over a
    join repeats ``rollout_id``), so that no column is lost to a later one of the same name."""
    seen = set(names)
    counts: dict[str, int] = {}
    out = []
    for name in names:
        counts[name] = counts.get(name, 0) + 1
        if counts[name] == 1:
            out.append(name)
            continue
        k = counts[name]
        while f"{name}_{k}" in seen:
            k += 1
        seen.add(f"{name}_{k}")
        out.append(f"{name}_{k}")
    return out


def _compact(col: Column, value: Any) -> Any:
    """A csv cell: JSON columns, arrays and records as compact JSON, other values as they are."""
    if col.is_json or isinstance(value, list | dict):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return value
