# `make train` / `make test` / `make bench` set up .venv on first use.
# GPU users: make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" test
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
ARGS   ?=
RECIPE ?= lm

.PHONY: venv train test test-deepspeed bench lint clean

venv: $(VENV)/.installed

# pip compiles the installed files to bytecode one at a time (~40 s of the install on 2 cores); compileall -j 0
# does the same on every core. (-qq: pip, too, leaves aside the files written for a newer Python than this one.)
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile $(TORCH)
	$(PY) -m pip install -q --no-compile -e ".[dev]"
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	touch $@
	@echo "installed: in a new shell run 'source $(VENV)/bin/activate' for python -m trainer, or call $(VENV)/bin/trainer"

train: venv
	$(PY) -m trainer recipe=$(RECIPE) $(ARGS)

# Where PYTHONDONTWRITEBYTECODE is set (the machines this project is built on set it), no process writes the .pyc files it compiles: each
# xdist worker, forkserver and fresh interpreter of the suite compiled the same sources again. Compiled once here.
# A pytest worker per core (JOBS=N to choose). One more filled the ~15% of 2 cores the suite's waits leave idle (4%
# idle, 258 s against 269 s), but its contention made a wandb file test read the file before wandb had written it.
JOBS ?= $(shell nproc)
test: venv
	$(PY) -m compileall -qq -j 0 trainer recipes tests benchmarks || true
	$(PY) -m pytest -q -n $(JOBS) tests $(ARGS)

# world=deepspeed's tests (pytest -m deepspeed): the deepspeed extra is installed first (after torch, without
# build isolation: its build imports torch). On a CPU the first engine start compiles one DeepSpeed op (~1 min).
test-deepspeed: $(VENV)/.deepspeed
	$(PY) -m pytest -q -n auto -m deepspeed tests/test_deepspeed.py $(ARGS)

$(VENV)/.deepspeed: $(VENV)/.installed
	$(PY) -m pip install -q --no-build-isolation -e ".[deepspeed]"
	touch $@

bench: venv
	$(PY) -m benchmarks $(ARGS)

lint: venv
	$(VENV)/bin/ruff check trainer recipes tests benchmarks

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
