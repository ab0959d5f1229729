"""Prompt files that replace APO's built-in optimizer prompts (``gradient_prompt_files=``,
``apply_edit_prompt_files=``, Agent-lightning's names).

Agent-lightning's files are POML, rendered by the ``poml`` package (a Node.js process per call).
eventlight renders its prompts natively, so a file here is a plain-text (UTF-8) template of ONE
user message, filled with ``str.format``; write a literal brace as ``{{`` or ``}}``. Its
placeholders are those of the built-in variants:

* critique (gradient) files: ``{prompt_template}`` (the template under critique, verbatim),
  ``{experiments}`` (variant 01's evidence: per run its status, final reward and chat messages as
  JSON), ``{runs}`` (variant 02's evidence: per run its status, final reward and at most
  ``{max_spans}`` spans as JSON, each cut to ``{max_chars}`` characters), ``{max_spans}``,
  ``{max_chars}``; a file must use ``{prompt_template}`` and ``{experiments}`` or ``{runs}``, as
  every built-in variant shows the template and the runs;
* rewrite (apply-edit) files: ``{prompt_template}`` and ``{critique}``, both required, as in every
  built-in variant.

Each evidence placeholder gets the whole ``evidence_char_budget``. Files are read and checked once,
when ``APO`` is made.
"""

from __future__ import annotations

import os
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eventlight.algorithm.apo.models import ChatMessages, RolloutResultForAPO
from eventlight.algorithm.apo.prompts import MAX_SPANS_PER_RUN, experiments_text, span_runs_text
from eventlight.core.errors import InvalidInputError, InvalidTypeError

GRADIENT_PLACEHOLDERS = ("prompt_template", "experiments", "runs", "max_spans", "max_chars")
"""Placeholders a critique file may use."""
APPLY_EDIT_PLACEHOLDERS = ("prompt_template", "critique")
"""Placeholders a rewrite file may use."""
GRADIENT_REQUIRED = (("prompt_template",), ("experiments", "runs"))
"""Placeholders a critique file must use: one of each group (the critic sees the template and the runs)."""
APPLY_EDIT_REQUIRED = (("prompt_template",), ("critique",))
"""Placeholders a rewrite file must use (the editor sees the template and the critique)."""
_SHOWS = {
    "prompt_template": "the template to improve",
    "experiments": "the runs",
    "critique": "the critique",
}
_NUMBERS = frozenset({"max_spans", "max_chars"})


@dataclass(frozen=True)
class PromptFile:
    """One checked prompt file: its path, its text and the placeholders it uses."""

    path: Path
    text: str
    names: frozenset[str] = field(default_factory=frozenset)

    def user(self, **values: Any) -> ChatMessages:
        """The file filled with ``values`` (those it names), as one user message."""
        return [{"role": "user", "content": self.text.format(**{k: values[k] for k in self.names})}]


@dataclass(frozen=True)
class GradientFile(PromptFile):
    """A critique prompt file; called as the built-in gradient variants are."""

    def __call__(self, template: str, runs: Sequence[RolloutResultForAPO], budget_chars: int) -> ChatMessages:
        values: dict[str, Any] = {"prompt_template": template, "max_spans": MAX_SPANS_PER_RUN}
        if "experiments" in self.names:
            values["experiments"] = experiments_text(runs, budget_chars)
        if self.names & {"runs", "max_chars"}:
            values["runs"], values["max_chars"] = span_runs_text(runs, budget_chars)
        return self.user(**values)


@dataclass(frozen=True)
class ApplyEditFile(PromptFile):
    """A rewrite prompt file; called as the built-in apply-edit variants are."""

    def __call__(self, template: str, critique: str) -> ChatMessages:
        return self.user(prompt_template=template, critique=critique)


def gradient_files(field_name: str, paths: Any) -> tuple[GradientFile, ...]:
    """``paths`` read and checked as critique files; ``()`` for ``None`` or an empty list.

    Raises:
        InvalidInputError: See ``load``.
        InvalidTypeError: See ``load``.
    """
    files = load(field_name, paths, GRADIENT_PLACEHOLDERS, GRADIENT_REQUIRED)
    return tuple(GradientFile(f.path, f.text, f.names) for f in files)


