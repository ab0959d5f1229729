"""``build_component``: make a component from a flexible spec (Agent-lightning 0.3.0's trainer helper)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["build_component"]

T = TypeVar("T")


def import_path(path: str) -> Any:
    """The object ``module.Name`` (or ``module:Name``) names.

    Raises:
        ValueError: ``path`` names no module.
    """
    module, _, attr = path.replace(":", ".").rpartition(".")
    if not module:
        raise ValueError(f"{path!r} is not an import path (module.Name)")
    return getattr(importlib.import_module(module), attr)


def build_component(
    spec: Any,
    *,
    expected_type: type[T],
    spec_name: str,
    default_factory: Callable[[], T] | None = None,
    allow_none: bool = False,
    registry: dict[str, str] | None = None,
    dict_requires_type: bool = True,
    dict_default_cls: type[T] | None = None,
    **_ignored: Any,
) -> T | None:
    """Build a ``expected_type`` from ``spec``: an instance (returned as is), a class or a factory
    (called with no argument), an import path or ``registry`` alias (``"module.Class"``), or a
    dict ``{"type": <path or alias>, **kwargs}`` (``dict_default_cls`` when it has no ``type``);
    ``None`` gives ``default_factory()``, or ``None`` when ``allow_none``.

    Raises:
        TypeError: What ``spec`` gives is not an ``expected_type``.
        ValueError: ``spec`` is ``None`` and neither a default nor ``None`` is allowed, or a dict
            lacks its ``type``.
    """
    if spec is None:
        if default_factory is not None:
            return default_factory()
        if allow_none:
            return None
        raise ValueError(f"{spec_name} must be given")
    if isinstance(spec, expected_type):
        return spec
    if isinstance(spec, str):
        built = import_path((registry or {}).get(spec, spec))()
    elif isinstance(spec, dict):
        kwargs = dict(spec)
        kind = kwargs.pop("type", None)
        if kind is None:
            if dict_requires_type or dict_default_cls is None:
                raise ValueError(f"{spec_name}: a dict spec needs a 'type'")
            cls: Any = dict_default_cls
        else:
            cls = import_path((registry or {}).get(kind, kind)) if isinstance(kind, str) else kind
        built = cls(**kwargs)
    elif callable(spec):
        built = spec()
    else:
        built = spec
    if not isinstance(built, expected_type):
        raise TypeError(f"{spec_name} must be a {expected_type.__name__}, got {type(built).__name__}")
    return built
