"""The projector: applies the stream to the Postgres read model in order, exactly once in effect.

It reads the stream **by sequence from its checkpoint** (an ephemeral, unacknowledged pull consumer
that starts at ``checkpoint + 1``; a gap in the consumer's delivery sequence, a lost consumer or any
fetch error re-creates it from the checkpoint), folds each batch with the projector's fold
(``eventlight.store.fold``, the code the in-memory read model runs too) and writes the changed rows
of the batch **and** the batch's last stream sequence in one transaction. Nothing depends on
redelivery or acknowledgements, so a projector killed mid-batch loses nothing: the next one starts
after the last committed sequence, and the checkpoint never moves past a sequence it did not apply.
An event that cannot be projected (malformed, or refused on its own) is recorded in
``projector_dead_letters`` in the batch's transaction, and the projection goes on.

One projector per namespace writes at a time, and this is fenced, not assumed:

* a leader holds ``pg_advisory_lock`` on a dedicated connection (a second instance waits as a hot
  standby), and stops leading the moment that connection is lost (``pg_terminate_backend``, a
  Postgres restart): a termination listener and a ping every ``LOCK_PING_S``;
* taking the lock takes the next *term* (``projector_checkpoint.term``, migration 007), and every
  batch moves the checkpoint with ``UPDATE ... WHERE term = <its term> AND last_seq = <where it
  applied from>`` first in its transaction: a deposed projector updates no row, raises ``Deposed``,
  and its transaction rolls back. It then competes for the lock again, as a standby.

The leader also runs the watchdog (``eventlight.store.watchdog``) over the rollouts in flight, which
it reads from the read model when it takes the lead (so a restart forgets no running attempt).

**Partitions** (``Settings.projector_partitions``, issue 17): the namespace's rollouts can be split
into partitions by a stable hash of their id (``partition``), each with its own lock, term and
checkpoint row; a ``ProjectorGroup`` runs one ``Projector`` per partition in a process and leads its
fair share of them, so several processes share the projection and take over a dead one's
partitions. Every partition reads the whole stream and folds only its own rollouts' messages (chosen
by subject, without decoding the others); partition 0 also projects resources and workers
(``workers``) and runs retirement; each partition's watchdog watches its own rollouts. A read that
needs stream sequence S waits until every partition's checkpoint has passed it.

``rebuild()`` projects the whole log (from sequence 0, read with ``EventLog.scan``) into the projector's
pool's schema without the consumer: a fresh schema rebuilt that way must equal the live one.

Modules: ``leader`` (``Projector``: the lock, the term, lifecycle, the watchdog), ``consume`` (reading
the stream from the checkpoint, ``rebuild``), ``batch`` (one batch's fold, rows and checkpoint in one
transaction), ``group`` (``ProjectorGroup``: a process's fair share of partitions), ``partition``
(the hash, the lock keys, the recorded count), ``workers`` (partition 0's worker records),
``common`` (settings, signals, error groups).
"""

from eventlight.store.jetstream.projector.common import Deposed
from eventlight.store.jetstream.projector.group import ProjectorGroup
from eventlight.store.jetstream.projector.leader import Projector

__all__ = ["Deposed", "Projector", "ProjectorGroup"]
