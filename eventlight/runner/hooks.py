"""``Hook``: callbacks around each attempt of ``LitAgentRunner``."""

from __future__ import annotations

from typing import Any


class Hook:
    """Callbacks around each attempt; all async, keyword-only, no-ops by default."""

    async def on_rollout_start(self, *, agent: Any, runner: Any, rollout: Any) -> None: ...

    async def on_trace_start(self, *, agent: Any, runner: Any, tracer: Any, rollout: Any) -> None: ...

    async def on_trace_end(self, *, agent: Any, runner: Any, tracer: Any, rollout: Any) -> None: ...

    async def on_rollout_end(self, *, agent: Any, runner: Any, rollout: Any, spans: Any) -> None: ...
