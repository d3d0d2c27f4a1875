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
#   make mutation-check     shows the differential suite fails on five known defects put back
#   make wheelhouse         dist/wheelhouse/: fastchain, Chainer and what an offline GPU node lacks
#   make wheelhouse-check   a clean Python 3.12 venv with the node's packages installs from it offline
#   make cupy14-check       Chainer and fastchain beside CuPy 14 and CUDA 13's libraries, GPU or not

PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= test,mpi,recipes
# Empty: the newest NumPy the registry offers (2.x). E.g. NUMPY_SPEC='numpy==1.26.*'.
NUMPY_SPEC ?=
# 1: keep setuptools<82 (which still ships pkg_resources) after building Chainer.
OLD_SETUPTOOLS ?= 0
PYTEST_ARGS ?=
# Hypothesis' seed for `make test`: fixed, so that CI and a run here draw the same
# examples (a failure repeats); `make test-differential` draws a new one each run.
HYPOTHESIS_SEED ?= 0
# The cuDNN frontend's Python module (11.6 MiB, without the CUTLASS DSL and TVM FFI
# it asks for, which fastchain's graphs do not use): the tests describe every cuDNN
# graph fastchain builds through its real API. Empty: not installed.
CUDNN_FRONTEND ?= nvidia-cudnn-frontend

PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.fastchain-setup
# What the venv was set up with: a change (EXTRAS=...,bench, another NUMPY_SPEC)
# sets it up again, as a change of pyproject.toml does.
SETUP_ARGS := extras=$(EXTRAS) numpy=$(NUMPY_SPEC) old_setuptools=$(OLD_SETUPTOOLS) cudnn_frontend=$(CUDNN_FRONTEND)
SETUP_ARGS_FILE := $(VENV)/.fastchain-setup-args

.PHONY: FORCE setup test test-np1 doctor demo bench gpu-check clean test-differential mutation-check \
	wheelhouse wheelhouse-check cupy14-check

setup: $(STAMP)

# Chainer 7.8.1's setup.py imports pkg_resources, which setuptools>=82 no longer
# has, so a plain `pip install chainer` fails in pip's isolated build. Build it
# without isolation against setuptools<82, then (by default) move to the newest
# setuptools so the venv is what a user has today.
$(SETUP_ARGS_FILE): FORCE
	@mkdir -p $(VENV)
	@echo '$(SETUP_ARGS)' | cmp -s - $@ || echo '$(SETUP_ARGS)' > $@

FORCE:

$(STAMP): pyproject.toml Makefile $(SETUP_ARGS_FILE)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -U pip
	$(PIP) install "setuptools<82" wheel $(NUMPY_SPEC)
	$(PY) -c "import importlib.metadata as m; m.version('chainer')" 2>/dev/null \
	  || $(PIP) install --no-build-isolation "chainer==7.8.1"
	$(PIP) install -e ".[$(EXTRAS)]" $(NUMPY_SPEC)
	@if [ -n "$(CUDNN_FRONTEND)" ]; then $(PIP) install --no-deps $(CUDNN_FRONTEND); fi
	@if [ "$(OLD_SETUPTOOLS)" != 1 ]; then $(PIP) install -U setuptools; fi
	$(PY) -c "import chainer, fastchain; print('fastchain ready: Chainer', chainer.__version__)"
	@touch $(STAMP)

test: setup
	$(VENV)/bin/pytest --hypothesis-seed=$(HYPOTHESIS_SEED) $(PYTEST_ARGS)

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

BENCHMARKS := loader overhead allreduce scaling learners nvtx_cost watch_cost onednn_threads drift ladder

bench: setup
	$(PIP) install -e ".[$(EXTRAS),bench]"
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
	$(PY) benchmarks/gpu_check.py --results $(GPU_RESULTS) $(GPU_CHECK_ARGS)
	$(PY) benchmarks/summary.py $(GPU_RESULTS)

# Chainer 7.8.1 and fastchain beside CuPy 14 (cupy-cuda13x and what its ctk extra
# brings in CuPy 14.2: CUDA 13's runtime, NVRTC, cuBLAS, cuFFT, cuRAND, cuSOLVER,
# cuSPARSE from NVIDIA's wheels, about 1.3 GB) in a folder of their own, so the
# venv stays as CI has it. Works without a GPU: every module is imported and what
# Chainer and fastchain conclude is written down (tests/cupy14_check.py).
CUPY14_DIR ?= .cupy14
CUPY14_LIBS := $(CUPY14_DIR)/nvidia/cu13/lib

cupy14-check: setup
	@test -d $(CUPY14_DIR)/cupy || { \
	  $(PIP) install --target $(CUPY14_DIR) --no-deps "cupy-cuda13x==14.*" && \
	  $(PIP) install --target $(CUPY14_DIR) "cuda-pathfinder==1.*,>=1.3.4" \
	    "cuda-toolkit[cublas,cudart,cufft,curand,cusolver,cusparse,nvrtc]==13.*"; }
	PYTHONPATH=$(CUPY14_DIR) LD_LIBRARY_PATH=$(CUPY14_LIBS)$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH} \
	  $(PY) -P tests/cupy14_check.py benchmarks/results/cupy14_check.json

