# Two commands on a fresh machine: `make run` (the rollout flow on the embedded
# default: local Ray, ephemeral Prefect, tiny model, CPU) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

export PREFECT_HOME ?= $(CURDIR)/.prefect-home
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export RAY_AUTH_MODE := disabled

.PHONY: venv run test lint bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: an open-ended torch requirement would otherwise pull a CUDA build.
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[dev,openrlhf-test]'
	# OpenRLHF's own code for the drop-in test, without its GPU requirements.
	$(BIN)/pip install -q --no-deps openrlhf==0.11.2
	# The runs' Prefect database, migrated here: the migrations took ~15
	# CPU-seconds of the first `make run` on a 2-core box (docs/benchmarks.md).
	$(BIN)/prefect server database upgrade -y
	touch $@

venv: $(BIN)/.installed

run: venv
	$(BIN)/rolloutflow $(ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two workers, a test file each at a time: most of the suite waits on
# processes it starts (Ray nodes, Prefect servers, engine actors). The
# slowest tests are listed at the end, to keep the suite's time in view.
test: venv lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15 $(PYTEST_ARGS)

bench: venv
	$(BIN)/python benchmarks/weight_sync_cpu.py

clean:
	rm -rf $(VENV) .prefect-home out
