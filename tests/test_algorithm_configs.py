"""The algorithms' settings are checked at construction: a 0, a negative, a NaN or a value of the
wrong type gets one ``ValueError`` naming the field, the value and what it may be, instead of a
failure deep in torch (or none). Needs neither torch nor a store.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest

from eventlight.algorithm import APO, Baseline
from eventlight.algorithm.grpo import GRPOConfig
from eventlight.algorithm.sft import SFTConfig
from eventlight.core.errors import InvalidInputError, InvalidTypeError
from eventlight.verl.config import VerlSettings

NAN = math.nan


def _ids(rows: list[tuple[str, Any, type[Exception], str]]) -> list[str]:
    """``field=value``, an integer of thousands of digits by its size (Python will not print it)."""
    return [
        f"{f}={v!r:.40}" if not isinstance(v, int) or v.bit_length() < 64 else f"{f}=<{v.bit_length()} bits>"
        for f, v, _, _ in rows
    ]


GRPO_BAD: list[tuple[str, Any, type[Exception], str]] = [  # field, value, error, what the message says
    ("micro_batch_size", 0, InvalidInputError, "whole number 1 to 2147483647, got 0"),
    ("micro_batch_size", -2, InvalidInputError, "whole number 1 to 2147483647, got -2"),
    ("micro_batch_size", 8.0, InvalidTypeError, "got 8.0 (float)"),
    ("max_seq_len", 0, InvalidInputError, "whole number 2 to 2147483647, got 0"),
    ("max_seq_len", "512", InvalidTypeError, "got '512' (str)"),
    ("lr", 0.0, InvalidInputError, "finite number > 0, got 0.0"),
    ("lr", -1e-5, InvalidInputError, "finite number > 0, got -1e-05"),
    ("lr", NAN, InvalidInputError, "finite number > 0, got nan"),
    ("lr", "2e-5", InvalidTypeError, "got '2e-5' (str)"),
    ("clip_eps", 0, InvalidInputError, "finite number > 0, got 0"),
    ("temperature", -0.5, InvalidInputError, "finite number >= 0, got -0.5"),
    ("temperature", math.inf, InvalidInputError, "got inf"),
    ("max_new_tokens", 0, InvalidInputError, "1 to 511 (below max_seq_len 512: the policy server refuses"),
    ("eval_every", -1, InvalidInputError, "0 to 2147483647, got -1"),
    ("rollout_timeout_s", NAN, InvalidInputError, "got nan"),
    ("rollout_timeout_s", 0, InvalidInputError, "> 0, got 0"),
    ("max_empty_steps", 0, InvalidInputError, "1 to 2147483647, got 0"),
    ("keep_checkpoints", 0, InvalidInputError, "1 to 2147483647, got 0"),
    ("keep_checkpoints", True, InvalidTypeError, "got True (bool)"),
    ("seed", -1, InvalidInputError, "0 to 4294967295, got -1"),
    ("seed", 2**40, InvalidInputError, "0 to 4294967295"),
    ("scale_by_std", "no", InvalidTypeError, "True or False, got 'no' (str)"),
    ("version_prefix", "run 1.", InvalidInputError, "letters, digits"),
    ("version_prefix", None, InvalidTypeError, "a string, got None (NoneType)"),
    ("steps", -1, InvalidInputError, "0 to 2147483647, got -1"),
    ("batch_size", 0, InvalidInputError, "1 to 2147483647, got 0"),
    ("group_size", 1, InvalidInputError, "2 to 2147483647, got 1"),
    ("lr", 10**400, InvalidInputError, "finite number > 0, got an integer of 1329 bits"),  # was OverflowError
    (
        "steps",
        -(10**5000),
        InvalidInputError,
        "0 to 2147483647, got a negative integer of 16610 bits",
    ),  # no 5000 digits
    # upper bounds: a count or a token count past a 32-bit int (10**30 failed inside torch)
    ("max_new_tokens", 10**30, InvalidInputError, "1 to 511 (below max_seq_len 512: the policy server refuses"),
    ("max_new_tokens", 512, InvalidInputError, "1 to 511 (below max_seq_len 512: the policy server refuses"),
    ("max_seq_len", 2**31, InvalidInputError, "2 to 2147483647, got 2147483648"),
    ("steps", 10**30, InvalidInputError, "0 to 2147483647, got an integer of 100 bits"),
    ("batch_size", 2**31, InvalidInputError, "1 to 2147483647, got 2147483648"),
    ("group_size", 2**63, InvalidInputError, "2 to 2147483647, got 9223372036854775808"),
    ("micro_batch_size", 10**30, InvalidInputError, "1 to 2147483647"),
    ("eval_every", 2**31, InvalidInputError, "0 to 2147483647"),
    ("max_empty_steps", 2**31, InvalidInputError, "1 to 2147483647"),
    ("keep_checkpoints", 10**30, InvalidInputError, "1 to 2147483647"),
]


@pytest.mark.parametrize(("field", "value", "error", "says"), GRPO_BAD, ids=_ids(GRPO_BAD))
def test_grpo_config_refuses_each_bad_field_by_name(field: str, value: Any, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=f"GRPOConfig.{field} must .*{re.escape(says)}") as got:
        GRPOConfig(**{field: value})
    assert isinstance(got.value, ValueError)
    print(f"GRPOConfig({field}=...): {type(got.value).__name__}: {got.value}")


SFT_BAD: list[tuple[str, Any, type[Exception], str]] = [
    ("lr", NAN, InvalidInputError, "finite number > 0, got nan"),
    ("lr", 0, InvalidInputError, "> 0, got 0"),
    ("min_reward", NAN, InvalidInputError, "finite number, got nan"),
    ("min_reward", "1", InvalidTypeError, "got '1' (str)"),
    ("min_reward", -(10**400), InvalidInputError, "finite number, got a negative integer of 1329 bits"),
    ("modes", "train", InvalidTypeError, "non-empty tuple of mode names"),
    ("modes", (), InvalidTypeError, "non-empty tuple of mode names"),
    ("keep_checkpoints", 0, InvalidInputError, "1 to 2147483647, got 0"),
    ("seed", -3, InvalidInputError, "0 to 4294967295, got -3"),
    ("steps", 2.5, InvalidTypeError, "got 2.5 (float)"),
    ("max_seq_len", 1, InvalidInputError, "2 to 2147483647, got 1"),
    ("train_on", "every", InvalidInputError, "one of 'last', 'all', got 'every'"),
    ("activation_checkpointing", 1, InvalidTypeError, "True or False, got 1 (int)"),
    ("version_prefix", "a*", InvalidInputError, "letters, digits"),
    ("steps", 10**30, InvalidInputError, "1 to 2147483647, got an integer of 100 bits"),
    ("batch_size", 2**31, InvalidInputError, "1 to 2147483647"),
    ("max_seq_len", 10**30, InvalidInputError, "2 to 2147483647"),
    ("save_every", 2**31, InvalidInputError, "1 to 2147483647"),
    ("keep_checkpoints", 2**31, InvalidInputError, "1 to 2147483647"),
]


@pytest.mark.parametrize(("field", "value", "error", "says"), SFT_BAD, ids=_ids(SFT_BAD))
def test_sft_config_refuses_each_bad_field_by_name(field: str, value: Any, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=f"SFTConfig.{field} must .*{re.escape(says)}"):
        SFTConfig(**{field: value})


BASELINE_BAD: list[tuple[str, Any, type[Exception], str]] = [
    ("span_verbosity", "key-values", InvalidInputError, "one of 'keys', 'key_values', 'none', got 'key-values'"),
    ("span_verbosity", "all", InvalidInputError, "one of 'keys', 'key_values', 'none', got 'all'"),
    ("train_split", NAN, InvalidInputError, "got nan"),
    ("train_split", 1.0, InvalidInputError, "in (0, 1), got 1.0"),
    ("train_split", "0.8", InvalidTypeError, "got '0.8' (str)"),
    ("n_epochs", 1.5, InvalidTypeError, "got 1.5 (float)"),
    ("max_queue_length", 0, InvalidInputError, "1 to 2147483647, got 0"),
    ("polling_interval", -5.0, InvalidInputError, ">= 0, got -5.0"),
    ("n_epochs", 10**30, InvalidInputError, "1 to 2147483647, got an integer of 100 bits"),
    ("max_queue_length", 2**31, InvalidInputError, "1 to 2147483647, got 2147483648"),
]


@pytest.mark.parametrize(("field", "value", "error", "says"), BASELINE_BAD, ids=_ids(BASELINE_BAD))
def test_baseline_refuses_each_bad_argument_by_name(field: str, value: Any, error: type[Exception], says: str) -> None:
    """A typo in ``span_verbosity`` used to log every span as ``"keys"`` would, silently."""
    with pytest.raises(error, match=f"Baseline.{field} must .*{re.escape(says)}"):
        Baseline(**{field: value})


APO_BAD: list[tuple[str, Any, type[Exception], str]] = [
    ("rollout_batch_timeout", NAN, InvalidInputError, "finite number > 0, got nan"),
    ("diversity_temperature", -1.0, InvalidInputError, ">= 0, got -1.0"),
    ("diversity_temperature", NAN, InvalidInputError, "got nan"),
    ("beam_width", "4", InvalidTypeError, "got '4' (str)"),
    ("beam_rounds", 2.0, InvalidTypeError, "got 2.0 (float)"),
    ("val_batch_size", 0, InvalidInputError, "1 to 2147483647, got 0"),
    ("optimizer_max_tokens", 0, InvalidInputError, "1 to 2147483647, got 0"),
    ("run_initial_validation", "yes", InvalidTypeError, "True or False"),
    ("gradient_model", "", InvalidInputError, "a model name, got ''"),
    ("apply_edit_model", None, InvalidTypeError, "a model name, got None"),
    ("rollout_config", {"max_attempts": 2}, InvalidTypeError, "a RolloutConfig or None"),
    ("_poml_trace", "yes", InvalidTypeError, "True or False, got 'yes' (str)"),
    ("gradient_prompt_files", "critique.txt", InvalidTypeError, "a list of paths or None, got 'critique.txt'"),
    ("apply_edit_prompt_files", [3], InvalidTypeError, "hold paths (str or Path), got 3 (int)"),
    ("optimizer_max_tokens", 10**30, InvalidInputError, "1 to 2147483647, got an integer of 100 bits"),
    ("gradient_batch_size", 2**31, InvalidInputError, "1 to 2147483647"),
    ("val_batch_size", 2**31, InvalidInputError, "1 to 2147483647"),
    ("beam_width", 2**31, InvalidInputError, "1 to 2147483647"),
    ("branch_factor", 2**31, InvalidInputError, "1 to 2147483647"),
    ("beam_rounds", 10**30, InvalidInputError, "0 to 2147483647"),
]


@pytest.mark.parametrize(("field", "value", "error", "says"), APO_BAD, ids=_ids(APO_BAD))
def test_apo_refuses_each_bad_argument_by_name(field: str, value: Any, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=f"APO.{field} must .*{re.escape(says)}"):
        APO(object(), **{field: value})


def test_the_defaults_and_agent_lightnings_documented_settings_pass() -> None:
    GRPOConfig()
    SFTConfig()
    GRPOConfig(lr=1, temperature=0, rollout_timeout_s=30, version_prefix="run-0412-")  # ints for floats are fine
    SFTConfig(min_reward=0, modes=None)
    Baseline(n_epochs=2, train_split=0.8, span_verbosity="key_values")  # Agent-lightning's docs
    Baseline(span_verbosity="none", polling_interval=0)
    APO(object(), val_batch_size=10, gradient_batch_size=4, beam_width=2, branch_factor=2, beam_rounds=2)
    GRPOConfig(max_new_tokens=511, max_seq_len=512)  # the bounds themselves pass
    GRPOConfig(steps=2**31 - 1, max_seq_len=2**31 - 1, max_new_tokens=2**31 - 2)
    SFTConfig(steps=2**31 - 1, max_seq_len=2**31 - 1)


def test_agent_lightnings_documented_apo_call_constructs(caplog: pytest.LogCaptureFixture) -> None:
    """The full constructor call of Agent-lightning's APO docs (``algorithm-zoo/apo``) raised
    ``TypeError: unexpected keyword argument 'gradient_prompt_files'``; it constructs, and
    ``_poml_trace=True`` (no POML renderer here) logs one line saying it has no effect."""
    apo = APO(
        object(),
        gradient_model="gpt-5-mini",
        apply_edit_model="gpt-4.1-mini",
        diversity_temperature=1.0,
        gradient_batch_size=4,
        val_batch_size=16,
        beam_width=4,
        branch_factor=4,
        beam_rounds=3,
        rollout_batch_timeout=3600.0,
        run_initial_validation=True,
        gradient_prompt_files=None,
        apply_edit_prompt_files=None,
        _poml_trace=False,
    )
    assert len(apo.gradient_variants) == 3 and len(apo.apply_edit_variants) == 2  # the built-ins
    assert not [r for r in caplog.records if "_poml_trace" in r.getMessage()]
    with caplog.at_level(logging.INFO, logger="eventlight.algorithm.apo.search"):
        APO(object(), _poml_trace=True)
    assert [(r.levelname, r.getMessage()) for r in caplog.records if "_poml_trace" in r.getMessage()] == [
        ("INFO", "APO(_poml_trace=True) has no effect: eventlight renders its optimizer prompts without POML")
    ]


PROMPT_FILE_BAD: list[tuple[str, str | None, str]] = [  # file name, content (None: not written), what it says
    ("critique.poml", "<poml><p>{{ prompt_template }}</p></poml>", "is a POML file; eventlight renders"),
    ("missing.txt", None, "cannot be read: FileNotFoundError"),
    ("empty.txt", " \n\t\n", "is empty"),
    ("unknown.txt", "Fix {prompt_template} for {task}", "unknown placeholder {task}; known: {prompt_template}"),
    ("positional.txt", "Fix {}", "uses the unknown placeholder {}"),
    ("attribute.txt", "Fix {prompt_template.upper}", "uses the unknown placeholder {prompt_template.upper}"),
    ("brace.txt", 'Reply as {"critique": 1} for {prompt_template}', 'uses the unknown placeholder {"critique"}'),
    ("unclosed.txt", "Fix {prompt_template", "is not a str.format template (expected '}' before end of string)"),
    ("spec.txt", "Fix {prompt_template:d}", "cannot be filled by str.format: ValueError"),
    ("latin1.txt", "Caf\xe9 {prompt_template}", "cannot be read: UnicodeDecodeError"),
]


@pytest.mark.parametrize("field", ["gradient_prompt_files", "apply_edit_prompt_files"])
@pytest.mark.parametrize(("name", "content", "says"), PROMPT_FILE_BAD, ids=[r[0] for r in PROMPT_FILE_BAD])
def test_apo_refuses_each_bad_prompt_file_naming_it(
    tmp_path: Path, field: str, name: str, content: str | None, says: str
) -> None:
    good = tmp_path / "good.txt"
    evidence = "by {critique}" if field == "apply_edit_prompt_files" else "for {runs}"
    good.write_text("Fix {prompt_template} " + evidence, encoding="utf-8")
    bad = tmp_path / name
    if content is not None:
        bad.write_bytes(content.encode("latin-1" if name == "latin1.txt" else "utf-8"))
    with pytest.raises(InvalidInputError, match=f"APO.{field}: {re.escape(repr(str(bad)))} .*{re.escape(says)}"):
        APO(object(), **{field: [good, bad]})


MISSING_PLACEHOLDER = [  # field, file text, the placeholder it says is missing
    ("gradient_prompt_files", "Critique this prompt given {experiments}", "{prompt_template}"),
    ("gradient_prompt_files", "Critique {prompt_template} ({max_spans} spans a run)", "{experiments} or {runs}"),
    ("apply_edit_prompt_files", "Rewrite {prompt_template} to be clearer", "{critique}"),
    ("apply_edit_prompt_files", "Apply this critique: {critique}", "{prompt_template}"),
    ("apply_edit_prompt_files", "Rewrite the prompt; no placeholder at all", "{prompt_template}"),
]


@pytest.mark.parametrize(("field", "text", "missing"), MISSING_PLACEHOLDER)
def test_apo_refuses_a_prompt_file_missing_a_placeholder_every_built_in_uses(
    tmp_path: Path, field: str, text: str, missing: str
) -> None:
    """A critique file that never shows the template or the runs, or a rewrite file that never shows
    the template or the critique, was taken, and the optimizer LLM worked blind; it is refused when
    ``APO`` is made, naming the file and the placeholder."""
    path = tmp_path / "prompt.txt"
    path.write_text(text, encoding="utf-8")
    says = f"APO.{field}: {str(path)!r} never uses {missing}: every built-in variant does"
    with pytest.raises(ValueError, match=re.escape(says)):
        APO(object(), **{field: [path]})


def test_a_directory_and_a_critique_placeholder_in_a_rewrite_file_are_refused(tmp_path: Path) -> None:
    (tmp_path / "edit.txt").write_text("{prompt_template} / {experiments}", encoding="utf-8")
    with pytest.raises(InvalidInputError, match=r"unknown placeholder \{experiments\}; known: \{prompt_template\}, "):
        APO(object(), apply_edit_prompt_files=[tmp_path / "edit.txt"])
    with pytest.raises(InvalidInputError, match="cannot be read: IsADirectoryError"):
        APO(object(), gradient_prompt_files=[tmp_path])


def test_numpy_numbers_are_taken_and_kept_as_pythons() -> None:
    """A sweep over ``np.arange`` / ``np.linspace`` hands ``np.int64`` and ``np.float32`` values: they
    were refused as "must be a whole number, got np.int64(8) (int64)" (and ``np.True_`` as "must be
    True or False, got np.True_ (bool)"), though every one worked before the checks. They are taken,
    and kept as Python's own types (a checkpoint's config is written as JSON)."""
    np = pytest.importorskip("numpy")
    grpo = GRPOConfig(batch_size=np.int64(8), lr=np.float32(1e-5), scale_by_std=np.bool_(False), seed=np.uint32(7))
    assert (grpo.batch_size, grpo.seed, grpo.scale_by_std) == (8, 7, False)
    assert [type(v) for v in (grpo.batch_size, grpo.lr, grpo.scale_by_std, grpo.seed)] == [int, float, bool, int]
    assert grpo.lr == pytest.approx(1e-5)
    sft = SFTConfig(steps=np.int32(3), min_reward=np.float16(0.5), activation_checkpointing=np.bool_(True))
    assert [type(v) for v in (sft.steps, sft.min_reward, sft.activation_checkpointing)] == [int, float, bool]
    baseline = Baseline(n_epochs=np.int64(2), train_split=np.float32(0.8), max_queue_length=np.int8(4))
    assert (type(baseline.n_epochs), type(baseline.train_split), baseline.max_queue_length) == (int, float, 4)
    apo = APO(object(), beam_width=np.int64(2), rollout_batch_timeout=np.float32(60), optimizer_max_tokens=np.int16(9))
    assert (type(apo.beam_width), apo.rollout_batch_timeout, type(apo.optimizer_max_tokens)) == (int, 60.0, int)
    with pytest.raises(InvalidTypeError, match=r"got np.float64\(8.0\) \(numpy.float64\)"):
        GRPOConfig(batch_size=np.float64(8.0))  # a float is still no whole number
    with pytest.raises(InvalidInputError, match="GRPOConfig.lr must be a finite number > 0, got nan"):
        GRPOConfig(lr=np.float32("nan"))


def test_verl_settings_name_the_key_and_the_value() -> None:
    """The VERL glue validated its dict already (``VerlSettings.from_config``); pinned here beside the others."""
    data = {"train_batch_size": 4, "max_prompt_length": 512, "max_response_length": 256}
    base: dict[str, Any] = {"actor_rollout_ref": {"model": {"path": "m"}}, "data": data}
    bad = [
        ({"data": {"train_batch_size": 0}}, "data.train_batch_size must be a positive integer, got 0"),
        ({"data": {"train_batch_size": "4"}}, "data.train_batch_size must be a positive integer, got '4'"),
        ({"actor_rollout_ref": {"rollout": {"temperature": NAN}}}, "temperature must be a number >= 0, got nan"),
    ]
    for over, says in bad:
        config = {**base, **{k: {**base.get(k, {}), **v} for k, v in over.items()}}
        with pytest.raises(InvalidInputError, match=re.escape(says)):
            VerlSettings.from_config(config)


def _verl(**kwargs: Any) -> Any:
    from eventlight.algorithm.verl import VERL

    data = {"train_batch_size": 4, "max_prompt_length": 512, "max_response_length": 256}
    return VERL({"actor_rollout_ref": {"model": {"path": "m"}}, "data": data}, **kwargs)


def _made(name: str) -> Any:
    from eventlight.algorithm.grpo import GRPO
    from eventlight.algorithm.sft import SFT

    return {
        "GRPO": GRPO,
        "SFT": SFT,
        "APO": lambda **kw: APO(object(), **kw),
        "VERL": _verl,
    }[name]


CALLABLES = [
    ("GRPO", "progress"),
    ("SFT", "progress"),
    ("APO", "progress"),
    ("VERL", "progress"),
    ("VERL", "trainer_cls"),
    ("VERL", "daemon_cls"),
]


@pytest.mark.parametrize(("algorithm", "field"), CALLABLES, ids=[f"{a}.{f}" for a, f in CALLABLES])
def test_callbacks_are_checked_to_be_callable(algorithm: str, field: str) -> None:
    """A ``progress`` callback (or VERL's ``trainer_cls``/``daemon_cls``) that cannot be called was
    taken, and failed only when called deep in a run (GRPO, SFT and APO log the TypeError at each
    event and go on) (a reviewer); it is refused at construction, naming the parameter."""
    make = _made(algorithm)
    for bad in ({"on": "step"}, "mymodule:progress"):
        with pytest.raises(InvalidTypeError, match=f"{algorithm}.{field} must be callable or None, got "):
            make(**{field: bad})
    made = make(**{field: print})
    assert getattr(made, field) is print
    assert getattr(make(**{field: None}), field) is None
