"""The runner: ``LitAgentRunner``, a queue consumer that runs an agent on each rollout it claims.

Modules: ``loop`` (``LitAgentRunner``: the dequeue loop and one attempt, with its differences from
Agent-lightning 0.3.0), ``hooks`` (``Hook``), ``identity`` (``worker_name``, ``system_snapshot``),
``retry`` (``Backoff``, which errors are retried).
"""

from eventlight.runner.hooks import Hook
from eventlight.runner.identity import system_snapshot, worker_name
from eventlight.runner.loop import LitAgentRunner
from eventlight.runner.retry import Backoff
from eventlight.unavailable import unavailable_class

Runner = LitAgentRunner
"""0.3.0's runner base class; eventlight has one runner, ``LitAgentRunner``."""

LegacyAgentRunner = unavailable_class(
    "LegacyAgentRunner",
    "the 0.1 client/server runner is not supported; use LitAgentRunner (or Trainer(n_runners=...))",
    __name__,
)

__all__ = ["Backoff", "Hook", "LegacyAgentRunner", "LitAgentRunner", "Runner", "system_snapshot", "worker_name"]
