"""VERL on the event store (Agent-lightning's ``agentlightning.verl``), behind the ``verl`` extra.

Modules, one concept each:

* ``config``: the VERL/Hydra-style config dict, validated into ``VerlSettings`` (no verl import);
* ``batch``: finished attempts (triplets with token ids) to verl's ``DataProto``: the data path,
  which runs on the CPU with torch and verl installed;
* ``daemon``: the store side: vLLM backends into the LLM proxy, tasks in, trajectories out;
* ``gpu``: verl's Ray workers, vLLM servers and the PPO loop (CUDA only; ``require_gpu``).

The algorithm is ``eventlight.algorithm.verl.VERL`` (``eventlight.VERL``). Nothing here is
imported by ``import eventlight``.
"""
