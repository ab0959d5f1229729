"""``examples/demo.py`` (what ``make demo`` runs): GRPO by default, APO one flag away with its failure behaviour."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from demo_runs import run_script

import eventlight as agl
from eventlight.net import free_port as closed_port
from eventlight.settings import Settings

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


async def test_the_demo_cancels_what_an_interrupted_run_left_queued(namespace: Settings) -> None:
    """An interrupted demo leaves its queued rollouts behind; the next demo's runners would take them
    first and fail them (their policy version is not served). The next demo cancels them, and only them."""
    from examples.demo_lease import cancel_leftovers

    async with agl.JetStreamLightningStore(namespace) as store:
        for rid in [f"run-old-ab12-step{i}" for i in range(3)] + ["someone-elses"]:
            await store.update_resources(rid, {"p": agl.PromptTemplate(template="{x}")})
        left = [await store.enqueue_rollout({"x": i}, resources_id=f"run-old-ab12-step{i}") for i in range(3)]
        other = await store.enqueue_rollout({"x": 9}, resources_id="someone-elses")
        also_left = await store.enqueue_rollout({"x": 7}, resources_id="run-old-ab12-step0")
        claimed = await store.dequeue_rollout(worker_id="w")  # the oldest queued one: left[0]
        assert claimed is not None and claimed.rollout_id == left[0].rollout_id
    assert await cancel_leftovers(namespace, namespace.nats_url or "", namespace.pg_dsn or "") == 3
    async with agl.JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.sync_all()
        status = {r.rollout_id: r.status for r in await store.query_rollouts()}
    assert [status[r.rollout_id] for r in left[1:]] == ["cancelled", "cancelled"]
    assert status[also_left.rollout_id] == "cancelled" and status[other.rollout_id] == "queuing"
    assert status[left[0].rollout_id] == "preparing", "a rollout a runner holds is not a leftover of the queue"
    assert await cancel_leftovers(namespace, namespace.nats_url or "", namespace.pg_dsn or "") == 0


async def test_a_second_demo_leaves_the_queue_of_a_live_run_alone(namespace: Settings, tmp_path: Path) -> None:
    """A second ``make demo`` in the namespace of one that ran cancelled every queued rollout of the
    running one (as leftovers), even when it then failed: the first evaluated on 8 of its 73 held-out
    items and exited 0 (fresh-user run). Now the second stops with one line naming the live run and
    its pid, and cancels nothing; once that run has ended, its leftovers are cancelled, with who
    cancelled them and why in their metadata."""
    from examples.demo_lease import cancel_leftovers

    settings = msgspec.structs.replace(namespace, state_dir=tmp_path)
    live = "run-20261207-101010-ab12"
    async with agl.JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
        await store.update_resources(f"{live}-step0", {"p": agl.PromptTemplate(template="{x}")})
        queued = [await store.enqueue_rollout({"x": i}, resources_id=f"{live}-step0") for i in range(3)]
    env = {
        **os.environ,
        "EVENTLIGHT_NATS_URL": settings.nats_url or "",
        "EVENTLIGHT_PG_DSN": settings.pg_dsn or "",
        "EVENTLIGHT_NAMESPACE": settings.namespace,
        "EVENTLIGHT_STATE_DIR": str(tmp_path),
    }
    (tmp_path / "model").mkdir()  # a model it cannot load: a second demo that went on fails soon after
    (tmp_path / "model" / "config.json").write_text("{}")
    second = [sys.executable, str(DEMO), "--n-runners", "1", "--steps", "1", "--model-dir", str(tmp_path / "model")]
    lease = f"demo run {live} in namespace {settings.namespace}"  # what a demo's lease says (DEMO_LEASE)
    async with agl.use_services(settings, what=lease):
        done = await asyncio.to_thread(
            subprocess.run, second, env=env, capture_output=True, text=True, timeout=240, check=False
        )
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"demo run {live} (pid {os.getpid()}) is running" in errors[0], done.stderr
    assert "EVENTLIGHT_NAMESPACE=" in errors[0] and "Traceback" not in done.stderr
    async with agl.JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
        await store.sync_all()
        assert {r.rollout_id: r.status for r in await store.query_rollouts()} == {
            r.rollout_id: "queuing" for r in queued
        }
    # the run has ended (its lease is given up): its queue is a leftover now
    assert await cancel_leftovers(settings, settings.nats_url or "", settings.pg_dsn or "", "run-new-cd34") == 3
    async with agl.JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
        await store.sync_all()
        cancelled = await store.query_rollouts(status_in=["cancelled"])
    assert len(cancelled) == 3
    assert all("cancelled by demo run run-new-cd34" in r.metadata["cancelled_by"]["reason"] for r in cancelled)


@pytest.mark.parametrize("algorithm", ["grpo", "apo"])
def test_a_second_demo_is_refused_before_it_starts_anything(algorithm: str, tmp_path: Path) -> None:
    """A second ``make demo`` in the namespace of a live one started (or reached) NATS and Postgres,
    and loaded torch, before it was refused; the APO demo held no demo lease and refused nothing.
    Both read the leases first now: one error line, nothing printed, nothing started, nothing
    written to the state folder. The servers named here do not answer, so a demo that went on to
    them would fail with another error."""
    from eventlight.ops.leases import take_lease
    from examples.demo_lease import demo_lease

    live, namespace = "run-20261207-101010-ab12", "demo_live"
    lease = take_lease(tmp_path, demo_lease(Settings(namespace=namespace), live))
    env = {
        **os.environ,
        "EVENTLIGHT_STATE_DIR": str(tmp_path),
        "EVENTLIGHT_NAMESPACE": namespace,
        "EVENTLIGHT_NATS_URL": f"nats://127.0.0.1:{closed_port()}",
        "EVENTLIGHT_PG_DSN": f"postgresql://postgres@127.0.0.1:{closed_port()}/postgres",
    }
    dead_llm = ["--base-url", f"http://127.0.0.1:{closed_port()}/v1", "--model", "m"] if algorithm == "apo" else []
    try:
        done = subprocess.run(
            [sys.executable, str(DEMO), "--algorithm", algorithm, "--n-runners", "1", *dead_llm],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        lease.close()
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"demo run {live} (pid {os.getpid()}) is running" in errors[0], done.stderr
    assert f"namespace '{namespace}'" in errors[0] and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == errors  # the error alone: no banner, no "nothing above is a result"
    assert done.stdout == "" and [p.name for p in tmp_path.iterdir()] == ["leases"]  # nothing started


@pytest.mark.e2e
async def test_the_apo_demo_cancels_what_an_earlier_run_left_queued(namespace: Settings, tmp_path: Path) -> None:
    """The GRPO demo cancelled what a dead earlier run left queued, noting by whom in
    ``metadata.cancelled_by``; the APO demo left it for its runners to take first. Now it cancels
    it the same way (here it then stops at its LLM check: the endpoint is down)."""
    settings = msgspec.structs.replace(namespace, state_dir=tmp_path)
    old = "run-20261207-101010-ab12-v0"
    async with agl.JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
        await store.update_resources(old, {"p": agl.PromptTemplate(template="{x}")})
        left = [await store.enqueue_rollout({"x": i}, resources_id=old, metadata={"mine": i}) for i in range(2)]
    env = {
        **os.environ,
        "EVENTLIGHT_NATS_URL": settings.nats_url or "",
        "EVENTLIGHT_PG_DSN": settings.pg_dsn or "",
        "EVENTLIGHT_NAMESPACE": settings.namespace,
        "EVENTLIGHT_STATE_DIR": str(tmp_path),
    }
    dead = f"http://127.0.0.1:{closed_port()}/v1"
    cmd = [sys.executable, str(DEMO), "--algorithm", "apo", "--n-runners", "1", "--base-url", dead, "--model", "m"]
    done = await asyncio.to_thread(
        subprocess.run, [*cmd, "--tasks", "4"], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 1 and "LLM unavailable" in done.stderr, done.stdout + done.stderr
    assert "cancelled 2 rollout(s) an earlier run left queued" in done.stdout, done.stdout
    async with agl.JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
        await store.sync_all()
        got = {r.rollout_id: r for r in await store.query_rollouts(rollout_id_in=[r.rollout_id for r in left])}
    assert [got[r.rollout_id].status for r in left] == ["cancelled", "cancelled"]
    for i, rollout in enumerate(left):
        metadata = got[rollout.rollout_id].metadata
        assert metadata["mine"] == i and "cancelled by demo run run-" in metadata["cancelled_by"]["reason"]


@pytest.mark.parametrize(
    "option",
    [
        ["--lr", "-1", "--lr: must be a finite number above 0, got -1\n"],
        ["--group-size", "1", "--group-size: must be from 2 to 2147483647, got 1\n"],
        ["--eval-every", "-1", "--eval-every: must be from 0 to 2147483647, got -1\n"],
        ["--threads", "-1", "--threads: must be from 0 to 2147483647, got -1\n"],
        ["--eval-items", "-3", "--eval-items: must be from 0 to 73, got -3\n"],
        ["--eval-items", "100", "--eval-items: must be from 0 to 73, got 100\n"],
        ["--model-dir", "no-such-folder", "--model-dir: no model at no-such-folder"],
        ["--rollout-timeout", "0", "--rollout-timeout: must be a finite number above 0, got 0\n"],
    ],
)
def test_the_demo_checks_every_option_before_it_starts_anything(option: list[str], tmp_path: Path) -> None:
    """``make demo ARGS="--lr -1"`` started the servers and cancelled the namespace's queued rollouts
    before GRPOConfig refused the lr: every option is checked first, as ``--steps 0`` is. The
    servers named here do not answer, so a demo that started anything would fail otherwise."""
    env = {
        **os.environ,
        "EVENTLIGHT_STATE_DIR": str(tmp_path),
        "EVENTLIGHT_NATS_URL": f"nats://127.0.0.1:{closed_port()}",
        "EVENTLIGHT_PG_DSN": f"postgresql://postgres@127.0.0.1:{closed_port()}/postgres",
    }
    *args, says = option
    done = subprocess.run(
        [sys.executable, str(DEMO), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.stdout == "" and list(tmp_path.iterdir()) == []  # nothing started, no lease taken


@pytest.mark.parametrize(
    "option",
    [
        ["--rounds", "-1", "--rounds: must be from 0 to 2147483647, got -1"],
        ["--n-runners", "0", "--n-runners: must be from 1 to 2147483647, got 0"],
        ["--beam-width", "0", "--beam-width: must be from 1 to 2147483647, got 0"],
        ["--branch-factor", "0", "--branch-factor: must be from 1 to 2147483647, got 0"],
        ["--beam-width", "2147483648", "--beam-width: must be from 1 to 2147483647, got 2147483648"],
        ["--llm-servers", "0", "--llm-servers: must be from 1 to 2147483647, got 0"],
        ["--tasks", "-2", "--tasks: must be from 0 to 2147483647, got -2"],
    ],
)
def test_the_apo_demo_checks_every_option_before_it_starts_anything(option: list[str], tmp_path: Path) -> None:
    """``--algorithm apo --rounds -1`` (``--n-runners 0``, ``--beam-width 0``) was refused only after
    ~35 s, once two llama.cpp servers had started (``--n-runners 0`` not at all); the GRPO demo
    refuses at once. The servers named here do not answer, so a demo that went on would fail otherwise."""
    env = {
        **os.environ,
        "EVENTLIGHT_STATE_DIR": str(tmp_path),
        "EVENTLIGHT_NATS_URL": f"nats://127.0.0.1:{closed_port()}",
        "EVENTLIGHT_PG_DSN": f"postgresql://postgres@127.0.0.1:{closed_port()}/postgres",
    }
    *args, says = option
    done = subprocess.run(
        [sys.executable, str(DEMO), "--algorithm", "apo", *args], env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: ") and says in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stdout == "" and list(tmp_path.iterdir()) == []


def test_the_demo_passes_rollout_timeout_to_grpo() -> None:
    """GRPO's ``rollout_timeout_s`` (600 s) had no option: a slow machine could not give its steps longer."""
    from examples.arithmetic.train_grpo import parse_args

    assert parse_args([]).config.rollout_timeout_s == 600.0
    assert parse_args(["--rollout-timeout", "1200"]).config.rollout_timeout_s == 1200.0


