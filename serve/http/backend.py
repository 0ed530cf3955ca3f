"""What the app serves (`Backend`): the engine's worker, the tokenizer, the HTTP sessions and
the model's public name; `load_backend` builds one from a model name or path.

Tokenizers. A checkpoint gets `serve.chat.tokenizer_for(path)` (a GGUF file: its own tokenizer
and ChatML; anything else: DeepSeek's tokenizer and layout). A model whose vocabulary is smaller
than its tokenizer's, such as the embedded tiny default (256 ids) with DeepSeek's tokenizer
(129,280), gets `ModVocabTokenizer`: every id the tokenizer makes is taken modulo the model's
vocabulary. The chat layout and its exact per-message spans are kept (DeepSeek's BOS and EOS,
ids 0 and 1, are the tiny model's own); text decodes through the tokenizer's first ids (bytes
and a few specials). Good for exercising the server; the text itself is of course noise.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

from serve import chat
from serve.engine import Engine, EngineConfig
from serve.http.auth import Tenants
from serve.http.limits import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_BODY_BYTES
from serve.http.metrics import Metrics
from serve.http.responses_input import Store
from serve.http.sessions import HttpSessions
from serve.http.text import ModVocabTokenizer
from serve.http.worker import EngineWorker

DEFAULT_MAX_TOKENS = 256  # chat completions without max_tokens: this, within the context
SESSION_TTL_S = 3600.0  # a named session idle this long is closed (`--session-ttl`)
MAX_SESSIONS = 10_000  # named sessions in all (`--max-sessions`): the LRU idle ones go first


@dataclasses.dataclass
class Backend:
    worker: EngineWorker
    tokenizer: object
    model_name: str
    max_seq_len: int
    vocab_size: int
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    request_timeout_s: float = 600.0
    snapshot_dir: str | None = None  # durable sessions: restored at start, saved at shutdown
    tenants: Tenants = dataclasses.field(default_factory=Tenants)  # API keys (none: one tenant)
    max_body_bytes: int = MAX_BODY_BYTES  # a larger request body is a 413
    body_timeout_s: float = BODY_TIMEOUT_S  # a body not in by then is a 408
    header_timeout_s: float = HEADER_TIMEOUT_S  # a connection without a request head by then
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # stored responses (`previous_response_id`: serve.http.responses_input.Store)
    responses: Store = dataclasses.field(default_factory=Store)
    # the directive context editing's clears are spliced as when a request names no mode
    # ("amortize" or "forget": `--context-edit-mode`)
    context_edit_mode: str = "amortize"

    def __post_init__(self):
        if self.context_edit_mode not in ("amortize", "forget"):
            raise ValueError(f"context_edit_mode={self.context_edit_mode!r}: amortize or forget")
        self.sessions.context.mode = self.context_edit_mode

    @functools.cached_property
    def grammars(self):
        """`serve.grammar.Grammars` of the tokenizer (None: one without its own ids, the tiny
        model's `ModVocabTokenizer`). `build_app` builds them before serving: llguidance holds
        the GIL while it reads the vocabulary (0.5 s for SmolLM2's), which on the first
        constrained request stalled every other one."""
        if not hasattr(self.tokenizer, "tokenizer_json"):
            return None
        from serve.grammar import Grammars

        return Grammars(
            self.tokenizer.tokenizer_json(), self.vocab_size, self.tokenizer.stop_tokens
        )

    @property
    def metrics(self) -> Metrics:
        return self.worker.metrics

    @property
    def sessions(self) -> HttpSessions:
        return self.worker.sessions

    @classmethod
    def for_engine(
        cls, engine, tokenizer, model_name: str, *, max_queue: int = 64,
        session_ttl_s: float | None = SESSION_TTL_S, max_sessions: int | None = MAX_SESSIONS,
        max_sessions_per_tenant: int | None = None, **kw,
    ):  # fmt: skip
        """A backend over `engine` (its worker not started); `kw`: `Backend` fields. Named
        sessions: closed after `session_ttl_s` idle, at most `max_sessions` in all and
        `max_sessions_per_tenant` a tenant (None: no limit; `HttpSessions`)."""
        vocab = engine.model.config.vocab_size
        if tokenizer.vocab_size > vocab:
            tokenizer = ModVocabTokenizer(tokenizer, vocab)
        count = lambda text: len(tokenizer.encode(text))  # noqa: E731
        sessions = HttpSessions(count, session_ttl_s, max_sessions, max_sessions_per_tenant)
        worker = EngineWorker(engine, Metrics(), sessions, max_queue=max_queue)
        return cls(worker, tokenizer, model_name, engine.state.max_seq_len, vocab, **kw)


def parse_mesh(text: str):
    """ "DATAxMODEL" -> a `leyline_jax.MeshConfig` over the first DATA*MODEL devices."""
    import leyline_jax as ll

    data, sep, model = text.lower().partition("x")
    if not sep or not data.isdigit() or not model.isdigit():
        raise ValueError(f"mesh {text!r} must be DATAxMODEL, e.g. 2x4")
    return ll.MeshConfig.create(data=int(data), model=int(model))


def load_backend(
    model: str = "tiny",
    config: EngineConfig | None = None,
    *,
    root: str = ".checkpoints",
    name: str | None = None,
    max_queue: int = 64,
    warmup: bool = False,
    mesh: str | None = None,
    dtype: str = "fp32",
    **kw,
) -> Backend:
    """Load a model ("tiny": the embedded default, written under `root`; "smollm2"; a
    checkpoint directory or .gguf file), its tokenizer and an engine of `config` (not
    started). `warmup`: the worker compiles every shape first (`Engine.warmup_plan`), one
    between steps while idle, serving meanwhile. `mesh`: "DATAxMODEL" (e.g. "2x4") to serve
    over that device mesh (None: one device). `dtype`: the params' ("fp32" or "bf16", as
    `--kv-dtype` names them). `kw`: `Backend` fields."""
    import leyline_jax as ll
    from serve.engine.config import DTYPES

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")

    if model == "tiny":
        from checkpoints.tiny import ensure_default_checkpoints

        path = str(ensure_default_checkpoints(root)["deepseek_v3"])
        tokenizer = chat.ChatTokenizer()
    else:
        path = chat.model_path(model)
        tokenizer = chat.tokenizer_for(path)
    grid = None if mesh is None else parse_mesh(mesh)
    m = ll.load_model(path, DTYPES[dtype], mesh=grid)  # each param on its shards as it is read
    engine = Engine(m, config, mesh=grid)
    served = name or (model if model in ("tiny", "smollm2") else Path(path).name)
    backend = Backend.for_engine(engine, tokenizer, served, max_queue=max_queue, **kw)
    if warmup:  # compiled by the worker while it serves; /health says 503 until it is done
        backend.worker.warming = engine.warmup_plan()
    return backend
