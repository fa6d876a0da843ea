# Every target works on a fresh clone: .venv is created on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# Sleeping OpenMP waiters: spinning ones slow everything 20x as soon as two processes share the cores.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: demo test install clean

$(BIN)/shaky: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $@

install: $(BIN)/shaky

demo: $(BIN)/shaky
	$(BIN)/shaky demo

test: $(BIN)/shaky
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache build *.egg-info
