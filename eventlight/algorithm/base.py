"""``Algorithm``: the tuner side of training (Agent-lightning ``agentlightning.algorithm``).

An algorithm enqueues rollouts into the store, waits for runners to finish them, reads their spans
(through an adapter) and publishes new resources. The trainer wires its collaborators in before it
calls ``run(train_dataset=..., val_dataset=...)``:

* trainer: held by **weak** reference (the trainer holds the algorithm; no cycle);
* store: strong reference (it must live as long as the algorithm runs);
* adapter, LLM proxy, initial resources: strong references. Agent-lightning holds the adapter and
  the proxy weakly, so ``algo.set_adapter(TraceToMessages())`` on a temporary fails later with
  "garbage collected" (``seed_algorithms.md`` sharp edge 1); we keep them.

``run`` may be a coroutine function (``is_async()`` is then true) or a plain function.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import random
import weakref
from collections.abc import Callable, Collection, Iterator
from typing import Any, Protocol, TypeVar

from eventlight.adapter import Adapter
from eventlight.core.errors import EventlightError
from eventlight.core.types import TERMINAL_ROLLOUT_STATUSES, NamedResources
from eventlight.store.base import LightningStore

__all__ = [
    "Algorithm",
    "Dataset",
    "FastAlgorithm",
    "FunctionalAlgorithm",
    "algo",
    "batch_iter_over_dataset",
]

log = logging.getLogger(__name__)

T_co = TypeVar("T_co", covariant=True)
T = TypeVar("T")


class Dataset(Protocol[T_co]):
    """Anything with ``len()`` and integer indexing (a list is fine)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> T_co: ...


class Algorithm:
    """Base class of algorithms. Subclasses override ``run`` and need not call ``__init__``."""

    _trainer_ref: weakref.ref[Any] | None = None
    _store: LightningStore | None = None
    _adapter: Adapter[Any, Any] | None = None
    _llm_proxy: Any = None
    _initial_resources: NamedResources | None = None
    _stop_requested: bool = False

    def run(self, train_dataset: Dataset[Any] | None = None, val_dataset: Dataset[Any] | None = None) -> Any:
        """Run the algorithm to completion; may be ``async def`` in subclasses. Returns nothing.

        Raises:
            NotImplementedError: Not overridden.
        """
        raise NotImplementedError(f"{type(self).__name__}.run is not implemented")

    def is_async(self) -> bool:
        """Whether ``run`` is a coroutine function (a ``def`` returning a coroutine counts as sync)."""
        return inspect.iscoroutinefunction(self.run)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)

    # -- collaborators ---------------------------------------------------------------------

    def set_trainer(self, trainer: Any) -> None:
        """Remember the trainer (weakly) for the run about to start; a stop requested during an
        earlier run (``request_stop``) is forgotten."""
        self._trainer_ref = weakref.ref(trainer)
        self._stop_requested = False

    def request_stop(self) -> None:
        """Ask ``run`` to stop at its next safe point, before it is cancelled.

        ``Trainer`` calls it when its run is cancelled (Ctrl+C), before it gives its runners their
        grace (``run`` goes on meanwhile: it serves what their agents call) and then cancels ``run``.
        An algorithm that reads ``stop_requested`` starts nothing new meanwhile (``GRPO``: no update
        from rollouts the stop cut short); one that does not is cancelled as before. eventlight's;
        Agent-lightning has no such call.
        """
        self._stop_requested = True

    @property
    def stop_requested(self) -> bool:
        """Whether ``request_stop`` was called since the run started."""
        return self._stop_requested

    def get_trainer(self) -> Any:
        """The trainer.

        Raises:
            ValueError: Never set, or already garbage-collected.
        """
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        if trainer is None:
            raise ValueError("trainer is not set or was garbage-collected")
        return trainer

    def set_store(self, store: LightningStore) -> None:
        """Set the store the algorithm drives."""
        self._store = store

    def get_store(self) -> LightningStore:
        """The store.

        Raises:
            ValueError: Not set.
        """
        if self._store is None:
            raise ValueError("store is not set; call set_store() or run the algorithm through a Trainer")
        return self._store

    def set_adapter(self, adapter: Adapter[Any, Any]) -> None:
        """Set the adapter that turns spans into training data."""
        self._adapter = adapter

    def get_adapter(self) -> Adapter[Any, Any]:
        """The adapter.

        Raises:
            ValueError: Not set.
        """
        if self._adapter is None:
            raise ValueError("adapter is not set; call set_adapter() or run the algorithm through a Trainer")
        return self._adapter

    def set_llm_proxy(self, llm_proxy: Any) -> None:
        """Set (or clear, with ``None``) the LLM proxy."""
        self._llm_proxy = llm_proxy

    def get_llm_proxy(self) -> Any:
        """The LLM proxy, or ``None`` if there is none."""
        return self._llm_proxy

    def set_initial_resources(self, resources: NamedResources) -> None:
        """Set the resources the algorithm starts from (name -> ``LLM``/``ProxyLLM``/``PromptTemplate``)."""
        self._initial_resources = dict(resources)

    def get_initial_resources(self) -> NamedResources | None:
        """The initial resources, or ``None`` if unset."""
        return self._initial_resources

    # -- giving up on rollouts ---------------------------------------------------------------

    async def _cancel_given_up(self, late: list[str], reason: str, who: str) -> set[str]:
        """Cancel the rollouts ``late`` that a wait gave up on, unless they ended meanwhile, each
        keeping its metadata with ``cancelled_by`` (pid and ``reason``) added, as the demos'
        leftover cancel. A queued one then never runs; one running ends its attempt, whose result
        nothing reads. Used by GRPO's step wait and APO's evaluation batch; the caller logs the
        warning line that counts them.

        Args:
            late: Rollout ids the wait gave up on.
            reason: Why, stored under ``metadata.cancelled_by.reason``.
            who: Prefix of the debug lines (``"GRPO"``, APO's log prefix).

        Returns:
            The ids actually cancelled (not those that ended meanwhile or could not be cancelled).
        """
        return await cancel_rollouts(self.get_store(), late, reason, who)


