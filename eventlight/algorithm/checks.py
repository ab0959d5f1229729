"""Checks of the algorithms' settings, run once at construction: one error naming the field, the
value given and what it may be, instead of a failure deep in torch, or none at all.

A value of the wrong type (a string, a bool for a number, a float for a whole number) raises
``InvalidTypeError``, one out of range (0, negative, NaN, infinite) ``InvalidInputError``; both are
``ValueError`` s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from eventlight.core.errors import InvalidInputError, InvalidTypeError
from eventlight.store.validate import is_token

MAX_SEED = 2**32 - 1
"""The largest ``seed`` (torch and numpy take 32-bit seeds; GRPO derives one per generation from it)."""

__all__ = [
    "MAX_SEED",
    "check_bool",
    "check_callable",
    "check_choice",
    "check_int",
    "check_number",
    "check_version_prefix",
]


def _shown(value: Any) -> str:
    return f"{value!r:.80} ({type(value).__name__})"


def check_int(field: str, value: Any, low: int, high: int | None = None) -> None:
    """``value`` is a whole number (not a bool) of at least ``low`` (and at most ``high``).

    Raises:
        InvalidTypeError: Not an ``int``.
        InvalidInputError: Out of range.
    """
    want = f"{field} must be a whole number " + (f">= {low}" if high is None else f"{low} to {high}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{want}, got {_shown(value)}")
    if value < low or (high is not None and value > high):
        raise InvalidInputError(f"{want}, got {value}")


def check_number(field: str, value: Any, low: float | None = None, *, above: bool = False) -> None:
    """``value`` is a finite ``int`` or ``float`` (not a bool), at least ``low`` when given (above
    it, with ``above``).

    Raises:
        InvalidTypeError: Not a number.
        InvalidInputError: NaN, infinite, or out of range.
    """
    want = f"{field} must be a finite number" + ("" if low is None else f" {'>' if above else '>='} {low:g}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidTypeError(f"{want}, got {_shown(value)}")
    if not math.isfinite(value) or (low is not None and (value < low or (above and value == low))):
        raise InvalidInputError(f"{want}, got {value!r}")


def check_bool(field: str, value: Any) -> None:
    """``value`` is ``True`` or ``False``.

    Raises:
        InvalidTypeError: Anything else (``1``, ``"false"``).
    """
    if not isinstance(value, bool):
        raise InvalidTypeError(f"{field} must be True or False, got {_shown(value)}")


def check_callable(field: str, value: Any) -> None:
    """``value`` is ``None`` or can be called (a function, a class, an object with ``__call__``),
    so that a callback given by mistake fails here, not at its first call deep in a run.

    Raises:
        InvalidTypeError: Anything else (a dict, a string, a list of callbacks).
    """
    if value is not None and not callable(value):
        raise InvalidTypeError(f"{field} must be callable or None, got {_shown(value)}")


def check_choice(field: str, value: Any, allowed: Sequence[str]) -> None:
    """``value`` is one of ``allowed``.

    Raises:
        InvalidInputError: Another value (a typo): the message lists the allowed ones.
    """
    if not isinstance(value, str) or value not in allowed:
        raise InvalidInputError(f"{field} must be one of {', '.join(map(repr, allowed))}, got {value!r:.80}")


def check_version_prefix(field: str, value: Any) -> None:
    """``value`` is ``""`` or can start a resources id (letters, digits and ``_-:@+=``, as ``is_token``).

    Raises:
        InvalidTypeError: Not a string.
        InvalidInputError: A character no id may hold (a space, a dot, a wildcard).
    """
    if not isinstance(value, str):
        raise InvalidTypeError(f"{field} must be a string, got {_shown(value)}")
    if value and not is_token(value):
        want = "letters, digits and '_-:@+=' only, at most 200 (it starts a resources id)"
        raise InvalidInputError(f"{field} must hold {want}, got {value!r:.80}")
