"""A tiny policy for the RL tests: a character tokenizer with a chat template and a random 2-layer Llama.

Built in memory from a transformers config (nothing downloaded, ~30k parameters), so a GRPO step,
the policy server and the whole store loop run in seconds on the CPU. ``tiny_agent`` is the agent
the e2e test's runner processes import.
"""

from __future__ import annotations

import string
from typing import Any

import eventlight as agl

SPECIAL = ["<pad>", "<eos>", "<unk>", "<system>", "<user>", "<assistant>"]
CHARS = list(string.digits + string.ascii_lowercase + " +?=.")
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_tokenizer() -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL[3:]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_model(seed: int = 0) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(SPECIAL) + len(CHARS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=1,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model


def tiny_policy(seed: int = 0, **kwargs: Any) -> Any:
    from eventlight.rl.policy import Policy

    return Policy(tiny_model(seed), tiny_tokenizer(), seed=seed, **kwargs)


@agl.rollout
async def tiny_agent(task: dict, llm: agl.LLM, rollout: agl.Rollout) -> float:
    """Ask the policy; reward = share of the answer made of digits (varies across samples)."""
    import openai

    async with openai.AsyncOpenAI(base_url=llm.endpoint, api_key="local", max_retries=0) as client:
        r = await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": task["q"]}],
            temperature=1.0 if rollout.mode == "train" else 0.0,
            max_tokens=int((llm.sampling_parameters or {}).get("max_tokens", 8)),
        )
    text = r.choices[0].message.content or ""
    return sum(c.isdigit() for c in text) / max(1, len(text))
