"""``ProxyMetrics``: what ``LLMProxy`` serves at ``GET /metrics`` (Prometheus text format).

One registry per proxy (two proxies in one process never share a series):

============================================== ===================================================
``eventlight_llm_proxy_calls_total{model}``    chat completions forwarded (routed or not)
``eventlight_llm_proxy_errors_total{model,status}`` of them, those the backend failed (HTTP status)
``eventlight_llm_proxy_tokens_total{model,kind}`` ``prompt`` / ``completion`` tokens of the answers
``eventlight_llm_proxy_latency_seconds{model}`` seconds from the request to the backend's answer
============================================== ===================================================

Health checks (requests with the check header) are not counted, as ``LLMCallHealth`` does not
count them.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

__all__ = ["CONTENT_TYPE_LATEST", "ProxyMetrics"]

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ProxyMetrics:
    """The counters and the latency histogram of one LLM proxy."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.calls = Counter(
            "eventlight_llm_proxy_calls", "Chat completions forwarded.", ["model"], registry=self.registry
        )
        self.errors = Counter(
            "eventlight_llm_proxy_errors",
            "Chat completions the backend failed, by HTTP status.",
            ["model", "status"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "eventlight_llm_proxy_tokens", "Tokens of the answers.", ["model", "kind"], registry=self.registry
        )
        self.latency = Histogram(
            "eventlight_llm_proxy_latency_seconds",
            "Seconds from the request to the backend's answer.",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )

    def record(
        self, *, model: str, latency_s: float, completion: dict[str, Any] | None, error_status: int | None
    ) -> None:
        """Count one forwarded call: its latency, its tokens (``completion["usage"]``) or its error."""
        self.calls.labels(model).inc()
        self.latency.labels(model).observe(max(0.0, latency_s))
        if error_status is not None:
            self.errors.labels(model, str(error_status)).inc()
            return
        usage = (completion or {}).get("usage") or {}
        for kind, key in (("prompt", "prompt_tokens"), ("completion", "completion_tokens")):
            value = usage.get(key)
            if isinstance(value, int) and value > 0:
                self.tokens.labels(model, kind).inc(value)

    def render(self) -> bytes:
        """Everything in Prometheus' text exposition format."""
        return generate_latest(self.registry)