# --- offline install (../shared/GPU-NODE.md) -----------------------------------
# dist/wheelhouse/ holds what a machine with no package index needs besides
# what it has: fastchain's wheel (its Chainer import hook included), Chainer
# 7.8.1 built into a wheel as `make setup` builds it (setuptools<82, no
# isolation), and the dependencies the reference GPU node lacks, for CPython
# $(WHEEL_PY) manylinux x86-64. On the node:
#   pip install --no-index --find-links dist/wheelhouse fastchain
WHEEL_PY ?= 3.12
WHEELHOUSE ?= dist/wheelhouse
# fastchain's and Chainer's requirements that the node does not have (GPU-NODE.md:
# it has numpy, pillow, filelock, protobuf, six, typing-extensions, mpi4py, ...).
NODE_LACKS ?= nvtx simplejpeg threadpoolctl packaging setuptools
# Not a requirement of fastchain, installed on the node with --no-deps: cuDNN 9's graphs
# (the node has cuDNN 9 itself, nvidia-cudnn-cu13, and cuda-bindings).
NODE_OPTIONAL ?= nvidia-cudnn-frontend
# What the GPU tests need that the node lacks (property-based: hypothesis; about 1.3 MiB):
# on the node, pip install --no-index --find-links dist/wheelhouse hypothesis.
NODE_TEST_LACKS ?= hypothesis sortedcontainers
# The node's own packages, for wheelhouse-check's stand-in of it.
NODE_HAS ?= numpy pillow filelock protobuf six typing-extensions pyyaml
# What the node's gpu_check.py runs with (it has them; no hypothesis): wheelhouse-check
# then rehearses the node's command on the CPU, in that venv, from this tree.
NODE_TOOLS ?= pytest pytest-timeout
WHEEL_PLATFORM := --only-binary=:all: --implementation cp --python-version $(WHEEL_PY) \
	--abi cp$(subst .,,$(WHEEL_PY)) --platform manylinux2014_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64

wheelhouse: setup
	rm -rf $(WHEELHOUSE) && mkdir -p $(WHEELHOUSE)
	$(PIP) wheel --no-deps --no-build-isolation -w $(WHEELHOUSE) "chainer==7.8.1"
	$(PIP) wheel --no-deps -w $(WHEELHOUSE) .
	$(PIP) download --no-deps -d $(WHEELHOUSE) $(WHEEL_PLATFORM) $(NODE_LACKS) $(NODE_OPTIONAL) \
	  $(NODE_TEST_LACKS)
	@du -sh $(WHEELHOUSE); ls $(WHEELHOUSE)

# (Scripts under tests/ run with -P: tests/ on sys.path would put its nvtx/ and cudnn/
# test packages in place of the real nvtx and cudnn modules.)
# A clean venv of Python $(WHEEL_PY) gets the node's packages from the index
# (the node has them already), then fastchain from the wheelhouse alone
# (--no-index): a missing dependency fails here. Then Chainer and fastchain
# import (the shims applied by the wheel's import hook, whatever the import
# order) and train a step with enable(), and the doctor runs; then the node's
# benchmarks/gpu_check.py runs its CPU-possible steps there (--device @numpy).
WHEELCHECK_VENV ?= dist/wheelhouse-check-venv
WHEEL_PYTHON := $(shell for p in python$(WHEEL_PY) $$HOME/.pyenv/versions/$(WHEEL_PY)*/bin/python$(WHEEL_PY) \
	  /usr/bin/python$(WHEEL_PY); do $$p -c 'import sys' >/dev/null 2>&1 && { echo $$p; break; }; done)

wheelhouse-check: wheelhouse
	@test -n "$(WHEEL_PYTHON)" || { echo "wheelhouse-check: no Python $(WHEEL_PY) here"; exit 1; }
	rm -rf $(WHEELCHECK_VENV) && $(WHEEL_PYTHON) -m venv $(WHEELCHECK_VENV)
	$(WHEELCHECK_VENV)/bin/python -m pip --disable-pip-version-check -q install $(NODE_HAS)
	$(WHEELCHECK_VENV)/bin/python -m pip --disable-pip-version-check -q install \
	  --no-index --find-links $(WHEELHOUSE) fastchain
	$(WHEELCHECK_VENV)/bin/python -m pip --disable-pip-version-check -q install \
	  --no-index --find-links $(WHEELHOUSE) --no-deps $(NODE_OPTIONAL)
	cd $(WHEELCHECK_VENV) && ./bin/python -P $(CURDIR)/tests/wheelhouse_check.py
	$(WHEELCHECK_VENV)/bin/fastchain doctor > /dev/null && echo "wheelhouse-check: doctor ran"
	$(WHEELCHECK_VENV)/bin/python -m pip --disable-pip-version-check -q install $(NODE_TOOLS)
	$(WHEELCHECK_VENV)/bin/python -m pip --disable-pip-version-check -q install \
	  --no-index --find-links $(WHEELHOUSE) hypothesis
	$(WHEELCHECK_VENV)/bin/python benchmarks/gpu_check.py --quick --device @numpy \
	  --steps doctor,gpu_tests,resnet_fp32,nvtx,breakdown --image-size 32 --batch 2 \
	  --results $(WHEELCHECK_VENV)/gpu-check --pack $(WHEELCHECK_VENV)/gpu-check.tar.gz

clean:
	rm -rf .venv .venv-np1 .pytest_cache result recipes/*/.data benchmarks/.cache dist