async def cancel_rollouts(
    store: Any, rollout_ids: list[str], reason: str, who: str, *, only_in: Collection[str] | None = None
) -> set[str]:
    """Cancel the rollouts ``rollout_ids``, unless they ended meanwhile (or, with ``only_in``, are no
    longer in one of those statuses, e.g. claimed by a runner since), each keeping its metadata with
    ``cancelled_by`` added: ``{"pid": <this process>, "reason": reason}``, which GRPO's and the
    demo's reports read back. A store that cannot read them back cancels them all the same, without
    their metadata.

    Args:
        store: The ``LightningStore`` that holds them.
        rollout_ids: Those to cancel.
        reason: Why, stored under ``metadata.cancelled_by.reason``.
        who: Prefix of the debug lines (``"GRPO"``, ``"the trainer"``).
        only_in: Statuses a rollout must still have to be cancelled (``None``: any not terminal).

    Returns:
        The ids actually cancelled.
    """
    try:
        current = {r.rollout_id: r for r in await store.query_rollouts(rollout_id_in=rollout_ids)}
    except EventlightError as e:  # cancel them all the same, without their metadata
        log.debug("%s could not read the rollouts it cancels: %r", who, e)
        current = {}
    cancelled: set[str] = set()
    for rid in rollout_ids:
        rollout = current.get(rid)
        if rollout is not None and rollout.status in TERMINAL_ROLLOUT_STATUSES:
            continue  # ended meanwhile: nothing to cancel
        if rollout is not None and only_in is not None and rollout.status not in only_in:
            continue
        metadata = {
            **((rollout.metadata if rollout else None) or {}),
            "cancelled_by": {"pid": os.getpid(), "reason": reason},
        }
        try:
            await store.update_rollout(rid, status="cancelled", metadata=metadata)
        except EventlightError as e:  # ended meanwhile
            log.debug("%s could not cancel %s: %s", who, rid, e)
            continue
        cancelled.add(rid)
    return cancelled


class FastAlgorithm(Algorithm):
    """Marker base class for quick developer loops; ``Trainer.dev`` accepts only these."""


_INJECTABLE = ("store", "adapter", "llm_proxy", "initial_resources")


class FunctionalAlgorithm(Algorithm):
    """An ``Algorithm`` made from a function by ``@algo``; see ``algo``.

    Calling the object calls the raw function; ``run`` injects collaborators by parameter name.
    """

    def __init__(self, func: Callable[..., Any]):
        self._func = func
        self._params = inspect.signature(func).parameters
        functools.update_wrapper(self, func)

    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self._func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._func(*args, **kwargs)

    def run(self, train_dataset: Dataset[Any] | None = None, val_dataset: Dataset[Any] | None = None) -> Any:
        """Call the function with what it asks for; a coroutine is returned when it is async.

        Raises:
            TypeError: A dataset is given but the function has no parameter of that name.
            ValueError: The function asks for ``store``/``adapter`` and it is not set.
        """
        kwargs = {name: self._collaborator(name) for name in _INJECTABLE if name in self._params}
        for name, value in (("train_dataset", train_dataset), ("val_dataset", val_dataset)):
            if name in self._params:
                kwargs[name] = value
            elif value is not None:
                raise TypeError(f"{self._func.__name__}() has no parameter {name!r} but a {name} was given")
        return self._func(**kwargs)

    def _collaborator(self, name: str) -> Any:
        getters = {
            "store": self.get_store,
            "adapter": self.get_adapter,
            "llm_proxy": self.get_llm_proxy,
            "initial_resources": self.get_initial_resources,
        }
        return getters[name]()


def algo(func: Callable[..., Any]) -> FunctionalAlgorithm:
    """Turn a function into an algorithm (Agent-lightning ``@agl.algo``).

    The function may be sync or async and may declare, by name, any of ``store``, ``adapter``,
    ``llm_proxy``, ``initial_resources``, ``train_dataset``, ``val_dataset``; ``*args``/``**kwargs``
    receive nothing. Example::

        @algo
        async def my_algorithm(*, store, train_dataset=None, val_dataset=None):
            await store.enqueue_rollout(input=train_dataset[0], mode="train")
    """
    return FunctionalAlgorithm(func)


def batch_iter_over_dataset(
    dataset: Dataset[T], batch_size: int, rng: random.Random | None = None
) -> Iterator[list[T]]:
    """Endless shuffled batches of ``batch_size`` distinct items (Agent-lightning semantics).

    If ``batch_size >= len(dataset)`` every batch is a fresh shuffle of the whole dataset. Otherwise
    indices are reshuffled each epoch and a partly filled batch carries over into the next epoch
    (only duplicates within one batch are skipped), so batches may straddle epochs.

    Raises:
        ValueError: The dataset is empty or ``batch_size < 1``.
    """
    rng = rng or random.Random()
    n = len(dataset)
    if n == 0 or batch_size < 1:
        raise ValueError(f"cannot batch a dataset of {n} items into batches of {batch_size}")
    if batch_size >= n:
        while True:
            order = list(range(n))
            rng.shuffle(order)
            yield [dataset[i] for i in order]
    batch: list[int] = []
    while True:
        order = list(range(n))
        rng.shuffle(order)
        for i in order:
            if i not in batch:
                batch.append(i)
            if len(batch) == batch_size:
                yield [dataset[j] for j in batch]
                batch = []
