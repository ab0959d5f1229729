"""The algorithm as a subscriber: finished attempts, adapted, as they finish (an eventlight addition).

``store.subscribe_triplets(...)`` / ``subscribe_messages(...)`` / ``subscribe(...)`` return a
``Subscription`` (``subscription``), an async iterator of ``FinishedAttempt`` (``records``) fed by
the event log's ``follow`` (a JetStream pull consumer, durable by name or ephemeral; the in-memory
log's list) through ``fold``, which applies the rule of ``eventlight.store.finish`` — the one
``wait_for_rollouts`` follows too — and reads each finished attempt's spans as ``eventlight.replay``
does (``logreplay.records.spans_of_batches``).
"""

from eventlight.store.subscription.records import FinishedAttempt, SubscriptionError, check_durable
from eventlight.store.subscription.subscription import Subscription, subscription_filters

__all__ = ["FinishedAttempt", "Subscription", "SubscriptionError", "check_durable", "subscription_filters"]
