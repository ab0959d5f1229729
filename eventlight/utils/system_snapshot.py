"""A snapshot of the machine for worker heartbeats (``agentlightning.utils.system_snapshot``)."""

from eventlight.runner.identity import system_snapshot

__all__ = ["system_snapshot"]
