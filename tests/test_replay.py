"""``eventlight replay``: the log (never the read models) → selected attempts → adapter → records.

Runs on real NATS for the JetStream log and on the in-memory log; the CLI is run as a user runs it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

import eventlight
from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.core.types import Span, Triplet
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.memory import InMemoryLightningStore
from tests.replay_adapters import AdaptOnly
from tests.test_cli import ROOT, assert_one_line_error, cli, env_of


def llm_span(rid: str, aid: str, seq: int, text: str, start: float) -> Span:
    return Span.from_attributes(
        attributes={
            "gen_ai.prompt.0.role": "user",
            "gen_ai.prompt.0.content": f"q {text}",
            "gen_ai.completion.0.role": "assistant",
            "gen_ai.completion.0.content": f"a {text}",
            "gen_ai.response.id": f"resp-{aid}-{seq}",
            "prompt_token_ids": [1, 2, seq],
            "response_token_ids": [3, seq],
        },
        rollout_id=rid,
        attempt_id=aid,
        sequence_id=seq,
        name="openai.chat.completion",
        start_time=start,
        end_time=start + 1,
    )


def reward_span(rid: str, aid: str, seq: int, value: float, start: float) -> Span:
    return Span.from_attributes(
        attributes={"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": value},
        rollout_id=rid,
        attempt_id=aid,
        sequence_id=seq,
        name="agentlightning.annotation",
        start_time=start,
        end_time=start,
    )


async def workload(store: Any) -> dict[str, str]:
    """Three rollouts: train succeeded (reward 0.9, two LLM calls), val succeeded (0.2), train failed."""
    res = await store.add_resources({"p": eventlight.PromptTemplate(template="v1 {x}")})
    ids: dict[str, str] = {}
    for name, mode, reward, status in (
        ("good", "train", 0.9, "succeeded"),
        ("val", "val", 0.2, "succeeded"),
        ("bad", "train", None, "failed"),
    ):
        r = await store.enqueue_rollout({"task": name}, mode=mode, resources_id=res.resources_id)
        d = await store.dequeue_rollout(worker_id="w1")
        assert d.rollout_id == r.rollout_id
        aid = d.attempt.attempt_id
        spans = [llm_span(r.rollout_id, aid, 1, name, 10.0), llm_span(r.rollout_id, aid, 2, name + "2", 12.0)]
        await store.add_many_spans(spans[:1])
        await store.add_many_spans(spans[1:])
        if reward is not None:
            await store.add_span(reward_span(r.rollout_id, aid, 3, reward, 14.0))
        await store.update_attempt(r.rollout_id, aid, status=status)
        ids[name] = r.rollout_id
    return ids


async def collect(run: Any) -> list[dict[str, Any]]:
    return [r async for r in run]


async def test_replay_on_memory_gives_triplets_with_provenance() -> None:
    async with InMemoryLightningStore() as store:
        ids = await workload(store)
        records = await collect(eventlight.replay(store, adapter="triplets"))
        # two LLM calls per attempt, in sequence order; the reward goes to the last call before it
        assert [(r["rollout_id"], r["index"]) for r in records] == [
            (ids[n], i) for n in ("good", "val", "bad") for i in (0, 1)
        ]
        good = records[1]
        assert good["prompt"]["token_ids"] == [1, 2, 2] and good["response"]["token_ids"] == [3, 2]
        assert good["reward"] == 0.9 and good["final_reward"] == 0.9 and records[0]["reward"] is None
        assert good["status"] == "succeeded" and good["mode"] == "train" and good["resources_version"] == 1
        assert good["attempt_seq"] < good["log_positions"][0] and len(good["log_positions"]) == 3
        msgs = await collect(eventlight.replay(store, adapter="messages", statuses="succeeded", modes="train"))
        assert len(msgs) == 2 and msgs[0]["messages"][-1] == {"role": "assistant", "content": "a good"}


async def test_filters_and_reward_relabelling() -> None:
    async with InMemoryLightningStore() as store:
        ids = await workload(store)
        kept = await collect(eventlight.replay(store, min_reward=0.5))
        assert {r["rollout_id"] for r in kept} == {ids["good"]}
        by_pos = await collect(eventlight.replay(store, since=kept[0]["attempt_seq"] + 1))
        assert {r["rollout_id"] for r in by_pos} == {ids["val"], ids["bad"]}

        def score(spans: list[Span]) -> float:  # a new reward on old rollouts: calls made
            return float(sum(s.name == "openai.chat.completion" for s in spans))

        relabelled = await collect(eventlight.replay(store, reward=score, statuses=["failed"]))
        assert [(r["reward"], r["final_reward"]) for r in relabelled] == [(None, 2.0), (2.0, 2.0)]


async def test_an_adapter_that_raises_on_one_attempt_is_reported_and_the_rest_replays() -> None:
    async with InMemoryLightningStore() as store:
        ids = await workload(store)

        def picky(spans: list[Span]) -> list[dict[str, Any]]:
            if any(s.rollout_id == ids["bad"] for s in spans):  # not a substring: random ids may hold "bad"
                raise RuntimeError("cannot adapt this one")
            return [{"n": len(spans)}]

        run = eventlight.replay(store, adapter=picky)
        records = await collect(run)
        assert [r["rollout_id"] for r in records] == [ids["good"], ids["val"]]
        assert len(run.errors) == 1 and run.errors[0].rollout_id == ids["bad"]
        assert "RuntimeError: cannot adapt this one" in run.errors[0].error and run.errors[0].attempt_id


@pytest.mark.parametrize(
    ("returned", "says"),
    [
        ("abc", "returned str 'abc'"),
        ({"a": 1}, "returned dict {'a': 1}"),
        (b"ab", "returned bytes b'ab'"),
        (None, "returned None"),
        (
            Triplet(prompt="p", response="r"),
            "returned Triplet Triplet(prompt='p', response='r', reward=None, metadata={})",
        ),
    ],
)
async def test_an_adapter_returning_no_list_of_items_fails_each_attempt(returned: Any, says: str) -> None:
    """A str or a dict was iterated: one record per character or per key, without a word."""
    async with InMemoryLightningStore() as store:
        await workload(store)
        run = eventlight.replay(store, adapter=lambda spans: returned)
        assert await collect(run) == []
    assert [e.error for e in run.errors] == [
        f"TypeError: the adapter {says}, expected a list of items (one record each)"
    ] * 3


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (float("nan"), "nan, expected a finite number or None"),
        (float("inf"), "inf, expected a finite number or None"),
        (float("-inf"), "-inf, expected a finite number or None"),
        (10**400, "1" + "0" * 56 + "..., too large for a float"),
        ("high", "str 'high', expected a number or None"),
        (True, "bool True, expected a number or None"),
    ],
    ids=["nan", "inf", "-inf", "huge-int", "str", "bool"],
)
async def test_a_reward_that_is_no_finite_number_fails_its_attempt(value: Any, says: str) -> None:
    """NaN or infinity from --reward became null with exit 0; from an adapter's ``reward`` field it
    was null in .jsonl and NaN in .parquet (and a string failed the whole .parquet replay)."""
    async with InMemoryLightningStore() as store:
        await workload(store)
        relabelled = eventlight.replay(store, reward=lambda spans: value)
        from_items = eventlight.replay(store, adapter=lambda spans: [{"n": 1, "reward": 1}, {"n": 2, "reward": value}])
        assert await collect(relabelled) == [] and await collect(from_items) == []
        whole = await collect(eventlight.replay(store, adapter=lambda spans: [{"reward": 1}, {"reward": None}]))
    assert all(f"the reward function returned {says}" in e.error for e in relabelled.errors), relabelled.errors
    assert all(f"the adapter's item 1 has reward {says}" in e.error for e in from_items.errors), from_items.errors
    assert len(relabelled.errors) == len(from_items.errors) == 3
    assert [r["reward"] for r in whole] == [1.0, None] * 3 and isinstance(whole[0]["reward"], float)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"adapter": "nope"}, "unknown adapter 'nope'"),
        ({"adapter": "no_such_module:f"}, "importing 'no_such_module' failed"),
        (
            {"adapter": "tests.replay_adapters:AdaptOnly"},
            "an instance of AdaptOnly is not callable",
        ),  # not once per attempt
        ({"adapter": AdaptOnly()}, "adapter: an instance of AdaptOnly is not callable"),
        ({"since": 10, "until": 3}, "bad range"),
        ({"since": "yesterday-ish"}, "neither a log position"),
        ({"since": "\u00b2"}, "neither a log position"),  # a digit to str.isdigit, not to int()
        ({"until": "\u0663"}, "neither a log position"),  # an Arabic-Indic 3: int() takes it; not a position
        ({"reward": "json:no_such_function"}, "has no attribute"),
        ({"min_reward": float("nan")}, "min_reward must be a finite number"),
        ({"min_reward": float("inf")}, "min_reward must be a finite number"),
        ({"min_reward": "0.5"}, "min_reward must be a finite number"),
        ({"llm_call_match": "chat ("}, "--llm-call-match 'chat (' is not a regular expression"),
        ({"adapter": "messages", "llm_call_match": "^chat "}, "the messages adapter does not pick LLM calls"),
        ({"adapter": "proxy-triplets", "llm_call_match": "^chat "}, "the proxy-triplets adapter does not pick"),
        ({"adapter": "tests.replay_adapters:picky", "llm_call_match": "^chat "}, "MODULE:CALLABLE or an object"),
        ({"adapter": AdaptOnly(), "llm_call_match": "^chat "}, "MODULE:CALLABLE or an object"),
    ],
)
def test_bad_arguments_fail_before_reading(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidInputError, match=says.replace("(", r"\(")):
        eventlight.replay(Settings(nats_url="nats://127.0.0.1:1"), **kwargs)


async def test_unreachable_nats_is_one_error() -> None:
    with pytest.raises(ServiceUnavailableError, match="not reachable"):
        await collect(eventlight.replay(Settings(nats_url="nats://127.0.0.1:1")))


async def last_seq(store: JetStreamLightningStore) -> int:
    info = await store.log.js.stream_info(store.log.stream)
    return int(info.state.last_seq)


async def test_jetstream_replay_reads_the_log_writes_nothing_and_matches_memory(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace) as store:  # no Postgres: the log alone
        await workload(store)
        before = await last_seq(store)
        run = eventlight.replay(namespace, adapter="triplets")
        records = await collect(run)
        assert await last_seq(store) == before, "a replay wrote to the log it read"
    assert run.stats.head_seq == before and run.stats.spans == 8 and len(records) == 6
    async with InMemoryLightningStore() as mem:
        await workload(mem)
        same = await collect(eventlight.replay(mem, adapter="triplets"))
    strip = (
        "rollout_id",
        "attempt_id",
        "resources_id",
        "attempt_seq",
        "log_positions",
        "metadata",
        "prompt",
        "response",
    )
    assert [{k: v for k, v in r.items() if k not in strip} for r in records] == [
        {k: v for k, v in r.items() if k not in strip} for r in same
    ]


async def test_old_event_shapes_replay_through_the_upcaster(namespace: Settings) -> None:
    """An ``AttemptUpdated`` v1 (a whole attempt snapshot) written straight to the stream is read
    as the v2 fact by the replay."""
    async with JetStreamLightningStore(namespace) as store:
        r = await store.enqueue_rollout({"task": "old"}, mode="train")
        d = await store.dequeue_rollout(worker_id="w1")
        aid = d.attempt.attempt_id
        await store.add_many_spans([llm_span(r.rollout_id, aid, 1, "old", 10.0)])
        attempt = msgspec.to_builtins(d.attempt)
        attempt.update(status="succeeded", end_time=20.0)
        v1 = {
            "type": "attempt_updated",
            "v": 1,
            "time": 20.0,
            "attempt": attempt,
            "rollout_status": "succeeded",
            "rollout_end_time": 20.0,
        }
        await store.log.js.publish(f"{store.log.prefix}.r.{r.rollout_id}.e", json.dumps(v1).encode())
    records = await collect(eventlight.replay(namespace, statuses=["succeeded"]))
    assert [(x["rollout_id"], x["status"]) for x in records] == [(r.rollout_id, "succeeded")]


def _read_all(path: Path) -> Any:
    import pandas as pd

    return pd.read_json(path, lines=True) if path.suffix == ".jsonl" else pd.read_parquet(path)


async def test_cli_replay_writes_the_same_bytes_twice_and_loads_everywhere(namespace: Settings, tmp_path: Path) -> None:
    async with JetStreamLightningStore(namespace) as store:
        await workload(store)
    env = env_of(namespace)
    for suffix in (".jsonl", ".parquet"):
        a, b = tmp_path / f"a{suffix}", tmp_path / f"b{suffix}"
        for out in (a, b):
            result = cli("replay", "--adapter", "triplets", "--status", "succeeded", "--out", str(out), env=env)
            assert result.returncode == 0, result.stderr
            assert "4 record(s) from 2 attempt(s)" in result.stdout
        assert a.read_bytes() == b.read_bytes(), f"{suffix}: same input, different bytes"
        frame = _read_all(a)
        assert len(frame) == 4 and set(frame["status"]) == {"succeeded"}
        assert {"rollout_id", "attempt_id", "resources_version", "final_reward", "log_positions"} <= set(frame.columns)
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "a.parquet").num_rows == 4
    datasets = pytest.importorskip("datasets")
    for kind, name in (("json", "a.jsonl"), ("parquet", "a.parquet")):
        ds = datasets.load_dataset(kind, data_files=str(tmp_path / name), split="train", cache_dir=str(tmp_path / "hf"))
        assert ds.num_rows == 4


def test_cli_replay_bad_input_is_one_line(namespace: Settings, tmp_path: Path) -> None:
    env = env_of(namespace)
    out = str(tmp_path / "x.jsonl")
    assert_one_line_error(cli("replay", "--adapter", "nope", "--out", out, env=env), 2, "unknown adapter")
    assert_one_line_error(cli("replay", "--since", "9", "--until", "2", "--out", out, env=env), 2, "bad range")
    assert_one_line_error(cli("replay", "--out", str(tmp_path / "x.csv"), env=env), 2, ".jsonl or .parquet")
    gone = {**env, "EVENTLIGHT_NATS_URL": "nats://127.0.0.1:1"}
    assert_one_line_error(cli("replay", "--out", out, env=gone), 1, "cannot reach", "127.0.0.1:1")


def test_cli_rebuild_refuses_what_only_a_replay_to_a_file_takes(namespace: Settings, tmp_path: Path) -> None:
    """``--rebuild --adapter messages`` rebuilt the read models and dropped the adapter without a word."""
    env = env_of(namespace)
    for extra in (
        ["--adapter", "messages"],
        ["--status", "succeeded"],
        ["--min-reward", "0.5"],
        ["--workers", "2"],
        ["--llm-call-match", "^chat "],
        ["--min-reward", "0"],  # falsy values were dropped without a word
        ["--since", ""],
    ):
        assert_one_line_error(cli("replay", "--rebuild", *extra, env=env), 2, f"{extra[0]} would not apply")
    for value in ("nan", "inf"):  # the option's name, not the Python argument's (min_reward)
        assert_one_line_error(
            cli("replay", "--min-reward", value, "--out", str(tmp_path / "x.jsonl"), env=env),
            2,
            f"--min-reward must be a finite number, not {value}",
        )
    assert not (tmp_path / "x.jsonl").exists()


def test_cli_import_of_a_folder_says_so(namespace: Settings, tmp_path: Path) -> None:
    assert_one_line_error(cli("import", str(tmp_path), env=env_of(namespace)), 2, "is a folder")


def only_error(result: Any, code: int) -> str:
    """The one ``error:`` line of a replay that failed (after the progress bar's last line)."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == code and len(errors) == 1, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    return errors[0]


@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
async def test_a_replay_that_fails_midway_leaves_no_partial_file(
    namespace: Settings, tmp_path: Path, existing: bool
) -> None:
    """A worker that dies after records were written: the file would pass for the whole dataset.
    A file already there was truncated as the replay began, and removed when it failed."""
    from tests.test_replay_parallel import workload as many

    async with JetStreamLightningStore(namespace) as store:
        await many(store)
    out = tmp_path / "partial.jsonl"
    if existing:
        out.write_text("precious\n")
    result = cli(
        "replay", "--adapter", "tests.replay_adapters:dies", "--workers", "2", "--out", str(out), env=env_of(namespace)
    )
    line = only_error(result, 1)
    assert "a replay worker process died" in line and "nothing was written" in line
    assert files_in(tmp_path) == (["partial.jsonl"] if existing else [])  # no temporary file
    assert not existing or out.read_text() == "precious\n"


def parquet_as_jsonl(path: Path) -> list[dict[str, Any]]:
    """The Parquet file's rows as its JSON lines have them: JSON text decoded, no key for a null."""
    import pyarrow.parquet as pq

    from eventlight.logreplay.writer import _TYPES

    rows = pq.read_table(path).to_pylist()
    return [{k: v if k in _TYPES else json.loads(v) for k, v in r.items() if v is not None} for r in rows]


def jsonl_rows(path: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in json.loads(line).items() if v is not None} for line in path.read_text().splitlines()]


