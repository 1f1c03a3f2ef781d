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
PIP_QUIET  := --quiet --disable-pip-version-check
PYTEST_ARGS ?=

.PHONY: all build demo test bench docs cuda-build test-cuda-build ci clean

all: test

$(VENV)/.ready: Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_QUIET) $(TORCH_CPU) $(DEPS)
	touch $@

build: $(VENV)/.ready
	$(VENV)/bin/pip install $(PIP_QUIET) --no-build-isolation --no-deps -e . -C build-dir=build/cpu

demo: build
	$(VENV)/bin/python examples/demo.py

test: build
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

bench: build
	$(VENV)/bin/python benchmarks/bench_multi_tensor.py

# The documentation site (docs/, Sphinx + MyST), warnings as errors; open docs/_build/html/index.html.
docs: build
	$(VENV)/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html

# The CUDA variant: compiled and linked with nvcc against torch's CUDA build. No GPU is needed
# to build it; its kernels run only where one is present, and the suite runs on the CPU.
$(CUDA_VENV)/.ready: Makefile
	$(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/pip install $(PIP_QUIET) $(TORCH_CUDA) $(DEPS)
	touch $@

cuda-build: $(CUDA_VENV)/.ready
	PEAK_CUDA=ON $(CUDA_VENV)/bin/pip install $(PIP_QUIET) --no-build-isolation --no-deps -e . -C build-dir=build/cuda

test-cuda-build: cuda-build
	$(CUDA_VENV)/bin/python -m pytest $(PYTEST_ARGS)

ci: test test-cuda-build

clean:
	rm -rf build
