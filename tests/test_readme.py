"""The README is true: its Python snippets run (or, for the Trainer, name only what exists)."""

from __future__ import annotations

import ast
import asyncio
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import eventlight as agl
from eventlight.ops import drop_namespace
from eventlight.settings import Settings
from tests.test_replay import workload

ROOT = Path(__file__).resolve().parents[1]


def snippet(name: str) -> str:
    """The ```python block right after ``<!-- README test: NAME -->`` in README.md."""
    text = (ROOT / "README.md").read_text()
    found = re.search(rf"<!-- README test: {name} -->\n```python\n(.*?)\n```", text, re.DOTALL)
    assert found, f"README.md has no snippet marked {name!r}"
    return found.group(1)


def test_store_snippet_runs_as_written(services: Any) -> None:
    base, svc = services
    env = {
        **os.environ,
        "EVENTLIGHT_NATS_URL": svc.nats_url,
        "EVENTLIGHT_PG_DSN": svc.pg_dsn,
        "EVENTLIGHT_STATE_DIR": str(base.state_dir),
    }
    try:
        done = subprocess.run(
            [sys.executable, "-c", snippet("store")], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        asyncio.run(drop_namespace(svc.nats_url, svc.pg_dsn, Settings(namespace="scratch")))
    assert done.returncode == 0, done.stderr
    rollout_id, status = done.stdout.split()
    assert rollout_id.startswith("ro-") and status == "succeeded"


def test_subscribe_snippet_runs_as_written() -> None:
    done = subprocess.run([sys.executable, "-c", snippet("subscribe")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rollout_id, status, data, position = done.stdout.split()
    assert rollout_id.startswith("ro-") and (status, data, position) == ("succeeded", "[]", "3")


def test_trainer_snippet_names_only_what_exists() -> None:
    """Every ``agl.X`` exists, and every call of one binds its keywords to the real signature."""
    tree = ast.parse(snippet("trainer"))
    calls = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "agl":
            assert hasattr(agl, node.attr), f"README names agl.{node.attr}, which does not exist"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if isinstance(func.value, ast.Name) and func.value.id == "agl" and callable(getattr(agl, func.attr)):
                target = getattr(agl, func.attr)
                args = [None] * len(node.args)
                kwargs = {k.arg: None for k in node.keywords if k.arg}
                inspect.signature(target).bind(*args, **kwargs)  # raises TypeError on a wrong keyword
                calls += 1
    assert calls >= 5  # Trainer, APO, PromptTemplate, LLM, TraceToMessages (+ Settings.from_env)
    assert "openai_client = " in snippet("trainer")  # the snippet says what openai_client is


def test_trainer_snippet_names_its_optimizer_models_and_what_must_run() -> None:
    """The snippet's APO asked its endpoint for Agent-lightning's default ``gpt-5-mini`` (which a
    local server does not serve), and did not say that anything had to be running (a fresh-user run)."""
    text = snippet("trainer")
    [apo] = [
        node
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "APO"
    ]
    keywords = {k.arg for k in apo.keywords}
    assert {"gradient_model", "apply_edit_model"} <= keywords
    url = re.search(r'AsyncOpenAI\(base_url="([^"]+)"', text)
    assert url, "the snippet's optimizer client names its endpoint"
    needs = [line for line in text.splitlines() if line.startswith("#") and "Needs" in line]
    assert needs and url.group(1) in needs[0], "a comment says what must be running, at the client's address"


def test_sql_examples_keep_their_placeholders_through_the_shell() -> None:
    """Each ``eventlight sql`` line of the README, as bash passes it: a query given ``--param``
    values still holds its ``$1`` (in double quotes bash replaced it with nothing, and the query
    failed with 'syntax error at or near "ORDER"': a fresh-user run)."""
    command_line = re.compile(r"^(?:\$ |\.venv/bin/)?eventlight sql (.*)$", re.S)  # in code blocks, not the table
    checked = 0
    lines: list[str] = []  # a line ending in a backslash goes on on the next (the demo's report query)
    for raw in (ROOT / "README.md").read_text().splitlines():
        if lines and lines[-1].endswith("\\"):
            lines[-1] += "\n" + raw
        else:
            lines.append(raw)
    for line in lines:
        if (found := command_line.match(line)) is None:
            continue
        command = found.group(1).split("  #")[0]
        argv = subprocess.run(
            ["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.split("\0")[:-1]
        if "--param" in argv or "-p" in argv:
            assert re.search(r"\$[0-9]", argv[0]), f"bash leaves no placeholder in: {line}"
            checked += 1
    assert checked >= 2


async def test_replay_snippet_finds_the_embedded_servers_as_the_cli_does(
    namespace: Settings, services: tuple[Settings, Any]
) -> None:
    """``agl.replay(agl.Settings.from_env(), ...)`` refused to run without ``$EVENTLIGHT_NATS_URL``
    while ``eventlight up``'s servers ran, which the CLI found (a fresh-user run)."""
    base, svc = services
    async with agl.JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        ids = await workload(store)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVENTLIGHT_")}
    env["EVENTLIGHT_STATE_DIR"] = str(base.state_dir)  # the servers are found there, as `eventlight up` left them
    if svc.nats_pid is None:  # the tests were given an external NATS: nothing embedded to find
        env["EVENTLIGHT_NATS_URL"] = svc.nats_url
    code = snippet("replay").replace('namespace="my_agent"', f'namespace="{namespace.namespace}"')
    run = [sys.executable, "-c", code]
    done = await asyncio.to_thread(subprocess.run, run, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"{ids['good']} 0 None",
        f"{ids['good']} 1 0.9",
        "0 records from spans named chat …",
    ]


def test_the_files_the_readme_examples_write_are_ignored_by_git() -> None:
    """``eventlight replay --out train.parquet`` and the like, run as written in a checkout, left
    the datasets as untracked files in its root (a fresh-user run)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    text = (ROOT / "README.md").read_text()
    outs = sorted(set(re.findall(r"--out ([\w./-]+\.(?:jsonl|parquet))\b", text)))
    assert {"train.parquet", "sft.jsonl", "genai.jsonl"} <= set(outs)
    check = subprocess.run(["git", "check-ignore", "--no-index", *outs], cwd=ROOT, capture_output=True, text=True)
    assert sorted(check.stdout.split()) == outs, check.stderr


def test_the_peer_failure_table_names_tests_that_exist_and_carry_their_case() -> None:
    """docs/porting.md's table of peer failures: every ``file::test`` it names is a test function
    of that file whose docstring says ``peer_failures`` and names the row's case (``C03``)."""
    text = (ROOT / "docs" / "porting.md").read_text()
    table = text[text.index("## Failures Agent-lightning's users hit") :]
    rows = [line for line in table.splitlines() if re.match(r"\| C\d\d ", line)]
    assert len(rows) >= 17
    for row in rows:
        case, cell = row.split(" | ")[0][2:5], row.split(" | ")[1]
        file = None
        for named in re.findall(r"`([^`]+::[^`]+)`", cell):
            head, test = named.split("::")
            file = head or file
            assert file is not None, row
            tree = ast.parse((ROOT / "tests" / file).read_text())
            functions = (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
            found = [n for n in functions if n.name == test]
            assert found, f"{case}: tests/{file} has no {test}"
            doc = ast.get_docstring(found[0]) or ""
            assert "peer_failures" in doc and case in doc, f"{case}: {file}::{test} does not say it tests {case}"
