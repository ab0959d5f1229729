"""Agent-lightning 0.3.0 names that cannot apply to eventlight: each raises a clear error on use.

``unavailable_class("AgentOpsTracer", "use OtelTracer ...")`` is a class that can be imported,
named in annotations and subclassed, but whose instantiation raises ``NotImplementedError`` saying
what to use instead; ``unavailable_function`` is the same for a function. A porting program that
only imports these names keeps working; one that uses them learns at once what to change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["unavailable_class", "unavailable_function"]


def _refuse(name: str, instead: str) -> NoReturn:
    raise NotImplementedError(f"{name} (Agent-lightning 0.3.0) is not available in eventlight: {instead}")


def unavailable_class(name: str, instead: str, module: str = "eventlight") -> type:
    """A class named ``name`` whose instances cannot be made (``NotImplementedError`` naming ``instead``)."""

    def __new__(cls: type, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(name, instead)

    doc = f"Not available in eventlight (Agent-lightning 0.3.0's ``{name}``): {instead}"
    return type(name, (), {"__new__": __new__, "__doc__": doc, "__module__": module})


def unavailable_function(name: str, instead: str, module: str = "eventlight") -> Callable[..., NoReturn]:
    """A function named ``name`` that raises ``NotImplementedError`` naming ``instead``."""

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        _refuse(name, instead)

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__module__ = module
    refuse.__doc__ = f"Not available in eventlight (Agent-lightning 0.3.0's ``{name}``): {instead}"
    return refuse
