# The two commands a newcomer runs: `make bench` and `make test`. Each creates .venv and
# installs what it needs (PyTorch pinned to the local CPU wheel through constraints.txt).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.dspark-installed

.PHONY: install test lint bench example clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,examples]'   # examples: tests run them
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/mypy src/dspark

test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/dspark bench --suite quick --report bench-report

example: $(STAMP)
	$(VENV)/bin/dspark run --nproc 2 examples/hello_distributed.py

clean:
	rm -rf $(VENV) bench-report .pytest_cache .mypy_cache .ruff_cache