async def test_a_field_that_first_appears_after_the_first_row_group_is_a_parquet_column(
    namespace: Settings, tmp_path: Path
) -> None:
    """Parquet's columns were fixed by the first 4,096 records: a field that first appeared later
    (a custom adapter adding a key to some records) failed the whole replay."""
    from tests.test_replay_parallel import workload as many

    async with JetStreamLightningStore(namespace) as store:
        await many(store)
    out = tmp_path / "late.parquet"
    out.write_bytes(b"precious")  # replaced once whole
    for name in ("late.jsonl", "late.parquet"):
        args = ("replay", "-a", "tests.replay_adapters:late_key", "--out", str(tmp_path / name))
        result = cli(*args, env=env_of(namespace))
        assert result.returncode == 0, result.stderr
    rows = parquet_as_jsonl(out)
    assert rows == jsonl_rows(tmp_path / "late.jsonl"), "Parquet and JSON lines differ"
    late = [r.get("late") for r in rows]
    assert len(rows) > 4096 and late[:4096] == [None] * 4096 and late[-1] == 1
    assert files_in(tmp_path) == ["late.jsonl", "late.parquet"]  # no file set aside left


def test_parquet_columns_grow_row_group_by_row_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fields appearing in the second and third row groups; a failure while the files set aside
    are copied leaves none of them."""
    from eventlight.logreplay import writer as w

    monkeypatch.setattr(w, "ROW_GROUP", 2)
    base = {"rollout_id": "ro-1", "attempt_id": "at-1", "index": 0, "log_positions": [3]}
    records = [{**base, "a": 1}, {**base, "a": 2}, {**base, "b": {"x": [1]}}, base, {**base, "reward": 0.5}]
    for suffix in ("jsonl", "parquet"):
        out = tmp_path / f"r.{suffix}"
        writer = w.writer_for(out)(out)
        for r in records:
            writer.write_attempt([r])
        writer.close()
    assert parquet_as_jsonl(tmp_path / "r.parquet") == jsonl_rows(tmp_path / "r.jsonl")
    assert files_in(tmp_path) == ["r.jsonl", "r.parquet"]
    import pyarrow.parquet as pq

    assert pq.ParquetFile(tmp_path / "r.parquet").metadata.num_row_groups == 3

    def fails(self: Any, part: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(w.ParquetWriter, "_copy", fails)
    broken = w.ParquetWriter(tmp_path / "x.parquet")
    for r in records:
        broken.write_attempt([r])
    with pytest.raises(OSError, match="disk full"):
        broken.close()
    assert files_in(tmp_path) == ["r.jsonl", "r.parquet", "x.parquet"]


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def interrupted(env: dict[str, str], args: list[str], ready: Callable[[int], bool]) -> Any:
    """Run ``eventlight ARGS`` in a session of its own, wait until ``ready(pid)`` (30 s at most), then
    send SIGINT to its process group, as a terminal's Ctrl-C does."""
    import signal
    import subprocess
    import sys
    import time

    base = {k: v for k, v in os.environ.items() if not k.startswith("EVENTLIGHT_")}
    command = [sys.executable, "-m", "eventlight.cli", *args]
    proc = subprocess.Popen(
        command, env={**base, **env}, cwd=ROOT, start_new_session=True, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not ready(proc.pid) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(command, proc.returncode, "", stderr)


async def test_ctrl_c_during_a_replay_leaves_an_existing_file_as_it_was(namespace: Settings, tmp_path: Path) -> None:
    """Ctrl-C deleted the file the replay was about to replace, and said nothing."""
    from tests.test_replay_parallel import workload as many

    async with JetStreamLightningStore(namespace) as store:
        await many(store)
    out = tmp_path / "keep.jsonl"
    out.write_text("precious\n")
    args = ["replay", "-a", "tests.replay_adapters:slow", "-j", "1", "-o", str(out)]
    started: list[float] = []

    def writing(pid: int) -> bool:  # a second into the adapter's 0.2 s per attempt
        import time

        if not started and (out.read_text() != "precious\n" or any(tmp_path.glob(".keep.jsonl.*.part"))):
            started.append(time.monotonic())
        return bool(started) and time.monotonic() - started[0] > 1.0

    line = only_error(interrupted(env_of(namespace), args, writing), 130)
    assert line.startswith("error: interrupted: nothing was written to")
    assert out.read_text() == "precious\n" and files_in(tmp_path) == ["keep.jsonl"]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
@pytest.mark.parametrize(
    ("adapter", "says"),
    [
        ("int_keys", "its records cannot be written"),
        ("str_reward", "TypeError: the adapter's item 1 has reward str 'high', expected a number or None"),
    ],
    ids=["int-keys", "str-reward"],
)
async def test_records_that_cannot_be_written_skip_their_attempt_not_the_replay(
    namespace: Settings, tmp_path: Path, suffix: str, adapter: str, says: str
) -> None:
    """A dict with int keys in an item failed the whole replay as an internal error; so did a
    ``reward`` of "high" in .parquet ("internal error: ArrowInvalid", leaving a 0-row file), which
    .jsonl wrote as it was."""
    from tests.test_replay_parallel import workload as many

    async with JetStreamLightningStore(namespace) as store:
        kinds = await many(store)
    out = tmp_path / f"some.{suffix}"
    result = cli("replay", "--adapter", f"tests.replay_adapters:{adapter}", "--out", str(out), env=env_of(namespace))
    assert result.returncode == 0, result.stderr
    skipped = [line for line in result.stderr.splitlines() if line.startswith("skipped:")]
    assert len(skipped) == len(kinds["bad"]) and all(says in line for line in skipped), result.stderr
    if suffix == "jsonl":
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    else:
        import pyarrow.parquet as pq

        rows = pq.read_table(out).to_pylist()
    written = {r["rollout_id"] for r in rows}
    assert written and not written & set(kinds["bad"]), "a skipped attempt's first record was written"
    assert len(rows) == 2 * len(written) and f"{len(rows)} record(s)" in result.stdout


def test_cli_replay_checks_the_file_name_before_looking_for_servers(tmp_path: Path) -> None:
    none = {"EVENTLIGHT_NATS_URL": "", "EVENTLIGHT_PG_DSN": "", "EVENTLIGHT_STATE_DIR": str(tmp_path / "empty-state")}
    assert_one_line_error(cli("replay", "--out", str(tmp_path / "x.csv"), env=none), 2, "expected a .jsonl or .parquet")
    assert_one_line_error(cli("replay", "--out", str(tmp_path / "x.jsonl"), env=none), 1, "no eventlight servers")
    assert not list(tmp_path.glob("x.*"))  # no file before the servers answer


async def test_cli_replay_since_past_the_head_warns_and_writes_an_empty_file(
    namespace: Settings, tmp_path: Path
) -> None:
    async with JetStreamLightningStore(namespace) as store:
        await workload(store)
    out = tmp_path / "late.jsonl"
    result = cli("replay", "--since", "100000", "--out", str(out), env=env_of(namespace))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == b""
    head = int(result.stdout.split("up to log position ")[1].split(")")[0])
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warnings == [f"warning: --since 100000 is past the end of the log: it ends at sequence {head}"], (
        result.stderr
    )


async def test_cli_replay_a_range_outside_the_log_warns_and_writes_an_empty_file(
    namespace: Settings, tmp_path: Path
) -> None:
    """An ISO ``--since`` after the log's last event wrote an empty file without a word, as did an
    ``--until`` before its first event (a reviewer); each is warned of as a ``--since`` position past
    the head is, naming the log's end, and the command exits 0."""
    import re
    import time
    from datetime import datetime

    before = time.time()
    async with JetStreamLightningStore(namespace) as store:
        await workload(store)
    after = time.time()
    cases = {
        ("--since", "2099-01-01T00:00:00Z"): r"--since 2099-01-01T00:00:00\+00:00 is past the end of the log: "
        r"no event at or after that time; its last event is at (\S+)$",
        ("--until", "2001-01-01"): r"--until 2001-01-01T00:00:00\+00:00 is before the start of the log: "
        r"no event at or before that time; its first event is at (\S+)$",
        ("--until", "0"): r"--until 0 is before the start of the log: it begins at sequence (1)$",
    }
    for args, says in cases.items():
        out = tmp_path / "outside.jsonl"
        result = cli("replay", *args, "--out", str(out), env=env_of(namespace))
        assert result.returncode == 0 and out.read_bytes() == b"", (args, result.stderr)
        assert "0 record(s) from 0 attempt(s)" in result.stdout
        [warning] = [line for line in result.stderr.splitlines() if "warning" in line]
        found = re.fullmatch("warning: " + says, warning)
        assert found, (args, result.stderr)
        if args[1] != "0":
            assert before - 1 <= datetime.fromisoformat(found[1]).timestamp() <= after + 1, warning


async def test_cli_replay_where_every_attempt_fails_exits_1(namespace: Settings, tmp_path: Path) -> None:
    """A reward function that raises on every attempt: each skip printed once (the first was printed
    twice, as a log warning and a 'skipped:' line) and the command fails instead of reporting 0
    records as a success (a fresh-user run)."""
    async with JetStreamLightningStore(namespace) as store:
        await workload(store)
    out = tmp_path / "none.jsonl"
    out.write_text("precious\n")  # a failed replay leaves it as it was
    result = cli("replay", "--reward", "os:getcwd", "--out", str(out), env=env_of(namespace))
    assert result.returncode == 1, result.stdout + result.stderr
    assert out.read_text() == "precious\n" and "nothing was written to" in result.stderr
    skipped = [line for line in result.stderr.splitlines() if line.startswith("skipped:")]
    assert len(skipped) == 3 and all("TypeError" in line for line in skipped), result.stderr
    assert result.stderr.count("TypeError") == 3 + 1, result.stderr  # the lines and the error (no log warning)
    assert "WARNING" not in result.stderr, result.stderr
    assert "error: every one of the 3 selected attempt(s) failed in the adapter or reward function" in result.stderr


async def test_cli_log_warnings_read_as_the_commands_own(namespace: Settings, tmp_path: Path) -> None:
    """``replay --resources-id ro-nope`` printed ``WARNING eventlight.logreplay.replay: …`` where the
    commands print ``warning: …`` (a fresh-user run)."""
    async with JetStreamLightningStore(namespace) as store:
        await workload(store)
    result = cli("replay", "--resources-id", "ro-nope", "--out", str(tmp_path / "x.jsonl"), env=env_of(namespace))
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "ro-nope" in line]
    assert warnings == ["warning: replay: no resources snapshot in the log is named ro-nope (--resources-id)"]
    assert "WARNING" not in result.stderr, result.stderr


