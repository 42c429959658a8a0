# Every target creates or reuses .venv and installs what it needs, so a fresh clone needs only Python.
PYTHON ?= python3
VENV ?= .venv
# The torch requirement. The default is the CPU build; GPU users override it, e.g.
#   make test TORCH_SPEC=torch==2.13.0    (with a CUDA index configured for pip)
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.shardwise-installed
DOCS_STAMP := $(VENV)/.shardwise-docs-installed

.PHONY: demo test lint typecheck docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml Makefile
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)" -e ".[test]"
# torchtitan for tests/*/integrations: --no-deps, plus only what the modules the tests
# import need (README, "Dependencies"); its own list (datasets, wandb, ...) is not needed.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps \
		"torchtitan==0.3.0" "tyro==1.0.17" "docstring-parser==0.18.0" "typeguard==4.6.1" \
		"spmd_types==0.2.3" "triton==3.9.0"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# Two pytest workers, each taking whole files (tests/README.md, "Running the suite");
# TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

# The documentation site (mkdocs.yml) into site/; --strict: a broken link, anchor or docstring
# reference fails the build.
$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)" -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Benchmarks print ratios against torch.distributed.checkpoint measured in the same run; they
# are never part of the test suite. BENCH_ARGS=--quick gives a one-minute smoke run.
bench: $(STAMP)
	$(BIN)/python bench/overlap_validation.py
	$(BIN)/python bench/checkpoint.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
