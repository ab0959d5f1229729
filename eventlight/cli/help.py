"""``--help`` that reads well at any width: typer's command and group with two things changed.

* A command's help is its docstring, whose paragraphs are broken at ~100 columns in the source.
  Typer (0.29, rich markup mode) keeps those breaks, and rich breaks each line again at the
  terminal's width: at 80 columns every other line held one or two words. Each paragraph is made
  one line here (``reflow``), and rich wraps it once.
* Typer labels each option with its Python type: a flag (``--catch-up``, ``--help``) showed
  ``<bool>``, as if it took a value, and a repeatable option ``<list[str]>``. A flag gets no label
  here, a repeatable option its element's (``<str>``; its help says it repeats), and a number
  with a range its type (``<int> [x>=1]``, not ``<int range> [x>=1]``, which took a column's
  width from the help beside it).

``ReadableCommand`` is the class of every ``eventlight`` command (``app.command(cls=...)``), and
of ``python -m bench``; ``ReadableGroup`` is the base of the ``eventlight`` group.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

__all__ = ["ReadableCommand", "ReadableGroup", "reflow"]

_LIST = re.compile(r"<list\[(?P<element>.+)\]>")
_RANGE = re.compile(r"<(?P<number>\w+) range>")


def reflow(text: str | None) -> str | None:
    """``text`` with each paragraph (separated by a blank line) on one line, its words separated
    by single spaces; ``None`` stays ``None``."""
    if text is None:
        return None
    paragraphs = re.split(r"\n\s*\n", text.strip())
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in paragraphs)


def _relabel(params: list[Any], ctx: Any) -> None:
    """Give each flag of ``params`` no type label, each repeatable option its element's and each
    number with a range its type."""
    for param in params:
        if isinstance(param, TyperArgument) and (found := _LIST.fullmatch(param.display_type(ctx))) is not None:
            # an argument's metavar is its name (usage, errors): its type label alone is changed
            setattr(param, "display_type_rich", functools.partial(_label, f"<{found['element']}>"))  # noqa: B010
        if not isinstance(param, TyperOption) or param.metavar is not None:
            continue
        if param.is_flag:
            param.metavar = ""  # typer shows the metavar instead of the type: nothing
        elif (found := _LIST.fullmatch(label := param.display_type(ctx))) is not None:
            param.metavar = f"<{found['element']}>"
        elif (found := _RANGE.fullmatch(label)) is not None:
            param.metavar = f"<{found['number']}>"  # typer adds the range after it: `<int> [x>=1]`


def _label(label: str, ctx: Any) -> str:
    return label


class _Readable:
    """What both classes below add to typer's: the help reflowed, the options relabelled."""

    help: str | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help = reflow(self.help)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _relabel(self.get_params(ctx), ctx)  # type: ignore[attr-defined]
        super().format_help(ctx, formatter)  # type: ignore[misc]


class ReadableCommand(_Readable, TyperCommand):
    """Typer's command with its help reflowed and its options labelled as the module says."""


class ReadableGroup(_Readable, TyperGroup):
    """Typer's group with its help reflowed and its options labelled as the module says (its
    commands' lines come from their own help: make them ``ReadableCommand``)."""
