"""One demo at a time in a namespace, for both demos (``make demo``: GRPO; ``--algorithm apo``: APO).

Each demo holds a lease on the state folder's servers named ``DEMO_LEASE`` (its run id and
namespace). A second demo in that namespace is refused (``refuse_if_live``) before it starts
anything, and again once it holds its own lease (of two starting at once, neither goes on to
cancel the other's queue). A demo that goes on cancels what an earlier one, no longer running,
left queued (``cancel_leftovers``): its own runners would otherwise take those rollouts first.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

import eventlight as agl

if TYPE_CHECKING:
    from eventlight.ops.leases import LeaseHolder

DEMO_LEASE = "demo run {run_id} in namespace {namespace}"
_DEMO_LEASE = re.compile(r"demo run (?P<run_id>\S+) in namespace (?P<namespace>\S+)")


class RunInProgressError(agl.EventlightError):
    """Another demo runs in this namespace now: starting this one would take its queue."""


def demo_lease(settings: agl.Settings, run_id: str) -> str:
    """What this run's lease says (``DEMO_LEASE``): ``use_services(settings, what=demo_lease(...))``."""
    return DEMO_LEASE.format(run_id=run_id, namespace=settings.namespace)


def live_demo(settings: agl.Settings, run_id: str) -> LeaseHolder | None:
    """The oldest other demo that runs in ``settings.namespace`` now, from the leases on the state
    folder's servers (each demo holds one named ``DEMO_LEASE``; a lease of a process that ended is
    not live, however it ended); ``None`` when there is none. ``run_id``: this run, left out.
    Reads the lease files only: it starts and connects to nothing."""
    from eventlight.ops.leases import lease_holders

    for holder in lease_holders(settings.state_dir):
        found = _DEMO_LEASE.fullmatch(holder.what)
        if found and found["namespace"] == settings.namespace and found["run_id"] != run_id:
            return holder
    return None


def refuse_if_live(settings: agl.Settings, run_id: str) -> None:
    """Raise ``RunInProgressError`` (one line: the live run, its pid, what to do) when another demo
    runs in this namespace; its queued rollouts are its own, not leftovers to cancel.

    Call it first, before any server or model starts (the refusal is then immediate and leaves
    nothing running), and again once this run holds its lease."""
    holder = live_demo(settings, run_id)
    if holder is None:
        return
    found = _DEMO_LEASE.fullmatch(holder.what)
    assert found is not None
    raise RunInProgressError(
        f"demo run {found['run_id']} (pid {holder.pid}) is running in namespace {settings.namespace!r} now; "
        "a second demo there would take its queued rollouts: wait for it to end, or run this one in "
        "another namespace (EVENTLIGHT_NAMESPACE=demo2 make demo)"
    )


async def cancel_leftovers(settings: agl.Settings, nats_url: str, pg_dsn: str, run_id: str = "") -> int:
    """Cancel the rollouts an earlier run of a demo (GRPO or APO) left queued in the namespace (it
    was interrupted, or killed); returns how many. Their resources id starts with ``run-`` (a run
    id: GRPO's checkpoints, APO's prompt versions); without this, this run's runners would take them
    first. Each keeps its metadata, with ``cancelled_by`` added: who cancelled it and why
    (``run_id``: this run, named there).

    Call it only once ``refuse_if_live`` found no other demo running in the namespace: a live
    run's queue is not a leftover.
    """
    why = f"left queued by an earlier demo run that is no longer running; cancelled by demo run {run_id or '?'}"
    async with agl.JetStreamLightningStore(settings, nats_url=nats_url, pg_dsn=pg_dsn) as store:
        await store.sync_all(timeout_s=60)  # the read model up to the end of the log
        queued = await store.query_rollouts(status_in=["queuing", "requeuing"])
        stale = [r for r in queued if (r.resources_id or "").startswith("run-")]
        for rollout in stale:
            metadata = {**(rollout.metadata or {}), "cancelled_by": {"pid": os.getpid(), "reason": why}}
            await store.update_rollout(rollout.rollout_id, status="cancelled", metadata=metadata)
    return len(stale)
