"""How a runner meets its store and proxy: whether dequeues long-poll, the runner's default
``RolloutConfig``, and the proxy token on the ``ProxyLLM`` resources it hands agents."""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import msgspec

from eventlight.core.types import AttemptedRollout, ProxyLLM, RolloutConfig, ended_by_cancel
from eventlight.store.base import LightningStore

log = logging.getLogger(__name__)

_DEFAULT = RolloutConfig()


async def apply_rollout_config(
    store: LightningStore, rollout: AttemptedRollout, config: RolloutConfig | None
) -> AttemptedRollout:
    """Give ``rollout`` the runner's ``config`` when it was enqueued with the default one.

    The config is recorded on the rollout (``update_rollout``) before the agent runs, so the
    watchdog's timeouts and the retry decision at the attempt's end follow it. A rollout whose
    enqueuer chose a config keeps it; one given equal to ``RolloutConfig()`` cannot be told from
    none (the event holds the config, not whether it was given) and takes the runner's. A store
    that refuses the update is logged; the attempt runs under the rollout's own config then.
    """
    if config is None or rollout.config != _DEFAULT or config == _DEFAULT:
        return rollout
    try:
        await store.update_rollout(rollout.rollout_id, config=config)
    except Exception as exc:
        log.warning("rollout %s keeps its default RolloutConfig: %s: %s", rollout.rollout_id, type(exc).__name__, exc)
        return rollout
    return msgspec.structs.replace(rollout, config=config)


@functools.lru_cache(maxsize=16)
def _dequeue_takes(cls: type, parameter: str) -> bool:
    method = getattr(cls, "dequeue_rollout", None)
    return method is not None and parameter in inspect.signature(method).parameters


def _dequeue_of(store: LightningStore) -> type:
    """The class whose ``dequeue_rollout`` a call on ``store`` runs: a wrapper that forwards calls
    (``LightningStoreThreaded``) answers for the store it wraps."""
    inner = getattr(store, "store", None)
    if isinstance(inner, LightningStore) and not hasattr(type(store), "dequeue_rollout"):
        return _dequeue_of(inner)
    return type(store)


def _long_polls(store: LightningStore) -> bool:
    """Whether the store's ``dequeue_rollout`` can wait for work in the server (``wait_s``)."""
    return _dequeue_takes(_dequeue_of(store), "wait_s")


def _reads_resources_with_claims(store: LightningStore) -> bool:
    """Whether the store's ``dequeue_rollout`` reads the claimed rollout's resources alongside the
    claim (``read_resources``; ``claimed_resources`` hands them over)."""
    cls = _dequeue_of(store)
    return _dequeue_takes(cls, "read_resources") and hasattr(cls, "claimed_resources")


def _claims_before_append(store: LightningStore) -> bool:
    """Whether the store's ``dequeue_rollout`` tells its caller of a claim before appending it
    (``on_claim``), so a runner can put it on its claim board first."""
    return _dequeue_takes(_dequeue_of(store), "on_claim")


async def rollout_cancelled(store: LightningStore, rollout_id: str, attempt_id: str | None = None) -> bool:
    """Whether ``rollout_id`` was cancelled, or (``attempt_id`` given) that attempt was ended by a
    cancel the rollout was requeued after (``ended_by_cancel``): eventlight's store answers from its
    log (``rollout_cancelled``, so a runner's write-only store can), another store by
    ``get_rollout_by_id`` (Agent-lightning's API: a store server, ``LightningStoreClient``), which
    sees the attempt while it is the rollout's latest."""
    probe = getattr(store, "rollout_cancelled", None)
    if probe is not None:
        return bool(await probe(rollout_id, attempt_id))
    rollout = await store.get_rollout_by_id(rollout_id)
    if rollout is None:
        return False
    if rollout.status == "cancelled":
        return True
    latest = rollout.attempt if isinstance(rollout, AttemptedRollout) else None
    return latest is not None and latest.attempt_id == attempt_id and ended_by_cancel(latest)


def with_proxy_key(resource: Any, token: str) -> Any:
    """``resource`` with ``api_key=token`` when it is a ``ProxyLLM`` (a copy: the stored one is shared)."""
    return msgspec.structs.replace(resource, api_key=token) if isinstance(resource, ProxyLLM) else resource
