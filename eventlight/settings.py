"""Settings: every environment variable eventlight reads, declared in one place.

=============================  ==========================================================  ======================
variable                       meaning                                                     default
=============================  ==========================================================  ======================
``EVENTLIGHT_NATS_URL``        use this NATS server instead of starting one                (start the embedded one)
``EVENTLIGHT_PG_DSN``          use this Postgres when reachable                            (start the embedded one)
``EVENTLIGHT_STATE_DIR``       where embedded servers keep data, pid files and logs        ``./.eventlight``
``EVENTLIGHT_NAMESPACE``       stream prefix ``el.<ns>`` and Postgres schema ``el_<ns>``   ``default``
``EVENTLIGHT_LOG_LEVEL``       log level of the CLI                                        ``INFO``
=============================  ==========================================================  ======================
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import msgspec

from eventlight.core.errors import InvalidInputError

_NS_RE = re.compile(r"^[a-z0-9_]{1,40}$")


def check_namespace(ns: str) -> str:
    """Validate a namespace: lowercase letters, digits and ``_``, 1-40 characters.

    Raises:
        InvalidInputError: The name would not be a valid NATS token and Postgres schema name.
    """
    if not _NS_RE.match(ns):
        raise InvalidInputError(f"namespace {ns!r} must match {_NS_RE.pattern}")
    return ns


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Where the services are and how to name things; validated once, passed whole.

    Attributes:
        nats_url: NATS server URL, or ``None`` to start the embedded one.
        pg_dsn: Postgres DSN, or ``None`` to start the embedded one.
        state_dir: Folder for embedded servers' data, pid files and logs.
        namespace: Isolates streams (``el.<ns>.…``) and the Postgres schema (``el_<ns>``).
        log_level: Log level the CLI configures.
    """

    nats_url: str | None = None
    pg_dsn: str | None = None
    state_dir: Path = Path(".eventlight")
    namespace: str = "default"
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        check_namespace(self.namespace)

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """Read the environment variables above; keyword arguments win over them."""
        env = os.environ
        values: dict[str, object] = {
            "nats_url": env.get("EVENTLIGHT_NATS_URL") or None,
            "pg_dsn": env.get("EVENTLIGHT_PG_DSN") or None,
            "state_dir": Path(env.get("EVENTLIGHT_STATE_DIR", ".eventlight")).absolute(),
            "namespace": env.get("EVENTLIGHT_NAMESPACE", "default"),
            "log_level": env.get("EVENTLIGHT_LOG_LEVEL", "INFO"),
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
