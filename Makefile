# Two commands that work on a fresh machine (see README.md):
#   make demo   set up .venv and run `sentineld demo` (FAULT=zero-std|lr|none)
#   make test   set up .venv and the Debian test dependencies, lint (ruff, mypy), then run the test suite
#   make check  the quick tier for a newcomer (< 5 min on 2 cores): lint, then the unit-level tests
#               (no real servers, no multi-process end-to-end runs, no long training scenarios)
FAULT ?= zero-std
# The quick tier: directories of unit-level tests, minus the files that train for hundreds of
# steps per case (the signature scenarios and onset runs; make test runs them) and the slow marks.
CHECK_DIRS = tests/contracts tests/daemon tests/agent tests/replay tests/preflight tests/report \
             tests/adversarial tests/signatures
CHECK_SKIP = --ignore=tests/signatures/test_runs.py --ignore=tests/signatures/test_dead_onset.py

.PHONY: setup system-deps demo lint test check bench

# Not echoed: setup.sh is silent when .venv is up to date and says what it installs otherwise
# (make demo printed a bare `scripts/setup.sh` line above the demo).
setup:
	@scripts/setup.sh

system-deps:
	scripts/system-deps.sh

demo: setup
	.venv/bin/sentineld demo --fault $(FAULT)

# mypy twice: the folders as configured (fast, what editors run), then the installed package
# (agent/ as sentineld.agent, replay/ as sentineld.replay), which sees the imports across them.
lint: setup
	.venv/bin/python -m ruff check
	.venv/bin/python -m mypy
	.venv/bin/python scripts/typecheck.py

test: setup system-deps lint
	.venv/bin/python -m pytest -q -p no:cacheprovider tests

check: setup lint
	.venv/bin/python -m pytest -q -p no:cacheprovider -x -m "not slow" $(CHECK_SKIP) $(CHECK_DIRS)

bench: setup
	.venv/bin/python bench/overhead.py
