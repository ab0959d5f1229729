"""Agent-lightning 0.3.0's ``agentlightning.utils`` submodules, where eventlight has them."""

from eventlight.utils import id, metrics, otel, otlp, server_launcher, system_snapshot

__all__ = ["id", "metrics", "otel", "otlp", "server_launcher", "system_snapshot"]
