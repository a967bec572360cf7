# The two commands a newcomer runs: `make bench` and `make test`. Each creates .venv and
# installs what it needs (PyTorch pinned to the local CPU wheel through constraints.txt).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.dspark-installed

.PHONY: install peers test test-quick lint bench example figures clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,examples,lab]'   # examples, lab: tests run them
	touch $(STAMP)

install: $(STAMP)

# Optional: DeepSpeed as a peer in `dspark bench --suite peers` (make test and CI do not need it).
# --no-build-isolation: DeepSpeed's sdist imports torch to build, and must see the pinned one.
# The second line builds DeepSpeed's CPU shared-memory op once (about a minute), so that no
# benchmark launch waits for a compiler.
peers: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt --no-build-isolation -e '.[dev,examples,lab,peers]'
	DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 $(PY) -c 'from deepspeed.comm.torch import build_shm_op; build_shm_op()'

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/mypy src/dspark

# compileall: where PYTHONDONTWRITEBYTECODE is set, every process (each benchmark worker, each test
# subprocess) would compile DSpark's sources again, ~0.15 s apiece; the cache is refreshed when a
# source changes, and compileall writes it whatever that variable says.
# The whole suite, what CI runs: two pytest workers, each with its own rank pool, a test file to a
# worker (files share module-level fixtures); then the tests that measure this machine's timing
# (straggler, busy machine, linear time, a CPU hog), alone, so that the other worker cannot skew them.
# --no-loadscope-reorder: the files go out in the order tests/conftest.py gives them, the ones that
# launch processes first (see [Note: long files first] there).
test: lint
	$(PY) -m compileall -q src/dspark
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not serial"
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m serial

# The edit-test loop: pure logic only, no rank pool and no launched process (about 2 minutes).
test-quick: $(STAMP)
	$(PY) -m compileall -q src/dspark
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow and not pool and not serial"

bench: $(STAMP)
	$(PY) -m compileall -q src/dspark
	$(VENV)/bin/dspark bench --suite quick --report bench-report

# docs/figures.md and the README's headline table, from the artifacts kept in benchmarks/results/
# (see [Note: figures from artifacts] in src/dspark/bench/figures.py).
figures: $(STAMP)
	$(PY) -m dspark.bench.figures

example: $(STAMP)
	$(VENV)/bin/dspark run --nproc 2 examples/hello_distributed.py

clean:
	rm -rf $(VENV) bench-report .pytest_cache .mypy_cache .ruff_cache
