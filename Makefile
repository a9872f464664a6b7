# The README's two commands: `make demo` (local swarm) and `make test` (the whole test suite).
# Both create the virtual environment on first use; nothing else needs installing by hand.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
# Pinned and installed first: a CPU build where the machine provides one, else PyPI's default (CUDA on Linux).
TORCH ?= torch==2.13.0

.PHONY: demo test venv clean gpu-check
venv: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: venv
	$(BIN)/gasloc swarm --peers 4 --duration 120

# The unit and in-process tests and the light multi-process ones (marker `light`, tests/e2e/conftest.py) on three
# workers (pytest-xdist; loadgroup would keep an xdist_group on one worker, which pytest 9 defeats, so no test relies
# on it; three, not two, on two cores: the docker build and the tests that wait on a socket or a child leave a core
# idle, 349 s against 414 s for this part), then the other multi-process tests one at a time: each starts a swarm
# that wants the machine's cores to itself. Both parts run even when the first fails, and the target fails if either
# did.
test: venv
	$(BIN)/pytest -n 3 --dist loadgroup -m "light or not e2e" tests; u=$$?; \
	$(BIN)/pytest -m "e2e and not light" tests/e2e; e=$$?; exit $$((u || e))

# On a machine with a CUDA device: tests/gpu and bench/gpu.py in one go (bench/gpu_check.sh; docs/gpu.md).
gpu-check: venv
	PY=$(BIN)/python bench/gpu_check.sh

clean:
	rm -rf $(VENV) runs build *.egg-info
