"""Filtering, sorting and paging of in-memory records, with the semantics of ``query_*``.

Shared by the in-memory backend; the Postgres backend expresses the same rules in SQL
(``eventlight.store.sql``). Semantics follow ``reference_store.md``: ``*_in`` is membership (an
empty list matches nothing), ``*_contains`` is a substring test, conditions combine with
``filter_logic``, no conditions match everything, ``limit=-1`` is unlimited, ``total`` counts
matches before paging, and ``None`` sorts last in ascending order.
"""

from __future__ import annotations

import functools
import typing
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import msgspec

from eventlight.core.errors import InvalidInputError, InvalidTypeError
from eventlight.core.types import PaginatedResult

T = TypeVar("T")
Condition = Callable[[Any], bool]


def check_paging(limit: int, offset: int, sort_order: str, filter_logic: str = "and") -> None:
    """Validate paging arguments.

    Raises:
        InvalidTypeError: ``limit`` or ``offset`` is not an int (also a ``TypeError``, as in 0.3.0).
        InvalidInputError: ``limit`` < -1, ``offset`` < 0, or an unknown order or logic.
    """
    for name, value in (("limit", limit), ("offset", offset)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidTypeError(f"{name} must be an int, got {value!r}")
    if limit < -1:
        raise InvalidInputError(f"limit must be -1 (unlimited) or >= 0, got {limit}")
    if offset < 0:
        raise InvalidInputError(f"offset must be >= 0, got {offset}")
    if sort_order not in ("asc", "desc"):
        raise InvalidInputError(f"sort_order must be 'asc' or 'desc', got {sort_order!r}")
    if filter_logic not in ("and", "or"):
        raise InvalidInputError(f"filter_logic must be 'and' or 'or', got {filter_logic!r}")


def deprecated_alias(new: Any, old: Any, new_name: str, old_name: str) -> Any:
    """Resolve a deprecated ``query_rollouts`` alias (``status``, ``rollout_ids``).

    The new parameter wins when both are given (``reference_store.md``); using the old one emits a
    ``DeprecationWarning`` as Agent-lightning 0.3.0 does.
    """
    if old is None:
        return new
    warnings.warn(f"{old_name}= is deprecated; use {new_name}=", DeprecationWarning, stacklevel=3)
    return old if new is None else new


_SORTABLE = (str, int, float)


def check_sort_field(cls: type, sort_by: str | None) -> None:
    """Raises ``InvalidInputError`` if ``sort_by`` is not a string or number field of ``cls``
    (``spec/seed_store_types.md``: "numeric or string field")."""
    if sort_by is None:
        return
    fields = _field_types(cls)
    if not isinstance(sort_by, str) or sort_by not in fields:
        raise InvalidInputError(f"cannot sort {cls.__name__} by unknown field {sort_by!r}")
    kinds = typing.get_args(fields[sort_by]) or (fields[sort_by],)
    if not all(k in _SORTABLE or k is type(None) for k in kinds):
        raise InvalidInputError(f"cannot sort {cls.__name__} by {sort_by!r}: not a string or number field")


def is_text_field(cls: type, name: str) -> bool:
    """Whether ``cls``'s field ``name`` holds strings (``str`` or ``str | None``)."""
    kinds = typing.get_args(_field_types(cls)[name]) or (_field_types(cls)[name],)
    return str in kinds


@functools.lru_cache(maxsize=32)
def _field_types(cls: type) -> dict[str, Any]:
    """``{field name: annotation}`` of a struct type (``msgspec.structs.fields`` resolves the
    annotations on every call: ~40 µs, once per query otherwise)."""
    return {f.name: f.type for f in msgspec.structs.fields(cls)}


def check_values(field: str, values: Any) -> list[Any] | None:
    """A ``*_in`` filter's values as a list: a sequence of strings, or ``None`` (no filter).

    Raises:
        InvalidTypeError: A lone string (``status_in="queuing"`` would be read as its characters),
            a non-sequence, or a value that is not a string.
    """
    if values is None:
        return None
    if isinstance(values, (str, bytes)):
        raise InvalidTypeError(f"{field} filter must be a list of strings, got the string {values!r}; use [{values!r}]")
    if not isinstance(values, Iterable):
        raise InvalidTypeError(f"{field} filter must be a list of strings, got {type(values).__name__}")
    out = list(values)
    for v in out:
        if not isinstance(v, str):
            raise InvalidTypeError(f"{field} filter values must be strings, got {v!r}")
    return out


def within(field: str, values: Sequence[Any] | None) -> Condition | None:
    values = check_values(f"{field}_in", values)
    if values is None:
        return None
    allowed = set(values)
    return lambda item: getattr(item, field) in allowed


def contains(field: str, needle: str | None) -> Condition | None:
    if needle is None:
        return None
    return lambda item: (v := getattr(item, field)) is not None and needle in v


def exact(field: str, value: Any | None) -> Condition | None:
    if value is None:
        return None
    return lambda item: getattr(item, field) == value


def select(
    items: Iterable[T],
    conditions: Sequence[Condition | None],
    *,
    filter_logic: str = "and",
    sort_by: str | None = None,
    sort_order: str = "asc",
    limit: int = -1,
    offset: int = 0,
) -> PaginatedResult[T]:
    """Filter, sort and page ``items``."""
    conds = [c for c in conditions if c is not None]
    if not conds:
        matched = list(items)
    elif filter_logic == "or":
        matched = [i for i in items if any(c(i) for c in conds)]
    else:
        matched = [i for i in items if all(c(i) for c in conds)]
    if sort_by is not None:
        present = [i for i in matched if getattr(i, sort_by) is not None]
        missing = [i for i in matched if getattr(i, sort_by) is None]
        present.sort(key=lambda i: getattr(i, sort_by), reverse=sort_order == "desc")
        matched = present + missing if sort_order == "asc" else missing + present
    total = len(matched)
    page = matched[offset:] if limit == -1 else matched[offset : offset + limit]
    return PaginatedResult(page, limit=limit, offset=offset, total=total)
