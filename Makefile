# Two entry points: `make run` (the demo) and `make test` (the whole suite).
# Both create the virtual environment in .venv on first use (Python 3.11 and make are enough).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: run test lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m serve

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check leyline_jax pallas_kernels checkpoints serve tests

clean:
	rm -rf $(VENV) .checkpoints .pytest_cache
