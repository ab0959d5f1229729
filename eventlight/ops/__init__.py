"""Operations: start, find and stop the servers eventlight needs; apply streams and migrations.

======================  ==========================================================================
module                  what
======================  ==========================================================================
``lifecycle``           ``ensure_services`` / ``prepare_services`` / ``stop_services`` (``up``/``down``),
                        ``use_services`` (a ``Trainer``'s run), ``lease_services`` / ``release_services``
``leases``              who uses the embedded servers now, and which ones stop when no one does
``discovery``           ``find_nats`` / ``find_pg``: the servers in use, without starting any
``state``               the state folder, its lock, ``services.json`` (``Services``, ``read_services``)
``nats_server``         the embedded nats-server, and a probe for any NATS URL
``postgres``            probing a DSN; choosing the embedded Postgres (system binaries or pgserver)
``pg_system``           the embedded Postgres from the system binaries (initdb, pg_ctl)
``pg_pgserver``         the embedded Postgres from the ``pgserver`` wheel
``procs``               pids, daemons, log tails, ports remembered across starts
``streams``             ``apply_streams``: ``eventlight/_data/streams/*.json`` onto JetStream
``schema``              ``apply_migrations`` (``eventlight/_data/migrations/``), ``drop_namespace``
======================  ==========================================================================
"""

from __future__ import annotations

from eventlight.ops.discovery import Endpoint, find_nats, find_pg
from eventlight.ops.lifecycle import (
    ensure_services,
    lease_services,
    prepare_services,
    release_services,
    stop_services,
    use_services,
)
from eventlight.ops.schema import apply_migrations, drop_namespace
from eventlight.ops.state import Services, read_services
from eventlight.ops.streams import apply_streams

__all__ = [
    "Endpoint",
    "Services",
    "apply_migrations",
    "apply_streams",
    "drop_namespace",
    "ensure_services",
    "find_nats",
    "find_pg",
    "lease_services",
    "prepare_services",
    "read_services",
    "release_services",
    "stop_services",
    "use_services",
]
