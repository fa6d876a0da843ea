# Every target works on a fresh clone: .venv is created on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-kill test-gpu reproduce install clean

$(BIN)/shaky: pyproject.toml constraints.txt setup.py shaky/comm/_fastpath.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	@touch $@

install: $(BIN)/shaky

demo: $(BIN)/shaky
	$(BIN)/shaky demo

# The tests start many processes at once, so their OpenMP threads sleep from the start instead of adapting
# (a shaky command's own default, shaky/waiting.py); the wait changes no number a test checks.
test test-kill test-gpu: export OMP_WAIT_POLICY ?= PASSIVE

test: $(BIN)/shaky
	$(BIN)/python -m pytest

# A run and a sweep stopped by SIGINT, SIGTERM and SIGKILL at 20 random moments each, resumed every time,
# compared with the uninterrupted ones (tests/test_kill.py), and by SIGINT and SIGTERM at 50 moments of their
# whole lives (tests/test_signals.py); the launchers' restarts (tests/test_launch.py), ranks killed, frozen or
# started again (tests/test_membership.py), a hung rank (tests/test_dist_faults.py), rounded values and a failure
# over real loss and a delayed exchange in the background replayed (tests/test_udp_train.py), the fuzzed
# configs run end to end in processes (tests/test_fuzz.py). Thirty minutes or more.
test-kill: $(BIN)/shaky
	$(BIN)/python -m pytest -m kill

# The equivalence tests on a CUDA device (tests/test_gpu.py; make test runs them too, and skips them without one).
test-gpu: $(BIN)/shaky
	$(BIN)/python -m pytest -m gpu -rs

# Every claim in experiments/*.toml: run the sweeps (finished runs are kept, so an
# interrupted reproduce resumes), then write REPRODUCTION.md and its plots in docs/reproduction.
# In the papers' order (RPS, RI-SGD, DTS); any other experiment file follows.
EXPERIMENTS := $(wildcard experiments/rps_drop_rate.toml experiments/rps_workers.toml experiments/rps_transport.toml \
	experiments/risgd.toml experiments/dts_delay.toml experiments/dts_scale.toml)
EXPERIMENTS += $(filter-out $(EXPERIMENTS),$(wildcard experiments/*.toml))
# The text experiments/gpt_*.toml read (data.path): shaky.data.synthetic_text, the same bytes on every machine,
# written here (nothing is downloaded) and checked against the SHA-256 their descriptions give, so that runs kept
# in runs/sweeps are never mixed with runs on other text.
SYNTHETIC_TEXT := runs/data/synthetic.txt
SYNTHETIC_BYTES := 1000000
SYNTHETIC_SHA256 := 6cd340e46d3f44efaba4da00ae6c97eb4edf5ed4e9e2af5db68a2125884eabdf
$(SYNTHETIC_TEXT): $(BIN)/shaky shaky/data.py
	@mkdir -p $(@D)
	$(BIN)/python -c "import hashlib, sys; from shaky.data import synthetic_text; \
		text = synthetic_text($(SYNTHETIC_BYTES)).encode('ascii'); digest = hashlib.sha256(text).hexdigest(); \
		sys.exit(f'synthetic_text($(SYNTHETIC_BYTES)) has SHA-256 {digest}, not $(SYNTHETIC_SHA256)') \
		if digest != '$(SYNTHETIC_SHA256)' else open('$@.tmp', 'wb').write(text)"
	mv $@.tmp $@
reproduce: $(BIN)/shaky $(SYNTHETIC_TEXT)
	$(BIN)/shaky sweep $(EXPERIMENTS) --out runs/sweeps
	$(BIN)/shaky report $(patsubst experiments/%.toml,runs/sweeps/%,$(EXPERIMENTS)) \
		--out docs/reproduction --reproduction REPRODUCTION.md

clean:
	rm -rf $(VENV) runs .pytest_cache build *.egg-info
