# The two commands of the README:
#   make demo   a short mixed-precision training run that prints what it did
#   make test   the whole test suite (CPU build against torch 2.13.0)
# Each installs what it needs on first use, and only that: `demo` the runtime (torch, numpy,
# matplotlib, the build tools) and a build for this machine's CPU level without the test twins;
# `test` adds the test tools and builds the full variant (every CPU level, the test twins) in a
# tree of its own. Rebuilds are incremental (persistent build trees under build/).
PYTHON     ?= python3.11
VENV       ?= .venv
CUDA_VENV  ?= .venv-cuda
TORCH_CPU  ?= torch==2.13.0
TORCH_CUDA ?= torch==2.14.1
BUILD_DEPS := scikit-build-core ninja cmake
RUNTIME_DEPS := numpy matplotlib
TEST_DEPS  := pytest hypothesis expecttest tqdm sphinx myst-parser nbclient nbformat ipykernel
# The trainers peak integrates with (tests/integrations, docs/integrations.md), pinned; installed in
# the same pip command as torch, so that the pinned torch stays (check_torch verifies it).
INTEGRATIONS := lightning==2.6.6 accelerate==1.15.0
PIP_QUIET  := --quiet --disable-pip-version-check
# $(call check_torch,venv,torch==X.Y.Z): fail when the venv's torch is not the pinned release.
check_torch = $(1)/bin/python -c "import sys, torch; want = '$(2)'.split('==')[1]; \
	sys.exit(0 if torch.__version__.split('+')[0] == want else \
	f'{torch.__version__} installed, {want} pinned: a dependency replaced torch')"
PYTEST_ARGS ?=
# `make test` leaves out the long fault-injection soak (`make soak`; CI runs it once).
TEST_SELECT ?= -m "not slow"

.PHONY: all build build-demo demo test lint bench wheel docs soak cuda-build test-cuda-build \
        test-sanitize test-torch gpu-check ci clean

all: test

# The runtime: what `make demo` needs (and a user of the library: torch, numpy; matplotlib for
# the demo's plot; the build tools).
$(VENV)/.runtime: Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_QUIET) $(TORCH_CPU) $(BUILD_DEPS) $(RUNTIME_DEPS)
	$(call check_torch,$(VENV),$(TORCH_CPU))
	touch $@

# The test and docs tools on top (torch named again so that no dependency replaces it).
$(VENV)/.ready: $(VENV)/.runtime
	$(VENV)/bin/pip install $(PIP_QUIET) $(TORCH_CPU) $(TEST_DEPS) $(INTEGRATIONS)
	$(call check_torch,$(VENV),$(TORCH_CPU))
	touch $@

# The demo's build: this machine's CPU level only, no test twins (build/demo).
DEMO_BUILD = -C build-dir=build/demo -C cmake.define.PEAK_TEST_TWINS=OFF \
             -C cmake.define.PEAK_CPU_ISA=native
# Dev and CI builds: every CPU level and the test-only twins (PEAK_TEST_TWINS, csrc/testing/);
# `make wheel` leaves the twins out.
TWINS = -C cmake.define.PEAK_TEST_TWINS=ON

build-demo: $(VENV)/.runtime
	$(VENV)/bin/pip install $(PIP_QUIET) --no-build-isolation --no-deps -e . $(DEMO_BUILD)

build: $(VENV)/.ready
	$(VENV)/bin/pip install $(PIP_QUIET) --no-build-isolation --no-deps -e . -C build-dir=build/cpu $(TWINS)

demo: build-demo
	$(VENV)/bin/python examples/demo.py

test: build
	$(VENV)/bin/python -m pytest $(TEST_SELECT) $(PYTEST_ARGS)

# The structure measures (import cycles, private names, file lengths, amp's line count against
# its ceiling and target).
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
# to build it; its kernels run only where one is present. Its suite is what a CUDA build of
# torch changes (CUDA_BUILD_TESTS: the build facts, the ops and their registration, the CUDA
# tests' collection and skips), not the whole suite again.
CUDA_BUILD_TESTS := tests/build/test_build.py tests/build/test_structure.py tests/ops \
                    tests/optimizers/test_fused_optimizers.py tests/optimizers/test_cuda_optimizers.py \
                    tests/amp/test_amp_cuda.py tests/torch_dialect tests/caster/test_caster_ops.py
