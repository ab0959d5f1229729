"""Settings: every environment variable eventlight reads, declared in one place.

===================================  =========================================================  ========================
variable                             meaning                                                    default
===================================  =========================================================  ========================
``EVENTLIGHT_NATS_URL``              use this NATS server (a cluster: its URLs,                 (start the embedded one)
                                     comma-separated)
``EVENTLIGHT_PG_DSN``                use this Postgres when reachable (``_FILE``: read it from  (start the embedded one)
                                     a file)
``EVENTLIGHT_STATE_DIR``             where embedded servers keep data, pid files and logs       ``./.eventlight``
``EVENTLIGHT_NAMESPACE``             stream prefix ``el.<ns>`` and Postgres schema ``el_<ns>``  ``default``
``EVENTLIGHT_LOG_LEVEL``             log level of the CLI                                       ``INFO``
``EVENTLIGHT_STREAM_REPLICAS``       replicas of the namespace's stream (3 on a 3-node          the definitions' (1)
                                     cluster)
``EVENTLIGHT_DURABILITY``            what an ack guarantees: ``fsync``, ``interval`` or         ``fsync``
                                     ``replicated`` (see ``DURABILITY``)
``EVENTLIGHT_SERVER_TOKEN``          bearer token ``eventlight serve`` requires and             none (no token asked)
                                     ``LightningStoreClient`` sends (``_FILE``: from a file)
``EVENTLIGHT_PROXY_TOKEN``           bearer token ``LLMProxy`` requires and runners hand their  none (no token asked)
                                     agents as a ``ProxyLLM``'s ``api_key`` (``_FILE``: a
                                     file)
``EVENTLIGHT_NATS_TOKEN``            NATS token (``_FILE``: from a file)                        none
``EVENTLIGHT_NATS_USER``             NATS user, with ``EVENTLIGHT_NATS_PASSWORD`` (or           none
                                     ``_FILE``)
``EVENTLIGHT_NATS_CREDS``            a NATS ``.creds`` file (JWT + nkey seed; needs ``nkeys``)  none
``EVENTLIGHT_RETENTION_S``           retire terminal rollouts this long after they end          (off: nothing retired)
                                     (archive)
``EVENTLIGHT_PROJECTOR_PARTITIONS``  partitions of rollouts the projection is split into        ``1``
                                     (1-64; fixed per namespace: ``projector.partition``)
``EVENTLIGHT_PG_OPEN_WAIT_S``        seconds opening Postgres waits while it takes no            ``30``
                                     connection now ("too many clients", starting up)
===================================  =========================================================  ========================

``<NAME>_FILE`` (Docker secrets' convention): the variable's value is the content of that file, one
trailing newline stripped; a file that is missing, unreadable or empty is an error naming both.
Secrets never appear in ``repr(settings)``, error messages, ``eventlight status`` or logs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import msgspec

from eventlight.core.errors import InvalidInputError
from eventlight.credentials import NatsAuth, read_secret
from eventlight.net import redact, redact_unparsed, server_urls

_NS_RE = re.compile(r"^[a-z0-9_]{1,40}$")

Durability = Literal["fsync", "interval", "replicated"]
DURABILITY: dict[str, str] = {
    "fsync": "an ack means the event is fsynced on the server's disk (embedded nats-server: sync_interval always)",
    "interval": (
        "an ack means the server holds the event; JetStream flushes to disk every 2 minutes "
        "(its default sync_interval): survives a crash of the process, not of the machine"
    ),
    "replicated": "an ack means a quorum of a 3-node cluster holds the event (R3 streams; needs EVENTLIGHT_NATS_URL)",
}
"""The named durability levels and what an acknowledged write survives at each (README: Durability)."""

PG_OPEN_WAIT_S = 30.0
"""Seconds opening Postgres waits while it takes no connection now (``Settings.pg_open_wait_s``)."""

MAX_PARTITIONS = 64
"""The most partitions a namespace's projection can be split into (``Settings.projector_partitions``)."""


def check_namespace(ns: str) -> str:
    """Validate a namespace: lowercase letters, digits and ``_``, 1-40 characters.

    Raises:
        InvalidInputError: The name would not be a valid NATS token and Postgres schema name.
    """
    if not _NS_RE.match(ns):
        raise InvalidInputError(f"namespace {ns!r} must match {_NS_RE.pattern}")
    return ns


