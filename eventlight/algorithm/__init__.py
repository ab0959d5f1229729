"""Algorithms: the base class, ``@algo``, ``Baseline``, ``APO`` and ``VERL`` (Agent-lightning ``algorithm``)."""

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
from eventlight.algorithm.verl import VERL

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
