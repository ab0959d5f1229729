"""The one error tree of eventlight.

::

    EventlightError
    ├── NotFoundError (also ValueError)          an id the store does not know
    │   ├── RolloutNotFoundError                 .rollout_id
    │   │   └── RolloutRetiredError              a write to a rollout retired to the archive
    │   ├── AttemptNotFoundError                 .rollout_id, .attempt_id
    │   └── ResourcesNotFoundError               .resources_id
    ├── InvalidTransitionError (also ValueError) the decider refused a command; .current, .requested
    ├── InvalidInputError (also ValueError)      a malformed span, filter or argument
    │   └── InvalidTypeError (also TypeError)    a value of the wrong type (``mode=123``); nothing written
    ├── ConcurrencyError                         an append lost its optimistic-concurrency race too often
    ├── WrongEventLoopError (also RuntimeError)  a store used from another event loop than its own
    ├── AuthenticationError (also PermissionError) a store server refused the bearer token (HTTP 401)
    └── ServiceUnavailableError                  NATS or Postgres cannot be reached; .server, retryable
        ├── ServerTooOldError                    a server answered but is older than eventlight needs;
        │                                        .found, .required, not retryable
        └── LLMUnavailableError                  the LLM behind a proxy fails its check or most calls

The ``ValueError`` bases keep Agent-lightning's contract ("a missing identifier must raise
``ValueError``") while giving each case its own type. Driver errors (nats-py, asyncpg) are mapped
once, at the backend boundary, with ``raise ... from e``.
"""

from __future__ import annotations

from eventlight.net import redact


class EventlightError(Exception):
    """Root of every error eventlight raises on purpose.

    Attributes:
        retryable: Whether the same call may succeed if repeated later.
    """

    retryable: bool = False


class NotFoundError(EventlightError, ValueError):
    """An id that the store does not know."""


class RolloutNotFoundError(NotFoundError):
    def __init__(self, rollout_id: str):
        super().__init__(f"rollout {rollout_id!r} does not exist")
        self.rollout_id = rollout_id


class RolloutRetiredError(RolloutNotFoundError):
    """A write to a rollout that finished and was retired from the hot stream to the archive
    (``Settings.retention_s``): it accepts no more events; replay, export and rebuild still read it."""

    def __init__(self, rollout_id: str):
        NotFoundError.__init__(
            self,
            f"rollout {rollout_id!r} is retired: it finished more than the retention window ago and its events "
            "moved to the archive stream, so it accepts no more writes (eventlight replay and export still read it)",
        )
        self.rollout_id = rollout_id


class AttemptNotFoundError(NotFoundError):
    def __init__(self, rollout_id: str, attempt_id: str, detail: str = ""):
        msg = f"attempt {attempt_id!r} of rollout {rollout_id!r} does not exist"
        super().__init__(f"{msg}: {detail}" if detail else msg)
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id


class ResourcesNotFoundError(NotFoundError):
    def __init__(self, resources_id: str):
        super().__init__(f"resources {resources_id!r} do not exist")
        self.resources_id = resources_id


class InvalidTransitionError(EventlightError, ValueError):
    """The decider refused a status change (see ``eventlight.core.decider``)."""

    def __init__(self, what: str, current: str, requested: str, reason: str = ""):
        msg = f"{what}: cannot go from {current!r} to {requested!r}"
        super().__init__(f"{msg} ({reason})" if reason else msg)
        self.current = current
        self.requested = requested


class InvalidInputError(EventlightError, ValueError):
    """A malformed argument: a span without ids, an unknown filter field, a bad status name."""


class InvalidTypeError(InvalidInputError, TypeError):
    """A payload value whose type is not its field's (``enqueue_rollout(mode=123)``,
    ``RolloutConfig(timeout_seconds="10")``): refused before anything is written. Also a
    ``TypeError``, as Python raises for a wrongly typed argument."""


class ConcurrencyError(EventlightError):
    """An append kept losing the optimistic-concurrency race on one rollout."""

    retryable = True


class WrongEventLoopError(EventlightError, RuntimeError):
    """A store whose connections belong to one event loop was called from another (a second
    ``asyncio.run``, another thread): refused at once instead of hanging on the other loop's sockets.
    Open one store per event loop."""


class AuthenticationError(EventlightError, PermissionError):
    """A store server (``eventlight serve --token``) refused the request's bearer token, or it had none."""


class ServiceUnavailableError(EventlightError):
    """NATS or Postgres cannot be reached.

    Attributes:
        server: The URL or DSN (without password) that failed.
        detail: What went wrong, without the server (``"nothing answers at host:4222 (...)"``).
        shutting_down: The server said it is going away (an orderly shutdown: NATS's ``409 Server
            Shutdown`` answer to a pending pull); the outage it begins is told by what follows.
    """

    retryable = True

    def __init__(self, server: str, detail: str, *, shutting_down: bool = False):
        server = redact(server)
        super().__init__(f"cannot reach {server}: {detail}")
        self.server = server
        self.detail = detail
        self.shutting_down = shutting_down


class ServerTooOldError(ServiceUnavailableError):
    """A server answered, but its version is older than eventlight needs (a nats-server before 2.11
    ignores the per-rollout expected-sequence header that fences appends). Not retryable: the same
    server gives the same answer.

    Attributes:
        server: The URL (without password) of the server that answered.
        found: The version it reported (``"2.9.10"``).
        required: The oldest version eventlight works with (``"2.11"``).
        detail: What is wrong and what to do, without the server.
    """

    retryable = False

    def __init__(self, server: str, *, found: str, required: str, detail: str):
        server = redact(server)
        EventlightError.__init__(self, f"{server} answered, but {detail}")
        self.server = server
        self.found = found
        self.required = required
        self.detail = detail
        self.shutting_down = False


class LLMUnavailableError(ServiceUnavailableError):
    """The LLM a run depends on does not answer: its start-up check failed, or most recent calls did.

    Raised by ``LLMProxy.check`` and by ``Trainer`` when the proxy's recent calls mostly fail, so a
    run stops instead of training against a dead model. ``server`` names the endpoint.
    """

    def __init__(self, server: str, detail: str):
        server = redact(server)
        EventlightError.__init__(self, f"LLM unavailable: {server}: {detail}")
        self.server = server


class NoRunnersError(EventlightError):
    """Rollouts wait and no runner is alive (none sent a heartbeat recently, see
    ``eventlight.store.liveness``): raised by ``Trainer`` when the runner processes it started keep
    dying or never come up, instead of waiting on the queue for ever."""