def _check_pg_ports(dsn: str) -> None:
    """Refuse a ``postgresql://`` URL whose port (of each host, ``h1:5432,h2:5433``) is not a number
    from 0 to 65535: asyncpg takes 99999 and its socket call fails with ``OverflowError``.

    Raises:
        InvalidInputError: A port is out of range or not a number (the password masked, ``redact_unparsed``).
    """
    authority = dsn.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
    for host in authority.rpartition("@")[2].split(","):
        try:
            urlsplit(f"postgresql://{host}").port  # noqa: B018 - parsing it raises on a bad port
        except ValueError as e:
            raise InvalidInputError(
                "pg_dsn (EVENTLIGHT_PG_DSN): " + redact_unparsed(dsn, "a Postgres DSN", e)
            ) from None


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Where the services are and how to name things; validated once, passed whole.

    Attributes:
        nats_url: NATS server URL (several, comma-separated, for a cluster), or ``None`` to start
            the embedded one; ``nats://``, ``tls://``, ``ws://`` or ``wss://`` (what nats-py
            connects with; ``host:port`` takes ``nats://``), refused here otherwise.
        pg_dsn: Postgres DSN, or ``None`` to start the embedded one.
        state_dir: Folder for embedded servers' data, pid files and logs.
        namespace: Isolates streams (``el.<ns>.…``) and the Postgres schema (``el_<ns>``).
        log_level: Log level the CLI configures.
        stream_replicas: Replicas of the namespace's stream when ``apply_streams`` creates or
            updates it (JetStream's ``num_replicas``, 1-5; 3 on a 3-node cluster makes an ack mean a
            quorum holds the write); ``None``: as ``eventlight/_data/streams`` says (1), or 3
            under ``durability="replicated"``.
        durability: What an acknowledged write survives (``DURABILITY``): ``fsync`` (the default),
            ``interval`` (the embedded server flushes periodically) or ``replicated`` (R3 streams on
            the cluster ``nats_url`` names; the embedded single server cannot give it).
        retention_s: Seconds a terminal rollout stays in the hot stream after it ended; then
            ``retire`` may move it to the archive stream ``EL_<NS>_ARCHIVE`` (created by
            ``apply_streams`` only when this is set). ``None`` (the default): no archive, nothing
            is retired.
        projector_partitions: Partitions of rollouts the namespace's projection is split into
            (1-64), each with its own lock, term and checkpoint, so several projector processes
            share the work; recorded in Postgres by the first projector and fixed from then on
            (``eventlight.store.jetstream.projector.partition``).
        pg_open_wait_s: Seconds opening Postgres (a store's ``start``, ``apply_migrations``) keeps
            trying while the server answers that it takes no connection now ("too many clients",
            starting up: ``pg_errors.BUSY``), at doubling intervals from 0.5 s to 5 s with one
            warning line a try; then one ``ServiceUnavailableError``. 0: no second try.
        nats_auth: NATS credentials (``EVENTLIGHT_NATS_*``); ``NatsAuth()``: none beyond the URL's.
        server_token: The bearer token of ``eventlight serve`` (``EVENTLIGHT_SERVER_TOKEN``).
        proxy_token: The bearer token of the LLM proxy (``EVENTLIGHT_PROXY_TOKEN``).

    ``repr`` masks the secrets (the DSN's and URL's passwords, the tokens).
    """

    nats_url: str | None = None
    pg_dsn: str | None = None
    state_dir: Path = Path(".eventlight")
    namespace: str = "default"
    log_level: str = "INFO"
    stream_replicas: int | None = None
    durability: Durability = "fsync"
    retention_s: float | None = None
    projector_partitions: int = 1
    pg_open_wait_s: float = PG_OPEN_WAIT_S
    nats_auth: NatsAuth = NatsAuth()
    server_token: str | None = None
    proxy_token: str | None = None

    def __repr__(self) -> str:
        shown = {f: getattr(self, f) for f in self.__struct_fields__}
        for key in ("nats_url", "pg_dsn"):
            if shown[key] is not None:
                shown[key] = redact(shown[key])
        for key in ("server_token", "proxy_token"):
            if shown[key] is not None:
                shown[key] = "***"
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    @property
    def replicas(self) -> int | None:
        """The stream's replicas to apply: ``stream_replicas``, else 3 when ``replicated``, else ``None``."""
        if self.stream_replicas is not None:
            return self.stream_replicas
        return 3 if self.durability == "replicated" else None

    def __post_init__(self) -> None:
        check_namespace(self.namespace)
        if self.nats_url is not None:  # here, so every command says it in one line before connecting
            try:
                server_urls(self.nats_url)
            except InvalidInputError as e:
                raise InvalidInputError(f"nats_url (EVENTLIGHT_NATS_URL): {e}") from None
        if self.pg_dsn is not None and not self.pg_dsn.lower().startswith(("postgresql://", "postgres://")):
            raise InvalidInputError(  # the value is not shown: a malformed DSN may still hold a password
                "pg_dsn (EVENTLIGHT_PG_DSN) must be a postgresql:// URL, e.g. "
                "postgresql://user:password@host:5432/dbname (the value given is not shown)"
            )
        if self.pg_dsn is not None:
            _check_pg_ports(self.pg_dsn)
        if self.durability not in DURABILITY:
            raise InvalidInputError(
                f"durability must be one of {', '.join(DURABILITY)} (EVENTLIGHT_DURABILITY), not {self.durability!r}"
            )
        if self.stream_replicas is not None and not 1 <= self.stream_replicas <= 5:
            raise InvalidInputError(
                f"stream_replicas must be 1 to 5 (JetStream's limit; EVENTLIGHT_STREAM_REPLICAS), "
                f"not {self.stream_replicas}"
            )
        if self.retention_s is not None and not self.retention_s >= 0:
            raise InvalidInputError(
                f"retention_s must be 0 or more seconds (EVENTLIGHT_RETENTION_S), not {self.retention_s}"
            )
        if not 0 <= self.pg_open_wait_s < float("inf"):
            raise InvalidInputError(
                f"pg_open_wait_s must be 0 or more seconds (EVENTLIGHT_PG_OPEN_WAIT_S), not {self.pg_open_wait_s}"
            )
        if not 1 <= self.projector_partitions <= MAX_PARTITIONS:
            raise InvalidInputError(
                f"projector_partitions must be 1 to {MAX_PARTITIONS} (EVENTLIGHT_PROJECTOR_PARTITIONS), "
                f"not {self.projector_partitions}"
            )

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """Read the environment variables above; keyword arguments win over them.

        Raises:
            InvalidInputError: A variable's value is not valid (a namespace, a number of replicas,
                a ``_FILE`` that cannot be read, NATS credentials that do not go together).
        """
        env = os.environ
        parts = _int_or_none("EVENTLIGHT_PROJECTOR_PARTITIONS", env.get("EVENTLIGHT_PROJECTOR_PARTITIONS"))
        open_wait_s = _float_or_none("EVENTLIGHT_PG_OPEN_WAIT_S", env.get("EVENTLIGHT_PG_OPEN_WAIT_S"))
        values: dict[str, object] = {
            "nats_url": env.get("EVENTLIGHT_NATS_URL") or None,
            "pg_dsn": read_secret("EVENTLIGHT_PG_DSN", env),
            "state_dir": Path(env.get("EVENTLIGHT_STATE_DIR", ".eventlight")).absolute(),
            "namespace": env.get("EVENTLIGHT_NAMESPACE", "default"),
            "log_level": env.get("EVENTLIGHT_LOG_LEVEL", "INFO"),
            "stream_replicas": _int_or_none("EVENTLIGHT_STREAM_REPLICAS", env.get("EVENTLIGHT_STREAM_REPLICAS")),
            "durability": env.get("EVENTLIGHT_DURABILITY") or "fsync",
            "retention_s": _float_or_none("EVENTLIGHT_RETENTION_S", env.get("EVENTLIGHT_RETENTION_S")),
            "projector_partitions": 1 if parts is None else parts,
            "pg_open_wait_s": PG_OPEN_WAIT_S if open_wait_s is None else open_wait_s,
            "nats_auth": NatsAuth.from_env(env),
            "server_token": server_token_from_env(env),
            "proxy_token": proxy_token_from_env(env),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]

    @property
    def subject_prefix(self) -> str:
        return f"el.{self.namespace}"

    @property
    def stream_name(self) -> str:
        return f"EL_{self.namespace.upper()}"

    @property
    def pg_schema(self) -> str:
        return f"el_{self.namespace}"

    @property
    def archive_stream_name(self) -> str:
        return f"EL_{self.namespace.upper()}_ARCHIVE"

    @property
    def archive_prefix(self) -> str:
        return f"elarc.{self.namespace}"


def server_token_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """``EVENTLIGHT_SERVER_TOKEN`` or the content of ``EVENTLIGHT_SERVER_TOKEN_FILE`` (``read_secret``).

    Raises:
        InvalidInputError: Both are set, or the file cannot be read or is empty.
    """
    return read_secret("EVENTLIGHT_SERVER_TOKEN", env)


def proxy_token_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """``EVENTLIGHT_PROXY_TOKEN`` or the content of ``EVENTLIGHT_PROXY_TOKEN_FILE`` (``read_secret``).

    Raises:
        InvalidInputError: Both are set, or the file cannot be read or is empty.
    """
    return read_secret("EVENTLIGHT_PROXY_TOKEN", env)


def _int_or_none(name: str, value: str | None) -> int | None:
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise InvalidInputError(f"{name} must be a whole number, not {value!r}") from None


def _float_or_none(name: str, value: str | None) -> float | None:
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise InvalidInputError(f"{name} must be a number of seconds, not {value!r}") from None