async def test_an_unknown_resources_id_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    async with InMemoryLightningStore() as store:
        await workload(store)
        with caplog.at_level("WARNING", logger="eventlight.logreplay.replay"):
            records = await collect(eventlight.replay(store, adapter="triplets", resources_ids=["rs-typo"]))
    assert records == []
    assert "no resources snapshot in the log is named rs-typo" in caplog.text


async def test_the_python_api_warns_of_a_range_outside_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """``eventlight.replay`` said nothing of a range outside the log, which ``eventlight replay``
    warns of (a reviewer); it logs the same lines. An ISO ``since`` on an empty log was warned of
    nowhere: it says the log is empty."""
    says: dict[str, list[str]] = {}
    async with InMemoryLightningStore() as empty:
        with caplog.at_level("WARNING", logger="eventlight.logreplay.replay"):
            assert await collect(eventlight.replay(empty, since="2020-01-01")) == []
        says["empty"] = [r.getMessage() for r in caplog.records]
    async with InMemoryLightningStore() as store:
        await workload(store)
        for name, bounds in {"past": {"since": 10**6}, "before": {"until": "2001-01-01"}, "inside": {}}.items():
            caplog.clear()
            with caplog.at_level("WARNING", logger="eventlight.logreplay.replay"):
                records = await collect(eventlight.replay(store, **bounds))  # type: ignore[arg-type]
            says[name] = [r.getMessage() for r in caplog.records]
            assert (records == []) == (name != "inside")
    assert says["empty"] == ["replay: --since 2020-01-01T00:00:00+00:00 selects nothing: the log is empty"]
    [past] = says["past"]
    assert past.startswith("replay: --since 1000000 is past the end of the log: it ends at sequence ")
    [before] = says["before"]
    assert before.startswith("replay: --until 2001-01-01T00:00:00+00:00 is before the start of the log: ")
    assert says["inside"] == []


