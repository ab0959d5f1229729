"""Switch on OpenTelemetry instrumentation of agent frameworks, so their spans reach the store.

``agentlightning.instrumentation`` patches AgentOps, LiteLLM and vLLM; eventlight patches no library
itself. It switches on **OpenInference's** maintained instrumentors (Arize's
``openinference-instrumentation-*`` packages, the ``frameworks`` extra) for the frameworks agents
are written with, unchanged:

==================  ==========================================  =====================================
name                package                                     spans
==================  ==========================================  =====================================
``openai``          ``openinference-instrumentation-openai``    each OpenAI SDK call (``ChatCompletion``)
``openai_agents``   ``openinference-instrumentation-openai-     agents, turns, generations, function
                    agents``                                    tools of the OpenAI Agents SDK
``langchain``       ``openinference-instrumentation-langchain`` chat models, tools, chains and LangGraph
                                                                nodes (LangChain callbacks)
==================  ==========================================  =====================================

One line does it: ``OtelTracer(instrument=["openai_agents"])`` (or ``"all"``) instruments in each
runner process with the tracer's provider and undoes it at the worker's teardown; or call
``instrument(...)`` / ``instrument_all()`` yourself. The OpenAI Agents SDK's own exporter to
OpenAI's servers is replaced by OpenInference's processor (its ``exclusive_processor``), so
nothing leaves the machine. The token ids of each call come from the LLM proxy's span of the same
call; the adapters keep that copy and count the framework's copies they drop
(``eventlight.adapter.dedup``).

Calls are reference-counted per framework: two tracers of one process that both ask for
``openai`` instrument it once, and it is undone when the last one lets go. An instrumentation that
was on before eventlight asked for it (the program's own) is used as it is and never undone.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Iterable
from typing import Any

from eventlight.core.errors import InvalidInputError

__all__ = [
    "FRAMEWORKS",
    "Instrumented",
    "instrument",
    "instrument_all",
    "instrumented",
    "require",
    "uninstrument",
    "uninstrument_all",
    "validate",
]

log = logging.getLogger(__name__)

FRAMEWORKS: dict[str, tuple[str, str, str]] = {
    "openai": ("openinference.instrumentation.openai", "OpenAIInstrumentor", "openinference-instrumentation-openai"),
    "openai_agents": (
        "openinference.instrumentation.openai_agents",
        "OpenAIAgentsInstrumentor",
        "openinference-instrumentation-openai-agents",
    ),
    "langchain": (
        "openinference.instrumentation.langchain",
        "LangChainInstrumentor",
        "openinference-instrumentation-langchain",
    ),
}
"""Framework name -> (module, instrumentor class, package to install)."""

_lock = threading.Lock()
_counts: dict[str, int] = {}
_ours: set[str] = set()  # instrumented by this module (not already on when first asked for)


def validate(frameworks: str | Iterable[str]) -> tuple[str, ...]:
    """``frameworks`` as a tuple of known names, or ``("all",)``; nothing is imported.

    Raises:
        InvalidInputError: An unknown name, or ``"all"`` beside other names.
    """
    names = (frameworks,) if isinstance(frameworks, str) else tuple(frameworks)
    if "all" in names and len(names) > 1:
        raise InvalidInputError(f"'all' instruments every installed framework: give it alone, not with {names}")
    unknown = [n for n in names if n not in FRAMEWORKS and n != "all"]
    if unknown:
        raise InvalidInputError(f"unknown framework(s) {unknown} to instrument; known: {sorted(FRAMEWORKS)} or 'all'")
    return tuple(dict.fromkeys(names))


def _names(frameworks: str | Iterable[str]) -> list[str]:
    names = validate(frameworks)
    if names == ("all",):
        return [name for name in FRAMEWORKS if _installed(name)]
    return list(names)


def _instrumentor(name: str) -> Any:
    module, cls, package = FRAMEWORKS[name]
    try:
        return getattr(importlib.import_module(module), cls)()
    except ImportError as exc:
        raise InvalidInputError(
            f"instrumenting {name!r} needs {package}: pip install 'eventlight[frameworks]' ({exc})"
        ) from exc


def _options(name: str) -> dict[str, Any]:
    # The Agents SDK's default processor exports traces to OpenAI's servers: replace it.
    return {"exclusive_processor": True} if name == "openai_agents" else {}


def instrument(*frameworks: str, tracer_provider: Any = None) -> list[str]:
    """Switch on the OpenInference instrumentation of ``frameworks``.

    Args:
        frameworks: Names from ``FRAMEWORKS`` (``"openai"``, ``"openai_agents"``, ``"langchain"``),
            or ``"all"``: every one whose packages are installed.
        tracer_provider: The OpenTelemetry ``TracerProvider`` spans go to (``OtelTracer.provider``);
            ``None``: the global one. A framework instrumented already keeps its first provider
            (the tracer's span processor routes spans by the current attempt, whichever provider).

    Returns:
        The names now instrumented by this call (each counted once more).

    Raises:
        InvalidInputError: An unknown name; an instrumentation package or its framework is not
            installed, or their versions conflict (nothing is instrumented then).
    """
    names = _names(frameworks)
    if not names:
        return []
    instrumentors = {name: _instrumentor(name) for name in names}  # all importable, or none is patched
    done: list[str] = []
    with _lock:
        try:
            for name, inst in instrumentors.items():
                if _counts.get(name, 0) == 0 and not inst.is_instrumented_by_opentelemetry:
                    _switch_on(name, inst, tracer_provider)
                    _ours.add(name)
                _counts[name] = _counts.get(name, 0) + 1
                done.append(name)
        except BaseException:
            for name in done:  # all or nothing
                _counts[name] -= 1
                if _counts[name] == 0 and name in _ours:
                    _ours.discard(name)
                    instrumentors[name].uninstrument()
            raise
    return names


def _switch_on(name: str, inst: Any, tracer_provider: Any) -> None:
    inst.instrument(tracer_provider=tracer_provider, **_options(name))
    if not inst.is_instrumented_by_opentelemetry:
        raise InvalidInputError(
            f"could not instrument {name!r}: the framework it instruments is not installed or its "
            f"version conflicts with {FRAMEWORKS[name][2]} (see the log)"
        )
    log.info("instrumented %s with %s", name, FRAMEWORKS[name][2])


def uninstrument(*frameworks: str) -> None:
    """Let go of ``frameworks`` (or ``"all"``); each is undone when its last user lets go.

    Raises:
        InvalidInputError: An unknown name.
    """
    names = validate(frameworks)
    with _lock:
        for name in list(_counts) if names == ("all",) else names:
            if _counts.get(name, 0) == 0:
                continue
            _counts[name] -= 1
            if _counts[name] == 0 and name in _ours:  # never undo what someone else switched on
                _ours.discard(name)
                _instrumentor(name).uninstrument()
                log.info("uninstrumented %s", name)


def instrumented() -> list[str]:
    """The frameworks instrumented now through this module."""
    with _lock:
        return [name for name, count in _counts.items() if count > 0]


def _installed(name: str) -> bool:
    try:
        inst = _instrumentor(name)
    except InvalidInputError:
        return False
    return inst._check_dependency_conflicts() is None  # the framework itself is importable too


def require(*frameworks: str) -> list[str]:
    """Check, without instrumenting, that ``frameworks`` can be instrumented in this environment.

    Returns:
        The names (``"all"``: those installed).

    Raises:
        InvalidInputError: An unknown name, a missing package, or a version conflict.
    """
    names = _names(frameworks)
    for name in names:
        conflict = _instrumentor(name)._check_dependency_conflicts()
        if conflict is not None:
            raise InvalidInputError(f"cannot instrument {name!r}: {conflict}")
    return names


def instrument_all(tracer_provider: Any = None) -> list[str]:
    """Instrument every framework of ``FRAMEWORKS`` whose packages are installed (Agent-lightning
    ``instrument_all``); the others are skipped.

    Returns:
        The names instrumented.
    """
    return instrument("all", tracer_provider=tracer_provider)


def uninstrument_all() -> None:
    """Undo every instrumentation this module switched on, whatever its count (Agent-lightning
    ``uninstrument_all``)."""
    with _lock:
        names = sorted(_ours)
        _counts.clear()
        _ours.clear()
    for name in names:
        _instrumentor(name).uninstrument()
        log.info("uninstrumented %s", name)


class Instrumented:
    """The frameworks one user (an ``OtelTracer``) asked for, switched on and off together.

    Args:
        frameworks: Names of ``FRAMEWORKS`` or ``"all"`` (validated at once, nothing imported).

    Raises:
        InvalidInputError: An unknown name.
    """

    def __init__(self, frameworks: str | Iterable[str] = ()):
        self.frameworks = validate(frameworks)
        self.on: list[str] = []

    def switch_on(self, tracer_provider: Any = None) -> None:
        """``instrument`` them with ``tracer_provider`` (once; again only after ``switch_off``).

        Raises:
            InvalidInputError: A package is missing or conflicts (``instrument``).
        """
        if self.frameworks and not self.on:
            self.on = instrument(*self.frameworks, tracer_provider=tracer_provider)

    def switch_off(self) -> None:
        """``uninstrument`` what ``switch_on`` switched on (idempotent)."""
        if self.on:
            uninstrument(*self.on)
            self.on = []
