# The two commands a newcomer needs (see README.md). Both build .venv first (idempotent).
PY := .venv/bin/python

.PHONY: setup demo test
setup:
	scripts/setup_cpu.sh

demo: setup  ## real SGLang server on the small hybrid model + a shared-prefix workload
	$(PY) bench/shared_prefix.py

test: setup  ## the test suite (starts real SGLang servers on loopback)
	$(PY) -m pytest -q
