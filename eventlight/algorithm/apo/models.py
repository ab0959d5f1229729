"""APO's candidate and rollout-result shapes, and its type aliases."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict, TypeVar

import msgspec

from eventlight.adapter import OpenAIMessages
from eventlight.core.types import (
    PromptTemplate,
)

T_task = TypeVar("T_task")
ProgressCallback = Callable[[dict[str, Any]], None]
ChatMessages = list[dict[str, str]]


class VersionedPromptTemplate(msgspec.Struct, kw_only=True):
    """A candidate prompt. ``version`` ("v0", "v1", ...) is also its resources id in the store.

    Attributes:
        version: Per-instance counter; the seed is ``v0`` on the first run.
        prompt_template: The template.
        score: Its latest validation score (mean final reward on a mini-batch), if evaluated.
    """

    version: str
    prompt_template: PromptTemplate
    score: float | None = None


class RolloutResultForAPO(TypedDict):
    """One finished rollout as the critic sees it (JSON-serialisable).

    Attributes:
        status: The rollout status (``succeeded``, ``failed``, ``cancelled``).
        final_reward: ``find_final_reward`` of its latest attempt's spans, or ``None``.
        spans: The spans as builtins dicts.
        messages: ``TraceToMessages.adapt`` of the spans.
    """

    status: str
    final_reward: float | None
    spans: list[dict[str, Any]]
    messages: list[OpenAIMessages]
