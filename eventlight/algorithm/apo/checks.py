"""Checks on rewritten templates: placeholder names, formatting, code fences; log prefixes."""

from __future__ import annotations

import re
import string
from typing import Any

# ------------------------------------------------------------------------------------------
# Checking rewritten templates


class _Blank:
    """Stands in for any placeholder value: every attribute, item and format spec works."""

    def __getattr__(self, name: str) -> _Blank:
        return self

    def __getitem__(self, key: Any) -> _Blank:
        return self

    def __format__(self, spec: str) -> str:
        return ""


def _field_names(template: str) -> set[str] | None:
    """Top-level placeholder names of an f-string template; ``None`` if it does not parse."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError:
        return None
    return {re.split(r"[.\[]", name, maxsplit=1)[0] for name in fields}


def _format_error(template: str, names: set[str]) -> str | None:
    """Why ``template.format(**{name: ...})`` fails, or ``None`` if it formats."""
    try:
        template.format(**{name: _Blank() for name in names})
    except (KeyError, ValueError, IndexError, AttributeError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _prefix(round_no: int, beam_no: int, branch_no: int, version: str) -> str:
    return f"[Round {round_no:02d} | Beam {beam_no:02d} | Branch {branch_no:02d} | Prompt {version}]"


def _clean_edit(text: str) -> str:
    """Strip whitespace and one enclosing Markdown code fence from an optimizer's rewrite."""
    text = text.strip()
    fenced = re.fullmatch(r"```[\w-]*\n(.*)\n```", text, flags=re.DOTALL)
    return fenced.group(1).strip() if fenced else text
