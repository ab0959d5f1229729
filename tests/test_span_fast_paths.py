"""The span path's fast paths give what the checks one by one give (issue 17, less CPU per rollout).

``check_spans`` checks attributes that are all ASCII strings with a join and a scan in C
(``_ascii_text_chars``), and ``span_from_readable`` copies attributes that hold no tuple and no
float without walking them; on any other attributes both walk them as before. Whatever the
attributes, the outcome must be the walk's: the same error with the same message, or none.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from eventlight import otel
from eventlight.core.errors import EventlightError
from eventlight.core.types import Span
from eventlight.store import validate


class _Text(str):
    """A ``str`` subclass: not an exact ``str``, so never on the fast path."""


_texts = st.one_of(
    st.text(alphabet=st.characters(max_codepoint=127), max_size=8),
    st.text(max_size=4),  # non-ASCII
    st.sampled_from(["é", "\ud800", "a\udfffb"]),  # lone surrogates (st.text leaves them out)
    st.builds(_Text, st.text(alphabet=st.characters(max_codepoint=127), max_size=4)),
)
_values = st.one_of(
    _texts,
    st.integers(),
    st.booleans(),
    st.none(),
    st.floats(),  # NaN and infinities included
    st.lists(st.one_of(st.text(max_size=3), st.floats(), st.integers()), max_size=3),
    st.tuples(st.text(max_size=3), st.floats()),
    st.binary(max_size=3),  # not JSON: refused by the walk
    st.lists(st.lists(st.floats(), max_size=2), max_size=2),  # nested: NaN inside
    st.tuples(st.tuples(st.floats()), st.binary(max_size=2)),
    st.dictionaries(_texts, st.one_of(st.floats(), st.integers(), st.booleans()), max_size=2),
)
_keys = st.one_of(_texts, st.integers(), st.none(), st.binary(max_size=2), st.booleans(), st.floats())


def _outcome(check: Any, *args: Any) -> tuple[str, str]:
    try:
        check(*args)
    except EventlightError as e:
        return type(e).__name__, str(e)
    return "", ""


def _span(attributes: dict[Any, Any]) -> Span:
    ids = {"rollout_id": "ro-1", "attempt_id": "at-1", "trace_id": "a" * 32, "span_id": "b" * 16}
    return Span(**ids, sequence_id=1, parent_id=None, name="s", attributes=attributes)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=5))
def test_check_spans_answers_as_the_walk_does(attributes: dict[Any, Any]) -> None:
    span = _span(attributes)
    fast = _outcome(validate.check_spans, [span])
    with mock.patch.object(validate, "_ascii_text_chars", lambda _attributes: None):
        walked = _outcome(validate.check_spans, [span])
    assert fast == walked


def test_the_fast_path_takes_ascii_strings_only() -> None:
    assert validate._ascii_text_chars({"a": "xy", "b": ""}) == 2
    for attributes in ({"a": "é"}, {"é": "x"}, {"a": _Text("x")}, {1: "x"}, {"a": 1}, {"a": "x", "b": ["y"]}, {}):
        assert validate._ascii_text_chars(attributes) is None, attributes


def _walked(attributes: dict[str, Any]) -> dict[str, Any]:
    """What ``_attrs`` gives, value by value: a tuple becomes a list, a NaN or infinity its text."""
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if type(value) is tuple:
            value = [otel.json_double(x) if type(x) is float else x for x in value]
        elif type(value) is float:
            value = otel.json_double(value)
        out[key] = value
    return out


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.text(max_size=4), _values, max_size=5))
def test_attributes_convert_as_the_walk_does(attributes: dict[str, Any]) -> None:
    assert repr(otel._attrs(dict(attributes))) == repr(_walked(attributes))  # repr: NaN != NaN; types too
