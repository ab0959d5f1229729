"""How the LLM behind a proxy is doing: the outcome of its recent calls.

``LLMProxy`` records every forwarded call here; ``Trainer`` stops a run when most recent calls
failed on the server side (a crashed or overloaded model), instead of training on empty answers::

    health = LLMCallHealth(window=20, min_calls=10, max_failure_fraction=0.5)
    health.record(ok=False, status=502, detail="connection refused", model="m")
    if health.failing():  # "12 of the last 20 LLM calls failed (last: 502 for model 'm': ...)"
        ...

Only server-side failures count: 5xx, 408 and 429 and connection errors (the proxy maps those to
5xx). A 4xx that the request itself caused (an over-long prompt's 400) says nothing about the
model's health and counts as a success here.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["LLMCallHealth"]


def is_server_failure(status: int) -> bool:
    """Whether an HTTP status says the backend (not the request) failed: 5xx, 408, 429."""
    return status >= 500 or status in (408, 429)


class LLMCallHealth:
    """A sliding window over the outcomes of the most recent LLM calls.

    Args:
        window: How many recent calls are kept.
        min_calls: No verdict before this many calls are in the window.
        max_failure_fraction: ``failing()`` once more than this fraction of the window failed
            (0.5: most calls).

    Raises:
        ValueError: ``window < 1``, ``min_calls`` outside ``1..window``, or a fraction outside ``[0, 1)``.
    """

    def __init__(self, window: int = 20, min_calls: int = 10, max_failure_fraction: float = 0.5):
        if window < 1 or not 1 <= min_calls <= window:
            raise ValueError(f"need 1 <= min_calls <= window, got min_calls={min_calls}, window={window}")
        if not 0.0 <= max_failure_fraction < 1.0:
            raise ValueError(f"max_failure_fraction must be in [0, 1), got {max_failure_fraction}")
        self.window = window
        self.min_calls = min_calls
        self.max_failure_fraction = max_failure_fraction
        self.calls = 0
        self.failures = 0
        self._recent: deque[bool] = deque(maxlen=window)
        self._last_failure: str | None = None
        self._tripped = asyncio.Event()

    def record(self, *, ok: bool, status: int = 200, detail: str = "", model: str | None = None) -> None:
        """Count one call. ``ok=False`` with a client-side status (a 400) counts as a success."""
        failed = not ok and is_server_failure(status)
        self.calls += 1
        self.failures += failed
        self._recent.append(failed)
        if failed:
            self._last_failure = f"{status} for model {model!r}: {detail}"[:300]
        if self.failing() is not None:
            self._tripped.set()

    def failing(self) -> str | None:
        """A one-line reason when most recent calls failed, else ``None``."""
        n = len(self._recent)
        bad = sum(self._recent)
        if n < self.min_calls or bad <= self.max_failure_fraction * n:
            return None
        return f"{bad} of the last {n} LLM calls failed (last: {self._last_failure})"

    def reset(self) -> None:
        """Forget the recent calls (a new run starts with a clean window)."""
        self._recent.clear()
        self._last_failure = None
        self._tripped = asyncio.Event()

    async def wait_failing(self) -> str:
        """Return the reason once ``failing()`` has held after some ``record`` (waits until then)."""
        await self._tripped.wait()
        return self.failing() or f"most recent LLM calls failed (last: {self._last_failure})"
