"""What VERL needs to train here (a CUDA GPU and the ``verl`` extra), checked without importing it:
``VERL.run`` and ``bench/verl_gpu.py`` call ``require_gpu`` before anything heavy is imported, so a
machine without torch gets the same one-line error as one without a GPU."""

from __future__ import annotations

import importlib.util

from eventlight.core.errors import EventlightError

__all__ = ["VerlUnavailableError", "require_gpu"]


class VerlUnavailableError(EventlightError):
    """VERL cannot train here: no CUDA GPU, or the ``verl`` extra (verl, vllm, ray) is missing."""


def require_gpu() -> None:
    """Check that VERL can train on this machine, before anything is started.

    Raises:
        VerlUnavailableError: One line naming what is missing.
    """
    missing = [m for m in ("torch", "verl", "vllm", "ray") if importlib.util.find_spec(m) is None]
    if missing:
        raise VerlUnavailableError(
            f"VERL needs the verl extra on a GPU machine (missing: {', '.join(missing)}); "
            "see the README's VERL section (the CPU data path is eventlight.verl.batch)"
        )
    import torch

    if not torch.cuda.is_available():
        raise VerlUnavailableError(
            f"VERL trains on CUDA GPUs and torch {torch.__version__} sees none; "
            "on a CPU use eventlight.algorithm.grpo.GRPO (the CPU data path is eventlight.verl.batch)"
        )
