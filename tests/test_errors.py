"""Servers that are down or unsuitable, and misuse, give one clear error from the error tree."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import eventlight as agl
from eventlight.core.errors import EventlightError, InvalidInputError, ServerTooOldError, ServiceUnavailableError
from eventlight.net import free_port
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.connect import connect_nats
from tests.conftest import old_nats_server


async def test_unreachable_nats_names_the_server() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    store = JetStreamLightningStore(Settings(namespace="x"), nats_url=url)
    t = time.monotonic()
    with pytest.raises(ServiceUnavailableError, match=url) as info:
        await store.start()
    assert time.monotonic() - t < 5  # at once, not after nats-py's reconnect attempts
    assert info.value.retryable and info.value.server == url
    await store.close()


async def test_unreachable_postgres_names_the_server_without_password(namespace: Settings) -> None:
    dsn = f"postgresql://postgres:secret@127.0.0.1:{free_port()}/postgres"
    store = JetStreamLightningStore(namespace, pg_dsn=dsn)
    with pytest.raises(ServiceUnavailableError, match="127.0.0.1") as info:
        await store.start()
    assert "secret" not in str(info.value)
    assert store.nc is not None and store.nc.is_closed  # the NATS connection did not leak
    await store.close()


async def test_a_namespace_without_tables_is_refused_at_start(services: tuple[Settings, object]) -> None:
    base, svc = services
    settings = Settings(nats_url=svc.nats_url, pg_dsn=svc.pg_dsn, namespace="nomigrations")  # type: ignore[attr-defined]
    store = JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn)
    with pytest.raises(InvalidInputError, match="eventlight up"):
        await store.start()
    assert store.nc is not None and store.nc.is_closed


async def test_a_closed_store_says_so(namespace: Settings) -> None:
    store = JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn)
    await store.start()
    await store.close()
    for call in (store.enqueue_rollout({}), store.dequeue_rollout(), store.query_rollouts()):
        with pytest.raises(InvalidInputError, match="closed"):
            await call


async def test_nats_without_expected_subject_sequence_is_refused() -> None:
    """A server older than 2.11 silently ignores the header eventlight's fencing needs: refused.

    A fake server speaks just enough of the NATS protocol (INFO, then PONG to PING) as 2.9.0; the
    error says it answered (``ServerTooOldError``), with both versions.
    """
    async with old_nats_server("2.9.0") as url:
        with pytest.raises(ServerTooOldError, match="answered, but nats-server 2.9.0 is too old") as info:
            await connect_nats(url)
    assert "2.11" in str(info.value) and "2.9.0" in str(info.value)
    assert (info.value.found, info.value.required) == ("2.9.0", "2.11") and not info.value.retryable
    assert isinstance(info.value, ServiceUnavailableError)


async def test_using_a_store_before_start_is_a_clear_error() -> None:
    store = JetStreamLightningStore(Settings(namespace="x"), nats_url="nats://127.0.0.1:1")
    with pytest.raises(InvalidInputError, match="not started"):
        await store.enqueue_rollout({})


async def test_runner_store_refuses_queries(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace) as runner_store:
        with pytest.raises(InvalidInputError, match="without Postgres"):
            await runner_store.query_rollouts()


def test_every_error_is_an_eventlight_error_and_ids_are_value_errors() -> None:
    for cls in (
        agl.RolloutNotFoundError,
        agl.AttemptNotFoundError,
        agl.ResourcesNotFoundError,
        agl.InvalidTransitionError,
        agl.InvalidInputError,
    ):
        assert issubclass(cls, EventlightError) and issubclass(cls, ValueError)
    assert issubclass(agl.ServiceUnavailableError, EventlightError) and agl.ServiceUnavailableError.retryable


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "eventlight.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_cli_sql_error_is_one_line_not_a_traceback(namespace: Settings) -> None:
    import os

    env = {**os.environ, "EVENTLIGHT_PG_DSN": namespace.pg_dsn or "", "EVENTLIGHT_NAMESPACE": namespace.namespace}
    bad = run_cli("sql", "SELEC nonsense", env=env)
    assert bad.returncode == 2 and "SQL error" in bad.stderr and "Traceback" not in bad.stderr
    ok = run_cli("sql", "SELECT count(*) AS n FROM rollouts", env=env)
    assert ok.returncode == 0 and "1 row(s)" in ok.stdout
    write = run_cli("sql", "DELETE FROM projector_checkpoint", env=env)  # the projection must not be edited
    assert write.returncode == 2 and "only reads" in write.stderr and "Traceback" not in write.stderr
    kept = run_cli("sql", "SELECT count(*) AS n FROM projector_checkpoint", env=env)
    assert kept.returncode == 0 and " 1 " in kept.stdout.replace("│", " ")


def test_cli_runner_with_an_unknown_agent_fails_clearly() -> None:
    result = run_cli("runner", "no_such_module:agent")
    assert result.returncode == 2 and "no module named 'no_such_module'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("what", "unknown"),
    [("publish to el.x.r.ro-1.e", True), ("atomic batch of 3 messages to EL_X", True), ("reading el.x.res.>", False)],
)
def test_a_write_whose_acknowledgement_never_came_says_its_outcome_is_unknown(what: str, unknown: bool) -> None:
    """A publish that timed out (or whose connection closed) may have been stored: its error says
    so, where a read's does not (a fresh reviewer saw stored writes answered as plain failures)."""
    import nats.errors

    from eventlight.store.jetstream.nats_errors import nats_errors

    for cause in (nats.errors.TimeoutError(), nats.errors.ConnectionClosedError()):
        with pytest.raises(ServiceUnavailableError) as info:
            with nats_errors("nats://127.0.0.1:4222", what):
                raise cause
        assert ("outcome is unknown" in str(info.value)) is unknown
