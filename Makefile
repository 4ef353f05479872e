# Two commands on a fresh machine: `make run` (the rollout flow on the embedded
# default: local Ray, ephemeral Prefect, tiny model, CPU) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

export PREFECT_HOME ?= $(CURDIR)/.prefect-home
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export RAY_AUTH_MODE := disabled

.PHONY: venv run run-agent test lint bench clean

# One stamp per set of packages: `make run` installs what a run needs, once;
# `make test` adds the test extras on top, once, without reinstalling the rest.
RUN_STAMP := $(BIN)/.run-installed
TEST_STAMP := $(BIN)/.test-installed

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	# torch first: an open-ended torch requirement would otherwise pull a CUDA build.
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e .
	# The runs' Prefect database, migrated here: the migrations took ~15
	# CPU-seconds of the first `make run` on a 2-core box (docs/history/benchmarks-diary.md).
	$(BIN)/prefect server database upgrade -y
	touch $@

# Rebuilt after the run's packages (a changed pyproject.toml redoes both).
$(TEST_STAMP): $(RUN_STAMP)
	$(BIN)/pip install -q -e '.[dev,openrlhf-test]'
	# OpenRLHF's own code for the drop-in test, without its GPU requirements
	# (its pins include DeepSpeed, flash-attn and vLLM).
	$(BIN)/pip install -q --no-deps openrlhf==0.11.2
	touch $@

venv: $(RUN_STAMP)

run: $(RUN_STAMP)
	$(BIN)/rolloutflow $(ARGS)

# The tool task (docs/agents.md): an agent calls a tool through the engines' OpenAI API.
run-agent: $(RUN_STAMP)
	$(BIN)/rolloutflow --agent agents.tool_task:agent --prompts-path data/tool_task.jsonl \
		--label-field answer --id-field id $(ARGS)

# ruff comes with the dev extra.
lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two workers, a test file each at a time: most of the suite waits on
# processes it starts (Ray nodes, Prefect servers, engine actors). The
# slowest tests are listed at the end, to keep the suite's time in view.
test: $(TEST_STAMP) lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15 $(PYTEST_ARGS)

bench: $(RUN_STAMP)
	$(BIN)/python benchmarks/weight_sync_cpu.py

clean:
	rm -rf $(VENV) .prefect-home out
