"""VERL on a machine without its extra: one line, before anything heavy is imported (a fresh user
got a ``ModuleNotFoundError: torch`` traceback instead). Runs without torch or verl installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = """
import asyncio, importlib.util, sys
real = importlib.util.find_spec
hidden = {"torch", "verl", "vllm", "ray"}
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] in hidden else real(name, *a)
import eventlight as agl
from eventlight.verl.requirements import VerlUnavailableError
config = {"actor_rollout_ref": {"model": {"path": "/models/tiny"}, "rollout": {"n": 2}},
          "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 32},
          "trainer": {"total_training_steps": 1}}
try:
    asyncio.run(agl.VERL(config).run(train_dataset=[{"q": "1 + 1?"}]))
except VerlUnavailableError as e:
    print("refused:", e)
heavy = sorted(m for m in ("torch", "eventlight.verl.batch", "eventlight.verl.gpu") if m in sys.modules)
print("imported:", heavy)
"""


def test_verl_run_without_the_extra_is_one_line_before_any_heavy_import() -> None:
    out = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: VERL needs the verl extra on a GPU machine (missing: torch, verl, vllm, ray)" in out.stdout
    assert "imported: []" in out.stdout, out.stdout


def test_the_gpu_bench_says_so_in_one_line_and_exits_2() -> None:
    run_bench = "import runpy\nrunpy.run_module('bench.verl_gpu', run_name='__main__')\n"
    program = PROGRAM.split("import eventlight as agl")[0] + run_bench
    out = subprocess.run(
        [sys.executable, "-c", program, "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "error: VERL needs the verl extra" in out.stderr + out.stdout
