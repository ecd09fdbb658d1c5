# Two commands that work on a fresh machine (see README.md):
#   make demo   set up .venv and run `sentineld demo` (FAULT=zero-std|lr|none)
#   make test   set up .venv and the Debian test dependencies, lint (ruff, mypy), then run the test suite
FAULT ?= zero-std

.PHONY: setup system-deps demo lint test bench

setup:
	scripts/setup.sh

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

bench: setup
	.venv/bin/python bench/overhead.py
