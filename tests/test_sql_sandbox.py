"""`eventlight sql` is not a sandbox escape: queries run as a read-only role with a statement timeout."""

from __future__ import annotations

import asyncpg
import pytest
from test_cli import assert_one_line_error, cli, env_of

from eventlight.settings import Settings
from eventlight.sql_reader import READER_ROLE, reader_dsn


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("COPY (SELECT 1) TO PROGRAM 'touch /eventlight-pwned'", "pg_execute_server_program"),
        ("SELECT pg_read_file('/etc/passwd')", "permission denied"),
        ("SELECT lo_import('/etc/passwd')", "permission denied"),
        ("SELECT set_config('role', 'postgres', false), pg_read_file('/etc/hostname')", "permission denied"),
        ("SELECT count(*) FROM pg_authid", "permission denied"),
        ("CREATE TABLE t (x int)", "read-only"),
    ],
)
def test_dangerous_statements_are_refused_in_one_line(namespace: Settings, query: str, says: str) -> None:
    line = assert_one_line_error(cli("sql", query, env=env_of(namespace)), 2, "SQL error")
    assert says in line


async def test_other_sessions_cannot_be_terminated(namespace: Settings) -> None:
    assert namespace.pg_dsn is not None
    victim = await asyncpg.connect(namespace.pg_dsn)
    try:
        pid = await victim.fetchval("SELECT pg_backend_pid()")
        result = cli("sql", f"SELECT pg_terminate_backend({pid})", env=env_of(namespace))
        assert_one_line_error(result, 2, "SQL error", "must be a superuser")
        assert await victim.fetchval("SELECT 1") == 1  # still alive
    finally:
        await victim.close()


def test_a_long_query_is_cancelled_at_the_timeout(namespace: Settings) -> None:
    result = cli("sql", "SELECT pg_sleep(20)", "--timeout-s", "0.5", env=env_of(namespace))
    assert_one_line_error(result, 2, "longer than --timeout-s 0.5 s")


def test_the_reader_sees_the_projections(namespace: Settings) -> None:
    result = cli("sql", "SELECT count(*) AS n FROM rollouts", "--format", "json", env=env_of(namespace))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == '{"n":0}' or result.stdout.strip() == '{"n": 0}'
    who = cli("sql", "SELECT current_user AS u, session_user AS s", "--format", "csv", env=env_of(namespace))
    assert who.stdout.strip().splitlines()[-1] == f"{READER_ROLE},{READER_ROLE}"


def test_reader_dsn_keeps_host_and_database() -> None:
    assert reader_dsn("postgresql://admin:secret@db.example:6543/app?sslmode=require") == (
        f"postgresql://{READER_ROLE}@db.example:6543/app?sslmode=require"
    )
    assert (
        reader_dsn("postgresql:///postgres?host=/run/pg", "pw")
        == f"postgresql://{READER_ROLE}:pw@/postgres?host=/run/pg"
    )
    with pytest.raises(ValueError):
        reader_dsn("mysql://x@y/z")
