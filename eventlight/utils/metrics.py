"""Metrics (``agentlightning.utils.metrics``): eventlight's are SQL views (``eventlight sql``) and the
store's ``statistics()``; 0.3.0's Prometheus tracker is not built."""

from eventlight.unavailable import unavailable_class

__all__ = ["MetricsBackend"]

MetricsBackend = unavailable_class(
    "MetricsBackend", "query the SQL views with `eventlight sql` or call store.statistics()", __name__
)