$(CUDA_VENV)/.ready: Makefile
	$(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/pip install $(PIP_QUIET) $(TORCH_CUDA) $(BUILD_DEPS) $(RUNTIME_DEPS) pytest hypothesis expecttest
	$(call check_torch,$(CUDA_VENV),$(TORCH_CUDA))
	touch $@

# Its device code for each of the two paths the source has (host_device.h's bf16 conversion is
# the one split by architecture, at sm_80): compute_75 PTX and sm_90 code. The wheel's default
# (CMakeLists.txt) adds 80-real, the same source as 90-real's; `make cuda-build CUDA_ARCHS=...`.
CUDA_ARCHS ?= 75-virtual;90-real
cuda-build: $(CUDA_VENV)/.ready
	PEAK_CUDA=ON PEAK_CUDA_ARCHS="$(CUDA_ARCHS)" $(CUDA_VENV)/bin/pip install $(PIP_QUIET) --no-build-isolation --no-deps -e . -C build-dir=build/cuda $(TWINS) \
	  -C cmake.define.PEAK_CPU_ISA=native

test-cuda-build: cuda-build
	$(CUDA_VENV)/bin/python -m pytest $(TEST_SELECT) $(CUDA_BUILD_TESTS) $(PYTEST_ARGS)

# The long fault-injection runs (2,000 steps per configuration); `make test` runs their short forms.
soak: build
	$(VENV)/bin/python -m pytest -m slow tests/reliability $(PYTEST_ARGS)

# The C++ core built with AddressSanitizer + UBSan (PEAK_SANITIZE=ON, build/asan, its own venv;
# the CPU kernels at -O3 as they ship, the rest at -O0; the native CPU level only), running the kernel and optimizer tests. torch is not instrumented, so the ASan runtime (and
# libstdc++, whose exceptions it intercepts) are preloaded; leak checks are off (CPython's own).
SAN_VENV   ?= .venv-asan
SAN_TESTS  := tests/ops/test_multi_tensor_ops.py tests/ops/test_launch_plan.py tests/ops/test_ops_errors.py \
              tests/ops/test_update_scale.py tests/optimizers/test_fused_optimizers.py tests/ops/test_opcheck.py \
              tests/optimizers/test_stochastic_rounding.py tests/optimizers/test_fused_clipping.py \
              tests/ops/test_cpu_levels.py tests/caster/test_caster_worker_threads.py
$(SAN_VENV)/.ready: Makefile
	$(PYTHON) -m venv $(SAN_VENV)
	$(SAN_VENV)/bin/pip install $(PIP_QUIET) $(TORCH_CPU) $(BUILD_DEPS) numpy pytest hypothesis expecttest
	touch $@

test-sanitize: $(SAN_VENV)/.ready
	PEAK_SANITIZE=ON $(SAN_VENV)/bin/pip install $(PIP_QUIET) --no-build-isolation --no-deps -e . -C build-dir=build/asan $(TWINS) \
	  -C cmake.define.PEAK_CPU_ISA=native
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so.6)" \
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
	$(SAN_VENV)/bin/python -m pytest -p no:cacheprovider $(SAN_TESTS) $(PYTEST_ARGS)

# Any torch release against this source: `make test-torch TORCH=2.15.0 [PYTHON=python3.13]`.
# Its own venv (.venv-torch-X.Y.Z-pyA.B) and build tree (this machine's CPU level, with the test
# twins); runs the tests that depend on the torch release (TORCH_TESTS). torch comes from PyPI
# (a CUDA build of several GB for most releases; the kernels are built CPU-only, PEAK_CUDA=OFF).
# PIP_CONSTRAINT=/dev/null: a machine-wide pip constraint that caps torch would refuse the release.
TORCH ?=
TORCH_TESTS := tests/build/test_build.py tests/ops tests/optimizers tests/torch_dialect tests/caster \
               tests/amp tests/fp16_utils
PYVER = $(shell $(PYTHON) -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
TORCH_VENV = .venv-torch-$(TORCH)-py$(PYVER)
test-torch:
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=2.15.0 [PYTHON=python3.13]"; exit 2; }
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install $(PIP_QUIET) --upgrade "pip>=23.1"  # -C: pip 23.1
	PIP_CONSTRAINT=/dev/null $(TORCH_VENV)/bin/pip install $(PIP_QUIET) torch==$(TORCH) $(BUILD_DEPS) numpy pytest hypothesis expecttest
	$(call check_torch,$(TORCH_VENV),torch==$(TORCH))
	PEAK_CUDA=OFF $(TORCH_VENV)/bin/pip install $(PIP_QUIET) --no-build-isolation --no-deps -e . \
	  -C build-dir=build/torch-$(TORCH)-py$(PYVER) $(TWINS) -C cmake.define.PEAK_CPU_ISA=native
	$(TORCH_VENV)/bin/python -m pytest -q $(TEST_SELECT) $(TORCH_TESTS) $(PYTEST_ARGS)

# What CI runs: the steps above in two lanes side by side (NOTE: [CI lanes] in .ci/run).
ci:
	.ci/run

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
