"""Algorithms: the base class, ``@algo``, ``Baseline`` and ``APO`` (Agent-lightning ``algorithm``)."""

from eventlight.algorithm.apo import APO, RolloutResultForAPO, VersionedPromptTemplate
from eventlight.algorithm.base import (
    Algorithm,
    Dataset,
    FastAlgorithm,
    FunctionalAlgorithm,
    algo,
    batch_iter_over_dataset,
)
from eventlight.algorithm.baseline import Baseline
from eventlight.unavailable import unavailable_class

VERL = unavailable_class(
    "VERL",
    "VERL is not built into eventlight yet; train a local model with eventlight.algorithm.grpo.GRPO "
    "(GRPO on the event store), or prompts with APO",
    __name__,
)

__all__ = [
    "APO",
    "Algorithm",
    "Baseline",
    "Dataset",
    "FastAlgorithm",
    "FunctionalAlgorithm",
    "RolloutResultForAPO",
    "VERL",
    "VersionedPromptTemplate",
    "algo",
    "batch_iter_over_dataset",
]
