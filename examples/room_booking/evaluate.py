"""Measure prompt templates on the room-booking tasks with a local (or given) OpenAI-compatible LLM.

Usage::

    python examples/room_booking/evaluate.py                      # all templates, local SmolLM2 server
    python examples/room_booking/evaluate.py --templates initial name_only --subset val
    python examples/room_booking/evaluate.py --base-url http://127.0.0.1:8000/v1 --model smollm2-135m-instruct

For each template it prints the mean reward on the train half, the validation half and all
tasks it ran, the mean seconds per request, how often the answer named no listed room, and how
often it named the first listed room (the position-bias baseline scores about 0.29).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import agent  # noqa: E402


def all_templates() -> dict[str, str]:
    return {"initial": agent.INITIAL_PROMPT, **agent.ALTERNATIVE_PROMPTS}


async def evaluate(client, model: str, template: str, tasks: list[dict]) -> dict:
    """Run one template on ``tasks`` sequentially.

    Returns:
        ``rewards`` (per task), ``answers``, ``seconds_per_request``, ``no_room`` and
        ``first_listed`` (fractions of answers).
    """
    rewards, answers = [], []
    no_room = first_listed = 0
    t0 = time.monotonic()
    for task in tasks:
        reward, answer = await agent.book_room(task, template, "", model, client=client)
        rewards.append(reward)
        answers.append(answer)
        named = agent.first_room_mentioned(answer, task)
        no_room += named is None
        first_listed += named == task["rooms"][0]["name"]
    n = len(tasks)
    return {
        "rewards": rewards,
        "answers": answers,
        "seconds_per_request": (time.monotonic() - t0) / n,
        "no_room": no_room / n,
        "first_listed": first_listed / n,
    }


async def main(argv: list[str] | None = None) -> int:
    import openai

    templates = all_templates()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--templates", nargs="*", default=list(templates), choices=list(templates))
    p.add_argument("--subset", choices=["all", "train", "val"], default="all")
    p.add_argument("--base-url", help="use this endpoint instead of starting the local SmolLM2 server")
    p.add_argument("--model", default=None, help="model name (default: the local server's alias)")
    p.add_argument("--log-dir", default=".eventlight/logs", help="local server log folder")
    p.add_argument("--json", type=Path, help="also write per-task results to this file")
    args = p.parse_args(argv)

    tasks = agent.load_tasks()
    train, val = agent.split(tasks)
    chosen = {"all": tasks, "train": train, "val": val}[args.subset]
    train_ids = {t["id"] for t in train}

    server = None
    if args.base_url is None:
        from eventlight.local_llm import LocalLLMServer

        server = LocalLLMServer(log_dir=args.log_dir)
        base_url = await server.start()
        print(f"local server up in {server.startup_s:.1f} s: {' '.join(server.command())}", flush=True)
        model = args.model or server.model
    else:
        base_url, model = args.base_url, args.model or "smollm2-135m-instruct"
    results = {}
    try:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="local") as client:
            await agent.book_room(tasks[0], agent.INITIAL_PROMPT, "", model, client=client)  # warm-up
            print(f"{'template':14s} {'train':>6s} {'val':>6s} {'all':>6s} {'s/req':>6s} {'noroom':>6s} {'first':>6s}")
            for name in args.templates:
                r = await evaluate(client, model, templates[name], chosen)
                tr = [x for t, x in zip(chosen, r["rewards"], strict=True) if t["id"] in train_ids]
                va = [x for t, x in zip(chosen, r["rewards"], strict=True) if t["id"] not in train_ids]

                def mean(xs: list[float]) -> str:
                    return f"{sum(xs) / len(xs):6.3f}" if xs else f"{'-':>6s}"

                print(
                    f"{name:14s} {mean(tr)} {mean(va)} {mean(r['rewards'])} {r['seconds_per_request']:6.2f} "
                    f"{r['no_room']:6.2f} {r['first_listed']:6.2f}",
                    flush=True,
                )
                results[name] = {"ids": [t["id"] for t in chosen], **r}
    finally:
        if server is not None:
            await server.stop()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
