"""Span rows read back from Postgres (``pg.span_from_row``): the typed decode of each JSON column
gives what decoding the row to Python objects and converting it gives, and rows it refuses go
that way."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from eventlight.core.types import Span
from eventlight.store.jetstream import pg

FULL = (
    "ro-1",
    "at-1",
    7,
    "a" * 32,
    "b" * 16,
    "c" * 16,
    "llm.call",
    '{"status_code": "ERROR", "description": "boom"}',
    '{"gen_ai.request.model": "m", "n": 3, "nested": {"k": [1, 2.5, null, true]}, "u": "\\u00e9 \\n"}',
    '[{"name": "e", "attributes": {"x": 1}, "timestamp": 1.25}]',
    '[{"context": {"trace_id": "d", "span_id": "e", "is_remote": true, "trace_state": {"k": "v"}},'
    ' "attributes": null}]',
    1.5,
    2.5,
    '{"trace_id": "aa", "span_id": "bb", "is_remote": false, "trace_state": {}}',
    None,
    '{"attributes": {"service.name": "svc"}, "schema_url": "https://x"}',
)


def _reference(row: tuple[Any, ...]) -> Span:
    """The row decoded to Python objects and converted as a whole (the path before the typed one)."""
    fields = pg._SPAN_FIELDS
    doc = {k: (pg.loads(v) if k in pg._SPAN_JSON else v) for k, v in zip(fields, row, strict=True)}
    return msgspec.convert(doc, Span)


def test_a_full_row_decodes_as_the_whole_conversion_does() -> None:
    span = pg.span_from_row(FULL)
    assert span == _reference(FULL)
    assert span.links[0].context.trace_state == {"k": "v"} and span.events[0].attributes == {"x": 1}
    assert span.parent is None and span.resource.attributes == {"service.name": "svc"}


def test_a_number_out_of_msgspec_range_falls_back_to_the_lenient_decode() -> None:
    """Postgres keeps ``1e5000`` in ``jsonb`` as a 5,001-digit integer; msgspec refuses it (Python's
    limit on integer digits), ``loads`` makes it ``inf``."""
    row = FULL[:8] + ('{"big": 1' + "0" * 5000 + "}",) + FULL[9:]
    span = pg.span_from_row(row)
    assert math.isinf(span.attributes["big"])
    assert span == _reference(row)


@pytest.mark.parametrize("column", [7, 8, 9, 10, 15])
def test_a_null_json_column_is_refused_as_the_conversion_refuses_it(column: int) -> None:
    row = FULL[:column] + (None,) + FULL[column + 1 :]
    with pytest.raises(msgspec.ValidationError) as typed:
        pg.span_from_row(row)
    with pytest.raises(msgspec.ValidationError) as whole:
        _reference(row)
    assert str(typed.value) == str(whole.value)


def test_a_wrongly_typed_json_column_is_refused() -> None:
    row = FULL[:9] + ('{"not": "a list"}',) + FULL[10:]
    with pytest.raises(msgspec.ValidationError, match="events"):
        pg.span_from_row(row)