async def test_cli_replay_an_iso_since_on_an_empty_log_says_it_is_empty(namespace: Settings, tmp_path: Path) -> None:
    """Printed once, as a warning line (not also as a log line)."""
    async with JetStreamLightningStore(namespace):
        pass  # the namespace's stream, with nothing in it
    out = tmp_path / "empty.jsonl"
    result = cli("replay", "--since", "2020-01-01", "--out", str(out), env=env_of(namespace))
    assert result.returncode == 0 and out.read_bytes() == b"", result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line.lower()]
    assert warnings == ["warning: --since 2020-01-01T00:00:00+00:00 selects nothing: the log is empty"], result.stderr


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_numpy_values_are_written_as_numbers_and_an_object_without_json_form_is_refused(
    tmp_path: Path, suffix: str
) -> None:
    """Token ids from a tokenizer's NumPy output were written as their repr ("np.int64(5)",
    "array([1, 2])"): strings in place of numbers, and an object's repr with its memory address
    gave other bytes on each replay of the same log."""
    import numpy as np

    from eventlight.logreplay.writer import UnwritableError, writer_for

    base = {"rollout_id": "ro-1", "attempt_id": "at-1", "index": 0, "reward": 1.0, "log_positions": [3]}
    record = {**base, "prompt": {"token_ids": list(np.array([5, 6]))}, "ids": np.array([[1, 2]]), "p": np.float32(0.5)}
    out = tmp_path / f"r.{suffix}"
    writer = writer_for(out)(out)
    with pytest.raises(UnwritableError, match="builtins.object is no JSON value"):
        writer.write_attempt([{**base, "meta": {"x": object()}}])
    writer.write_attempt([record])
    writer.close()
    if suffix == "jsonl":
        (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    else:
        import pyarrow.parquet as pq

        (row,) = pq.read_table(out).to_pylist()
        row = {k: json.loads(row[k]) for k in ("prompt", "ids", "p")}
    assert row["prompt"] == {"token_ids": [5, 6]} and row["ids"] == [[1, 2]] and row["p"] == 0.5


def test_a_numpy_reward_is_a_number() -> None:
    """A reward function returning a NumPy float32 or int64 (a reward model's output) failed every
    attempt with "returned float32 np.float32(0.5), expected a number or None"."""
    import numpy as np

    from eventlight.logreplay.records import adapt_batches

    for value, expected in [(np.float32(0.5), 0.5), (np.int64(2), 2.0)]:
        adapted = adapt_batches([], lambda spans: [{"x": 1}], lambda spans, v=value: v)
        assert adapted.final_reward == expected and type(adapted.final_reward) is float
        assert adapted.items == [{"x": 1, "reward": expected}]


def genai_span(rid: str, aid: str, seq: int, text: str, start: float) -> Span:
    """An LLM call named as OpenTelemetry's GenAI conventions name it (``{operation} {model}``,
    opentelemetry-instrumentation-openai-v2)."""
    span = llm_span(rid, aid, seq, text, start)
    attributes = {**(span.attributes or {}), "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o"}
    return msgspec.structs.replace(span, name="chat gpt-4o", attributes=attributes)


async def genai_workload(store: Any, rollouts: int = 2) -> None:
    for i in range(rollouts):
        r = await store.enqueue_rollout({"task": i}, mode="train")
        d = await store.dequeue_rollout(worker_id="w1")
        aid = d.attempt.attempt_id
        await store.add_many_spans([genai_span(r.rollout_id, aid, 1, f"t{i}", 10.0)])
        await store.add_span(reward_span(r.rollout_id, aid, 2, 1.0, 12.0))
        await store.update_attempt(r.rollout_id, aid, status="succeeded")


async def test_llm_call_match_takes_spans_named_in_the_genai_conventions() -> None:
    """Spans named ``chat gpt-4o`` gave no triplet: only an adapter object could set the pattern."""
    async with InMemoryLightningStore() as store:
        await genai_workload(store)
        default = await collect(eventlight.replay(store, adapter="triplets"))
        genai = await collect(eventlight.replay(store, adapter="triplets", llm_call_match=r"^chat "))
    assert default == []
    assert [(r["prompt"]["token_ids"], r["response"]["token_ids"], r["reward"]) for r in genai] == [
        ([1, 2, 1], [3, 1], 1.0)
    ] * 2


async def test_cli_llm_call_match(namespace: Settings, tmp_path: Path) -> None:
    async with JetStreamLightningStore(namespace) as store:
        await genai_workload(store)
    out = tmp_path / "genai.jsonl"
    result = cli("replay", "--llm-call-match", "^chat ", "-j", "2", "--out", str(out), env=env_of(namespace))
    assert result.returncode == 0, result.stderr
    assert "2 record(s) from 2 attempt(s)" in result.stdout
    assert [json.loads(line)["response"]["token_ids"] for line in out.read_text().splitlines()] == [[3, 1]] * 2


def test_cli_llm_call_match_is_checked_before_looking_for_servers(tmp_path: Path) -> None:
    none = {"EVENTLIGHT_NATS_URL": "", "EVENTLIGHT_PG_DSN": "", "EVENTLIGHT_STATE_DIR": str(tmp_path / "empty-state")}
    out = str(tmp_path / "x.jsonl")
    for args, says in (
        (["--llm-call-match", "chat ("], "is not a regular expression: missing ), unterminated subpattern"),
        (["-a", "messages", "--llm-call-match", "^chat "], "applies to the triplets adapter only"),
        (["-a", "tests.replay_adapters:picky", "--llm-call-match", "^chat "], "set the pattern there"),
    ):
        assert_one_line_error(cli("replay", *args, "--out", out, env=none), 2, says)
    assert not list(tmp_path.glob("x.*"))


async def test_a_range_of_a_position_and_a_time_is_checked_as_one_of_a_kind() -> None:
    """``since=<position>, until=<time>`` (or the other way) with the start after the end gave an
    empty result without a word; ``since=10, until=3`` is a "bad range" error."""
    import time as clock
    from datetime import UTC, datetime

    hour_ago, in_an_hour = (datetime.fromtimestamp(clock.time() + d, UTC).isoformat() for d in (-3600, 3600))
    async with InMemoryLightningStore() as store:
        ids = await workload(store)
        first = await collect(eventlight.replay(store))
        val_seq = next(r["attempt_seq"] for r in first if r["rollout_id"] == ids["val"])
        kept = await collect(eventlight.replay(store, since=val_seq, until=in_an_hour))
        assert {r["rollout_id"] for r in kept} == {ids["val"], ids["bad"]}
        assert await collect(eventlight.replay(store, since=hour_ago, until=val_seq))  # the start and val
        with pytest.raises(InvalidInputError, match=rf"bad range: --since {val_seq} is later than --until .* \(log "):
            await collect(eventlight.replay(store, since=val_seq, until=hour_ago))
        with pytest.raises(InvalidInputError, match=rf"bad range: --since .* is later than --until {val_seq} \(log "):
            await collect(eventlight.replay(store, since=in_an_hour, until=val_seq))
        with pytest.raises(InvalidInputError, match=r"--until 100000 \(log position \d+, the last entry up to 100000,"):
            await collect(eventlight.replay(store, since=in_an_hour, until=100000))
        assert await collect(eventlight.replay(store, since=100000, until=hour_ago)) == []  # past the end: warned


async def test_cli_a_bad_range_of_a_position_and_a_time_is_one_line(namespace: Settings, tmp_path: Path) -> None:
    async with JetStreamLightningStore(namespace) as store:
        await workload(store)
    out = tmp_path / "x.jsonl"
    result = cli("replay", "--since", "2", "--until", "2001-01-01", "--out", str(out), env=env_of(namespace))
    assert "bad range: --since 2 is later than --until 2001-01-01T00:00:00+00:00 (log position 2" in only_error(
        result, 2
    )
    assert files_in(tmp_path) == []


async def test_replay_from_settings_without_servers_or_stream_says_what_to_run(
    namespace: Settings, tmp_path: Path
) -> None:
    """Without ``nats_url`` the embedded servers are looked for (none here: the state folder is
    empty); a namespace without a stream is named, with the command that creates it."""
    with pytest.raises(ServiceUnavailableError, match="no eventlight servers are running .*run `eventlight up`"):
        await collect(eventlight.replay(Settings(state_dir=tmp_path, namespace="h")))
    other = msgspec.structs.replace(namespace, namespace="no_such_ns_replay")
    with pytest.raises(
        InvalidInputError, match="has no stream EL_NO_SUCH_NS_REPLAY .*`eventlight up -N no_such_ns_replay`"
    ):
        await collect(eventlight.replay(other))


async def refused_calls(store: Any, n: int) -> None:
    """``n`` rollouts whose one LLM call failed (a 400: the prompt too long), so no triplet."""
    from eventlight.llm_proxy.span_attributes import make_span

    too_long = {"type": "ContextWindowExceededError", "status_code": 400, "message": "maximum context length"}
    for i in range(n):
        started = await store.start_rollout({"task": i})
        rid, aid = started.rollout_id, started.attempt.attempt_id
        request = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}]}
        span = make_span(
            request, None, too_long, system="hosted_vllm", streaming=False, rollout_id=rid, attempt_id=aid,
            sequence_id=1, start_time=1.0,
        )  # fmt: skip
        await store.add_span(span)
        await store.update_attempt(rid, aid, status="failed")


