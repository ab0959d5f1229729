"""Claims of ``EventStore``: dequeue (claim a queue entry), start an attempt, mark a worker idle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from eventlight.core import commands as c
from eventlight.core.errors import (
    AttemptNotFoundError,
    ConcurrencyError,
    InvalidInputError,
    InvalidTransitionError,
    NotFoundError,
    ServiceUnavailableError,
)
from eventlight.core.events import WorkerIdle, leaves_queue
from eventlight.core.types import (
    AttemptedRollout,
    ResourcesUpdate,
    Rollout,
    generate_id,
)
from eventlight.store.command_loop import Outcome
from eventlight.store.futures import cancels, mark_seen, raise_if_cancelled, wait_done
from eventlight.store.ports import EventLog, Queued
from eventlight.store.service.plumbing import BACKGROUND_CLOSE_WAIT_S, StorePlumbing, store_call
from eventlight.store.validate import (
    check_token,
    check_wait,
)

log = logging.getLogger(__name__)

IDLE_REFRESH_S = 1.0
"""An empty poll re-marks an idle worker (``last_dequeue_time``) at most this often, in seconds."""
MAX_IDLE_MARKS = 4096  # workers whose last idle mark this store remembers
MAX_CLAIM_READS = 1024  # resources read with claims and not handed over yet, kept at most
MAX_LEFT_QUEUE = 65536  # rollouts whose last known claim (or other exit from the queue) is remembered


UNKNOWN_CLAIM_RETRIES_S = (0.5, 1.0, 2.0, 4.0, 8.0)
"""Waits (seconds) before each try to settle a claim whose append failed in transit (the first lets
a publish still in flight land, so that its attempt is found)."""

GIVE_UP_RECANCEL_S = 0.05  # how often a pull its dequeue gave up on is cancelled again (``_give_up``)


async def _give_up(pull: asyncio.Future[Queued | None]) -> None:
    """End a pull its dequeue gave up on (its caller was cancelled, or the store closes), and hand
    back an entry it brings all the same. The pull is cancelled again until it ends: nats-py's
    ``wait_for`` can swallow a cancel (creating the queue's subscription, on Python 3.11), and the
    pull would then go on to wait out its long poll. Run in the background, so ``close`` waits for
    it (up to ``BACKGROUND_CLOSE_WAIT_S``) before it closes the connection the hand-back needs."""
    while not pull.done():
        pull.cancel()
        await asyncio.wait([pull], timeout=GIVE_UP_RECANCEL_S)
    if pull.cancelled() or pull.exception() is not None:
        return
    item = pull.result()
    if item is not None:
        log.info("handing back queue entry %d of rollout %s: its dequeue had given up", item.seq, item.rollout_id)
        with contextlib.suppress(Exception):  # if the connection is gone, it comes back after the ack wait
            await item.nak(0.0)


async def _hand_back(item: Queued) -> None:
    with contextlib.suppress(Exception):  # if the connection is gone, it comes back after the ack wait
        await item.nak(0.0)


def _cancel(read: asyncio.Future[ResourcesUpdate | None] | None) -> None:
    if read is not None:
        read.cancel()


class Claims(StorePlumbing):
    """Claims from the work queue, and the worker idle/busy policy of empty polls."""

    @store_call
    async def dequeue_rollout(
        self,
        worker_id: str | None = None,
        *,
        wait_s: float = 0.0,
        read_resources: bool = False,
        on_claim: Callable[[str, str], object] | None = None,
    ) -> AttemptedRollout | None:
        """Claim the oldest queued rollout.

        Args:
            worker_id: The claiming runner; becomes the attempt's ``worker_id``.
            wait_s: Seconds to wait for work when the queue is empty (eventlight extension; the
                Agent-lightning API is non-blocking, ``0``). Runners pass their poll interval so
                an idle runner sleeps in the server instead of spinning (peer failure C19).
                A caller cancelled mid-claim (``asyncio.wait_for``) leaves nothing stranded: an
                attempt its claim started is marked ``failed``, an entry it did not claim goes
                back to the queue at once.
            read_resources: Also read the claimed rollout's resources (its ``resources_id``, else
                the latest), alongside the claim instead of after it: on JetStream both requests
                leave in one write, and the runner waits one round trip less (eventlight extension;
                ``LitAgentRunner`` sets it). ``claimed_resources`` hands them over. The read is
                made while the claim is appended: it shows the resources as of the claim.
            on_claim: Called with ``(rollout_id, attempt_id)`` of each claim just before its append
                (eventlight extension): a runner of a ``RunnerPool`` writes it on its claim board
                there, so a process killed once the claim is stored, before this call returns,
                leaves it on the board. A claim that is refused (the rollout was claimed or
                cancelled meanwhile) is not made: its attempt never exists.

        Raises:
            InvalidInputError: ``worker_id`` is not a token, or ``wait_s`` is not from 0 to
                ``MAX_WAIT_S`` (3,600 s).
            InvalidTypeError: ``wait_s`` is not a number.
        """
        if worker_id is not None:
            check_token("worker_id", worker_id)
        check_wait("wait_s", wait_s)
        log = self._log()
        clock = asyncio.get_running_loop().time
        deadline = clock() + wait_s if wait_s > 0 else 0.0
        while True:
            if wait_s > 0:
                waited, item = await self._long_poll(log, max(0.0, deadline - clock()))
            else:
                waited, item = await self._pull_now(log)
            if not waited:  # the store closes
                return None
            if item is not None and self._draining:  # arrived as the close began: claim nothing more
                # in the background, as every other hand-back: a hand-back waits for the server's
                # answer, and a close while NATS is down must not hold this dequeue for it
                self._in_background(_hand_back(item))
                return None
            if item is not None:
                claimed = await self._claim(item, worker_id, read_resources, on_claim)
                if claimed is not None:
                    if worker_id is not None:
                        self._idle_marks.pop(worker_id, None)
                    return claimed
            if item is None or (wait_s > 0 and clock() >= deadline):
                await self._mark_idle(worker_id)
                return None

    async def _long_poll(self, log: EventLog, wait_s: float) -> tuple[bool, Queued | None]:
        """A pull that waits up to ``wait_s`` seconds, in a task of its own that a close interrupts
        (``_unless_closing``): ``(False, None)`` when the store closes first. An entry the pull
        brings after its caller gave up (cancelled, the store closing) goes back (``_give_up``)."""
        pull = asyncio.ensure_future(log.next_queued(wait_s))
        try:
            waited, item = await self._unless_closing(pull)
        except BaseException:  # cancelled: an entry the pull brings (or brought) goes back
            self._in_background(_give_up(pull))
            raise
        if not waited:
            self._in_background(_give_up(pull))
        return waited, item

    async def _pull_now(self, log: EventLog) -> tuple[bool, Queued | None]:
        """A non-blocking dequeue's pull (``next_queued(0)``), awaited in the caller's own task: it
        answers in a round trip (a few more ms to confirm an empty answer), so a close need not
        interrupt it, and it spends no task of its own (CPU on every empty poll). Cancelled,
        the queue hands back an entry its pull brings late. A cancel that Python 3.11's
        ``wait_for`` swallowed inside it (nats-py's consumer info) is raised here, and an entry it
        brought all the same goes back (``raise_if_cancelled``). ``(False, None)``: the store is
        closing (nothing pulled).

        Raises:
            asyncio.CancelledError: The caller was cancelled.
            ServiceUnavailableError: The queue's server did not answer.
        """
        if self._draining:  # a claim refused as the close began: claim nothing more
            return False, None
        since = cancels()
        item = await log.next_queued(0.0)
        if item is not None and cancels() > since:
            self._in_background(_hand_back(item))
        raise_if_cancelled(since)
        return True, item

    async def _claim(
        self, item: Queued, worker_id: str | None, read_resources: bool, on_claim: Callable[[str, str], object] | None
    ) -> AttemptedRollout | None:
        """Claim a queue entry: append ``AttemptStarted`` expecting the rollout's version; an entry
        whose rollout left ``queuing``/``requeuing`` since is acknowledged and skipped. With
        ``read_resources``, the resources the entry names are read concurrently (``claimed_resources``)."""
        try:
            last = await self._entry_is_last(item)
        except BaseException:  # cancelled, or NATS did not answer: the entry goes back at once
            self._in_background(_hand_back(item))
            raise
        if last is None:  # the rollout left the queue after this entry: nothing to decide
            await item.ack()
            return None
        cmd = c.StartAttempt(attempt_id=generate_id("at-", 8), worker_id=worker_id, claim=True)
        hint = (item.created, item.seq) if item.created is not None and last else None
        named = item.created.rollout.resources_id if item.created is not None else None
        read: asyncio.Future[ResourcesUpdate | None] | None = None
        if read_resources and item.created is not None:  # a requeued entry names none: read after the claim
            # Scheduled before the append, so on JetStream its request leaves with the claim's publish.
            read = asyncio.ensure_future(self._resources_for(named))
            read.add_done_callback(mark_seen)
        if on_claim is not None:
            on_claim(item.rollout_id, cmd.attempt_id)
        claim = asyncio.ensure_future(self._loop.execute(item.rollout_id, cmd, hint=hint, max_tries=3))
        # Registered until the caller has its answer: a caller cancelled mid-claim (``wait_for``, a
        # runner shutting down) may have had its append stored already; its claim is then settled
        # in the background (``_abandon``), or by ``close`` if the caller has not resumed by then.
        self._claims[claim] = (item, cmd.attempt_id)
        try:
            return await self._finish_claim(claim, item, cmd.attempt_id, named, read)
        except asyncio.CancelledError:
            _cancel(read)
            self._abandon(claim)
            raise
        finally:
            self._claims.pop(claim, None)

    async def _finish_claim(
        self,
        claim: asyncio.Future[Outcome],
        item: Queued,
        attempt_id: str,
        named: str | None,
        read: asyncio.Future[ResourcesUpdate | None] | None,
    ) -> AttemptedRollout | None:
        try:
            outcome = await asyncio.shield(claim)
        except InvalidTransitionError:
            _cancel(read)
            await item.ack()  # cancelled, revived or already claimed since it was queued
            return None
        except (NotFoundError, InvalidInputError) as e:  # a queue entry no rollout stands behind
            _cancel(read)
            log.warning("dropping queue entry %d on rollout %r: %s", item.seq, item.rollout_id, e)
            await item.ack()  # else it would come back every ack wait, for ever
            return None
        except ConcurrencyError:
            _cancel(read)
            await item.nak(0.1)
            return None
        except asyncio.CancelledError:
            raise
        except ServiceUnavailableError:
            # The append failed in transit: it may have been stored (an acknowledgement lost), and
            # the caller, told it failed, will never run that attempt.
            _cancel(read)
            self._claims.pop(claim, None)
            self._in_background(self._settle_unknown_claim(item, attempt_id))
            raise
        except BaseException:
            _cancel(read)
            self._claims.pop(claim, None)  # failed for this caller, who hears of it: nothing to settle
            raise
        self._held[(item.rollout_id, attempt_id)] = item
        self._left_queue_at(item.rollout_id, outcome.version)
        claimed = outcome.state.attempted_rollout()
        if read is not None:
            # Its answer came with the claim's ack; waiting for it here makes the read the one of the
            # claim on every backend (in memory it would otherwise run at the caller's next await).
            await wait_done(read)
            if claimed.resources_id == named:
                self._claim_reads[(claimed.rollout_id, claimed.attempt.attempt_id)] = read
                if len(self._claim_reads) > MAX_CLAIM_READS:  # claimed by a caller that never asked
                    _cancel(self._claim_reads.pop(next(iter(self._claim_reads))))
            else:  # pointed at other resources since it was queued: ``claimed_resources`` reads those
                read.cancel()
        return claimed

    async def _entry_is_last(self, item: Queued) -> bool | None:
        """Whether a queue entry is still its rollout's last state event (``True``: its ``created``
        state can be claimed with the entry's position as the fence), known to be passed by an
        event that took the rollout off the queue (``None``: it can never be claimed, as any return
        to the queue has an entry of its own), or neither (``False``: the claim decides on the
        rollout's state). A first delivery is presumed last; a redelivered entry (its claim's lease
        ran out: mostly one of a rollout claimed since) is judged from what this store knows, else
        from the rollout's next state event (one direct get), instead of a fenced append that the
        log would refuse, a load and a decision. What this store knows are facts, never its cache
        of states: a claim it made, an event it read (``_left_queue``)."""
        if self._left_queue.get(item.rollout_id, 0) > item.seq:
            return None
        if not item.redelivered:
            return True
        try:
            after = await self._log().state_event_after(item.rollout_id, item.seq)
        except InvalidInputError:
            return False
        if after is None:
            return True
        if leaves_queue(after[1]):
            self._left_queue_at(item.rollout_id, after[0])
            return None
        return False

    def _left_queue_at(self, rollout_id: str, seq: int) -> None:
        """Remember that the rollout was off the queue at log position ``seq`` (entries before it
        can never be claimed); the last ``MAX_LEFT_QUEUE`` rollouts are kept."""
        self._left_queue[rollout_id] = max(seq, self._left_queue.pop(rollout_id, 0))
        if len(self._left_queue) > MAX_LEFT_QUEUE:
            self._left_queue.pop(next(iter(self._left_queue)))

    def _abandon(self, claim: asyncio.Future[Outcome]) -> None:
        """Settle ``claim`` in the background if its caller has not had its answer (once)."""
        entry = self._claims.pop(claim, None)
        if entry is not None:
            self._in_background(self._abandon_claim(claim, *entry))

    async def _settle_abandoned_claims(self) -> None:
        """Before closing: settle the claims whose callers were cancelled (also those cancelled
        callers that have not resumed yet), and wait up to ``BACKGROUND_CLOSE_WAIT_S`` for them."""
        for claim in list(self._claims):
            self._abandon(claim)
        if self._background:
            await asyncio.wait(set(self._background), timeout=BACKGROUND_CLOSE_WAIT_S)

    async def _abandon_claim(self, claim: asyncio.Future[Outcome], item: Queued, attempt_id: str) -> None:
        """Settle a claim whose caller was cancelled before it returned: an attempt it started is
        marked ``failed`` (nobody will run it; the rollout's retry policy decides what follows, as
        for a runner that fails what it holds when it stops), and a queue entry it did not claim is
        handed back at once (``nak``), instead of after the consumer's ack wait."""
        rollout_id = item.rollout_id
        try:
            await claim
        except (InvalidTransitionError, NotFoundError, InvalidInputError):
            with contextlib.suppress(Exception):
                await item.ack()  # what an uncancelled claim does with such an entry
            return
        except BaseException:
            with contextlib.suppress(Exception):
                await item.nak(0.0)
            return
        self._held[(rollout_id, attempt_id)] = item
        await self._fail_unreceived(rollout_id, attempt_id)

    async def _settle_unknown_claim(self, item: Queued, attempt_id: str) -> None:
        """Settle a claim whose append failed in transit (``ServiceUnavailableError``): if the server
        stored it, the attempt is marked ``failed`` (its caller will never run it; the rollout's
        retry policy decides what follows, as for a caller cancelled mid-claim), else the entry is
        handed back at once (``nak``) instead of after the consumer's ack wait. Tried again after
        ``UNKNOWN_CLAIM_RETRIES_S`` while the servers do not answer; after that the entry waits out
        its ack wait, and an attempt stored meanwhile stays ``preparing`` (logged)."""
        rollout_id = item.rollout_id
        for delay in UNKNOWN_CLAIM_RETRIES_S:
            await asyncio.sleep(delay)
            self._held[(rollout_id, attempt_id)] = item
            try:
                await self.update_attempt(rollout_id, attempt_id, status="failed")
            except AttemptNotFoundError:  # never stored
                self._held.pop((rollout_id, attempt_id), None)
                with contextlib.suppress(Exception):
                    await item.nak(0.0)
                return
            except ServiceUnavailableError:
                self._held.pop((rollout_id, attempt_id), None)
                continue
            except Exception:  # finished or moved on meanwhile: nothing to settle
                self._held.pop((rollout_id, attempt_id), None)
                return
            log.warning(
                "the claim of rollout %s got no answer but was stored; marked its attempt %s failed",
                rollout_id,
                attempt_id,
            )
            return
        log.warning(
            "could not learn whether the claim of rollout %s (attempt %s) was stored: the servers did not"
            " answer; if it was, the attempt stays preparing until a timeout in its rollout's config",
            rollout_id,
            attempt_id,
        )

    def _answer_lost(self, result: object) -> None:
        """Claims a cancelled caller never received (``store_call``) are settled as those of a
        caller cancelled mid-claim: their attempts are marked ``failed`` in the background."""
        lost = result if isinstance(result, list) else [result]
        for claimed in lost:
            if isinstance(claimed, AttemptedRollout):
                key = (claimed.rollout_id, claimed.attempt.attempt_id)
                if key in self._held:
                    self._in_background(self._fail_unreceived(*key))

    async def _fail_unreceived(self, rollout_id: str, attempt_id: str) -> None:
        log.warning(
            "dequeue_rollout was cancelled after it claimed rollout %s; marking its attempt %s failed",
            rollout_id,
            attempt_id,
        )
        try:
            await self.update_attempt(rollout_id, attempt_id, status="failed")
        except Exception as e:  # the store closed, a server went away: the queue entry stays held
            log.warning("could not mark attempt %s of rollout %s failed: %r", attempt_id, rollout_id, e)

    async def _resources_for(self, resources_id: str | None) -> ResourcesUpdate | None:
        """A rollout's resources as a runner resolves them: by id, else the latest snapshot."""
        return await (self.get_resources_by_id(resources_id) if resources_id else self.get_latest_resources())

    @store_call
    async def claimed_resources(self, rollout: Rollout) -> ResourcesUpdate | None:
        """The resources of a rollout this store claimed: those read with its claim
        (``dequeue_rollout(read_resources=True)``), else read now. ``None``: there are none.

        By ``rollout.resources_id``, else the latest snapshot, as ``LitAgentRunner`` resolves them
        (eventlight extension). What was read with a claim is handed over once; if that read
        failed, the resources are read again. Any ``Rollout`` is taken; only the
        ``AttemptedRollout`` a claim returned finds what was read with it.

        Raises:
            InvalidInputError: ``rollout`` is not a ``Rollout``.
            ServiceUnavailableError: A server did not answer.
        """
        self._check_open()
        if not isinstance(rollout, Rollout):
            raise InvalidInputError(
                f"claimed_resources takes the rollout dequeue_rollout returned, not {type(rollout).__name__}"
            )
        attempt = rollout.attempt if isinstance(rollout, AttemptedRollout) else None
        read = self._claim_reads.pop((rollout.rollout_id, attempt.attempt_id), None) if attempt else None
        if read is not None and not read.cancelled():
            with contextlib.suppress(Exception):
                return await read
        return await self._resources_for(rollout.resources_id)

    async def _mark_idle(self, worker_id: str | None) -> None:
        if worker_id is None:
            return
        now = self._clock()
        last = self._idle_marks.get(worker_id)
        if last is not None and 0.0 <= now - last < IDLE_REFRESH_S:
            return
        if len(self._idle_marks) >= MAX_IDLE_MARKS:
            self._idle_marks.pop(next(iter(self._idle_marks)))
        self._idle_marks[worker_id] = now
        # Its own task, shielded: a cancelled caller stops waiting at once (nats-py's ``wait_for``
        # could swallow the cancel), and the mark is written all the same.
        mark = asyncio.ensure_future(self._log().publish(WorkerIdle(time=now, worker_id=worker_id)))
        mark.add_done_callback(mark_seen)
        self._wrote(await asyncio.shield(mark))

    @store_call
    async def start_attempt(self, rollout_id: str, worker_id: str | None = None) -> AttemptedRollout:
        if worker_id is not None:
            check_token("worker_id", worker_id)
        cmd = c.StartAttempt(attempt_id=generate_id("at-", 8), worker_id=worker_id)
        started = (await self._loop.execute(rollout_id, cmd)).state.attempted_rollout()
        if worker_id is not None:
            self._idle_marks.pop(worker_id, None)  # busy now: its next empty poll marks it idle at once
        return started
