"""Agents: ``LitAgent`` and the ``@rollout`` / ``@llm_rollout`` / ``@prompt_rollout`` decorators.

Semantics follow Agent-lightning 0.3 (``tutorials_write-agents.md``, ``seed_runtime.md`` §1):
a decorated function takes the task first (the parameter must be named ``task``) and receives its
resources by parameter name and type: ``llm`` gets the first ``LLM`` resource (a ``ProxyLLM`` is
resolved to this attempt's routed URL), ``prompt_template`` the first ``PromptTemplate``, and
``rollout`` the ``AttemptedRollout``. It may return ``None`` (rewards emitted with ``emit_reward``),
a number (the runner records it as the final reward), or a list of spans.

Differences from 0.3.0, each deliberate: a signature the runner could not call as
``func(task, **resources)`` (a parameter without a default that nothing fills, a keyword-only
``task``, a positional-only resource) is refused when decorated (``rollout``: ``NotImplementedError``,
``llm_rollout``/``prompt_rollout``: ``ValueError``), where 0.3.0 accepts it and fails every rollout.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from eventlight.core.types import LLM, PromptTemplate, ProxyLLM, Rollout

log = logging.getLogger(__name__)

T = TypeVar("T")


class LitAgent(Generic[T]):
    """Base class of agents. Override ``rollout`` (sync) or ``rollout_async``.

    ``training_rollout*`` runs for ``mode == "train"``; every other mode (``val``, ``test``, ``None``)
    runs ``validation_rollout*``; both call ``rollout*`` by default. The agent holds weak references
    to its trainer and its runner (Agent-lightning 0.3.0).

    Args:
        trained_agents: Deprecated (a ``DeprecationWarning``, as in 0.3.0): configure ``agent_match``
            in the adapter instead. Kept as ``self.trained_agents``.
    """

    trained_agents: str | None = None
    _trainer_ref: Any = None  # class defaults: a subclass whose __init__ skips super().__init__() works
    _runner_ref: Any = None

    def __init__(self, *, trained_agents: str | None = None) -> None:
        if trained_agents is not None:
            warnings.warn(
                "`trained_agents` is deprecated. Configure `agent_match` in adapter instead.",
                DeprecationWarning,
                stacklevel=2,
            )
        self.trained_agents = trained_agents
        self._trainer_ref = None
        self._runner_ref = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the trainer and runner (weak references): runner processes set their own."""
        state = dict(self.__dict__)
        state["_trainer_ref"] = state["_runner_ref"] = None
        return state

    def set_trainer(self, trainer: Any) -> None:
        self._trainer_ref = weakref.ref(trainer)

    def get_trainer(self) -> Any:
        """The trainer this agent was given (``set_trainer``).

        Raises:
            ValueError: None was set, or it has been garbage collected.
        """
        return _deref(self._trainer_ref, "Trainer")

    @property
    def trainer(self) -> Any:
        """``get_trainer()``."""
        return self.get_trainer()

    def set_runner(self, runner: Any) -> None:
        self._runner_ref = weakref.ref(runner)

    def get_runner(self) -> Any:
        """The runner running this agent (``set_runner``; ``LitAgentRunner.init`` sets it).

        Raises:
            ValueError: None was set, or it has been garbage collected.
        """
        return _deref(self._runner_ref, "Runner")

    @property
    def runner(self) -> Any:
        """``get_runner()``."""
        return self.get_runner()

    def get_tracer(self) -> Any:
        """The runner's tracer, else (a runner without one) the trainer's (0.3.0).

        Raises:
            ValueError: No runner was set (0.3.0 does not fall back to the trainer then either).
        """
        runner = self.get_runner()
        return runner.tracer if hasattr(runner, "tracer") else self.get_trainer().tracer

    @property
    def tracer(self) -> Any:
        """``get_tracer()``."""
        return self.get_tracer()

    def on_rollout_start(self, task: Any, runner: Any, tracer: Any) -> None:
        """Called by the runner before each attempt, before the tracer starts; a no-op by default.

        Deprecated (0.3.0): implement ``Hook.on_rollout_start`` instead. 0.3.0's ``LitAgentRunner``
        never calls it (only the 0.1 runner did); eventlight's does, as the docs say. An exception is
        logged, not raised.
        """

    def on_rollout_end(self, task: Any, rollout: Rollout, runner: Any, tracer: Any) -> None:
        """Called by the runner after each attempt, before its status is recorded; a no-op by default.

        Deprecated (0.3.0): implement ``Hook.on_rollout_end`` instead. 0.3.0's ``LitAgentRunner``
        never calls it; eventlight's does, as the docs say. An exception is logged, not raised.
        """

    def is_async(self) -> bool:
        """True when a ``*_async`` method is overridden."""
        cls = type(self)
        return any(
            getattr(cls, name) is not getattr(LitAgent, name)
            for name in ("rollout_async", "training_rollout_async", "validation_rollout_async")
        )

    def rollout(self, task: T, resources: dict[str, Any], rollout: Rollout) -> Any:
        raise NotImplementedError("Agents must implement the `rollout` method.")

    async def rollout_async(self, task: T, resources: dict[str, Any], rollout: Rollout) -> Any:
        raise NotImplementedError("Agents must implement the `rollout_async` method.")

    def training_rollout(self, task: T, resources: dict[str, Any], rollout: Rollout) -> Any:
        return self.rollout(task, resources=resources, rollout=rollout)

    def validation_rollout(self, task: T, resources: dict[str, Any], rollout: Rollout) -> Any:
        return self.rollout(task, resources=resources, rollout=rollout)

    async def training_rollout_async(self, task: T, resources: dict[str, Any], rollout: Rollout) -> Any:
        return await self.rollout_async(task, resources=resources, rollout=rollout)

    async def validation_rollout_async(self, task: T, resources: dict[str, Any], rollout: Rollout) -> Any:
        return await self.rollout_async(task, resources=resources, rollout=rollout)


