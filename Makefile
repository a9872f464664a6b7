# The README's two commands: `make demo` (local swarm) and `make test` (the whole test suite).
# Both create the virtual environment on first use; nothing else needs installing by hand.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
# Pinned and installed first: a CPU build where the machine provides one, else PyPI's default (CUDA on Linux).
TORCH ?= torch==2.13.0

.PHONY: demo test venv clean
venv: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: venv
	$(BIN)/gasloc swarm --peers 4 --duration 120

# The unit and in-process tests on two workers (pytest-xdist), then the multi-process tests one at a time: each
# starts a swarm that wants the machine's cores to itself. Both parts run even when the first fails, and the
# target fails if either did.
test: venv
	$(BIN)/pytest -n 2 tests/unit tests/integration; u=$$?; $(BIN)/pytest tests/e2e; e=$$?; exit $$((u || e))

clean:
	rm -rf $(VENV) runs build *.egg-info
