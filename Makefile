# The two commands of the README:
#   make demo   a short mixed-precision training run that prints what it did
#   make test   the whole test suite (CPU build against torch 2.13.0)
# Both create the virtual environment and build peak on first use; rebuilds are incremental
# (persistent build trees under build/).
PYTHON     ?= python3.11
VENV       ?= .venv
CUDA_VENV  ?= .venv-cuda
TORCH_CPU  ?= torch==2.13.0
TORCH_CUDA ?= torch==2.14.1
DEPS       := scikit-build-core ninja cmake numpy pytest hypothesis expecttest matplotlib \
              tqdm sphinx myst-parser nbclient nbformat ipykernel
# The trainers peak integrates with (tests/integrations, docs/integrations.md), pinned; installed in
# the same pip command as torch, so that the pinned torch stays (check_torch verifies it).
INTEGRATIONS := lightning==2.6.6 accelerate==1.15.0
PIP_QUIET  := --quiet --disable-pip-version-check
# $(call check_torch,venv,torch==X.Y.Z): fail when the venv's torch is not the pinned release.
check_torch = $(1)/bin/python -c "import sys, torch; want = '$(2)'.split('==')[1]; \
	sys.exit(0 if torch.__version__.split('+')[0] == want else \
	f'{torch.__version__} installed, {want} pinned: a dependency replaced torch')"
PYTEST_ARGS ?=

.PHONY: all build demo test lint bench wheel docs soak cuda-build test-cuda-build test-sanitize ci clean

all: test

$(VENV)/.ready: Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_QUIET) $(TORCH_CPU) $(DEPS) $(INTEGRATIONS)
	$(call check_torch,$(VENV),$(TORCH_CPU))
	touch $@

# Dev and CI builds include the test-only twins (PEAK_TEST_TWINS, csrc/testing/); `make wheel`
# does not.
TWINS = -C cmake.define.PEAK_TEST_TWINS=ON

build: $(VENV)/.ready
	$(VENV)/bin/pip install $(PIP_QUIET) --no-build-isolation --no-deps -e . -C build-dir=build/cpu $(TWINS)

demo: build
	$(VENV)/bin/python examples/demo.py

test: build
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# The structure measures of issue #15 (import cycles, private names, file lengths, amp's line
# count against its ceiling and target).
lint:
	python3 tools/check_structure.py

bench: build
	$(VENV)/bin/python benchmarks/bench_multi_tensor.py

# A wheel for any x86-64 (the CPU kernels of every level, chosen at run time: docs/build.md),
# built in a tree of its own (without the test-only twins). It requires the torch it was built
# against.
wheel: $(VENV)/.ready
	$(VENV)/bin/pip wheel $(PIP_QUIET) --no-build-isolation --no-deps -w dist . -C build-dir=build/wheel -C cmake.define.PEAK_TEST_TWINS=OFF

# The documentation site (docs/, Sphinx + MyST), warnings as errors; open docs/_build/html/index.html.
docs: build
	$(VENV)/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html

# The CUDA variant: compiled and linked with nvcc against torch's CUDA build. No GPU is needed
# to build it; its kernels run only where one is present, and the suite runs on the CPU.
$(CUDA_VENV)/.ready: Makefile
	$(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/pip install $(PIP_QUIET) $(TORCH_CUDA) $(DEPS) $(INTEGRATIONS)
	$(call check_torch,$(CUDA_VENV),$(TORCH_CUDA))
	touch $@

cuda-build: $(CUDA_VENV)/.ready
	PEAK_CUDA=ON $(CUDA_VENV)/bin/pip install $(PIP_QUIET) --no-build-isolation --no-deps -e . -C build-dir=build/cuda $(TWINS)

test-cuda-build: cuda-build
	$(CUDA_VENV)/bin/python -m pytest $(PYTEST_ARGS)

# The long fault-injection runs (2,000 steps per configuration); CI runs their short forms in `test`.
soak: build
	$(VENV)/bin/python -m pytest -m slow tests/reliability $(PYTEST_ARGS)

# The C++ core built with AddressSanitizer + UBSan (PEAK_SANITIZE=ON, build/asan, its own venv),
# running the kernel and optimizer tests. torch is not instrumented, so the ASan runtime (and
# libstdc++, whose exceptions it intercepts) are preloaded; leak checks are off (CPython's own).
SAN_VENV   ?= .venv-asan
SAN_TESTS  := tests/ops/test_multi_tensor_ops.py tests/ops/test_launch_plan.py tests/ops/test_ops_errors.py \
              tests/ops/test_update_scale.py tests/optimizers/test_fused_optimizers.py tests/ops/test_opcheck.py \
              tests/optimizers/test_stochastic_rounding.py tests/optimizers/test_fused_clipping.py \
              tests/ops/test_cpu_levels.py tests/caster/test_caster_worker_threads.py
$(SAN_VENV)/.ready: Makefile
	$(PYTHON) -m venv $(SAN_VENV)
	$(SAN_VENV)/bin/pip install $(PIP_QUIET) $(TORCH_CPU) scikit-build-core ninja cmake numpy pytest hypothesis expecttest
	touch $@

test-sanitize: $(SAN_VENV)/.ready
	PEAK_SANITIZE=ON $(SAN_VENV)/bin/pip install $(PIP_QUIET) --no-build-isolation --no-deps -e . -C build-dir=build/asan $(TWINS)
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so.6)" \
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
	$(SAN_VENV)/bin/python -m pytest -p no:cacheprovider $(SAN_TESTS) $(PYTEST_ARGS)

ci: test test-cuda-build test-sanitize

clean:
	rm -rf build

# One command on a GPU machine (no venv, no network): builds peak for the local GPU's
# architecture and the native CPU level into build/gpu-check with the interpreter given (default
# python3, whatever torch it has), then the smoke test, every CUDA test and the GPU benchmarks,
# each under its own timeout; one report (report.md + logs) in OUT. DRY_RUN=1: the same on the
# CPU (CPU-only build, toy benchmark sizes), to check the script without a GPU. docs/build.md.
#   make gpu-check [OUT=dir] [DRY_RUN=1] [PYTHON=python3] [GPU_CHECK_ARGS="--budget-s 600"]
GPU_CHECK_OUT  ?= build/gpu-check-report
GPU_CHECK_ARGS ?=
# PYTHON's default above names the venv's base interpreter; a GPU machine has its own python3.
gpu-check: GPU_CHECK_PY = $(if $(filter command line environment,$(origin PYTHON)),$(PYTHON),python3)
gpu-check:
	$(GPU_CHECK_PY) tools/gpu_check.py --out "$(or $(OUT),$(GPU_CHECK_OUT))" \
	  $(if $(filter 1 yes true,$(DRY_RUN)),--dry-run) $(GPU_CHECK_ARGS)
.PHONY: gpu-check