def _deref(ref: Any, what: str) -> Any:
    if ref is None:
        raise ValueError(f"{what} has not been set for this agent.")
    target = ref()
    if target is None:
        raise ValueError(f"{what} reference is no longer valid (object has been garbage collected).")
    return target


def _first(resources: dict[str, Any], kind: type, what: str) -> Any:
    found = [(k, v) for k, v in resources.items() if isinstance(v, kind)]
    if not found:
        raise ValueError(f"No {what} resource found in the provided resources.")
    if len(found) > 1:
        log.warning("Multiple %s resources found; using the first one: %r", what, found[0][0])
    return found[0][1]


class FunctionalLitAgent(LitAgent[Any]):
    """An agent made from a function by ``@rollout``; calling it calls the function."""

    def __init__(self, rollout_func: Callable[..., Any], *, strip_proxy: bool = True):
        super().__init__()
        self._func = rollout_func
        self._strip_proxy = strip_proxy
        self._is_async = inspect.iscoroutinefunction(rollout_func)
        self._params = set(inspect.signature(rollout_func).parameters)
        functools.update_wrapper(self, rollout_func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._func(*args, **kwargs)

    def __reduce__(self) -> Any:
        qualname = getattr(self._func, "__qualname__", None)
        if qualname is None:  # a functools.partial: pickled by value
            return (_functional_agent, (self._func, self._strip_proxy))
        return (_rebuild_functional, (self._func.__module__, qualname))

    def is_async(self) -> bool:
        return self._is_async

    def _kwargs(self, resources: dict[str, Any], rollout: Rollout) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if "rollout" in self._params:
            kwargs["rollout"] = rollout
        if "llm" in self._params:
            llm = _first(resources, LLM, "LLM")
            if self._strip_proxy and isinstance(llm, ProxyLLM):
                llm = llm.with_attempted_rollout(rollout)
            kwargs["llm"] = llm
        if "prompt_template" in self._params:
            kwargs["prompt_template"] = _first(resources, PromptTemplate, "prompt template")
        return kwargs

    def rollout(self, task: Any, resources: dict[str, Any], rollout: Rollout) -> Any:
        if self._is_async:
            raise RuntimeError(f"{_name(self._func)} is asynchronous. Use rollout_async instead.")
        return self._func(task, **self._kwargs(resources, rollout))

    async def rollout_async(self, task: Any, resources: dict[str, Any], rollout: Rollout) -> Any:
        if not self._is_async:
            raise RuntimeError(f"{_name(self._func)} is synchronous. Use rollout instead.")
        return await self._func(task, **self._kwargs(resources, rollout))


def _functional_agent(func: Callable[..., Any], strip_proxy: bool) -> FunctionalLitAgent:
    return FunctionalLitAgent(func, strip_proxy=strip_proxy)


def _rebuild_functional(module: str, qualname: str) -> Any:
    import importlib

    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


_INJECTED = ("rollout", "llm", "prompt_template")


def _name(func: Callable[..., Any]) -> str:
    """How a message names ``func``: its qualified name, else (a ``functools.partial``, an object) its repr."""
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _validate(func: Callable[..., Any], resource_param: str) -> None:
    """Check that ``func`` can be called as the runner calls it: ``func(task, **resources)``.

    The task goes first, positionally (the parameter must be named ``task``, as in 0.3.0), and
    ``rollout``, ``llm`` and ``prompt_template`` by keyword where the signature names them.

    Raises:
        ValueError: It has no ``resource_param`` parameter, or cannot be called that way (a
            parameter without a default that nothing fills, a keyword-only ``task``, a
            positional-only resource).
    """
    sig = inspect.signature(func)
    params = list(sig.parameters)
    if len(params) < 2:
        raise ValueError(f"Function {_name(func)} must have at least 2 parameters.")
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if params[0] != "task" or sig.parameters["task"].kind not in positional:
        raise ValueError(f"Function {_name(func)} must have a positional parameter called 'task'.")
    if resource_param not in params:
        raise ValueError(f"Function {_name(func)} must have a positional parameter called '{resource_param}'.")
    injected = [name for name in _INJECTED if name in sig.parameters]
    try:
        sig.bind(None, **dict.fromkeys(injected))
    except TypeError as e:
        call = ", ".join(["task", *(f"{name}=..." for name in injected)])
        raise ValueError(f"Function {_name(func)}{sig} cannot be called as ({call}): {e}.") from e


def llm_rollout(func: Callable[..., Any] | None = None, *, strip_proxy: bool = True) -> Any:
    """Make an agent from ``func(task, llm[, rollout])``."""

    def wrap(f: Callable[..., Any]) -> FunctionalLitAgent:
        _validate(f, "llm")
        return FunctionalLitAgent(f, strip_proxy=strip_proxy)

    return wrap(func) if func is not None else wrap


def prompt_rollout(func: Callable[..., Any] | None = None) -> Any:
    """Make an agent from ``func(task, prompt_template[, rollout])``."""

    def wrap(f: Callable[..., Any]) -> FunctionalLitAgent:
        _validate(f, "prompt_template")
        return FunctionalLitAgent(f)

    return wrap(func) if func is not None else wrap


def rollout(func: Callable[..., Any]) -> FunctionalLitAgent:
    """Make an agent from ``func(task, llm[, rollout])`` or ``func(task, prompt_template[, rollout])``.

    ``func`` may be sync or async, a function or a ``functools.partial`` of one; other parameters
    need defaults. A signature the runner could not call is refused here, not at every rollout.

    Raises:
        NotImplementedError: The signature matches neither pattern, or the runner could not call it.
    """
    reasons = []
    for param in ("llm", "prompt_template"):
        try:
            _validate(func, param)
        except ValueError as e:
            if param in inspect.signature(func).parameters:
                reasons.append(str(e))
            continue
        return FunctionalLitAgent(func)
    raise NotImplementedError(
        f"Function signature {inspect.signature(func)} does not match any known agent patterns. Expected "
        "signatures: (task, llm[, rollout]) or (task, prompt_template[, rollout]). Functions can be sync or async."
        + "".join(f" {reason}" for reason in reasons)
    )