@pytest.mark.parametrize("option", ["--n-runners", "--steps"])
def test_the_demo_refuses_a_count_of_zero(option: str) -> None:
    """``--n-runners 0`` ran one runner without a word; ``--steps 0`` evaluated for 37 s, then ended
    with "error: run … did not train" (fresh-user runs)."""
    done = subprocess.run(
        [sys.executable, str(DEMO), option, "0"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == f"error: argument {option}: must be from 1 to 2147483647, got 0\n"
    assert done.stdout == ""


@pytest.mark.parametrize(
    "option", [["--bogus"], ["--lr", "-1"], ["--group-size", "1"], ["--steps", "0"], ["--algorithm", "apo", "--bogus"]]
)
def test_a_refused_option_is_one_error_line(option: list[str]) -> None:
    """``make demo ARGS="--bogus"`` printed argparse's 5-line usage block before the error; README
    says a refused option is one line."""
    done = subprocess.run(
        [sys.executable, str(DEMO), *option], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: "), done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("algorithm", ["grpo", "apo"])
def test_the_demo_help_names_algorithm_and_the_make_command(algorithm: str) -> None:
    """``--help`` left out ``--algorithm`` and showed ``python examples/arithmetic/train_grpo.py``
    as the command, where the user ran ``make demo``."""
    done = subprocess.run(
        [sys.executable, str(DEMO), "--algorithm", algorithm, "--help"], capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith('usage: make demo ARGS="[--algorithm {grpo,apo}]'), done.stdout
    assert "--algorithm {grpo,apo}" in done.stdout.split("options:")[1]
    assert "examples/arithmetic/train_grpo.py" not in done.stdout and "examples/room_booking" not in done.stdout
    other = 'make demo ARGS="--algorithm apo --help"' if algorithm == "grpo" else 'make demo ARGS="--help"'
    assert done.stdout.rstrip().splitlines()[-1].endswith(f"{other} lists them."), done.stdout


@pytest.mark.parametrize("algorithm", ["grpo", "apo"])
def test_every_demo_option_says_what_it_does(algorithm: str) -> None:
    """``make demo ARGS=--help`` showed ``--seed`` without a word and ``--temperature`` without its
    default (the APO demo four options without a word); every option now has its line, with its
    default where it has one."""
    import examples.demo as main

    if algorithm == "apo":
        from examples.room_booking import train_apo as demo
    else:
        from examples.arithmetic import train_grpo as demo  # type: ignore[no-redef]
    parser = main.demo_parser(demo.__doc__, algorithm)
    with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()):
        demo.parse_args(["--help"], parser)
    options = {a.option_strings[-1]: a for a in parser._actions}
    assert [name for name, action in options.items() if not action.help] == []
    for name, action in options.items():  # a number's default is said, unless it means something of its own
        if isinstance(action.default, int | float) and not isinstance(action.default, bool):
            assert "default" in action.help or f"{action.default} = " in action.help, name
    if algorithm == "grpo":
        assert "(default 0.7)" in options["--temperature"].help and "(default 0)" in options["--seed"].help


@pytest.mark.parametrize(
    ("option", "says"),
    [
        (["--steps", "-1"], "error: argument --steps: must be from 1 to 2147483647, got -1\n"),
        (["--steps", "2147483648"], "error: argument --steps: must be from 1 to 2147483647, got 2147483648\n"),
        (["--group-size", "1"], "error: argument --group-size: must be from 2 to 2147483647, got 1\n"),
        (["--lr", "-1"], "error: argument --lr: must be a finite number above 0, got -1\n"),
        (["--algorithm", "apo", "--rounds", "-1"], "error: argument --rounds: must be from 0 to 2147483647, got -1\n"),
        (["--algorithm", "apo", "--tasks", "-1"], "error: argument --tasks: must be from 0 to 2147483647, got -1\n"),
    ],
)
def test_both_demos_refuse_a_count_in_the_same_words(option: list[str], says: str) -> None:
    """``--steps -1`` said "argument --steps: must be at least 1, got -1" and ``--algorithm apo
    --rounds -1`` "--rounds must be a whole number 0 to 1000000, got -1": the same mistake, two forms;
    later ``--steps 0`` "must be at least 1" but ``--steps 2147483648`` "--steps must be a whole number
    0 to 2147483647", ``--group-size 1`` "… 2 to …", and ``--lr -1`` echoed ``-1.0``: every count and
    number option now has one form, its range and the value as typed."""
    done = subprocess.run(
        [sys.executable, str(DEMO), *option], capture_output=True, text=True, timeout=120, check=False
    )
    assert (done.returncode, done.stdout, done.stderr) == (2, "", says)


def test_an_interrupted_demo_says_how_to_continue_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl+C ended the demo with a bare "interrupted": the line now gives the command that resumes
    the run from its last checkpoint, with the options it ran with (as README.md writes it)."""
    from examples.arithmetic.train_grpo import interrupted
    from examples.demo import _make_demo

    monkeypatch.setenv("EVENTLIGHT_STATE_DIR", str(tmp_path))
    run = "run-20261207-101010-ab12"
    assert interrupted(run, ["--steps", "2"], _make_demo) == (
        f"interrupted: run {run} stopped before its first checkpoint; nothing to resume: "
        'run `make demo ARGS="--steps 2"` again to start over'
    )
    assert interrupted(run, [], _make_demo).endswith("nothing to resume: run `make demo` again to start over")
    step = tmp_path / "checkpoints" / run / "step-00001"
    step.mkdir(parents=True)
    (step / "state.json").write_text(json.dumps({"step": 1, "version": f"{run}-step1"}))
    (step.parent / "LATEST").write_text(step.name)
    assert interrupted(run, ["--steps", "2", "--lr", "2e-5"], _make_demo) == (
        f'interrupted: run {run} stopped at checkpoint step1; to continue it: make demo ARGS="--steps 2 --lr 2e-5 '
        f'--resume {run}"'
    )
    again = interrupted(run, ["--resume", run, "--steps", "4"], lambda options: " ".join(options))
    assert again.endswith(f"to continue it: --steps 4 --resume {run}")


async def test_the_demo_report_leaves_failed_rollouts_out_of_the_mean(namespace: Settings) -> None:
    """After ``--resume``, a checkpoint's rows held the interrupted run's failed rollouts as reward 0
    (``reward_by_resources``: missing = 0): 62 rollouts, mean 0.128, where the 41 with a reward
    averaged 0.194. The report's mean is over the rollouts with a reward; it counts failed ones apart
    and cancelled ones too: one cancelled while it ran (the evaluation had given up on it) is no
    result even with a reward, where the table showed it rewarded beside an evaluation without it."""
    from examples.arithmetic.train_grpo import report_command, report_sql
    from tests.test_cli import ROOT, env_of
    from tests.test_replay import reward_span
    from tests.test_sql_views import rows

    run = "run-20261207-101010-ab12"
    async with agl.JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        for step in (0, 1):
            await store.update_resources(f"{run}-step{step}", {"p": agl.PromptTemplate(template="{x}")})
        plan = [("step0", "val", 0.5, "succeeded"), ("step1", "train", 0.25, "succeeded")]
        plan += [("step1", "train", 0.75, "succeeded"), ("step1", "train", None, "failed")]
        plan += [("step1", "train", None, "")]  # cancelled in the queue
        plan += [("step0", "val", 0.9, "cancelled")]  # cancelled while it ran, its reward recorded
        for version, mode, reward, status in plan:
            made = await store.enqueue_rollout({"x": 1}, mode=mode, resources_id=f"{run}-{version}")
            if not status:  # left in the queue, then cancelled
                await store.update_rollout(made.rollout_id, status="cancelled")
                continue
            claimed = await store.dequeue_rollout(worker_id="w")
            assert claimed is not None and claimed.rollout_id == made.rollout_id
            if reward is not None:
                await store.add_span(reward_span(made.rollout_id, claimed.attempt.attempt_id, 1, reward, 1.0))
            if status == "cancelled":
                await store.update_rollout(made.rollout_id, status="cancelled")
                continue
            await store.update_attempt(made.rollout_id, claimed.attempt.attempt_id, status=status)
        await store.sync_all(timeout_s=10)
    got = rows(report_sql(run), ns=namespace)
    # the command the summary prints runs as printed (here with this Python's eventlight)
    command = "\n".join(report_command(run)).replace(".venv/bin/eventlight", f"{sys.executable} -m eventlight.cli", 1)
    printed = await asyncio.to_thread(
        subprocess.run,
        ["bash", "-c", command],
        cwd=ROOT,
        env={**os.environ, **env_of(namespace)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert printed.returncode == 0 and f"{run}-step1" in printed.stdout, printed.stderr
    assert got == [
        {
            "checkpoint": f"{run}-step0",
            "mode": "val",
            "rewarded": 1,
            "mean_reward": "0.500",
            "failed": 0,
            "cancelled": 1,
        },
        {
            "checkpoint": f"{run}-step1",
            "mode": "train",
            "rewarded": 2,
            "mean_reward": "0.500",
            "failed": 1,
            "cancelled": 1,
        },
    ]


def test_a_partial_held_out_evaluation_is_no_result(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """A demo whose held-out rollouts were cancelled under it (a second demo in its namespace)
    evaluated step 0 on 8 of 73 items, then printed ``nan`` for a split, concluded "peaked at …; a
    lower --lr keeps the gain", and exited 0. Now each partial evaluation is a warning, its reward
    says how few items it had (``no result`` for a split it lacks), no conclusion is drawn, and the
    run exits 1. The warning names the cause the ``eval`` event knows (it guessed "was another demo
    running in this namespace?" when the evaluation had timed out under load), the count of
    rollouts parts failed from given up on (it said "10 failed or unfinished" beside a table with 0
    failed), and the last line is a sentence."""
    from types import SimpleNamespace

    import examples.arithmetic.train_grpo as demo

    def no_cli(*args: Any, **kwargs: Any) -> Any:
        raise OSError("not in this test")

    monkeypatch.setattr(demo.subprocess, "run", no_cli)
    run = "run-20261207-101010-ab12"
    evals = [
        {
            "version": f"{run}-step0",
            "n": 8,
            "asked": 73,
            "unfinished": 60,
            "timeout_s": 600.0,
            "cancelled": 5,
            "cancelled_by": {"left queued by an earlier demo run": 5},
            "mean_reward": 0.25,
            "by_split": {"2-digit": 0.25},
        },
        {"version": f"{run}-step4", "n": 73, "asked": 73, "mean_reward": 0.643, "by_split": {"1-digit": 0.6}},
        {"version": f"{run}-step8", "n": 73, "asked": 73, "mean_reward": 0.3, "by_split": {"1-digit": 0.3}},
    ]
    counters = {"rollouts_enqueued": 100, "failed_rollouts": 0, "unfinished_rollouts": 10, "spans_read": 9}
    steps = [{"step": 1, "trained": True, "step_s": 5.0}]
    grpo = SimpleNamespace(
        evals=evals, counters=counters, steps=steps, versions=[f"{run}-step8"], checkpoint_dir=None, policy=None
    )
    for event in evals:
        demo.on_progress({"event": "eval", "step": 0, **event})
    code = demo.report(None, grpo, run, 1.0)  # type: ignore[arg-type]
    out, err = capsys.readouterr()
    assert code == 1 and err.strip() == (
        f"error: run {run}: 1 of its 3 held-out evaluations got fewer results than they asked for, so the "
        "held-out rewards above are not comparable and no conclusion is drawn"
    )
    warning = (
        f"warning: the held-out evaluation at {run}-step0 got 8 of 73 results (60 did not finish within 600 s "
        "and were cancelled, likely as the machine was too busy or slow for them: fewer --eval-items ask less; 5 were "
        "cancelled before they ended (left queued by an earlier demo run)); its reward is not comparable"
    )
    assert out.count(warning) == 2  # as it ran; summary
    assert "another demo" not in out
    assert "rollouts recorded   : 100 this run (0 failed, 10 not finished when their step stopped waiting" in out
    assert f"held-out reward, {run}-step0" in out and "0.250 (only 8 of 73 items)" in out
    assert "1-digit              no result -> 0.300" in out and "2-digit              0.250 -> no result" in out
    assert "nan" not in out and "peaked" not in out


def test_the_summary_says_what_was_skipped_and_wraps_its_sql_command(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The summary printed what GRPO skipped as a raw dict (``{'zero_advantage': 12, ...}``) and
    its ``eventlight sql`` command on one 470-character line. Now the counts are in words, most
    first, and the command is a clause a line, continued with backslashes, passing bash the same
    query as ``report_sql``."""
    from collections import Counter
    from types import SimpleNamespace

    import examples.arithmetic.train_grpo as demo

    def no_cli(*args: Any, **kwargs: Any) -> Any:
        raise OSError("not in this test")

    monkeypatch.setattr(demo.subprocess, "run", no_cli)
    run = "run-20261207-101010-ab12"
    evals = [
        {"version": f"{run}-step0", "n": 4, "asked": 4, "mean_reward": 0.25, "by_split": {"1-digit": 0.25}},
        {"version": f"{run}-step1", "n": 4, "asked": 4, "mean_reward": 0.5, "by_split": {"1-digit": 0.5}},
    ]
    counters = Counter(rollouts_enqueued=40, spans_read=80, failed_rollouts=2, zero_advantage=12)  # as GRPO's
    steps = [{"step": 1, "trained": True, "step_s": 5.0}]
    grpo = SimpleNamespace(
        evals=evals, counters=counters, steps=steps, versions=[f"{run}-step1"], checkpoint_dir=None, policy=None
    )
    assert demo.report(None, grpo, run, 1.0) == 0  # type: ignore[arg-type]
    monkeypatch.undo()  # subprocess.run again, for bash below
    out = capsys.readouterr().out
    assert (
        "  skipped             : 12 rollouts with zero advantage (their group's rewards all equal), 2 failed rollouts\n"
        in out
    )
    lines = out.splitlines()
    start = lines.index("  run it yourself:") + 2  # after `eventlight up`
    end = lines.index("    .venv/bin/eventlight down")
    command = [line.removeprefix("    ") for line in lines[start:end]]
    assert len(command) > 1 and max(map(len, lines[start:end])) <= 100, command
    argv = subprocess.run(
        ["bash", "-c", "printf '%s\\0' " + "\n".join(command)], capture_output=True, text=True, check=True
    ).stdout.split("\0")[:-1]
    assert argv == [".venv/bin/eventlight", "sql", demo.report_sql(run)]
    assert demo.skipped_line({"rollouts_enqueued": 3, "spans_read": 1}) == "nothing"


def test_a_run_whose_step_updated_trained_however_many_rollouts_were_cancelled(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """``--steps 1`` under load: step 1's update ran and wrote its checkpoint, but 130 of the 178
    rollouts (held-out ones of both evaluations) timed out and were cancelled, and the demo ended on
    "did not train: 178 rollouts, 130 failed or unfinished", with no summary and no "nothing above
    is a result". A run with a step that updated trained: the summary comes, with its partial
    evaluations' warnings, and exit 1; a run with none says so, counting cancelled apart from
    failed, and ends with the line the README promises."""
    from types import SimpleNamespace

    import examples.arithmetic.train_grpo as demo

    def no_cli(*args: Any, **kwargs: Any) -> Any:
        raise OSError("not in this test")

    monkeypatch.setattr(demo.subprocess, "run", no_cli)
    monkeypatch.setattr(demo, "_said", 3)  # progress lines came before
    run = "run-20261207-101010-cd34"
    partial_eval = {"n": 0, "asked": 73, "unfinished": 73, "timeout_s": 600.0, "cancelled": 0, "cancelled_by": {}}
    evals = [
        {"version": f"{run}-step0", **partial_eval, "mean_reward": float("nan"), "by_split": {}},
        {"version": f"{run}-step1", **partial_eval, "n": 16, "mean_reward": 0.1, "by_split": {"1-digit": 0.1}},
    ]
    counters = {"rollouts_enqueued": 178, "failed_rollouts": 0, "unfinished_rollouts": 130, "spans_read": 9}
    grpo = SimpleNamespace(
        evals=evals,
        counters=counters,
        steps=[{"step": 1, "trained": True, "step_s": 113.0}],
        versions=[f"{run}-step1"],
        checkpoint_dir=None,
        policy=None,
        config=SimpleNamespace(rollout_timeout_s=600.0),
    )
    assert demo.report(None, grpo, run, 1.0) == 1  # type: ignore[arg-type]
    out, err = capsys.readouterr()
    assert "did not train" not in err and "eventlight demo: GRPO" in out
    assert f"warning: the held-out evaluation at {run}-step0 got 0 of 73 results" in out
    assert err.startswith(f"error: run {run}: 2 of its 2 held-out evaluations got fewer results")

    grpo.steps = [{"step": 1, "trained": False, "step_s": 0.0}]
    assert demo.report(None, grpo, run, 1.0) == 1  # type: ignore[arg-type]
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"error: run {run} did not train: none of its 1 step(s) had anything to learn; "
        "178 rollouts: 0 failed, 130 not finished within 600 s and cancelled",
        "the run did not train; nothing above is a result",
    ]


def test_the_printed_commands_name_a_namespace_other_than_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """With EVENTLIGHT_NAMESPACE=demo4 the summary's "run it yourself" ``eventlight sql …`` and its
    ``--resume`` hint left the namespace out: the sql then read the default namespace's 0 rows, and
    the resume recorded into another namespace. Both, and an interrupted run's last line, name it."""
    from types import SimpleNamespace

    import examples.arithmetic.train_grpo as demo
    from examples.demo import _make_demo

    monkeypatch.setattr(demo.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout="(0 rows)\n"))
    monkeypatch.setenv("EVENTLIGHT_NAMESPACE", "demo4")
    monkeypatch.setenv("EVENTLIGHT_STATE_DIR", str(tmp_path))
    run = "run-20261207-101010-ef56"
    full = {"n": 73, "asked": 73, "mean_reward": 0.5, "by_split": {"1-digit": 0.5}}
    grpo = SimpleNamespace(
        evals=[{"version": f"{run}-step0", **full}, {"version": f"{run}-step1", **full}],
        counters={"rollouts_enqueued": 105, "failed_rollouts": 0, "unfinished_rollouts": 0, "spans_read": 9},
        steps=[{"step": 1, "trained": True, "step_s": 5.0}],
        versions=[f"{run}-step1"],
        checkpoint_dir=tmp_path / "checkpoints" / run,
        policy=None,
    )
    assert demo.report(None, grpo, run, 1.0) == 0  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "\n    ".join(demo.report_command(run, "demo4")) in out
    assert demo.report_command(run, "demo4")[0].startswith('.venv/bin/eventlight sql -N demo4 "SELECT')
    assert f"--resume {run} --steps N with EVENTLIGHT_NAMESPACE=demo4 continues" in out
    step1 = tmp_path / "checkpoints" / run / "step-00001"
    step1.mkdir(parents=True)
    (step1 / "state.json").write_text(json.dumps({"step": 1, "version": f"{run}-step1"}))
    (step1.parent / "LATEST").write_text(step1.name)
    line = demo.interrupted(run, ["--steps", "2"], _make_demo)
    assert line.endswith(f'to continue it: EVENTLIGHT_NAMESPACE=demo4 make demo ARGS="--steps 2 --resume {run}"')
    monkeypatch.delenv("EVENTLIGHT_NAMESPACE")
    assert demo.report(None, grpo, run, 1.0) == 0  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "\n    ".join(demo.report_command(run)) in out and " -N " not in out and "EVENTLIGHT_NAMESPACE" not in out


def test_the_step_line_says_how_many_rollouts_had_a_nonzero_advantage(capsys: Any) -> None:
    """ "step  1: train reward 0.083, 8 sequences trained (8 without signal)" read as if the 8 trained
    had no signal: the 8 were other rollouts, tied with their group. The line now says how many of
    the step's rollouts had a nonzero advantage, why the others taught nothing, and the sequences
    trained."""
    from examples.arithmetic.train_grpo import on_progress

    step = {"event": "step", "step": 1, "train_reward": 0.083, "loss": 0.058, "rollout_s": 487.0, "step_s": 113.0}
    on_progress({**step, "rollouts": 16, "sequences": 8, "skipped": {"zero_advantage": 8}})
    skipped = {"zero_advantage": 24, "failed_rollouts": 2, "no_reward": 1}
    on_progress({**step, "step": 2, "rollouts": 32, "sequences": 0, "skipped": skipped, "loss": float("nan")})
    late = {"rollouts": 20, "asked": 32, "unfinished": 12, "timeout_s": 600.0, "sequences": 4}
    on_progress({**step, "step": 3, **late, "skipped": {"zero_advantage": 16}})
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        "step  1: train reward 0.083, 8 of 16 rollouts had a nonzero advantage (8 scored the same as their whole "
        "group), 8 sequences trained, loss 0.058, rollouts 487 s, update 113.0 s",
        "step  2: train reward 0.083, 5 of 32 rollouts had a nonzero advantage (24 scored the same as their whole "
        "group, 3 failed or gave no reward), 0 sequences trained, loss   n/a, rollouts 487 s, update 113.0 s",
        "step  3: train reward 0.083, 4 of 32 rollouts had a nonzero advantage (16 scored the same as their whole "
        "group, 12 did not finish within 600 s and were cancelled), 4 sequences trained, loss 0.058, rollouts "
        "487 s, update 113.0 s",
    ]


def test_a_timed_out_held_out_evaluation_is_one_statement(capsys: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Step 0's evaluation timed out under load and the demo said so three times, two of them read as
    contradictory: GRPO's WARNING "(73 did not finish within rollout_timeout_s=600 s; 0 were
    cancelled before they ended)", the demo's "(73 did not finish within 600 s and were cancelled …)"
    and "held-out reward no result (only 0 of 73 items) at …-step0 (0 items: none)". Now the demo
    prints one line, GRPO's line (at INFO when a progress callback reports the event) says the
    timed-out ones were cancelled, and a partial evaluation with results gives them on that line."""
    from eventlight.algorithm.grpo import GRPO, GRPOConfig
    from examples.arithmetic.train_grpo import on_progress

    grpo = GRPO(GRPOConfig(steps=1), progress=on_progress)
    grpo.set_store(agl.InMemoryLightningStore())
    with caplog.at_level("INFO", logger="eventlight.algorithm.grpo"):
        asyncio.run(grpo._report_eval(0, "run-x-step0", [], 73))
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert "73 did not finish within rollout_timeout_s=600 s and were cancelled; 0 others" in caplog.text
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        "warning: the held-out evaluation at run-x-step0 got 0 of 73 results (73 did not finish within 600 s and "
        "were cancelled, likely as the machine was too busy or slow for them: fewer --eval-items ask less); "
        "no held-out reward"
    ]
    some = {
        "n": 8,
        "asked": 73,
        "unfinished": 65,
        "timeout_s": 600.0,
        "mean_reward": 0.25,
        "by_split": {"1-digit": 0.25},
    }
    on_progress({"event": "eval", "step": 4, "version": "run-x-step4", **some})
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 1 and lines[0].endswith(
        "fewer --eval-items ask less); its reward is not comparable: 0.250 over those 8 (1-digit 0.250)"
    )


class _NoModel:
    """A policy with no model: ``call`` runs the function (GRPO's checkpoint, with no folder to write)."""

    async def call(self, fn: Any, /, *args: Any) -> Any:
        return fn(*args)


def test_a_step_that_gave_up_on_its_rollouts_is_one_statement(capsys: Any, caplog: pytest.LogCaptureFixture) -> None:
    """GRPO's WARNING "GRPO step 0: 73 of its rollouts (73 held-out) did not finish within
    rollout_timeout_s=600 s; cancelled 73 of them …" still came beside the demo's evaluation line
    saying the same. With a progress callback, which gets the count (the ``eval`` event's
    ``unfinished`` for held-out rollouts, the ``step`` event's for training ones), GRPO's line is
    INFO, as is its "nothing to train on (…)" when the step event says why; the demo's step line
    counts the training rollouts its wait gave up on."""
    from eventlight.algorithm.grpo import GRPO, GRPOConfig
    from examples.arithmetic.train_grpo import on_progress

    async def give_up() -> None:
        store = agl.InMemoryLightningStore()
        grpo = GRPO(GRPOConfig(steps=2, rollout_timeout_s=0.2), policy=_NoModel(), progress=on_progress)
        grpo.set_store(store)
        ids = [(await store.enqueue_rollout({"q": i}, metadata={"group": 0})).rollout_id for i in range(3)]
        assert await grpo._wait(ids, 1, held_out=ids[2:]) == {}  # no runner: none ends
        assert grpo._cancelled == set(ids)
        await grpo._report_eval(1, "run-x-step1", [], 1)
        assert not await grpo._train(1, "run-x-step1", [], 0.2, asked=2, cancelled=2)

    with caplog.at_level("INFO", logger="eventlight.algorithm.grpo"):
        asyncio.run(give_up())
    assert [r.levelname for r in caplog.records] == ["INFO"] * 3, caplog.text
    assert "GRPO step 1: 3 of its rollouts (1 held-out) did not finish within rollout_timeout_s=0.2 s" in caplog.text
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert lines[0].startswith("warning: the held-out evaluation at run-x-step1 got 0 of 1 results (1 did not finish")
    assert lines[1:] == [
        "step  2: train reward   n/a, 0 of 2 rollouts had a nonzero advantage (2 did not finish within 0.2 s and were "
        "cancelled), 0 sequences trained, loss   n/a, rollouts 0 s, update 0.0 s"
    ]


async def test_the_demo_says_what_it_waits_for_while_it_starts(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """126 s passed without a line after "loading SmolLM2-135M-Instruct … starting 8 runners…" on a
    loaded machine. Until GRPO's first progress event, the demo now says every 30 s what it waits
    for: the model's load, then the policy server and runners; the first event ends those lines."""
    from types import SimpleNamespace

    import examples.arithmetic.train_grpo as demo

    monkeypatch.setattr(demo, "STARTING_LINE_EVERY_S", 0.01)
    lines_said: asyncio.Queue[str] = asyncio.Queue()
    say = demo.say

    def said(text: str) -> None:
        say(text)
        lines_said.put_nowait(text)

    monkeypatch.setattr(demo, "say", said)
    grpo = SimpleNamespace(policy=None)
    starting = asyncio.ensure_future(demo._while_starting(grpo, 8))
    await lines_said.get()
    grpo.policy = object()
    while not (await lines_said.get()).startswith("the model is loaded"):
        pass
    demo.on_progress({"event": "enqueued", "step": 0, "version": "run-x-step0", "total": 105, "held_out": 73})
    await asyncio.wait_for(starting, 60)  # it ends on the first event
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert lines[0].startswith("still loading SmolLM2-135M-Instruct after 0 s; then the policy server and 8 runners")
    assert lines[-2].startswith("the model is loaded; waiting for the policy server and 8 runners to start")
    assert lines[-1].startswith("step  0: 32 training and 73 held-out evaluation rollouts enqueued")


def test_the_demo_reports_an_update_in_progress(capsys: Any) -> None:
    """An update of 113 s printed nothing: GRPO's ``updating`` events are a line each."""
    from examples.arithmetic.train_grpo import on_progress

    update = {"sequences": 24, "micro_batches": 3, "micro_batches_done": 1, "elapsed_s": 30.2}
    on_progress({"event": "updating", "step": 1, **update})
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert lines == ["step  1: updating the weights on 24 sequences, 1 of 3 micro-batches done after 30 s"]


def test_the_rollouts_progress_line_says_what_its_numbers_count(capsys: Any) -> None:
    """ "step  4: 40 of 105 rollouts finished" did not say that 73 of the 105 were the held-out
    evaluation's items, not training samples. The line now counts each apart when a step has both,
    and names the kind when it has one."""
    from examples.arithmetic.train_grpo import on_progress

    both = {"finished": 40, "total": 105, "held_out": 73, "held_out_finished": 10, "elapsed_s": 62.4}
    on_progress({"event": "rollouts", "step": 4, **both})
    on_progress({"event": "rollouts", "step": 1, "finished": 20, "total": 32, "held_out": 0, "elapsed_s": 31})
    unread = {"finished": None, "total": 73, "held_out": 73, "held_out_finished": None, "elapsed_s": 5}
    on_progress({"event": "rollouts", "step": 8, **unread})
    on_progress({"event": "rollouts", "step": 0, **both, "finished": None, "held_out_finished": None})
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        "step  4: 40 of 105 rollouts finished after 62 s: 30 of 32 training, 10 of 73 held-out evaluation",
        "step  1: 20 of 32 training rollouts finished after 31 s",
        "step  8: ? of 73 held-out evaluation rollouts finished after 5 s",
        "step  0: ? of 105 rollouts finished after 62 s: ? of 32 training, ? of 73 held-out evaluation",
    ]


_STOPPING_DEMO = """
import asyncio, sys
sys.path.insert(0, {root!r})
from examples import demo
import examples.{module} as script
from eventlight.trainer_guards import ctrl_c_again_hurries

class Pool:  # the trainer's runners: their stop begins once the cancel reaches them
    stopping = False

    def hurry(self):
        print("hurried", flush=True)

async def main(args):  # the demo's run, short of servers and a model: it stops in order when cancelled
    pool = Pool()
    with ctrl_c_again_hurries(pool):
        print("running", flush=True)
        try:
            await asyncio.sleep(120)
        except asyncio.CancelledError:
            print("cancelled", flush=True)
            await asyncio.to_thread(sys.stdin.readline)  # meanwhile the test's second SIGTERM (make's relay)
            pool.stopping = True
            await asyncio.sleep(0.5)  # the runners' grace, the model, the servers
            print("stopped in order", flush=True)
            raise

script.main = main
raise SystemExit(demo.main(["--algorithm", {algorithm!r}]))
"""


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["sigint", "sigint-ignored"])
@pytest.mark.parametrize(
    ("algorithm", "module", "says"),
    [
        ("grpo", "arithmetic.train_grpo", "stopped before its first checkpoint"),
        ("apo", "room_booking.train_apo", "interrupted"),
    ],
)
def test_sigterm_to_the_process_group_stops_the_demo_as_ctrl_c_does(
    algorithm: str, module: str, says: str, sigint_ignored: bool, tmp_path: Path
) -> None:
    """``kill -TERM -- -PGID`` ended ``make demo`` at once (exit 143 from the default action): no
    ``interrupted:`` line, NATS and Postgres left running, rollouts left queued and claimed, stale
    leases. A SIGTERM now cancels the run as Ctrl+C does (its orderly stop, the same last line),
    and the demo exits 143.

    ``make`` relays that SIGTERM to the demo: a second one, before the runners began to stop. It
    reached ``asyncio.run``'s handler (``KeyboardInterrupt``: every task cancelled at once; with
    SIGINT ignored, the run cancelled again), so GRPO's policy server stopped under the runners'
    attempts, which failed with its 503. It is the same stop now."""
    import signal

    script = tmp_path / "stopping_demo.py"
    root = str(Path(__file__).resolve().parents[1])
    script.write_text(_STOPPING_DEMO.format(root=root, module=module, algorithm=algorithm))
    env = {**os.environ, "EVENTLIGHT_STATE_DIR": str(tmp_path / "state")}

    def sigint_state() -> None:  # a background job of a script ignores SIGINT; a terminal's does not
        signal.signal(signal.SIGINT, signal.SIG_IGN if sigint_ignored else signal.SIG_DFL)

    proc = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=sigint_state,
    )  # fmt: skip
    try:
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline() == "running\n"
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.stdout.readline() == "cancelled\n"
        os.kill(proc.pid, signal.SIGTERM)  # make's relay, before the runners began to stop
        proc.stdin.write("\n")
        proc.stdin.flush()
        out, errors = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, errors
    assert out == "stopped in order\n", out + errors
    assert says in errors.splitlines()[-1] and "Traceback" not in errors, errors


@pytest.mark.parametrize("algorithm", ["grpo", "apo"])
@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("EVENTLIGHT_NATS_URL", "http://x", "error: nats_url (EVENTLIGHT_NATS_URL): "),
        ("EVENTLIGHT_DURABILITY", "bogus", "error: durability must be one of "),
        ("EVENTLIGHT_STREAM_REPLICAS", "0", "error: stream_replicas must be 1 to 5 (JetStream's limit; EVENTLIGHT_"),
    ],
)
def test_a_refused_setting_exits_2_as_a_refused_option(
    algorithm: str, name: str, value: str, says: str, tmp_path: Path
) -> None:
    """``EVENTLIGHT_NATS_URL=http://x make demo`` (``EVENTLIGHT_DURABILITY=bogus``) exited 1, as a run
    that failed, where ``eventlight`` exits 2 for the same value and the demo 2 for a refused option:
    input refused before anything starts exits 2, in one error line naming the variable."""
    env = {
        **os.environ,
        "EVENTLIGHT_STATE_DIR": str(tmp_path),
        "EVENTLIGHT_NATS_URL": f"nats://127.0.0.1:{closed_port()}",
        "EVENTLIGHT_PG_DSN": f"postgresql://postgres@127.0.0.1:{closed_port()}/postgres",
        name: value,
    }
    done = subprocess.run(
        [sys.executable, str(DEMO), "--algorithm", algorithm], env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(says) and name in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("algorithm", ["grpo", "apo"])
def test_a_log_level_no_logger_knows_is_a_warning_not_a_traceback(algorithm: str, tmp_path: Path) -> None:
    """``EVENTLIGHT_LOG_LEVEL=bogus make demo`` ended in logging's ``ValueError: Unknown level``
    traceback; it warns, with the value as typed, as ``eventlight`` does, and goes on (here to a
    refused option, exit 2)."""
    env = {**os.environ, "EVENTLIGHT_STATE_DIR": str(tmp_path), "EVENTLIGHT_LOG_LEVEL": "bogus"}
    option = ["--steps", "0"] if algorithm == "grpo" else ["--rounds", "-1"]
    done = subprocess.run(
        [sys.executable, str(DEMO), "--algorithm", algorithm, *option], env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[0] == "warning: EVENTLIGHT_LOG_LEVEL='bogus' is not a log level; using WARNING"


def test_resume_of_a_run_without_a_checkpoint_is_one_error_line(tmp_path: Path) -> None:
    """``make demo ARGS="--resume run-nope"`` printed its error and then "the run stopped before it
    could train; nothing above is a result", with nothing above. The error line is all now."""
    env = {
        **os.environ,
        "EVENTLIGHT_STATE_DIR": str(tmp_path),
        "EVENTLIGHT_NATS_URL": f"nats://127.0.0.1:{closed_port()}",
        "EVENTLIGHT_PG_DSN": f"postgresql://postgres@127.0.0.1:{closed_port()}/postgres",
    }
    done = subprocess.run(
        [sys.executable, str(DEMO), "--resume", "run-nope"], env=env, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 2  # refused input, as a refused option, done.stdout + done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: --resume run-nope: no checkpoint of that run"), done.stderr


def test_resume_of_a_run_that_has_its_steps_is_one_error_line(tmp_path: Path) -> None:
    """``--steps 1 --resume <run>`` of a run that finished its 1 step started the servers, loaded the
    model and evaluated its checkpoint again (73 more rollouts in its summary), then ended with "did
    not train: no step ran", exit 1. It is refused in one line before anything starts (the servers
    named here do not answer)."""
    run = "run-20261207-000000-abcd"
    step = tmp_path / "checkpoints" / run / "step-00001"
    step.mkdir(parents=True)
    (step / "state.json").write_text(json.dumps({"step": 1, "version": f"{run}-step1"}))
    (step.parent / "LATEST").write_text(step.name)
    env = {
        **os.environ,
        "EVENTLIGHT_STATE_DIR": str(tmp_path),
        "EVENTLIGHT_NATS_URL": f"nats://127.0.0.1:{closed_port()}",
        "EVENTLIGHT_PG_DSN": f"postgresql://postgres@127.0.0.1:{closed_port()}/postgres",
    }
    done = subprocess.run(
        [sys.executable, str(DEMO), "--steps", "1", "--resume", run], env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2  # refused input, as a refused option, done.stdout + done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr == (
        f"error: --resume {run}: that run already has 1 step(s) (checkpoint step1) and --steps 1 asks for no more; "
        "give --steps 2 or more to train it further\n"
    ), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # nothing started, no lease taken


async def test_a_run_that_finished_its_steps_keeps_no_optimizer_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that finished its steps but exited 1 (its held-out evaluation was partial) kept
    optimizer.pt (1.08 GB) beside its weights: only a report of 0 dropped it. Finishing the steps
    drops it, whatever the report says."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import contextlib
    from types import SimpleNamespace

    import eventlight.algorithm.grpo as grpo_module
    from examples.arithmetic import train_grpo

    monkeypatch.setenv("EVENTLIGHT_STATE_DIR", str(tmp_path))
    dropped: list[Path] = []

    class Policy:
        def drop_optimizer_state(self, checkpoint_dir: Path) -> None:
            dropped.append(checkpoint_dir)

    class GRPO:  # the run's steps, all done
        def __init__(self, config: Any, *, checkpoint_dir: Path, **kwargs: Any) -> None:
            self.policy, self.checkpoint_dir = Policy(), checkpoint_dir

    class Trainer:
        def __init__(self, **kwargs: Any) -> None:
            pass

        async def fit_async(self, *args: Any, **kwargs: Any) -> None:
            pass

    @contextlib.asynccontextmanager
    async def use_services(settings: Any, what: str) -> Any:
        yield SimpleNamespace(nats_url="", pg_dsn="")

    async def no_leftovers(*args: Any) -> int:
        return 0

    monkeypatch.setattr(grpo_module, "GRPO", GRPO)
    monkeypatch.setattr(train_grpo.agl, "use_services", use_services)
    monkeypatch.setattr(train_grpo.agl, "Trainer", Trainer)
    monkeypatch.setattr(train_grpo.agl, "LLMProxy", lambda: None)
    monkeypatch.setattr(train_grpo, "cancel_leftovers", no_leftovers)
    monkeypatch.setattr(train_grpo, "report", lambda *args: 1)  # a partial held-out evaluation: exit 1
    args = train_grpo.parse_args(["--n-runners", "1"])
    assert await train_grpo.train(args) == 1
    assert dropped == [tmp_path / "checkpoints" / args.run_id]


def test_the_demo_says_when_a_steps_rollouts_are_enqueued(capsys: Any) -> None:
    """Two minutes passed without a line between "loading SmolLM2 … starting 8 runners" and the
    first progress line: the step's rollouts, once enqueued, are a line of their own."""
    from examples.arithmetic.train_grpo import on_progress

    on_progress({"event": "enqueued", "step": 0, "version": "run-x-step0", "total": 105, "held_out": 73})
    on_progress({"event": "enqueued", "step": 1, "version": "run-x-step1", "total": 32, "held_out": 0})
    on_progress({"event": "enqueued", "step": 8, "version": "run-x-step8", "total": 73, "held_out": 73})
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        "step  0: 32 training and 73 held-out evaluation rollouts enqueued (run-x-step0); the runners are at work",
        "step  1: 32 training rollouts enqueued (run-x-step1); the runners are at work",
        "step  8: 73 held-out evaluation rollouts enqueued (run-x-step8); the runners are at work",
    ]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_says_what_it_installs_before_each_long_install() -> None:
    """A first ``make demo``: pip's ``--quiet`` installs left 40–160 s without a line, and setuptools'
    "Editable installation." box came twice (once per ``-e`` install). Each install of packages is
    now announced by a line saying what it installs and about how long it takes, and pip runs with a
    filter of that one warning (not with stderr thrown away). ``make -n -B``: every recipe of every
    install target, printed, none run."""
    root = Path(__file__).resolve().parents[1]
    targets = ["local", "rl", "sft", "verl", "frameworks", ".venv/.installed-dev"]
    done = subprocess.run(
        ["make", "-n", "-B", "--no-print-directory", "-C", str(root), *targets],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    said = ""  # the last "Installing …" line of the recipe
    installs = 0
    for line in lines:
        if line.startswith("touch "):  # a recipe's end
            said = ""
        elif line.startswith('echo "Installing '):
            said = line
        elif " pip install " in line and "--upgrade pip" not in line and '--no-deps "$wheel"' not in line:
            installs += 1
            assert said and "minute" in said, f"no line says what this installs and how long: {line}"
            assert "-W 'ignore:Editable installation:UserWarning' -m pip install" in line, line
    assert installs >= 7, done.stdout


def test_a_sigterm_is_named_as_what_cancelled_the_run(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """A SIGTERM was reported as "the run was cancelled (Ctrl+C?)": the demo's SIGTERM handler
    notes the signal, and the trainer's line names it."""
    import logging
    import signal

    import eventlight.trainer_guards as guards
    from eventlight.trainer import Trainer
    from examples.interrupt import TermAsInterrupt

    monkeypatch.setattr(guards, "_stop_signal", None)
    with caplog.at_level(logging.WARNING, logger="eventlight.trainer"):
        Trainer._say_runners_stop_first(True, 8, 10.0)
    assert "the run was cancelled (Ctrl+C?): stopping its 8 runner(s)" in caplog.text
    assert "(Ctrl+C again: at once)" in caplog.text
    caplog.clear()
    seen: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        TermAsInterrupt()._on_term(signal.SIGTERM, None)  # handed to the SIGINT handler in place
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [signal.SIGINT]
    with caplog.at_level(logging.WARNING, logger="eventlight.trainer"):
        Trainer._say_runners_stop_first(True, 8, 10.0)
    assert "the run was cancelled (SIGTERM): stopping its 8 runner(s)" in caplog.text, caplog.text
    assert "(Ctrl+C or SIGTERM again: at once)" in caplog.text
    assert guards.stopped_early_reason(asyncio.CancelledError()) == "the run stopped early: it was cancelled (SIGTERM)"


def test_the_first_line_says_how_many_are_held_out_and_how_many_evaluated() -> None:
    """``--eval-items 8`` began "GRPO on 227 sums, 8 held out" though 73 are held out and 8 of them
    evaluated (and ``--eval-items 100`` was clamped to 73 unsaid: now refused, see above)."""
    from examples.arithmetic.train_grpo import N_HELD_OUT, first_line, parse_args

    assert N_HELD_OUT == 73
    assert first_line(227, 73, 73) == "GRPO on 227 sums, 73 held out"
    assert first_line(227, 8, 73) == "GRPO on 227 sums, 73 held out, 8 of them evaluated"
    assert parse_args(["--eval-items", "73"]).eval_items == 73


def test_the_sql_note_of_a_partial_evaluation_claims_no_late_results(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """After a partial evaluation the note under the SQL table said the rewarded count held "some
    [rollouts] after a partial evaluation above stopped waiting", also where it had none (step 0:
    0 rewarded). It says what the count holds, without claiming any."""
    from types import SimpleNamespace

    import examples.arithmetic.train_grpo as demo

    run = "run-20261207-101010-ab12"
    table = f" checkpoint | mode | rewarded\n {run}-step0 | val | 0"
    monkeypatch.setattr(demo.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, table, ""))
    evals = [
        {"version": f"{run}-step0", "n": 0, "asked": 73, "unfinished": 73, "timeout_s": 600.0, "cancelled": 0,
         "cancelled_by": {}, "mean_reward": float("nan"), "by_split": {}},
        {"version": f"{run}-step1", "n": 73, "asked": 73, "mean_reward": 0.4, "by_split": {"1-digit": 0.4}},
    ]  # fmt: skip
    counters = {"rollouts_enqueued": 100, "failed_rollouts": 0, "unfinished_rollouts": 73, "spans_read": 9}
    grpo = SimpleNamespace(
        evals=evals, counters=counters, steps=[{"step": 0, "trained": True, "step_s": 5.0}],
        versions=[f"{run}-step1"], checkpoint_dir=None, policy=None,
    )  # fmt: skip
    assert demo.report(None, grpo, run, 1.0) == 1  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert f"{run}-step0 | val | 0" in out and "some after" not in out
    assert "those that ended after a partial evaluation above stopped waiting too, if any" in out
