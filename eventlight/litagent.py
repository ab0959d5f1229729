"""``agentlightning.litagent``: agents and their decorators (``eventlight.agent``)."""

from eventlight.agent import FunctionalLitAgent, LitAgent, llm_rollout, prompt_rollout, rollout

__all__ = ["FunctionalLitAgent", "LitAgent", "llm_rollout", "prompt_rollout", "rollout"]
