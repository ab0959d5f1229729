"""``RunnerMetrics``: what a runner serves at ``GET /metrics`` when asked (``eventlight runner --metrics-port``).

========================================================= ============================================
``eventlight_runner_attempts_total{status,mode}``         attempts this runner finished, by the status it recorded
``eventlight_runner_attempt_seconds{mode}``               how long its agent ran on them (histogram)
``eventlight_runner_attempts_in_flight``                  attempts it runs now
``eventlight_runner_dequeue_failures_total``              dequeues that failed (a NATS error, ...) and were retried
========================================================= ============================================

Counts are per process (each runner process of ``eventlight runner -n N`` serves its own, on
``port + index``). A ``RunnerMetrics`` pickles as a fresh, empty one: the spawned runner process
counts from zero.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["RunnerMetrics"]

ATTEMPT_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


class RunnerMetrics:
    """The counters of one runner process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.attempts = Counter(
            "eventlight_runner_attempts",
            "Attempts this runner finished, by the status it recorded.",
            ["status", "mode"],
            registry=self.registry,
        )
        self.attempt_seconds = Histogram(
            "eventlight_runner_attempt_seconds",
            "Seconds the agent ran on an attempt.",
            ["mode"],
            buckets=ATTEMPT_BUCKETS_S,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "eventlight_runner_attempts_in_flight", "Attempts this runner runs now.", registry=self.registry
        )
        self.dequeue_failures = Counter(
            "eventlight_runner_dequeue_failures", "Dequeues that failed and were retried.", registry=self.registry
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (RunnerMetrics, ())  # the registry's locks do not pickle; a new process counts anew

    def finished(self, status: str, mode: str | None, seconds: float) -> None:
        """Count one attempt this runner recorded with ``status``."""
        label = mode or ""
        self.attempts.labels(status, label).inc()
        self.attempt_seconds.labels(label).observe(max(0.0, seconds))

    def serve(self, port: int, host: str = "127.0.0.1") -> Any:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the HTTP server.

        Raises:
            OSError: The port is taken.
        """
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