async def test_attempts_whose_calls_were_all_left_out_are_told_once(caplog: pytest.LogCaptureFixture) -> None:
    """``eventlight replay`` printed ``no triplet: all 1 LLM call(s) were left out (AdapterStats(...
    errors=1 ...))`` once per such attempt, the same line each time (it named no attempt), the counts as
    a repr. The replay tells them once at its end, counted, the counts in words."""
    async with InMemoryLightningStore() as store:
        await refused_calls(store, 2)
        with caplog.at_level("WARNING", logger="eventlight"):
            assert await collect(eventlight.replay(store, adapter="triplets")) == []
    assert [r.getMessage() for r in caplog.records] == [
        "replay: no triplet from 2 attempt(s): all their LLM calls were left out "
        "(2 LLM call(s), 0 record(s); 2 failed (span status ERROR))"
    ]


async def test_cli_replay_tells_attempts_whose_calls_were_all_left_out_once(
    namespace: Settings, tmp_path: Path
) -> None:
    async with JetStreamLightningStore(namespace) as store:
        await refused_calls(store, 2)
    result = cli("replay", "--out", str(tmp_path / "x.jsonl"), env=env_of(namespace))
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: no triplet from 2 attempt(s): all their LLM calls were left out "
        "(2 LLM call(s), 0 record(s); 2 failed (span status ERROR))"
    ], result.stderr
