"""``EventStore``: the one ``LightningStore``, written once over the two ports (``ports``).

Every rule that is not a pure transition lives here, for every backend: the command loop
(``command_loop``), claims from the work queue, resources versioning, ``resources_id=None`` → the
latest snapshot, ``attempt_id="latest"``, validation of ids and spans, the worker idle/busy policy
and span de-duplication. A backend only says how to build its ``EventLog`` and ``ReadModel``
(``eventlight.store.memory``, ``eventlight.store.jetstream``).

Policies (the same on every backend):
    * ``worker_id`` values become subject tokens: one with dots, spaces or wildcards is refused with
      ``InvalidInputError`` by ``dequeue_rollout``, ``start_rollout``, ``start_attempt`` and
      ``update_worker``;
    * an empty poll marks a worker ``idle`` (a ``WorkerIdle`` event, which sets
      ``last_dequeue_time`` and ``idle``): at once after the worker claimed or started an attempt
      through this store, else at most once per ``IDLE_REFRESH_S`` (1 s), so ``last_dequeue_time``
      is the worker's last poll to within a second (0.3.0 writes it on every poll; here each write
      is an fsynced event, and a spinning poller would write hundreds a second);
    * a claim keeps its queue entry in progress (``update_worker`` extends it) until the attempt
      finishes through this store.

Modules: ``plumbing`` (the ports, the command loop, read-your-writes, ``close``), ``rollouts``
(enqueue, start, update), ``claims`` (dequeue, start_attempt, idle marks), ``resources``,
``reports`` (spans, worker heartbeats), ``reads`` (the queries), ``store`` (``EventStore``).
"""

from eventlight.store.service.claims import IDLE_REFRESH_S, MAX_IDLE_MARKS
from eventlight.store.service.plumbing import UNSET, Unset
from eventlight.store.service.rollouts import ENDED
from eventlight.store.service.store import EventStore

__all__ = ["ENDED", "IDLE_REFRESH_S", "MAX_IDLE_MARKS", "UNSET", "EventStore", "Unset"]
