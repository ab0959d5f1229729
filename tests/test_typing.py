"""mypy (strict, as configured in pyproject.toml) finds no error in the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_finds_no_error_in_the_package() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "eventlight"], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"mypy eventlight exited {done.returncode}:\n{done.stdout}{done.stderr}"
