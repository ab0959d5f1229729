"""From a selected attempt to records: its spans in order, the adapter, rewards, provenance.

An attempt's spans are its span batches decoded in log order and sorted by ``(sequence_id, log
position)``; a span id seen twice keeps its first copy (the read model's rule). The adapter gets
that list (``TracerTraceToTriplet`` builds the span tree from it, Agent-lightning's ``TraceTree``).

Each item the adapter returns becomes one record::

    rollout_id, attempt_id, attempt_sequence_id, index      which attempt, which item of it
    mode, status, resources_id, resources_version           the rollout and attempt as the log has them
    final_reward                                            the attempt's reward (``find_final_reward``,
                                                            or ``--reward``'s function of the spans)
    attempt_seq, log_positions                              where it came from: the log position of
                                                            the attempt's start and of its span batches
    prompt, response, reward, metadata                      a ``Triplet``'s fields
    messages, tools                                         or the keys of a dict item (``TraceToMessages``)

With a reward function the triplets' ``reward`` is relabelled as Agent-lightning's
``to_trajectory(final_reward=...)`` does: the last triplet gets the new reward, the others ``None``.

An attempt fails (reported like an adapter that raises, the rest replays) when the adapter returns
something other than a collection of items (a string, bytes, a mapping or a single item would give
a record per character or per key), or when a reward (the reward function's, or an item's
``reward`` field) is not a number or ``None``, or is NaN or infinite. A record's ``reward`` is
therefore a float or ``None`` in both file formats. A NaN or infinity in any other field is
written as JSON ``null`` (JSON has neither), in ``.jsonl`` and in ``.parquet``'s JSON text alike.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from eventlight.adapter.stats import AdapterStats
from eventlight.core.errors import InvalidInputError
from eventlight.core.events import SpansAdded, decode_event
from eventlight.core.types import Span, Triplet
from eventlight.logreplay.select import Selected
from eventlight.rewards import find_final_reward

AdapterFn = Callable[[Sequence[Span]], Any]
RewardFn = Callable[[Sequence[Span]], Any]

BUILTIN_ADAPTERS = ("triplets", "messages", "proxy-triplets")

PROVENANCE = (
    "rollout_id",
    "attempt_id",
    "attempt_sequence_id",
    "index",
    "mode",
    "status",
    "resources_id",
    "resources_version",
    "final_reward",
    "attempt_seq",
    "log_positions",
)
"""The fields every record has, whatever the adapter."""


def load_callable(spec: str, what: str) -> Any:
    """Import ``module:attribute`` (dotted attribute allowed; ``path/to/file.py:attribute`` too).

    Raises:
        InvalidInputError: The spec is malformed, the module cannot be imported or has no such attribute.
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise InvalidInputError(f"{what} {spec!r}: expected MODULE:CALLABLE, e.g. mypkg.rewards:score")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise InvalidInputError(f"{what} {spec!r}: no Python file {module_name}")
        sys.path.insert(0, str(path.resolve().parent))
        module_name = path.stem
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # the user's module, whatever it raises while importing
        raise InvalidInputError(f"{what} {spec!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise InvalidInputError(f"{what} {spec!r}: {module_name} has no attribute {attr!r}") from None
    if not callable(obj):
        raise InvalidInputError(f"{what} {spec!r} is a {type(obj).__name__}, not callable")
    return obj


def resolve_adapter(adapter: str | AdapterFn, llm_call_match: str | None = None) -> AdapterFn:
    """``triplets`` (``TracerTraceToTriplet``), ``messages`` (``TraceToMessages``), ``proxy-triplets``
    (``LlmProxyTraceToTriplet``), ``MODULE:CALLABLE`` (an adapter class is instantiated without
    arguments), or a callable of the spans.

    Args:
        adapter: The name or the callable.
        llm_call_match: For ``triplets`` only: the regex (``re.search`` on span names) that marks
            LLM calls, instead of Agent-lightning's ``openai\\.chat\\.completion``
            (``check_llm_call_match``).

    Raises:
        InvalidInputError: An unknown name, a spec that does not import, or something not callable
            (a class with ``adapt`` but no ``__call__``, say); an ``llm_call_match`` that
            ``check_llm_call_match`` refuses.
    """
    check_llm_call_match(adapter, llm_call_match)
    if callable(adapter):
        return adapter
    if not isinstance(adapter, str):
        raise InvalidInputError(f"adapter: {_not_callable(adapter)}")
    from eventlight.adapter import LlmProxyTraceToTriplet, TracerTraceToTriplet, TraceToMessages

    if adapter == "triplets":  # attempts with no LLM call are told once, by the replay (``Adapted.unmatched``)
        triplets = (
            TracerTraceToTriplet() if llm_call_match is None else TracerTraceToTriplet(llm_call_match=llm_call_match)
        )
        triplets.warn_unmatched = triplets.warn_left_out = False
        return triplets
    builtin: dict[str, Callable[[], AdapterFn]] = {
        "messages": TraceToMessages,
        "proxy-triplets": LlmProxyTraceToTriplet,
    }
    if adapter in builtin:
        return builtin[adapter]()
    if ":" not in adapter:
        raise InvalidInputError(
            f"unknown adapter {adapter!r}: expected one of {', '.join(BUILTIN_ADAPTERS)} or MODULE:CALLABLE"
        )
    obj = load_callable(adapter, "adapter")
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as e:
            raise InvalidInputError(f"adapter {adapter!r}: {obj.__name__}() failed: {type(e).__name__}: {e}") from e
        if not callable(obj):  # refused once here, not on every attempt
            raise InvalidInputError(f"adapter {adapter!r}: {_not_callable(obj)}")
    return obj  # type: ignore[no-any-return]


def check_llm_call_match(adapter: object, llm_call_match: str | None) -> None:
    """Refuse an ``llm_call_match`` that is no regex, or that the adapter would not use: only the
    ``triplets`` adapter (``TracerTraceToTriplet``) picks LLM calls by span name. ``messages`` takes
    every span with ``gen_ai.*`` attributes and ``proxy-triplets`` the LLM proxy's spans with token
    ids; an adapter given as ``MODULE:CALLABLE`` or an object is built by its own code, which sets
    its own pattern.

    Raises:
        InvalidInputError: Either.
    """
    if llm_call_match is None:
        return
    if not isinstance(llm_call_match, str):
        raise InvalidInputError(f"--llm-call-match must be a regular expression (a str), got {llm_call_match!r}")
    if adapter != "triplets":
        if adapter in BUILTIN_ADAPTERS:
            why = f"the {adapter} adapter does not pick LLM calls by span name"
        else:
            why = (
                "an adapter given as MODULE:CALLABLE or an object is built by its own code: set the pattern "
                "there, e.g. TracerTraceToTriplet(llm_call_match=...)"
            )
        raise InvalidInputError(f"--llm-call-match applies to the triplets adapter only: {why}")
    try:
        re.compile(llm_call_match)
    except re.error as e:
        raise InvalidInputError(f"--llm-call-match {llm_call_match!r} is not a regular expression: {e}") from None


def _not_callable(obj: object) -> str:
    return (
        f"an instance of {type(obj).__name__} is not callable: give a function of the spans, or a class with "
        "__call__(spans) (subclassing eventlight.adapter.TraceAdapter makes __call__ run adapt)"
    )


def resolve_reward(reward: str | RewardFn | None) -> RewardFn | None:
    """A reward function of an attempt's spans (``MODULE:CALLABLE`` or a callable), or ``None``."""
    if reward is None or callable(reward):
        return reward
    return load_callable(reward, "reward function")  # type: ignore[no-any-return]


def attempt_spans(selected: Selected) -> tuple[list[Span], list[int]]:
    """The attempt's spans in sequence order (first copy of a span id kept) and the log positions
    of the batches that held them.

    Raises:
        InvalidInputError: A batch is not an event this version reads.
    """
    return spans_of_batches(selected.batches)


def spans_of_batches(
    batches: Sequence[tuple[int, bytes]], malformed: list[tuple[int, str]] | None = None
) -> tuple[list[Span], list[int]]:
    """Spans of raw span batches ``(log position, payload)`` in log order, sorted by ``(sequence_id,
    position)`` with the first copy of a span id kept, and the positions of the batches that held
    them. With ``malformed``, a batch that does not decode is recorded there as ``(position, why)``
    and skipped (the subscribers' way); without it, it raises (the replay's way: the attempt fails).

    Raises:
        InvalidInputError: A batch does not decode and ``malformed`` is ``None``.
    """
    seen: set[str] = set()
    spans: list[tuple[int, int, Span]] = []
    positions: list[int] = []
    for pos, data in batches:
        try:
            event = decode_event(data)
        except InvalidInputError as e:
            if malformed is None:
                raise
            malformed.append((pos, str(e)))
            continue
        if not isinstance(event, SpansAdded):
            continue
        kept = False
        for span in event.spans:
            if span.span_id in seen:
                continue
            seen.add(span.span_id)
            spans.append((span.sequence_id, pos, span))
            kept = True
        if kept:
            positions.append(pos)
    spans.sort(key=lambda t: (t[0], t[1]))
    return [s for _, _, s in spans], positions


def _reward_value(value: Any, what: str) -> float | None:
    """``value`` as a float, or ``None``; ``what`` names it in the error (``"the reward function
    returned"``).

    Raises:
        TypeError: Not a real number (``numbers.Real``: a NumPy ``float32`` is one, a bool is not).
        ValueError: NaN or infinite, or an int past a float's range.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # Real: NumPy's floats and ints too
        raise TypeError(f"{what} {type(value).__name__} {_short(value)}, expected a number or None")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{what} {_short(value)}, too large for a float") from None
    if not math.isfinite(number):
        raise ValueError(f"{what} {number}, expected a finite number or None")
    return number


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _items(returned: Any) -> Iterable[Any]:
    """What the adapter returned, if it is a collection of items.

    Raises:
        TypeError: A string, bytes, a mapping or a single item: iterating it would make one record
            per character or per key.
    """
    single = isinstance(returned, (str, bytes, bytearray, Mapping, msgspec.Struct)) or hasattr(returned, "model_dump")
    if returned is None or single or not isinstance(returned, Iterable):
        kind = "None" if returned is None else f"{type(returned).__name__} {_short(returned)}"
        raise TypeError(f"the adapter returned {kind}, expected a list of items (one record each)")
    return returned


def item_fields(item: Any) -> dict[str, Any]:
    """A record's payload fields for one adapter item (a ``Triplet``, a dict, or anything else as ``value``)."""
    if isinstance(item, Triplet):
        return {"prompt": item.prompt, "response": item.response, "reward": item.reward, "metadata": item.metadata}
    if isinstance(item, msgspec.Struct):
        return msgspec.structs.asdict(item)
    if isinstance(item, Mapping):
        return dict(item)
    if hasattr(item, "model_dump"):  # a pydantic Triplet from Agent-lightning code
        return dict(item.model_dump())
    return {"value": item}


class Adapted(msgspec.Struct, frozen=True):
    """What the adapter made of one attempt's span batches: each item's record fields (``prompt``,
    ``response``, ... without the provenance), the final reward, and the batches' log positions.
    Plain data, so a worker process can send it back."""

    items: list[dict[str, Any]]
    final_reward: float | None
    log_positions: list[int]
    unmatched: tuple[str, ...] | None = None
    """The attempt's span names when none matched the adapter's ``llm_call_match`` (an adapter
    ``resolve_adapter`` built, which does not warn itself), else ``None``."""
    left_out: AdapterStats | None = None
    """The adapter's counts when it found LLM calls and left every one out (an adapter
    ``resolve_adapter`` built, which does not warn itself), else ``None``."""


def adapt_batches(batches: Sequence[tuple[int, bytes]], adapter: AdapterFn, reward_fn: RewardFn | None) -> Adapted:
    """Decode an attempt's span batches, run the adapter (and reward function), and give each item's
    record fields (see the module docstring).

    Raises:
        TypeError, ValueError: The adapter returned no collection of items, or a reward is not a
            finite number or ``None`` (module docstring).
        Exception: Whatever the adapter or reward function raised, for the caller to report.
    """
    spans, positions = spans_of_batches(batches)
    if reward_fn is not None:
        final = _reward_value(reward_fn(spans), "the reward function returned")
    else:
        final = find_final_reward(spans)
    items = list(_items(adapter(spans)))
    unmatched = getattr(adapter, "last_unmatched", None) if getattr(adapter, "warn_unmatched", True) is False else None
    stats = getattr(adapter, "last_stats", None) if getattr(adapter, "warn_left_out", True) is False else None
    left_out = stats if isinstance(stats, AdapterStats) and stats.llm_calls and not stats.triplets else None
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        fields = item_fields(item)
        clash = sorted(set(fields) & set(PROVENANCE))
        if clash:
            raise ValueError(f"the adapter's item {i} has fields named like the record's own: {', '.join(clash)}")
        if "reward" in fields:
            fields["reward"] = _reward_value(fields["reward"], f"the adapter's item {i} has reward")
        if reward_fn is not None and isinstance(item, Triplet):
            fields["reward"] = final if i == len(items) - 1 else None
        elif "reward" not in fields and not isinstance(item, Triplet):
            fields["reward"] = final
        out.append(fields)
    return Adapted(out, final, positions, unmatched, left_out)


def records_from(selected: Selected, adapted: Adapted) -> list[dict[str, Any]]:
    """The records of one attempt: the provenance the log gives it, then each item's fields."""
    attempt, rollout = selected.attempt, selected.rollout
    base = {
        "rollout_id": rollout.rollout_id,
        "attempt_id": attempt.attempt_id,
        "attempt_sequence_id": attempt.sequence_id,
        "mode": rollout.mode,
        "status": attempt.status,
        "resources_id": rollout.resources_id,
        "resources_version": selected.resources_version,
        "final_reward": adapted.final_reward,
        "attempt_seq": selected.started_seq,
        "log_positions": adapted.log_positions,
    }
    return [{**base, "index": i, **fields} for i, fields in enumerate(adapted.items)]


def records_of(selected: Selected, adapter: AdapterFn, reward_fn: RewardFn | None) -> list[dict[str, Any]]:
    """The records of one attempt (see the module docstring).

    Raises:
        Exception: Whatever the adapter or reward function raised, for the caller to report.
    """
    return records_from(selected, adapt_batches(selected.batches, adapter, reward_fn))
