"""The demos' option parser: a refused option is one ``error:`` line, as README.md says.

argparse prints its whole usage block before the error (five lines for the GRPO demo); the demos
print the error alone, and ``--help`` for the usage. Every count and number option is refused in one
form, ``error: argument --X: must be from A to B, got V`` (``V`` as typed), by its argparse type.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import NoReturn

from eventlight.algorithm.checks import MAX_COUNT
from eventlight.core.errors import InvalidInputError

USAGE_EXIT = 2
"""The demos' exit code for input refused before the run starts: an option, an ``EVENTLIGHT_*``
setting, a ``--resume`` (as argparse's own, and the CLI's for the same settings); a run that
started and failed exits 1."""


class Refused(Exception):
    """Input the demo refused before starting anything; its ``main()`` prints it as one ``error:``
    line and returns ``USAGE_EXIT``."""


@contextlib.contextmanager
def refusing() -> Iterator[None]:
    """Raise ``Refused`` (same message) for an ``InvalidInputError`` or ``FileNotFoundError`` raised
    inside: the checks of settings and ``--resume`` a demo makes before it starts a server."""
    try:
        yield
    except (InvalidInputError, FileNotFoundError) as e:
        raise Refused(str(e)) from None


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr, ``error: <why>``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}\n")


def count(low: int, high: int = MAX_COUNT) -> Callable[[str], int]:
    """argparse type of a count: a whole number from ``low`` to ``high``; else ``ArgumentTypeError``
    in the one form every count option of both demos has, with the value as typed:
    ``error: argument --steps: must be from 1 to 2147483647, got 0``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number from {low} to {high}, got {text}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {text}")
        return value

    return parse


def number(low: float, *, above: bool = False) -> Callable[[str], float]:
    """argparse type of a real option: a finite number of at least ``low`` (above it, with
    ``above``); else ``ArgumentTypeError`` with the value as typed: ``error: argument --lr: must be
    a finite number above 0, got -1``."""
    want = f"must be a finite number {'above' if above else 'of at least'} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{want}, got {text}") from None
        if not math.isfinite(value) or value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"{want}, got {text}")
        return value

    return parse


at_least_one = count(1)
"""A count of at least 1 (``--n-runners 0`` ran one runner): ``count(1)``."""
at_least_zero = count(0)
"""A count where 0 means none or a default: ``count(0)``."""


def with_option_names(message: str, owner: str, options: Mapping[str, str]) -> str:
    """``message`` (a config's error) with each ``<owner>.<field>`` it names replaced by the demo's
    option for it: ``GRPOConfig.lr`` -> ``--lr``."""
    for field, option in options.items():
        message = re.sub(rf"\b{re.escape(owner)}\.{field}\b", option, message)
    return message
