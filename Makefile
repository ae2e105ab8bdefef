# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install demo test test-slow test-vllm lint

# torch first, pinned, its CPU build: a bare `torch` requirement would pull a multi-GB CUDA build.
install:
	tools/install-torch $(PYTHON)
	$(PIP) install setuptools wheel ninja
	$(PIP) install --no-build-isolation -e ".[test,bench,train,serve]"

demo: install
	dflash demo

test: install
	$(PYTHON) -m pytest -q

test-slow: install
	$(PYTHON) -m pytest -q -m slow

# vLLM in its own venv (.venv-vllm), never in this environment; see docs/vllm.md
test-vllm:
	.ci/vllm-env .venv-vllm
	.venv-vllm/bin/python -m pytest -q -m vllm

# Python by ruff, C++ (csrc/, ascend_kernels/, tests/*.cpp) by clang-format and .clang-format
lint:
	ruff check .
	clang-format --dry-run --Werror $$(git ls-files 'csrc/*.cpp' 'csrc/*.h' 'ascend_kernels/*.cpp' \
	  'ascend_kernels/*.h' 'tests/*.cpp')
