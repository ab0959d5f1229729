"""Token ids in a chat completion, wherever the backend or LiteLLM put them.

vLLM (>= 0.10.2) with ``return_token_ids: true`` answers with a top-level ``prompt_token_ids`` and a
``token_ids`` list per choice; LiteLLM (1.110) keeps both and copies the choice's ids into
``choices[i].provider_specific_fields.token_ids``. Other placements seen behind LiteLLM:

=============================================================== ==========================================
``prompt_token_ids``                                            vLLM chat completions (top level)
``provider_specific_fields.prompt_token_ids``                   a provider transformation that moves it
``choices[0].prompt_token_ids``                                 vLLM's completions API shape (per choice)
``choices[0].provider_specific_fields.prompt_token_ids``        LiteLLM, given the per-choice shape
``choices[i].token_ids``                                        vLLM chat completions
``choices[i].provider_specific_fields.token_ids``               LiteLLM's copy (sometimes the only one)
``choices[i].message.provider_specific_fields.token_ids``       a provider that attaches them to the message
``response_token_ids`` (list of lists)                          Agent-lightning's instrumented older vLLM
=============================================================== ==========================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eventlight.adapter.attrs import TOKEN_IDS_INCOMPLETE, TOKEN_IDS_MISSING

MISSING_ATTRIBUTE = TOKEN_IDS_MISSING
INCOMPLETE_ATTRIBUTE = TOKEN_IDS_INCOMPLETE


def int_list(value: Any) -> list[int] | None:
    """``value`` as a list of ints, or ``None`` if it is not one."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _choices(response: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    raw = response.get("choices")
    return [c for c in raw if isinstance(c, Mapping)] if isinstance(raw, list) else []


def prompt_token_ids(response: Mapping[str, Any]) -> list[int] | None:
    """The prompt's ids from the first placement that holds a list of ints, else ``None``."""
    choices = _choices(response)
    first = choices[0] if choices else {}
    for holder in (response, _mapping(response.get("provider_specific_fields")), first):
        ids = int_list(holder.get("prompt_token_ids"))
        if ids is not None:
            return ids
    return int_list(_mapping(first.get("provider_specific_fields")).get("prompt_token_ids"))


def choice_token_ids(choice: Mapping[str, Any]) -> list[int] | None:
    """One choice's completion ids (``token_ids`` on the choice, in its provider fields or its message's)."""
    message = _mapping(choice.get("message"))
    for holder in (
        choice,
        _mapping(choice.get("provider_specific_fields")),
        _mapping(message.get("provider_specific_fields")),
    ):
        ids = int_list(holder.get("token_ids"))
        if ids is not None:
            return ids
    return None


def token_ids(response: Mapping[str, Any]) -> tuple[list[int] | None, list[list[int]]]:
    """Prompt ids and the per-choice completion ids (choices without ids left out) of a completion."""
    per_choice = [ids for ids in map(choice_token_ids, _choices(response)) if ids is not None]
    if not per_choice:  # older instrumented vLLM: top-level list of lists
        legacy = response.get("response_token_ids")
        if isinstance(legacy, list):
            per_choice = [ids for ids in (int_list(x) for x in legacy) if ids is not None]
    return prompt_token_ids(response), per_choice


def normalize(completion: dict[str, Any]) -> None:
    """Put the ids where vLLM does (top-level ``prompt_token_ids``, ``choices[i].token_ids``), in place,
    so a client sees one shape whichever placement the backend used."""
    prompt = prompt_token_ids(completion)
    if prompt is not None and completion.get("prompt_token_ids") is None:
        completion["prompt_token_ids"] = prompt
    legacy = completion.get("response_token_ids")
    legacy = legacy if isinstance(legacy, list) else []
    for n, choice in enumerate(completion.get("choices") or []):
        if isinstance(choice, dict) and choice.get("token_ids") is None:
            ids = choice_token_ids(choice)
            if ids is None and n < len(legacy):
                ids = int_list(legacy[n])
            if ids is not None:
                choice["token_ids"] = ids


def token_id_marks(
    response: Mapping[str, Any], prompt: list[int] | None, per_choice: list[list[int]]
) -> dict[str, Any]:
    """The marks of missing or incomplete ids for a successful call (``{}`` when all is there).

    Incomplete: the completion ids do not add up to ``usage.completion_tokens``, or the prompt ids
    to ``usage.prompt_tokens`` (peer failure C14: a truncated id list trains on the wrong tokens).
    """
    marks: dict[str, Any] = {}
    missing = [what for what, ok in (("prompt", prompt is not None), ("response", bool(per_choice))) if not ok]
    if missing:
        marks[MISSING_ATTRIBUTE] = missing
    usage = _mapping(response.get("usage"))
    completion_tokens, prompt_tokens = usage.get("completion_tokens"), usage.get("prompt_tokens")
    if per_choice and isinstance(completion_tokens, int) and sum(map(len, per_choice)) != completion_tokens:
        marks[INCOMPLETE_ATTRIBUTE] = True
    if prompt is not None and isinstance(prompt_tokens, int) and prompt_tokens and len(prompt) != prompt_tokens:
        marks[INCOMPLETE_ATTRIBUTE] = True
    return marks
