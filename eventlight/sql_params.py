"""Bound parameters of ``eventlight sql --param``: values for ``$1``, ``$2``, … never pasted into the SQL.

Each ``--param`` is text from the command line; it is converted to the type Postgres inferred for
its placeholder when the statement was prepared (``asyncpg``'s ``get_parameters``), so
``WHERE attempt_seq > $1`` takes ``--param 10`` as a number and ``WHERE status = $1`` as text.
A placeholder of any other type (``timestamptz``, ``date``, ``interval``, arrays, ``bytea``, …)
takes its text as Postgres reads a literal of that type (``'2024-05-01 12:00Z'``, ``'{a,b}'``):
:func:`bind_on` has the server parse it (``$1::text::<type>``) and binds the parsed value, unless
that value would not come back unchanged (an interval with months: asyncpg counts one as 30 days).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import asyncpg

from eventlight.core.errors import InvalidInputError

_INTS = {"int2", "int4", "int8", "oid"}
_FLOATS = {"float4", "float8"}
_KINDS = {
    **dict.fromkeys(_INTS, "a whole number"),
    **dict.fromkeys(_FLOATS, "a number"),
    "numeric": "a number",
    "bool": "true or false",
    "json": "JSON",
    "jsonb": "JSON",
}
"""How a message names what a placeholder of each Postgres type takes."""
_AS_TEXT = {"text", "varchar", "bpchar", "char", "name", "unknown"}
"""Types whose placeholder takes the text as it is (asyncpg encodes a ``str`` for them)."""
_BOOLS = {"true": True, "t": True, "1": True, "yes": True, "false": False, "f": False, "0": False, "no": False}


def _convert(text: str, type_name: str, i: int) -> Any:
    try:
        if type_name in _INTS:
            return int(text)
        if type_name in _FLOATS:
            return float(text)
        if type_name == "numeric":
            from decimal import Decimal

            return Decimal(text)
        if type_name == "bool":
            return _BOOLS[text.lower()]
        if type_name in ("json", "jsonb"):
            json.loads(text)
            return text
    except (ValueError, KeyError, ArithmeticError) as e:
        raise InvalidInputError(
            f"--param ${i} {text!r} is not {_KINDS.get(type_name, type_name)} (Postgres takes ${i} as {type_name})"
        ) from e
    return text


def bind(params: Sequence[str], types: Sequence[Any]) -> list[Any]:
    """The values for a prepared statement's placeholders.

    Args:
        params: The ``--param`` texts, in placeholder order.
        types: The statement's parameter types (``stmt.get_parameters()``; each has a ``name``).

    Raises:
        InvalidInputError: A count that differs from the placeholders, or a text not of its type.
    """
    if len(params) != len(types):
        raise InvalidInputError(f"the query has {len(types)} placeholder(s) ($1…) and {len(params)} --param given")
    return [_convert(p, t.name, i) for i, (p, t) in enumerate(zip(params, types, strict=True), start=1)]


async def bind_on(conn: asyncpg.Connection, params: Sequence[str], types: Sequence[Any]) -> list[Any]:
    """:func:`bind`, with the values of the other types parsed by the server ``conn`` is on.

    Args:
        conn: The connection the statement was prepared on (inside its transaction).
        params: The ``--param`` texts, in placeholder order.
        types: The statement's parameter types (``stmt.get_parameters()``; ``name`` and ``oid``).

    Raises:
        InvalidInputError: As :func:`bind`; or Postgres cannot read a text as its placeholder's type,
            or the value it reads would be bound changed.
    """
    values = bind(params, types)
    for k, (text, t) in enumerate(zip(params, types, strict=True)):
        if t.name not in _KINDS and t.name not in _AS_TEXT:
            values[k] = await _parsed(conn, text, t.oid, k + 1)
    return values


async def _parsed(conn: asyncpg.Connection, text: str, oid: int, i: int) -> Any:
    type_sql = await conn.fetchval("SELECT format_type($1::oid, NULL)", oid)  # quoted as SQL writes it
    try:
        value = await conn.fetchval(f"SELECT $1::text::{type_sql}", text)
        bound, meant = await conn.fetchrow(f"SELECT $1::{type_sql}::text, $2::text::{type_sql}::text", value, text)
    except (asyncpg.PostgresError, asyncpg.InterfaceError) as e:
        raise InvalidInputError(
            f"--param ${i} {text!r} is not a valid {type_sql} (Postgres takes ${i} as {type_sql}: {e})"
        ) from e
    if bound != meant:  # asyncpg's interval is a timedelta: a month becomes 30 days
        raise InvalidInputError(
            f"--param ${i} {text!r} would be bound as {bound!r}, not {meant!r} ({type_sql}):"
            " write this value into the statement"
        )
    return value
