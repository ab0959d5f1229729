"""Checks of the algorithms' settings, run once at construction: one error naming the field, the
value given and what it may be, instead of a failure deep in torch, or none at all.

A value of the wrong type (a string, a bool for a number, a float for a whole number) raises
``InvalidTypeError``, one out of range (0, negative, NaN, infinite, an integer past a float's range
for a number, a whole number past ``MAX_COUNT`` / ``MAX_TOKENS``) ``InvalidInputError``; both are
``ValueError`` s. NumPy's integers, floats and bools are taken as Python's (a sweep over
``np.arange`` hands ``np.int64`` s): each check returns the value as a Python ``int``, ``float`` or
``bool``, which the caller keeps.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from eventlight.core.errors import InvalidInputError, InvalidTypeError
from eventlight.store.validate import is_token

MAX_SEED = 2**32 - 1
"""The largest ``seed`` (torch and numpy take 32-bit seeds; GRPO derives one per generation from it)."""

MAX_COUNT = 2**31 - 1
"""The largest step, epoch, batch, group, beam, queue or checkpoint count: the largest signed 32-bit
integer. Each is a number of optimizer steps, rollouts, requests or files, where anything near it is
a typo, and the libraries they reach (torch, numpy, the Trainer of transformers/TRL: ``max_steps``,
batch sizes) hold them in 32- or 64-bit integers: a larger one failed, if at all, deep inside them."""

MAX_TOKENS = 2**31 - 1
"""The largest token count (``max_new_tokens``, ``max_seq_len``, ``optimizer_max_tokens``): the
largest signed 32-bit integer, as llama.cpp's ``n_ctx`` / ``n_predict`` (``int32_t``) take them,
and far past any model's context (``max_new_tokens=10**30`` failed inside torch)."""

__all__ = [
    "MAX_COUNT",
    "MAX_SEED",
    "MAX_TOKENS",
    "check_bool",
    "check_callable",
    "check_choice",
    "check_int",
    "check_number",
    "check_version_prefix",
    "set_checked",
]


def _shown(value: Any) -> str:
    kind = type(value)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
    return f"{_number(value):.80} ({name})"


def _number(value: Any) -> str:
    """``repr(value)``; an integer of more than 64 bits by its size (its digits may be thousands,
    past what Python turns into text)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value).bit_length() > 64:
        return f"{'a negative' if value < 0 else 'an'} integer of {int(value).bit_length()} bits"
    return repr(value)


def _is_numpy_bool(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def check_int(field: str, value: Any, low: int, high: int | None = None, *, why: str = "") -> int:
    """``value`` is a whole number (not a bool; a NumPy integer too) of at least ``low`` (and at most ``high``).

    Args:
        field: Named in the error (``"GRPOConfig.steps"``).
        value: What was given.
        low: The smallest allowed.
        high: The largest allowed (``None``: no bound).
        why: Put after the range in the error, e.g. ``" (below max_seq_len 512)"``.

    Returns:
        ``value`` as a Python ``int``.

    Raises:
        InvalidTypeError: Not an integer.
        InvalidInputError: Out of range.
    """
    want = f"{field} must be a whole number " + (f">= {low}" if high is None else f"{low} to {high}") + why
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidTypeError(f"{want}, got {_shown(value)}")
    whole = int(value)
    if whole < low or (high is not None and whole > high):
        raise InvalidInputError(f"{want}, got {_number(whole)}")
    return whole


def check_number(field: str, value: Any, low: float | None = None, *, above: bool = False) -> int | float:
    """``value`` is a finite real number (an ``int``, a ``float``, a NumPy number; not a bool), at
    least ``low`` when given (above it, with ``above``).

    Returns:
        ``value`` as a Python ``int`` (an integer) or ``float`` (anything else).

    Raises:
        InvalidTypeError: Not a number.
        InvalidInputError: NaN, infinite, an integer past a float's range (``10**400``), or out of range.
    """
    want = f"{field} must be a finite number" + ("" if low is None else f" {'>' if above else '>='} {low:g}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidTypeError(f"{want}, got {_shown(value)}")
    number = int(value) if isinstance(value, numbers.Integral) else float(value)
    try:
        finite = math.isfinite(number)
    except OverflowError:  # an int no float can hold: torch and the arithmetic on it would fail later
        finite = False
    if not finite or (low is not None and (number < low or (above and number == low))):
        raise InvalidInputError(f"{want}, got {_number(number)}")
    return number


def check_bool(field: str, value: Any) -> bool:
    """``value`` is ``True`` or ``False`` (NumPy's too).

    Returns:
        ``value`` as a Python ``bool``.

    Raises:
        InvalidTypeError: Anything else (``1``, ``"false"``).
    """
    if not isinstance(value, bool) and not _is_numpy_bool(value):
        raise InvalidTypeError(f"{field} must be True or False, got {_shown(value)}")
    return bool(value)


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


def set_checked(config: Any, field: str, value: Any) -> None:
    """Set ``field`` of a frozen dataclass ``config`` (from its ``__post_init__``) to ``value``, as
    a check returned it (a NumPy integer kept as a Python ``int``)."""
    object.__setattr__(config, field, value)
