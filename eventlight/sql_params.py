"""Bound parameters of ``eventlight sql --param``: values for ``$1``, ``$2``, … never pasted into the SQL.

Each ``--param`` is text from the command line; it is converted to the type Postgres inferred for
its placeholder when the statement was prepared (``asyncpg``'s ``get_parameters``), so
``WHERE attempt_seq > $1`` takes ``--param 10`` as a number and ``WHERE status = $1`` as text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

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
