"""``examples/demo.py`` (what ``make demo`` runs): GRPO by default, APO one flag away with its failure behaviour."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from demo_runs import run_script

from eventlight.net import free_port as closed_port

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def run_main_job(services: Any, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``examples/demo.py`` with one runner in a namespace of its own on the session's servers."""
    return run_script(services, DEMO, *args, timeout=timeout)


@pytest.mark.e2e
def test_algorithm_apo_runs_the_apo_demo_and_keeps_its_llm_check(services: Any) -> None:
    dead = f"http://127.0.0.1:{closed_port()}/v1"
    done = run_main_job(services, "--algorithm", "apo", "--base-url", dead, "--model", "m", "--tasks", "4")
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "LLM unavailable" in errors[0] and dead in errors[0], done.stderr
    assert "val reward, initial prompt" not in done.stdout and "Traceback" not in done.stderr
