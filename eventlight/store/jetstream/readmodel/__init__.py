"""The Postgres read model: the projector's tables (``migrations/``) and the queries over them.

Reads first wait until the projector's checkpoint has passed the caller's last write
(``sync``: read-your-writes). ``wait_for_rollouts`` listens to the rollouts' terminal events on the
stream (``r.*.e``) and to the local projector's commits instead of polling.

Modules: ``model`` (``SqlReadModel``), ``waits`` (``sync``, ``wait_for_rollouts``), ``queries``.
"""

from eventlight.store.jetstream.readmodel.model import SqlReadModel
from eventlight.store.jetstream.readmodel.waits import MAX_HINTS, SYNC_TIMEOUT_S

__all__ = ["MAX_HINTS", "SYNC_TIMEOUT_S", "SqlReadModel"]
