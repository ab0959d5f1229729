"""A training program whose main file starts the Trainer outside ``if __name__ == "__main__":`` is
refused before anything starts: its runner processes import that file again (forkserver / spawn),
so each started the training again, died with multiprocessing's bootstrapping error and was
restarted until the run ended with ``NoRunnersError``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eventlight.settings import Settings

TRAIN = """
import eventlight as agl


@agl.rollout
async def agent(task: dict, prompt_template: agl.PromptTemplate) -> float:
    return 1.0


trainer = agl.Trainer(
    algorithm=agl.Baseline(),
    n_runners=1,
    initial_resources={"prompt_template": agl.PromptTemplate(template="hi", engine="f-string")},
)
{call}
"""


def _run(tmp_path: Path, program: str, settings: Settings | None = None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "train.py").write_text(program)
    env = {"EVENTLIGHT_STATE_DIR": str(tmp_path / "state")}
    if settings is not None:
        env |= {"EVENTLIGHT_NATS_URL": settings.nats_url or "", "EVENTLIGHT_PG_DSN": settings.pg_dsn or ""}
        env["EVENTLIGHT_NAMESPACE"] = settings.namespace
    return subprocess.run(
        [sys.executable, str(tmp_path / "train.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, **env},
    )


def test_an_unguarded_fit_stops_at_once_naming_the_guard(namespace: Settings, tmp_path: Path) -> None:
    t0 = time.monotonic()
    done = _run(tmp_path, TRAIN.replace("{call}", 'trainer.fit(agent, [{"i": 1}])'), namespace)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: Trainer.fit() runs at the top level of"), done.stderr[-3000:]
    assert 'without `if __name__ == "__main__":`' in last and "train.py (line 15)" in last
    assert "restarted" not in done.stderr and time.monotonic() - t0 < 30
    assert not (tmp_path / "state").exists()  # nothing was started


@pytest.mark.parametrize(
    ("call", "refused"),
    [
        ('if __name__ == "__main__":\n    check()', False),
        ('if "__main__" == __name__ and True:\n    check()', False),
        ("def main() -> None:\n    check()\n\n\nmain()", True),
        ("check()", True),
    ],
)
def test_the_guard_is_found_in_the_main_file(tmp_path: Path, call: str, refused: bool) -> None:
    program = (
        "from eventlight.trainer_guards import refuse_unguarded_main\n\n\n"
        "def check() -> None:\n    refuse_unguarded_main('Trainer.fit()')\n    print('passed')\n\n\n" + call + "\n"
    )
    done = _run(tmp_path, program)
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__main__.py").write_text(program)
    as_package = subprocess.run(  # multiprocessing does not import a package's __main__ again
        [sys.executable, "-m", "pkg"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert as_package.returncode == 0 and as_package.stdout.strip() == "passed", as_package.stderr
    if refused:
        assert done.returncode == 1 and "without `if __name__" in done.stderr, done.stderr
    else:
        assert done.returncode == 0 and done.stdout.strip() == "passed", done.stderr
