"""Flat OpenTelemetry attributes <-> nested data (Agent-lightning ``agentlightning.utils.otel`` helpers).

Span attributes are flat: ``{"gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "hi"}``.
``unflatten_attributes`` rebuilds ``{"gen_ai": {"prompt": [{"role": "user", "content": "hi"}]}}``;
``flatten_attributes`` goes the other way. As in Agent-lightning 0.3, a level whose keys are exactly
the digit strings ``0..n-1`` becomes a list; any other level (``{"0", "2"}``, ``{"0", "a"}``) stays a dict.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from itertools import repeat
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "filter_and_unflatten_attributes",
    "filter_attributes",
    "flatten_attributes",
    "unflatten_attributes",
]

_PRIMITIVES = (str, bool, int, float)


def _leaf_list_type(items: list[Any]) -> type | None:
    """The one primitive type of a non-empty list (bool and int are different), else ``None``."""
    kinds = {type(x) for x in items}
    if len(kinds) == 1:
        (kind,) = kinds
        if kind in _PRIMITIVES:
            return kind
    return None


def _walk(value: Any, prefix: str, out: dict[str, Any], expand_leaf_lists: bool) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"attribute keys must be str, got {key!r} under {prefix or '<root>'!r}")
            _walk(item, f"{prefix}.{key}" if prefix else key, out, expand_leaf_lists)
        return
    if isinstance(value, (list, tuple)):
        items = list(value)
        if not items:
            return  # an empty list disappears, as in Agent-lightning
        if not expand_leaf_lists and _leaf_list_type(items) is not None and prefix:
            out[prefix] = items
            return
        if not expand_leaf_lists and all(isinstance(x, _PRIMITIVES) for x in items):
            log.warning("attribute %r holds a mixed primitive list; expanding it by index", prefix)
        for i, item in enumerate(items):
            _walk(item, f"{prefix}.{i}" if prefix else str(i), out, expand_leaf_lists)
        return
    if not prefix:
        raise ValueError(f"cannot flatten a bare {type(value).__name__}; pass a dict or a list")
    out[prefix] = value


def flatten_attributes(data: Mapping[str, Any] | list[Any], *, expand_leaf_lists: bool = False) -> dict[str, Any]:
    """Flatten nested dicts and lists into dotted attribute keys.

    Args:
        data: A dict (or list) of nested dicts, lists and primitive values.
        expand_leaf_lists: When ``False`` (default) a non-empty list of one primitive type
            (``str``, ``int``, ``float`` or ``bool``; bool and int differ) stays one list value;
            when ``True`` it is expanded into ``.0``, ``.1``, ... keys too.

    Returns:
        ``{"a.b.0.c": value, ...}``. Empty lists and empty dicts produce no key; a list of dicts or
        of mixed items is expanded by index (a mixed primitive list logs a warning).

    Raises:
        ValueError: A dict key is not a ``str``, or ``data`` is a bare primitive.
    """
    out: dict[str, Any] = {}
    _walk(data, "", out, expand_leaf_lists)
    return out


def _listify(node: Any) -> Any:
    """A copy of ``node`` with its levels made lists where their keys are exactly ``"0".."n-1"``."""
    if not isinstance(node, dict):
        return node
    converted = {key: _listify(value) if isinstance(value, dict) else value for key, value in node.items()}
    if "0" in converted and all(str(i) in converted for i in range(len(converted))):  # keys exactly "0".."n-1"
        return [converted[str(i)] for i in range(len(converted))]
    return converted


_DIGITS = tuple(str(i) for i in range(256))
_MISSING = object()


def _listify_own(node: dict[str, Any]) -> dict[str, Any] | list[Any]:
    """``_listify`` in place, for the levels ``unflatten_attributes`` made (and owns)."""
    for key, value in node.items():
        if type(value) is dict:
            node[key] = _listify_own(value)
    if "0" in node:
        n = len(node)
        digits = _DIGITS[:n] if n <= len(_DIGITS) else tuple(map(str, range(n)))
        if all(map(node.__contains__, digits)):  # keys exactly "0".."n-1"
            return list(map(node.__getitem__, digits))
    return node


def unflatten_attributes(flat: Mapping[str, Any]) -> dict[str, Any] | list[Any]:
    """Rebuild nested data from dotted keys (the inverse of ``flatten_attributes``).

    Args:
        flat: ``{"a.b": 1, "a.c.0": 2, "a.c.1": 3}``.

    Returns:
        ``{"a": {"b": 1, "c": [2, 3]}}``, keys in the order of ``flat``. A level becomes a list
        only when its keys are exactly ``"0".."n-1"``; the top level itself may therefore be a list.
        ``flat`` and its values are left as they are (a dict value is copied).

    Raises:
        ValueError: One key holds a value and another key nests below it (``"a": 1`` and ``"a.b": 2``).

    The shape of the result depends on the keys alone (and on which values are dicts), and span
    attributes repeat the same keys from span to span, so the shape of each key tuple seen is
    kept as a builder of the result from the values (``_Shapes``).
    """
    keys = tuple(flat)
    build = _SHAPES.get(keys)
    if build is not None:
        values = tuple(flat.values())
        if not any(map(isinstance, values, repeat(dict))):
            return build(values)  # type: ignore[no-any-return]
    elif keys not in _SHAPES:
        _SHAPES.learn(keys)
    return _unflatten(flat)


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any] | list[Any]:
    root: dict[str, Any] = {}
    for key, value in flat.items():
        if isinstance(value, dict):
            value = _listify(value)  # a copy: the levels below are all this function's own
        node, last = root, key
        if "." in key:
            path = key.split(".")
            last = path.pop()
            for part in path:
                child = node.get(part, _MISSING)
                if child is _MISSING:
                    child = node[part] = {}
                elif not isinstance(child, dict):
                    raise ValueError(f"attribute {key!r} nests under a key that already holds a value")
                node = child
        if isinstance(node.get(last), dict):
            raise ValueError(f"attribute {key!r} holds a value where other keys nest")
        node[last] = value
    return _listify_own(root)


class _Leaf(int):
    """The position of a value in ``flat``: what ``_Shapes.learn`` unflattens in place of values."""


def _expr(node: Any) -> str:
    """Python source building ``node`` from ``v``, the values in ``flat`` order."""
    if isinstance(node, _Leaf):
        return f"v[{int(node)}]"
    if isinstance(node, list):
        return "[" + ", ".join(map(_expr, node)) + "]"
    return "{" + ", ".join(f"{key!r}: {_expr(value)}" for key, value in node.items()) + "}"


class _Shapes(dict[tuple[str, ...], Any]):
    """Key tuple -> a function of the values giving ``unflatten_attributes``'s result (``None``:
    keys that conflict, always unflattened the slow way, which raises). At most ``MAX`` shapes of
    at most ``MAX_KEYS`` keys are kept."""

    MAX = 4096
    MAX_KEYS = 64

    def learn(self, keys: tuple[str, ...]) -> None:
        if len(keys) > self.MAX_KEYS:
            return
        if len(self) >= self.MAX:
            self.clear()
        try:
            shape = _unflatten(dict(zip(keys, map(_Leaf, range(len(keys))), strict=True)))
        except ValueError:
            self[keys] = None
            return
        # The source holds the keys only as repr() string literals and the values only as v[i].
        self[keys] = eval("lambda v: " + _expr(shape))  # noqa: S307


_SHAPES = _Shapes()


def filter_attributes(attributes: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The attributes whose key equals ``prefix`` or starts with ``prefix + "."``."""
    dotted = prefix + "."
    return {k: v for k, v in attributes.items() if k == prefix or k.startswith(dotted)}


def filter_and_unflatten_attributes(attributes: Mapping[str, Any], prefix: str) -> dict[str, Any] | list[Any]:
    """Unflatten the attributes below ``prefix`` with the prefix stripped.

    Example: ``({"gen_ai.prompt.0.role": "user"}, "gen_ai.prompt")`` gives ``[{"role": "user"}]``.

    Returns:
        The nested value; ``{}`` when no key is below ``prefix``.

    Raises:
        ValueError: A key equals ``prefix`` itself (it cannot be placed), or keys conflict.
    """
    if prefix in attributes:
        raise ValueError(f"attribute {prefix!r} is a value, not a prefix of nested keys")
    cut = len(prefix) + 1
    return unflatten_attributes({k[cut:]: v for k, v in filter_attributes(attributes, prefix).items()})
