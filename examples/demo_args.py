"""The demos' option parser: a refused option is one ``error:`` line, as README.md says.

argparse prints its whole usage block before the error (five lines for the GRPO demo); the demos
print the error alone, and ``--help`` for the usage.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr, ``error: <why>``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}\n")


def at_least_one(text: str) -> int:
    """argparse type of a count: a whole number >= 1 (``--n-runners 0`` ran one runner)."""
    return _whole(text, 1, "must be at least 1")


def at_least_zero(text: str) -> int:
    """argparse type of a count where 0 means none or a default: a whole number >= 0, refused in
    the same form as ``at_least_one`` (``argument --rounds: must be 0 or more, got -1``)."""
    return _whole(text, 0, "must be 0 or more")


def _whole(text: str, low: int, refused: str) -> int:
    """``text`` as a whole number of at least ``low``; else ``ArgumentTypeError``, ``<refused>, got <value>``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{refused}, got {value}")
    return value


def with_option_names(message: str, owner: str, options: Mapping[str, str]) -> str:
    """``message`` (a config's error) with each ``<owner>.<field>`` it names replaced by the demo's
    option for it: ``GRPOConfig.lr`` -> ``--lr``."""
    for field, option in options.items():
        message = re.sub(rf"\b{re.escape(owner)}\.{field}\b", option, message)
    return message
