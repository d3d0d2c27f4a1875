# fastchain's developer and user entry points. Every target sets up the venv first.
#
#   make setup      create .venv (idempotent) with fastchain (editable) + test deps
#   make test       the test suite (what CI runs)
#   make test-np1   the same suite in .venv-np1: NumPy 1.26, Python 3.12, old setuptools
#   make doctor     describe this machine
#   make demo       train ResNet-50 on generated JPEGs with fastchain (the README's main job)
#   make bench      the quick form of every benchmark -> benchmarks/results/
#   make gpu-check  on a GPU machine: GPU tests, then the GPU benchmarks -> benchmarks/results/gpu/
#   make test-differential  the differential suite at full size (>= 2,000 cases; SEED=... repeats)
#   make mutation-check     shows the differential suite fails on four known defects put back

PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= test,mpi,recipes
# Empty: the newest NumPy the registry offers (2.x). E.g. NUMPY_SPEC='numpy==1.26.*'.
NUMPY_SPEC ?=
# 1: keep setuptools<82 (which still ships pkg_resources) after building Chainer.
OLD_SETUPTOOLS ?= 0
PYTEST_ARGS ?=

PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.fastchain-setup

.PHONY: setup test test-np1 doctor demo bench gpu-check clean test-differential mutation-check

setup: $(STAMP)

# Chainer 7.8.1's setup.py imports pkg_resources, which setuptools>=82 no longer
# has, so a plain `pip install chainer` fails in pip's isolated build. Build it
# without isolation against setuptools<82, then (by default) move to the newest
# setuptools so the venv is what a user has today.
$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -U pip
	$(PIP) install "setuptools<82" wheel $(NUMPY_SPEC)
	$(PY) -c "import importlib.metadata as m; m.version('chainer')" 2>/dev/null \
	  || $(PIP) install --no-build-isolation "chainer==7.8.1"
	$(PIP) install -e ".[$(EXTRAS)]" $(NUMPY_SPEC)
	@if [ "$(OLD_SETUPTOOLS)" != 1 ]; then $(PIP) install -U setuptools; fi
	$(PY) -c "import chainer, fastchain; print('fastchain ready: Chainer', chainer.__version__)"
	@touch $(STAMP)

test: setup
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# A working Python 3.12 (pyenv's shim may exist without the version selected).
PY312 := $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do \
	  $$p -c 'import sys' >/dev/null 2>&1 && { echo $$p; break; }; done)

test-np1:
	@test -n "$(PY312)" || echo "no Python 3.12 found: .venv-np1 uses $(PYTHON)"
	$(MAKE) test VENV=.venv-np1 PYTHON="$(or $(PY312),$(PYTHON))" \
	  NUMPY_SPEC='numpy==1.26.*' OLD_SETUPTOOLS=1

# fastchain against plain Chainer on random models, options, optimizers,
# snapshots and data-parallel runs (tests/differential/): EXAMPLES single-process
# cases, a third as many plain scripts with the loader, EXAMPLES/30 MPI launches of
# up to 12 cases each. The seed is printed first; SEED=<it> repeats the run.
DIFFERENTIAL_EXAMPLES ?= 2100

test-differential: setup
	@seed=$${SEED:-$$($(PY) -c 'import random; print(random.randrange(2**32))')}; \
	echo "test-differential: hypothesis seed $$seed (repeat: make test-differential SEED=$$seed)"; \
	FASTCHAIN_DIFFERENTIAL_EXAMPLES=$(DIFFERENTIAL_EXAMPLES) $(VENV)/bin/pytest -p no:cacheprovider \
	  -o timeout=0 tests/differential --hypothesis-seed=$$seed --hypothesis-show-statistics

mutation-check: setup
	$(PY) tests/differential/mutations.py

doctor: setup
	$(VENV)/bin/fastchain doctor

demo: setup
	$(PY) recipes/resnet50/train.py --config recipes/resnet50/demo.yaml --all

BENCHMARKS := loader overhead allreduce scaling nvtx_cost ladder

bench: setup
	@for b in $(BENCHMARKS); do \
	  echo "== benchmarks/$$b.py --quick"; \
	  $(PY) benchmarks/$$b.py --quick || exit 1; \
	done
	$(PY) benchmarks/summary.py benchmarks/results

GPU_RESULTS := benchmarks/results/gpu

gpu-check: setup
	@nvidia-smi -L >/dev/null 2>&1 || { echo "gpu-check: no NVIDIA GPU here (nvidia-smi finds none): run it on a machine with one"; exit 1; }
	$(PIP) install -e ".[$(EXTRAS),gpu]"
	@$(PY) -c "import sys; from fastchain.backends import cuda; s = cuda.cupy_status(); \
	  sys.exit(0 if s.available else 'gpu-check: CuPy cannot use the GPU: {} (fix: {})'.format(s.why, s.fix))"
	$(VENV)/bin/pytest -m gpu -rs
	mkdir -p $(GPU_RESULTS)
	$(PY) benchmarks/ladder.py --results $(GPU_RESULTS)
	$(PY) benchmarks/allreduce.py --communicator nccl \
	  --processes $$($(PY) -c "from fastchain.backends import cuda; print(len(cuda.gpus()))") \
	  --results $(GPU_RESULTS)
	$(PY) benchmarks/overhead.py --results $(GPU_RESULTS)
	$(PY) benchmarks/loader.py --results $(GPU_RESULTS)
	$(PY) benchmarks/nvtx_cost.py --results $(GPU_RESULTS)
	$(PY) benchmarks/summary.py $(GPU_RESULTS)

clean:
	rm -rf .venv .venv-np1 .pytest_cache result recipes/*/.data benchmarks/.cache
