"""``unflatten_attributes`` keeps a builder per key tuple (``_SHAPES``) and ``Heads.below`` sorts a
span's keys out in one pass: both give what the straightforward code gives, on generated input.

The oracles are the implementations they replaced, kept here: a level per key split on dots,
lists where a level's keys are exactly "0".."n-1", and one prefix filter per head.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from eventlight.adapter.attrs import Heads, _nested
from eventlight.attributes import _SHAPES, unflatten_attributes


def oracle_listify(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    converted = {k: oracle_listify(v) if isinstance(v, dict) else v for k, v in node.items()}
    if "0" in converted and all(str(i) in converted for i in range(len(converted))):
        return [converted[str(i)] for i in range(len(converted))]
    return converted


def oracle(flat: dict[str, Any]) -> Any:
    root: dict[str, Any] = {}
    for key, value in flat.items():
        if isinstance(value, dict):
            value = oracle_listify(value)
        path = key.split(".")
        node = root
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError("nests under a value")
            node = child
        if isinstance(node.get(path[-1]), dict):
            raise ValueError("a value where keys nest")
        node[path[-1]] = value
    return oracle_listify(root)


segment = st.sampled_from(["0", "1", "2", "a", "b", "content", "role", ""])
keys = st.lists(segment, min_size=1, max_size=4).map(".".join)
leaf = st.one_of(st.integers(), st.text(max_size=3), st.lists(st.integers(), max_size=3), st.none())
value = st.one_of(leaf, st.dictionaries(st.sampled_from(["0", "1", "x"]), leaf, max_size=3))
flats = st.dictionaries(keys, value, max_size=8)


def outcome(f: Any, flat: dict[str, Any]) -> Any:
    try:
        return ("ok", f(flat))
    except ValueError:
        return ("error", None)


@settings(max_examples=2000, deadline=None)
@given(flats)
def test_unflatten_equals_the_oracle_the_first_time_and_from_its_kept_shape(flat: dict[str, Any]) -> None:
    want = outcome(oracle, flat)
    snapshot = repr(flat)
    assert outcome(unflatten_attributes, flat) == want  # learns the shape
    assert outcome(unflatten_attributes, flat) == want  # builds from it (or falls back: dict values)
    assert repr(flat) == snapshot, "unflatten changed its input"
    if want[0] == "ok" and len(flat) <= _SHAPES.MAX_KEYS:
        assert tuple(flat) in _SHAPES


@settings(max_examples=500, deadline=None)
@given(flats)
def test_the_same_keys_with_other_values_build_their_own_result(flat: dict[str, Any]) -> None:
    outcome(unflatten_attributes, flat)
    other = {k: f"other {i}" for i, k in enumerate(flat)}
    assert outcome(unflatten_attributes, other) == outcome(oracle, other)


heads_keys = st.lists(
    st.sampled_from(["gen_ai", "prompt", "0", "role", "agentlightning", "operation", "input"]), min_size=1, max_size=5
).map(".".join)


@settings(max_examples=1000, deadline=None)
@given(st.dictionaries(heads_keys, st.integers(), max_size=8))
def test_heads_below_is_one_nested_filter_per_head(attrs: dict[str, int]) -> None:
    heads = Heads("gen_ai.prompt", "gen_ai", "agentlightning.operation.input", "agentlightning.operation")
    below = heads.below(attrs)
    for _ in range(2):  # the second time from the keys' kept places
        for head in heads.heads:
            dotted = head + "."
            want = {k[len(dotted) :]: v for k, v in attrs.items() if k.startswith(dotted)}
            assert below.get(head, {}) == want
            assert outcome(unflatten_attributes, want) == outcome(oracle, want)
            if want and outcome(oracle, want)[0] == "ok":
                assert _nested(attrs, head) == oracle(want)
        below = heads.below(attrs)
