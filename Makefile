# Two commands on a fresh machine:  `make demo`  and  `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test venv gpu-test clean

$(BIN)/monoserve: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/monoserve

# Local Ray cluster on the CPU engine, tiny model, a few concurrent streamed requests.
demo: venv
	$(BIN)/monoserve demo

# Everything but the GPU tests (those run on a GPU machine: `make gpu-test`), on two workers (the Ray tests on one
# of them, tests/conftest.py); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

gpu-test: venv
	$(BIN)/python -m pytest -q -m gpu

clean:
	rm -rf $(VENV) build *.egg-info
