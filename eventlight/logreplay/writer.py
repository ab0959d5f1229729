"""Record files: JSON lines or Parquet, the same records in the same order, byte for byte the same
for the same input.

* ``.jsonl``: one JSON object a line, keys sorted (msgspec), nested values as they are; loads with
  ``pandas.read_json(lines=True)`` and ``datasets.load_dataset("json", data_files=...)``.
* ``.parquet``: the provenance fields as typed columns (strings, int64, double,
  ``log_positions: list<int64>``), ``reward`` as double, and every other field as JSON text (the
  adapters' prompts, responses and messages differ in shape from row to row, which Parquet's one
  schema per file cannot hold); loads with ``pyarrow.parquet.read_table``, ``pandas.read_parquet``
  and ``datasets.load_dataset("parquet", ...)``. Needs the ``replay`` extra (pyarrow). The columns
  are every field of any record; a record without one has ``null`` there, where its JSON line has
  no key (``ParquetWriter``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import msgspec

from eventlight.core.errors import InvalidInputError
from eventlight.logreplay.files import temporary_beside
from eventlight.logreplay.records import PROVENANCE

ROW_GROUP = 4096


def _json_value(value: Any) -> Any:
    """A value msgspec does not encode itself, as JSON data: a NumPy array or scalar (or anything
    else with ``tolist()``, a torch tensor) as its ``tolist()``, a pydantic model as its
    ``model_dump(mode="json")``.

    Raises:
        TypeError: Anything else: its ``repr`` is no data (a NumPy int was written ``"np.int64(5)"``)
            and may hold a memory address, which would give other bytes on each replay.
    """
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    kind = type(value)
    raise TypeError(f"a {kind.__module__}.{kind.__qualname__} is no JSON value (give lists, dicts, strings, numbers)")


_encoder = msgspec.json.Encoder(order="sorted", enc_hook=_json_value)


def to_json(value: Any) -> bytes:
    """Deterministic JSON (sorted keys; NumPy values as lists and numbers, ``_json_value``).

    Raises:
        TypeError: A value of a type that has no JSON form (``_json_value``).
    """
    return _encoder.encode(value)


class UnwritableError(InvalidInputError):
    """An attempt's records cannot be written (a value the JSON encoder refuses, such as a dict with
    int keys); nothing of that attempt was written."""


def _encoded(record: dict[str, Any], fields: Any = None) -> bytes:
    """``to_json`` of the record (of its ``fields`` only, when given), its error as ``UnwritableError``."""
    try:
        return to_json(record if fields is None else {k: v for k, v in record.items() if k in fields})
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as e:
        raise UnwritableError(f"{type(e).__name__}: {e}") from e


class RecordWriter(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def write_attempt(self, records: list[dict[str, Any]]) -> None:
        """Write one attempt's records, all or none.

        Raises:
            UnwritableError: One of them cannot be encoded; none was written.
        """

    def close(self) -> None: ...


class JsonlWriter:
    """Writes ``path`` as JSON lines."""

    def __init__(self, path: Path):
        self.path = path
        self._f = path.open("wb")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(to_json(record) + b"\n")

    def write_attempt(self, records: list[dict[str, Any]]) -> None:
        """``RecordWriter.write_attempt``."""
        lines = [_encoded(r) + b"\n" for r in records]  # all encoded before any is written
        self._f.write(b"".join(lines))

    def close(self) -> None:
        self._f.close()


_TYPES = {
    "rollout_id": "string",
    "attempt_id": "string",
    "attempt_sequence_id": "int64",
    "index": "int64",
    "mode": "string",
    "status": "string",
    "resources_id": "string",
    "resources_version": "int64",
    "final_reward": "float64",
    "attempt_seq": "int64",
    "log_positions": "list<int64>",
    "reward": "float64",
}


class ParquetWriter:
    """Writes ``path`` as Parquet in row groups of ``ROW_GROUP`` records. The columns are the
    provenance, then every other field that any record has, sorted; a record without one has
    ``null`` there.

    A Parquet file has one set of columns, and the records stream through (a custom adapter may add
    a field to a few records only, late in the replay): when a row group brings a field the ones
    written lack, the file so far is set aside beside ``path`` and the writing goes on in a new one
    with the new columns. ``close`` then copies the files set aside and the last one into ``path``,
    one row group at a time, with every column (``null`` in the rows written before it appeared),
    and removes them. A replay whose fields all appear in its first row group is written once.
    """

    def __init__(self, path: Path):
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as e:
            raise InvalidInputError(
                "Parquet output needs pyarrow: pip install 'eventlight[replay]' (or write .jsonl)"
            ) from e
        self.pa, self.pq = pa, pq
        self.path = path
        self._rows: list[dict[str, Any]] = []
        self._schema: Any = None
        self._writer: Any = None
        self._set_aside: list[Path] = []
        """Files of the row groups written before a field appeared, in order."""

    def _arrow_type(self, name: str) -> Any:
        kind = _TYPES.get(name, "json")
        if kind == "list<int64>":
            return self.pa.list_(self.pa.int64())
        return self.pa.string() if kind == "json" else getattr(self.pa, kind)()

    def _make_schema(self, names: set[str]) -> Any:
        extra = sorted(names - set(PROVENANCE))
        return self.pa.schema([(n, self._arrow_type(n)) for n in [*PROVENANCE, *extra]])

    def _cell(self, name: str, value: Any) -> Any:
        if name in _TYPES or value is None:
            return value
        return to_json(value).decode()

    def write(self, record: dict[str, Any]) -> None:
        self._rows.append(record)
        if len(self._rows) >= ROW_GROUP:
            self._flush()

    def write_attempt(self, records: list[dict[str, Any]]) -> None:
        """``RecordWriter.write_attempt``: the fields stored as JSON text are encoded first."""
        for r in records:
            _encoded(r, r.keys() - _TYPES.keys())
        for r in records:
            self.write(r)

    def _flush(self) -> None:
        names = {k for r in self._rows for k in r}
        if self._schema is None or not names <= set(self._schema.names):
            self._widen(names | set(self._schema.names if self._schema is not None else ()))
        columns = {n: [self._cell(n, r.get(n)) for r in self._rows] for n in self._schema.names}
        self._writer.write_table(self.pa.table(columns, schema=self._schema))
        self._rows = []

    def _widen(self, names: set[str]) -> None:
        """Go on writing with the columns ``names``; what was written so far is set aside."""
        if self._writer is not None:
            self._writer.close()
            aside = temporary_beside(self.path)
            self._set_aside.append(aside)
            os.replace(self.path, aside)
        self._schema = self._make_schema(names)
        self._writer = self.pq.ParquetWriter(self.path, self._schema)

    def close(self) -> None:
        try:
            if self._rows or self._schema is None:
                self._flush()
            self._writer.close()
            if self._set_aside:
                self._widen(set(self._schema.names))  # the last file is set aside too
                for part in self._set_aside:
                    self._copy(part)
                self._writer.close()
        finally:
            for part in self._set_aside:
                with contextlib.suppress(OSError):
                    part.unlink()
            self._set_aside = []

    def _copy(self, part: Path) -> None:
        """Write ``part``'s row groups with the file's columns, ``null`` in those it lacks."""
        with self.pq.ParquetFile(part) as source:
            for i in range(source.num_row_groups):
                group = source.read_row_group(i)
                columns = [
                    group.column(f.name) if f.name in group.column_names else self.pa.nulls(group.num_rows, f.type)
                    for f in self._schema
                ]
                self._writer.write_table(self.pa.Table.from_arrays(columns, schema=self._schema))


def writer_for(path: Path) -> Callable[[Path], RecordWriter]:
    """The writer (a class) for ``path`` by its suffix (``.jsonl`` or ``.parquet``), without opening
    ``path``: a caller checks the name before it connects to anything. Calling the Parquet one
    without pyarrow raises ``InvalidInputError``.

    Raises:
        InvalidInputError: Another suffix.
    """
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return JsonlWriter
    if suffix == ".parquet":
        return ParquetWriter
    raise InvalidInputError(f"--out {path}: expected a .jsonl or .parquet file name")
