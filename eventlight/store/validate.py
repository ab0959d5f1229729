"""Input checks shared by both backends: ids that become NATS subject tokens, spans, resources."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from eventlight.errors import InvalidInputError
from eventlight.types import LLM, PromptTemplate, ProxyLLM, Span

_TOKEN = re.compile(r"^[A-Za-z0-9_\-:@+=]{1,200}$")


def check_token(what: str, value: Any) -> str:
    """Validate an id that becomes a NATS subject token (no dots, spaces or wildcards).

    Raises:
        InvalidInputError: ``value`` is not such a string.
    """
    if not isinstance(value, str) or not _TOKEN.match(value):
        raise InvalidInputError(
            f"{what} {value!r} is not a valid id: use 1-200 letters, digits or '_-:@+=' (no dots or spaces)"
        )
    return value


def check_spans(spans: Sequence[Any]) -> None:
    """Validate spans before anything is written.

    Raises:
        InvalidInputError: An item is not a ``Span``, or lacks its rollout, attempt or span id, or
            has a negative sequence id.
    """
    for i, span in enumerate(spans):
        if not isinstance(span, Span):
            raise InvalidInputError(f"span #{i} is a {type(span).__name__}, not an eventlight Span")
        if not span.rollout_id or not span.attempt_id:
            raise InvalidInputError(f"span #{i} ({span.name!r}) lacks rollout_id or attempt_id")
        if span.attempt_id == "latest":
            raise InvalidInputError(f"span #{i} ({span.name!r}) must name its attempt id, not 'latest'")
        if not span.span_id or not span.trace_id:
            raise InvalidInputError(f"span #{i} ({span.name!r}) lacks span_id or trace_id")
        if not isinstance(span.sequence_id, int) or span.sequence_id < 0:
            raise InvalidInputError(f"span #{i} ({span.name!r}) has an invalid sequence_id {span.sequence_id!r}")


def check_resources(resources: Mapping[str, Any]) -> None:
    """Validate named resources.

    Raises:
        InvalidInputError: Not a mapping of names to ``LLM``/``ProxyLLM``/``PromptTemplate``.
    """
    if not isinstance(resources, Mapping):
        raise InvalidInputError(f"resources must be a dict of name -> resource, got {type(resources).__name__}")
    for name, res in resources.items():
        if not isinstance(name, str) or not isinstance(res, (LLM, ProxyLLM, PromptTemplate)):
            raise InvalidInputError(f"resource {name!r} is a {type(res).__name__}, not an LLM or PromptTemplate")
