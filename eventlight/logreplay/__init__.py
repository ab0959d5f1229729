"""The log over time: replay stored traces into datasets, rebuild the read models, export and import.

===========  ===================================================================================
module       what
===========  ===================================================================================
``replay``   ``eventlight.replay(...)``: the log → selected attempts → adapter → records
``select``   the one-pass fold of the raw log that selects attempts (``Filters``, ``LogFold``)
``records``  an attempt's spans in order, the adapter and reward function, one record per item
``parallel`` the adapter in worker processes, started on attempts while the log is still read
``writer``   records as JSON lines or Parquet, deterministic
``files``    an output file written beside its target and renamed over it once whole
``rebuild``  the whole log into a fresh schema, compared with the live one, swapped in on request
``transfer`` a slice of the log to a file and back into another namespace, without duplicates
``catchup``  the read models projected up to the log's head (after an import, ``sql --catch-up``)
``servers``  the NATS and Postgres a ``Settings`` names, else the embedded ones, as the commands find them
===========  ===================================================================================

The commands (``eventlight replay``, ``export``, ``import``) live in ``eventlight.cli.replay``.
"""

from __future__ import annotations

from eventlight.logreplay.replay import Replay, ReplayError, ReplayStats, ReplayWorkerError, replay
from eventlight.logreplay.select import Bound

__all__ = ["Bound", "Replay", "ReplayError", "ReplayStats", "ReplayWorkerError", "replay"]
