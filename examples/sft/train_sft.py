"""Fine-tune SmolLM2-135M-Instruct on the best conversations of an earlier run, on the CPU (eventlight.algorithm.sft).

After ``make demo`` (GRPO) or ``make demo ARGS="--algorithm apo"`` the store holds that run's
rollouts, their spans and rewards. This script selects the succeeded training rollouts whose final
reward reaches ``--min-reward``, turns their LLM calls into conversations (``TraceToMessages``),
runs a few TRL ``SFTTrainer`` steps with the loss on the assistant's tokens only, and records the
weights as resources version ``<run>-sft-step<steps>``:

    python examples/sft/train_sft.py --run RUN_ID [--steps 10] [--min-reward 1.0]
    python examples/sft/train_sft.py --records sft.jsonl      # from `eventlight replay --adapter messages`

``--run`` reads the rollouts made with that run's resources (ids containing RUN_ID, e.g. GRPO's
``RUN_ID-step<k>``) through ``eventlight.replay`` and starts from the run's last GRPO checkpoint
when there is one; without ``--run`` every stored training rollout counts. Running it again with
the same ``--out`` resumes an interrupted fine-tuning from its last trainer checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import eventlight as agl  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", help="learn from this run's rollouts (its resources ids contain RUN_ID)")
    p.add_argument("--records", type=Path, help="a JSONL of replay records (`eventlight replay --adapter messages`)")
    p.add_argument("--min-reward", type=float, default=1.0, help="keep rollouts with at least this reward (1.0)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    p.add_argument("--batch-size", type=int, default=4, help="conversations per step (default 4)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default 1e-5)")
    p.add_argument("--max-seq-len", type=int, default=512, help="longest conversation trained on, in tokens")
    p.add_argument("--model-dir", help="start from this transformers model folder (default: see above)")
    p.add_argument("--out", type=Path, help="checkpoint folder (default .eventlight/checkpoints/<run>-sft)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    return p.parse_args(argv)


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def start_dir(args: argparse.Namespace, settings: agl.Settings) -> str | None:
    """The model to fine-tune: ``--model-dir``, else the run's last GRPO checkpoint, else SmolLM2."""
    if args.model_dir or not args.run:
        return str(args.model_dir) if args.model_dir else None
    from eventlight.rl.policy import latest_checkpoint

    last = latest_checkpoint(settings.state_dir / "checkpoints" / args.run)
    return str(last) if last is not None else None


async def main(args: argparse.Namespace) -> int:
    try:
        return await train(args)
    except (agl.EventlightError, FileNotFoundError, OSError, ImportError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


async def train(args: argparse.Namespace) -> int:
    import torch

    from eventlight.algorithm.sft import SFT, SFTConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    settings = agl.Settings.from_env()
    name = f"{args.run or 'all'}-sft"
    config = SFTConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        min_reward=args.min_reward,
        max_seq_len=args.max_seq_len,
        version_prefix=f"{args.run}-" if args.run else "",
    )
    model_dir = start_dir(args, settings)
    say(f"fine-tuning {model_dir or 'SmolLM2-135M-Instruct (from the GGUF)'} for {args.steps} steps")
    out = args.out or settings.state_dir / "checkpoints" / name
    if args.records is not None:  # a file: no servers needed, nothing recorded
        records = [json.loads(line) for line in args.records.read_text().splitlines() if line.strip()]
        sft = SFT(config, model_dir=model_dir, checkpoint_dir=out, state_dir=settings.state_dir, records=records)
        await sft.run()
        return summary(sft, t0)
    async with agl.use_services(settings) as services:  # its end stops what it started, unless still used
        async with agl.JetStreamLightningStore(settings, nats_url=services.nats_url, pg_dsn=services.pg_dsn) as store:
            records_from_run = await run_records(store, args.run, args.min_reward) if args.run else None
            sft = SFT(
                config,
                model_dir=model_dir,
                checkpoint_dir=out,
                state_dir=settings.state_dir,
                records=records_from_run,
            )
            sft.set_store(store)
            await sft.run()
            return summary(sft, t0)


async def run_records(store: Any, run: str, min_reward: float) -> list[dict[str, Any]]:
    ids = [r.resources_id for r in await store.query_resources(resources_id_contains=run)]
    if not ids:
        raise ValueError(f"no resources of run {run!r} in this namespace")
    replay = agl.replay(store, adapter="messages", resources_ids=ids, min_reward=min_reward, statuses=["succeeded"])
    return [r async for r in replay]


def summary(sft: Any, t0: float) -> int:
    r = sft.result
    steps = r.get("step_s") or [float("nan")]
    print("=" * 78)
    print(f"SFT {sft.version}: {r.get('examples')} conversations trained ({r.get('conversations')} selected)")
    print(f"  skipped            : {r.get('skipped') or 'nothing'}")
    print(f"  steps              : {r.get('steps_run')} this run (global step {r.get('global_step')})")
    print(f"  assistant-token NLL: {r.get('loss_before', float('nan')):.3f} -> {r.get('loss_after', float('nan')):.3f}")
    print(f"  step time          : {sum(steps) / len(steps):.2f} s mean; peak memory {r.get('peak_rss_mb', 0):.0f} MiB")
    print(f"  weights            : {sft.final_dir}")
    print(f"  wall time          : {time.monotonic() - t0:.0f} s")
    print("=" * 78)
    return 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(
        level=os.environ.get("EVENTLIGHT_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s"
    )
    raise SystemExit(asyncio.run(main(parse_args())))
