"""From conversations (``TraceToMessages`` records) to token ids with a loss mask on the model's own tokens.

A conversation is rendered with the model's chat template once in full and once up to each
trained assistant turn with the generation prompt; the characters between the two are the
assistant's, and the tokens that fall inside them (up to and including the end-of-turn token,
e.g. ``<|im_end|>``, so the model learns to stop) keep their id as label. Every other token —
system and user turns, tool outputs, role headers, separators after the end-of-turn token — gets
``-100`` and receives no gradient. Offsets come from one tokenization of the whole text, so a
token that a BPE merge draws across a boundary is never split.

Which assistant turns train: ``"last"`` (default) the completion of the recorded LLM call, i.e.
the assistant messages after the last non-assistant one (earlier assistant turns are the prompt's
history and are trained in their own records); ``"all"`` every assistant message.

Conversations that cannot train are skipped and counted by reason (``skipped``): no assistant
turn, a template that does not render the conversation or does not extend its own prefix, no
assistant token left, longer than ``max_len`` tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Example", "encode_conversation", "encode_conversations"]

IGNORE = -100
TrainOn = Literal["last", "all"]


class _Skip(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Example:
    """One trainable sequence: token ids and labels (``-100`` where no loss is taken)."""

    input_ids: list[int]
    labels: list[int]

    @property
    def n_loss_tokens(self) -> int:
        return sum(label != IGNORE for label in self.labels)

    def as_row(self) -> dict[str, list[int]]:
        """The pre-tokenized row TRL's ``SFTTrainer`` takes as is (``input_ids`` + ``labels``)."""
        return {"input_ids": list(self.input_ids), "labels": list(self.labels)}


def _render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Any, *, generation: bool) -> str:
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation}
    if tools:
        kwargs["tools"] = tools
    try:
        text = tokenizer.apply_chat_template([dict(m) for m in messages], **kwargs)
    except Exception as exc:  # jinja errors, missing template: the conversation cannot be rendered
        raise _Skip("template_error") from exc
    if not isinstance(text, str):
        raise _Skip("template_error")
    return text


def _trained_turns(messages: Sequence[Mapping[str, Any]], train_on: TrainOn) -> list[int]:
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if train_on == "all":
        return turns
    last_other = max((i for i, m in enumerate(messages) if m.get("role") != "assistant"), default=-1)
    return [i for i in turns if i > last_other]


def _char_ranges(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Any, turns: list[int], full: str
) -> list[range]:
    """Character ranges of the trained assistant turns in ``full``, the whole conversation's rendering."""
    eos = getattr(tokenizer, "eos_token", None)
    ranges: list[range] = []
    for i in turns:
        before = _render(tokenizer, messages[:i], tools, generation=True) if i else ""
        through = _render(tokenizer, messages[: i + 1], tools, generation=False)
        if not through.startswith(before) or not full.startswith(through):
            raise _Skip("template_not_prefix")
        end = len(through)
        if isinstance(eos, str) and eos:
            stop = through.find(eos, len(before))
            if stop >= 0:
                end = stop + len(eos)
        ranges.append(range(len(before), end))
    return ranges


def encode_conversation(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    train_on: TrainOn = "last",
) -> Example:
    """Token ids and assistant-only labels of one conversation.

    Args:
        tokenizer: A transformers *fast* tokenizer with a chat template (offsets are needed).
        messages: OpenAI chat messages (``{"role", "content", ...}``).
        tools: Tool definitions to render with the template, if any.
        train_on: ``"last"`` or ``"all"`` assistant turns (see the module docstring).

    Raises:
        ValueError: The conversation cannot train; the message is the skip reason.
    """
    try:
        return _encode(tokenizer, messages, tools, train_on)
    except _Skip as skip:
        raise ValueError(skip.reason) from None


def _encode(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Any, train_on: TrainOn) -> Example:
    turns = _trained_turns(messages, train_on)
    if not turns:
        raise _Skip("no_assistant_turn")
    full = _render(tokenizer, messages, tools, generation=False)
    ranges = _char_ranges(tokenizer, messages, tools, turns, full)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(i) for i in enc["input_ids"]]
    labels = [
        tok if e > s and any(s >= r.start and e <= r.stop for r in ranges) else IGNORE
        for tok, (s, e) in zip(ids, enc["offset_mapping"], strict=True)
    ]
    example = Example(ids, labels)
    if example.n_loss_tokens == 0:
        raise _Skip("no_assistant_tokens")
    return example


def encode_conversations(
    tokenizer: Any,
    conversations: Iterable[Mapping[str, Any]],
    *,
    max_len: int,
    train_on: TrainOn = "last",
    skipped: Counter[str] | None = None,
) -> list[Example]:
    """Encode ``{"messages", "tools"}`` records; those that cannot train are counted in ``skipped``.

    A conversation longer than ``max_len`` tokens is skipped (``too_long``), never truncated: a
    truncated one would train on a cut-off answer or on none.
    """
    skipped = skipped if skipped is not None else Counter()
    out: list[Example] = []
    for conv in conversations:
        messages = conv.get("messages")
        if not isinstance(messages, list) or not messages:
            skipped["no_messages"] += 1
            continue
        try:
            example = _encode(tokenizer, messages, conv.get("tools"), train_on)
        except _Skip as skip:
            skipped[skip.reason] += 1
            continue
        if len(example.input_ids) > max_len:
            skipped["too_long"] += 1
            continue
        out.append(example)
    return out
