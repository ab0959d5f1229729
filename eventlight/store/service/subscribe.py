"""Subscriptions of ``EventStore``: finished attempts, adapted, as they finish (``eventlight.store.subscription``)."""

from __future__ import annotations

from collections.abc import Iterable

from eventlight.core.errors import InvalidInputError
from eventlight.logreplay.records import AdapterFn, resolve_adapter
from eventlight.store.service.plumbing import StorePlumbing
from eventlight.store.subscription import Subscription, check_durable, subscription_filters

Values = str | Iterable[str] | None


class Subscriptions(StorePlumbing):
    """``subscribe``, ``subscribe_triplets``, ``subscribe_messages`` (an eventlight addition:
    Agent-lightning 0.3 has no subscriber API; its algorithms poll ``wait_for_rollouts`` and then
    ``query_spans``)."""

    def subscribe(
        self,
        adapter: str | AdapterFn = "triplets",
        *,
        durable: str | None = None,
        since: int | None = None,
        modes: Values = None,
        resources_ids: Values = None,
        statuses: Values = None,
        server_timeout_s: float = 30.0,
    ) -> Subscription:
        """Finished attempts with the adapter's output for each, as they finish.

        Yields one ``FinishedAttempt`` per attempt, at the log event that finished it (its status
        ``succeeded``/``failed``/``timeout``, or its rollout terminal), with its spans in the log
        before that event. Delivery semantics: ``eventlight.store.subscription.subscription``.

        Args:
            adapter: ``"triplets"`` (``TracerTraceToTriplet``), ``"messages"`` (``TraceToMessages``),
                ``"proxy-triplets"``, ``"module:callable"``, or a callable of an attempt's spans
                (an ``Adapter`` instance), as ``eventlight.replay`` takes it.
            durable: A name (1-64 letters, digits, ``_``, ``-``): the position survives the process;
                opened again, it resumes after its last acknowledged record. ``None``: ephemeral.
            since: Where a new subscription starts: after this log position (default: the head
                when it starts, i.e. what finishes from then on). Ignored when ``durable`` exists.
                Iteration yields nothing that finished before; ``collect`` returns a rollout that
                ended before at once, read from the log.
            modes, resources_ids, statuses: Keep attempts of rollouts with these modes / resources
                ids, and with these attempt statuses (others are read and acknowledged, not yielded).
            server_timeout_s: How long a lost NATS server is waited for before iterating raises
                ``ServiceUnavailableError`` (JetStream only).

        Returns:
            A ``Subscription``: ``async with`` it, then ``async for record in sub`` or
            ``await sub.collect(rollout_ids, timeout_s)``.

        Raises:
            InvalidInputError: An unknown adapter, an invalid durable name, a negative ``since``,
                an unknown status or mode, or a closed or unstarted store.
        """
        resolved = resolve_adapter(adapter)
        name = check_durable(durable)
        if since is not None and (isinstance(since, bool) or not isinstance(since, int) or since < 0):
            raise InvalidInputError(f"since={since!r}: expected a log position (an int >= 0) or None")
        if not server_timeout_s > 0:
            raise InvalidInputError(f"server_timeout_s={server_timeout_s!r}: expected seconds > 0")
        filters = subscription_filters(modes, resources_ids, statuses)
        return Subscription(
            self._log(), resolved, filters, durable=name, since=since, server_timeout_s=server_timeout_s
        )

    def subscribe_triplets(self, adapter: str | AdapterFn = "triplets", **options: object) -> Subscription:
        """``subscribe`` with a triplet adapter (default ``TracerTraceToTriplet``): each record's
        ``data`` is the attempt's ``list[Triplet]``. Options as ``subscribe``'s."""
        return self.subscribe(adapter, **options)  # type: ignore[arg-type]

    def subscribe_messages(self, adapter: str | AdapterFn = "messages", **options: object) -> Subscription:
        """``subscribe`` with ``TraceToMessages`` (default): each record's ``data`` is the attempt's
        conversations (``list`` of ``{"messages", "tools"}``). Options as ``subscribe``'s."""
        return self.subscribe(adapter, **options)  # type: ignore[arg-type]
