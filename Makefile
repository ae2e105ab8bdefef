# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install demo test test-slow lint

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
install:
	$(PIP) install torch==2.13.0
	$(PIP) install setuptools wheel ninja
	$(PIP) install --no-build-isolation -e ".[test,bench,train,serve]"

demo: install
	dflash demo

test: install
	$(PYTHON) -m pytest -q

test-slow: install
	$(PYTHON) -m pytest -q -m slow

lint:
	ruff check .
