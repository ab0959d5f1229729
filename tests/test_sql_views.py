"""The documented SQL views (migration 008) answer on a real workload, and ``eventlight sql --param``
binds values instead of pasting them into the statement."""

from __future__ import annotations

import json

import asyncpg

from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from tests.test_cli import assert_one_line_error, cli, env_of
from tests.test_replay import workload

VIEWS = ("v_rollouts", "v_attempts", "v_spans", "v_rewards", "llm_calls", "reward_by_resources", "rollout_rewards")


def rows(*args: str, ns: Settings) -> list[dict[str, object]]:
    result = cli("sql", *args, "--format", "json", env=env_of(ns))
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


async def test_views_are_documented_and_answer(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        ids = await workload(store)
        await store.sync_all(timeout_s=10)
    assert namespace.pg_dsn is not None
    conn = await asyncpg.connect(namespace.pg_dsn)
    try:
        for view in VIEWS:
            comment = await conn.fetchval(
                "SELECT obj_description($1::regclass, 'pg_class')", f"{namespace.pg_schema}.{view}"
            )
            assert comment, f"{view} has no COMMENT"
    finally:
        await conn.close()
    good = rows("SELECT * FROM v_rollouts WHERE rollout_id = $1", "--param", ids["good"], ns=namespace)
    assert len(good) == 1 and good[0]["final_reward"] == 0.9 and good[0]["resources_version"] == 1
    assert good[0]["latest_attempt_status"] == "succeeded" and good[0]["duration_s"] is not None
    attempts = rows("SELECT status, spans, final_reward FROM v_attempts ORDER BY start_time", ns=namespace)
    assert [(a["status"], a["spans"]) for a in attempts] == [("succeeded", 3), ("succeeded", 3), ("failed", 2)]
    assert len(rows("SELECT * FROM v_spans WHERE attributes ? $1", "--param", "prompt_token_ids", ns=namespace)) == 6
    assert sorted(r["reward"] for r in rows("SELECT reward FROM v_rewards", ns=namespace)) == [0.2, 0.9]
    by_res = rows("SELECT * FROM reward_by_resources WHERE mode = $1", "--param", "train", ns=namespace)
    assert by_res[0]["rollouts"] == 2 and by_res[0]["resources_version"] == 1
    many = rows(
        "SELECT count(*) AS n FROM v_spans WHERE sequence_id >= $1 AND name = $2",
        "-p",
        "2",
        "-p",
        "openai.chat.completion",
        ns=namespace,
    )
    assert many == [{"n": 3}]


def test_params_are_bound_never_pasted(namespace: Settings) -> None:
    # a value that would be an injection if pasted in is only compared as text
    assert rows("SELECT count(*) AS n FROM rollouts WHERE status = $1", "--param", "x' OR '1'='1", ns=namespace) == [
        {"n": 0}
    ]
    env = env_of(namespace)
    assert_one_line_error(
        cli("sql", "SELECT $1::int", "--param", "ten", env=env),
        2,
        "--param $1 'ten' is not a whole number (Postgres takes $1 as int4)",
    )
    assert_one_line_error(cli("sql", "SELECT $1::int", env=env), 2, "1 placeholder(s)", "0 --param")


def test_a_placeholder_the_shell_expanded_is_named_as_the_likely_cause(namespace: Settings) -> None:
    """The README's queries with ``$1`` in double quotes reached eventlight without it (bash expands
    it to nothing): the error was a bare 'syntax error at or near "ORDER"' (a fresh-user run)."""
    env, hint = env_of(namespace), "did the shell expand $1? quote the query with single quotes"
    expanded = "SELECT name FROM v_spans WHERE rollout_id =  ORDER BY sequence_id"  # "… = $1 ORDER …" after bash
    error = assert_one_line_error(cli("sql", expanded, "-p", "ro-x", env=env), 2, 'syntax error at or near "ORDER"')
    assert f"the query has no $1 placeholder but 1 --param given: {hint}" in error
    error = assert_one_line_error(  # "… = '$1'" after bash: valid SQL without a placeholder
        cli("sql", "SELECT count(*) FROM v_rollouts WHERE mode = ''", "-p", "train", env=env), 2, "0 placeholder(s)"
    )
    assert error.count("placeholder") == 1 and hint in error
    error = assert_one_line_error(cli("sql", "SELECT $1 ORDR BY 1", "-p", "x", env=env), 2, "syntax error")
    assert "shell" not in error  # a syntax error of its own, with its placeholder
    assert "shell" not in assert_one_line_error(cli("sql", "SELECT 1 ORDR BY 1", env=env), 2, "syntax error")


def test_params_of_other_types_are_read_as_postgres_reads_a_literal(namespace: Settings) -> None:
    # timestamptz, date, interval and arrays: asyncpg would refuse a str for each
    [row] = rows(
        "SELECT $1::timestamptz AS t, $2::date AS d, $3::interval + interval '0' AS i, $4::text[] AS a, $5::uuid AS u",
        *("-p", "2024-05-01 12:00Z", "-p", "2024-05-01", "-p", "1 hour", "-p", "{a,b}"),
        *("-p", "0e9b9c6a-0000-4000-8000-000000000000"),
        ns=namespace,
    )
    assert row == {
        "t": "2024-05-01T12:00:00+00:00",
        "d": "2024-05-01",
        "i": "1:00:00",
        "a": ["a", "b"],
        "u": "0e9b9c6a-0000-4000-8000-000000000000",
    }
    env = env_of(namespace)
    assert_one_line_error(
        cli("sql", "SELECT $1::date", "-p", "2024-02-30", env=env),
        2,
        "--param $1 '2024-02-30' is not a valid date (Postgres takes $1 as date: date/time field value out of range",
    )
    assert_one_line_error(  # bound as a timedelta, one month would silently become 30 days
        cli("sql", "SELECT now() - $1::interval", "-p", "1 month", env=env),
        2,
        "--param $1 '1 month' would be bound as '30 days', not '1 mon' (interval)",
    )
