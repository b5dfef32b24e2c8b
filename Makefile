# `make train` / `make test` / `make bench` set up .venv on first use.
# GPU users: make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" test
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
ARGS   ?=
RECIPE ?= lm

.PHONY: venv train test bench lint clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@
	@echo "installed: in a new shell run 'source $(VENV)/bin/activate' for python -m trainer, or call $(VENV)/bin/trainer"

train: venv
	$(PY) -m trainer recipe=$(RECIPE) $(ARGS)

test: venv
	$(PY) -m pytest -q -n auto tests $(ARGS)

bench: venv
	$(PY) -m benchmarks $(ARGS)

lint: venv
	$(VENV)/bin/ruff check trainer recipes tests benchmarks

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
