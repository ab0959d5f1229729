"""APO: Automatic Prompt Optimization by textual gradients and beam search (Agent-lightning ``APO``).

Ideas from ProTeGi (https://aclanthology.org/2023.emnlp-main.494.pdf) and TextGrad. Each round
samples parents from the beam, rolls each parent out on a training batch, asks an optimizer LLM
for a critique of the parent (the "textual gradient"), asks it again to rewrite the parent using
the critique, scores all candidates on one validation mini-batch, keeps the best ``beam_width``,
and re-scores the leader on the whole validation set.
"""

from eventlight.algorithm.apo.models import RolloutResultForAPO, VersionedPromptTemplate
from eventlight.algorithm.apo.prompts import APPLY_EDIT_VARIANTS as APPLY_EDIT_VARIANTS
from eventlight.algorithm.apo.prompts import EVIDENCE_CHAR_BUDGET as EVIDENCE_CHAR_BUDGET
from eventlight.algorithm.apo.prompts import GRADIENT_VARIANTS as GRADIENT_VARIANTS
from eventlight.algorithm.apo.search import APO

__all__ = ["APO", "RolloutResultForAPO", "VersionedPromptTemplate"]
