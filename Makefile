# Every target works on a fresh clone: .venv is created on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

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
