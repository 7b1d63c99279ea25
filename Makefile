# The two commands a newcomer needs (see README.md), plus test-fast. All build .venv first (idempotent).
PY := .venv/bin/python
# make test runs whole modules on this many pytest-xdist workers, one core each (tests/parallel.py); 0: all in one process
TEST_WORKERS ?= 2

.PHONY: setup demo test test-fast
setup:
	scripts/setup_cpu.sh

demo: setup  ## real SGLang server on the small hybrid model + a shared-prefix workload
	$(PY) bench/shared_prefix.py

test: setup  ## the test suite (starts real SGLang servers on loopback)
	$(PY) -m pytest -q -n $(TEST_WORKERS)

test-fast: setup  ## the tests that start no SGLang server, router, Engine or launcher (-m "not server")
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not server"
