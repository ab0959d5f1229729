"""README.md's "Command line" table and the commands' ``--help`` say the same thing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

from test_cli import cli

from eventlight.core.types import RolloutMode
from eventlight.logreplay.records import BUILTIN_ADAPTERS

ROOT = Path(__file__).resolve().parents[1]
VIEW = re.compile(r"\b(v_[a-z_]+|llm_calls|reward_by_resources|rollout_rewards)\b")


def row(command: str) -> str:
    """The README table row of ``eventlight <command>``."""
    rows = [
        line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(f"| `eventlight {command}")
    ]
    assert len(rows) == 1, (command, rows)
    return rows[0]


def help_of(*command: str) -> str:
    result = cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    return result.stdout


def options_of(help_text: str) -> set[str]:
    return set(re.findall(r"^│ (--[a-z][a-z-]*)", help_text, re.MULTILINE)) - {"--help", "--namespace"}


def test_the_replay_row_names_every_adapter_help_names() -> None:
    text = help_of("replay")
    for adapter in BUILTIN_ADAPTERS:
        assert adapter in text
        assert f"{adapter}\\|" in row("replay")


def test_the_serve_row_names_every_option_of_serve() -> None:
    options = options_of(help_of("serve"))
    assert "--max-body-bytes" in options
    assert {o for o in options if f"[{o}" not in row("serve")} == set()


def test_the_sql_row_names_the_views_help_names_and_migration_008_defines() -> None:
    text, readme = help_of("sql"), row("sql")
    documented = set(
        re.findall(
            r"CREATE OR REPLACE VIEW (\w+)", (ROOT / "eventlight/_data/migrations/008_documented_views.sql").read_text()
        )
    )
    assert {v for v in documented if v.startswith("v_")} <= set(VIEW.findall(text))
    assert set(VIEW.findall(text)) | documented <= set(VIEW.findall(readme))
    assert "008_documented_views.sql" in readme
    assert "--catch-up" in options_of(text)
    assert {o for o in options_of(text) if f"[{o}" not in readme} == set()  # every option of sql


def test_replay_mode_help_and_its_error_name_the_same_modes(tmp_path: Path) -> None:
    modes = get_args(RolloutMode)
    assert f"<{'|'.join(modes)}>" in help_of("replay")
    result = cli("replay", "--mode", "bogus", "--out", str(tmp_path / "x.jsonl"))
    assert result.returncode == 2 and f"is not one of {', '.join(map(repr, modes))}" in result.stderr, result.stderr


def test_eventlight_bench_help_names_eventlight_bench() -> None:
    assert "Usage: eventlight bench [OPTIONS]" in help_of("bench")
    direct = subprocess.run(
        [sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60, check=True
    )
    assert "Usage: python -m bench [OPTIONS]" in direct.stdout