def apply_edit_files(field_name: str, paths: Any) -> tuple[ApplyEditFile, ...]:
    """``paths`` read and checked as rewrite files; ``()`` for ``None`` or an empty list.

    Raises:
        InvalidInputError: See ``load``.
        InvalidTypeError: See ``load``.
    """
    files = load(field_name, paths, APPLY_EDIT_PLACEHOLDERS, APPLY_EDIT_REQUIRED)
    return tuple(ApplyEditFile(f.path, f.text, f.names) for f in files)


def load(
    field_name: str, paths: Any, placeholders: tuple[str, ...], required: tuple[tuple[str, ...], ...] = ()
) -> list[PromptFile]:
    """Read and check each of ``paths`` (a list or tuple of ``str`` or ``os.PathLike``, or ``None``):
    each may use ``placeholders`` and must use one of each group of ``required``.

    Raises:
        InvalidTypeError: ``paths`` is not a list or tuple (a single path included), or holds
            something that is no path.
        InvalidInputError: A ``.poml`` file; a file that does not exist, cannot be read or is not
            UTF-8; an empty one; one with an unknown placeholder, that ``str.format`` cannot fill,
            or that misses a required one. The message names the argument, the file and, for a
            placeholder, which.
    """
    if paths is None:
        return []
    if not isinstance(paths, list | tuple):
        raise InvalidTypeError(
            f"{field_name} must be a list of paths or None, got {paths!r:.80} ({type(paths).__name__})"
            + ("; put a single path in a list" if isinstance(paths, str | os.PathLike) else "")
        )
    return [_load_one(field_name, path, placeholders, required) for path in paths]


def _load_one(
    field_name: str, path: Any, placeholders: tuple[str, ...], required: tuple[tuple[str, ...], ...]
) -> PromptFile:
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise InvalidTypeError(f"{field_name} must hold paths (str or Path), got {path!r:.80} ({type(path).__name__})")
    path = Path(path)
    where = f"{field_name}: {str(path)!r}"
    known = ", ".join(f"{{{name}}}" for name in placeholders)
    if path.suffix.lower() == ".poml":
        raise InvalidInputError(
            f"{where} is a POML file; eventlight renders its optimizer prompts natively, without POML: "
            f"convert it to a plain-text user-message template for str.format using {known} "
            "(a literal brace written {{ or }})"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInputError(f"{where} cannot be read: {type(e).__name__}: {e}") from e
    if not text.strip():
        raise InvalidInputError(f"{where} is empty; it must be a user-message template using {known}")
    names = _check_placeholders(where, text, placeholders, known)
    for group in required:
        if names.isdisjoint(group):
            missing = " or ".join(f"{{{name}}}" for name in group)
            raise InvalidInputError(
                f"{where} never uses {missing}: every built-in variant does, to show the optimizer LLM "
                f"{_SHOWS[group[0]]} (the placeholders a file may use: {known})"
            )
    return PromptFile(path, text, names)


def _check_placeholders(where: str, text: str, placeholders: tuple[str, ...], known: str) -> frozenset[str]:
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
    except ValueError as e:
        raise InvalidInputError(
            f"{where} is not a str.format template ({e}); write a literal brace as {{{{ or }}}}"
        ) from e
    for name in names:
        if name not in placeholders:
            raise InvalidInputError(
                f"{where} uses the unknown placeholder {{{name}}}; known: {known} (a literal brace is {{{{ or }}}})"
            )
    try:
        text.format(**{name: 1 if name in _NUMBERS else "x" for name in placeholders})
    except (ValueError, KeyError, IndexError, AttributeError, TypeError) as e:
        raise InvalidInputError(f"{where} cannot be filled by str.format: {type(e).__name__}: {e}") from e
    return frozenset(names)
