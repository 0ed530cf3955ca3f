"""Running the server: `python -m serve.http` (`main`), and `ServerThread` (uvicorn in a thread
of this process, for tests and benchmarks).

    python -m serve.http --model PATH|tiny|smollm2 [--dtype fp32|bf16] [--port 8000]
        [--host 127.0.0.1] [--num-pages N] [--page-size N] [--max-seqs N] [--kv-dtype bf16|fp32]
        [--max-queue 64] [--warmup] [--list-shapes] [--compile-cache DIR|off]
        [--max-body-bytes 16777216] [--body-timeout 30] [--header-timeout 10] [--session-ttl 3600]
        [--max-sessions 10000] [--max-sessions-per-tenant N] [--context-edit-mode amortize|forget]
        [--snapshot-dir DIR] [--api-key KEY ...] [--api-keys-file FILE] [--admin-key KEY]

The engine's flags and their defaults are `serve.engine.EngineConfig`'s.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import threading
import time

from serve import compile_cache, multihost
from serve.engine import EngineConfig
from serve.http.app import build_app, restore_sessions, save_at_shutdown
from serve.http.auth import Tenants
from serve.http.backend import (
    DEFAULT_MAX_TOKENS,
    MAX_SESSIONS,
    SESSION_TTL_S,
    Backend,
    load_backend,
)
from serve.http.limits import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_BODY_BYTES, header_deadline

log = logging.getLogger("serve.http")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `backend` in a thread of this process; the engine worker starts with it
    and stops with it."""

    def __init__(self, backend: Backend, host: str = "127.0.0.1", port: int | None = None):
        import uvicorn

        self.backend, self.host = backend, host
        self.port = port or free_port(host)
        self.app = build_app(backend)
        config = uvicorn.Config(
            self.app,
            host=host,
            port=self.port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
            http=header_deadline(backend.header_timeout_s),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.backend.worker.start()
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > timeout or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.backend.worker.stop()
        save_at_shutdown(self.backend)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def freeze_heap() -> None:
    """Move every object alive now (the model, jax's caches, restored sessions) out of the
    garbage collector's reach (`gc.freeze`), as vLLM and SGLang do after loading: a full
    collection otherwise walks them all, holding the GIL (120-170 ms with the tiny model, every
    few snapshots: `/health` stalled that long). Objects frozen are never collected, so only a
    long-lived process at the end of a phase of its life calls it (`main`, and the worker once
    its warmup ends: `EngineWorker.warmed`)."""
    gc.collect()
    gc.freeze()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="An OpenAI-compatible HTTP server over the engine")
    ap.add_argument(
        "--model",
        default="tiny",
        help="tiny (the embedded default), smollm2, a checkpoint dir or .gguf file",
    )
    ap.add_argument("--served-model-name", default=None, help="the model's id in the API")
    ap.add_argument("--root", default=".checkpoints", help="where the tiny default lives")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    EngineConfig.add_arguments(ap)
    ap.add_argument("--max-queue", type=int, default=64, help="requests in flight before 429")
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="a chat completion's budget when the request sets none",
    )
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument(
        "--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="a larger body is a 413"
    )
    ap.add_argument(
        "--body-timeout", type=float, default=BODY_TIMEOUT_S, help="seconds to send a body (408)"
    )
    ap.add_argument(
        "--header-timeout", type=float, default=HEADER_TIMEOUT_S, help="seconds to send a head"
    )
    ap.add_argument(
        "--warmup",
        action="store_true",
        help="compile every shape first, serving meanwhile (/health: 503 until done)",
    )
    ap.add_argument(
        "--list-shapes", action="store_true", help="print the shapes --warmup compiles and exit"
    )
    ap.add_argument("--mesh", default=None, help="a DATAxMODEL device mesh, e.g. 2x4")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="the weights'")
    group = ap.add_argument_group("multi-controller serving (serve.multihost): one per host")
    group.add_argument("--num-processes", type=int, default=1, help="processes in the group")
    group.add_argument("--process-id", type=int, default=0, help="0: the leader (HTTP)")
    group.add_argument("--coordinator", help="HOST:PORT of process 0's coordination service")
    ap.add_argument(
        "--snapshot-dir",
        help="durable sessions: restore them from DIR at start, save them there on shutdown "
        "(SIGTERM, SIGINT) and on POST /v1/snapshot; in a group, every process's DIR holds "
        "the leader's snapshots (shared storage)",
    )
    ap.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="a tenant's key (repeat for more tenants): /v1/ routes need one (serve.http.auth)",
    )
    ap.add_argument(
        "--session-ttl", type=float, default=SESSION_TTL_S, help="close a session idle this long"
    )
    ap.add_argument("--max-sessions", type=int, default=MAX_SESSIONS, help="named sessions")
    ap.add_argument("--max-sessions-per-tenant", type=int, default=0, help="0: no such cap")
    ap.add_argument(
        "--context-edit-mode",
        default="amortize",
        choices=["amortize", "forget"],
        help="the directive context_management's clears are spliced as when a request's "
        "leyline.mode names none (forget: the session re-prefilled from the first clear)",
    )
    ap.add_argument("--api-keys-file", help="tenants' keys, one a line: KEY or TENANT KEY")
    ap.add_argument(
        "--admin-key", action="append", default=[], help="a key for admin routes (snapshot)"
    )
    ap.add_argument(
        "--compile-cache",
        help="keep compiled programs in DIR (default: serve.compile_cache's; off)",
    )
    return ap


def _group_member(backend, warmup: bool, process_id: int) -> bool:
    """Every process of a group: `--warmup` compiles the same programs in the same order; a
    follower restores the leader's snapshot (as the leader does) and follows it, then True."""
    engine = backend.worker.engine
    if warmup:
        log.info("warmup: %d shapes compiled", engine.warmup())
    if process_id == 0:
        return False
    if backend.snapshot_dir is not None:
        restore_sessions(backend)
    log.info("process %d follows the leader", process_id)
    multihost.follow(engine, backend.grammars)
    return True


def main(argv=None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        tenants = Tenants.from_args(args.api_key, args.api_keys_file, args.admin_key)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    group = args.num_processes > 1
    if group:
        if not args.coordinator or not 0 <= args.process_id < args.num_processes:
            ap.error("--num-processes > 1 needs --coordinator and a --process-id below it")
        multihost.initialize(args.coordinator, args.num_processes, args.process_id)
    if tenants.single:
        log.warning("no --api-key: single-tenant (every client shares sessions and the cache)")
    compile_cache.enable(args.compile_cache)
    backend = load_backend(
        args.model,
        EngineConfig.from_args(args),
        root=args.root,
        name=args.served_model_name,
        max_queue=args.max_queue,
        warmup=args.warmup and not group,
        mesh=args.mesh,
        dtype=args.dtype,
        default_max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        header_timeout_s=args.header_timeout,
        snapshot_dir=args.snapshot_dir,
        tenants=tenants,
        session_ttl_s=args.session_ttl or None,
        max_sessions=args.max_sessions or None,
        max_sessions_per_tenant=args.max_sessions_per_tenant or None,
        context_edit_mode=args.context_edit_mode,
    )
    if args.list_shapes:
        names = backend.worker.engine.warmup_plan().names()
        print(f"{len(names)} shapes:", *names, sep="\n  ")
        return
    if group and _group_member(backend, args.warmup, args.process_id):
        return  # a follower, released by the leader
    if backend.worker.warming is not None:
        names = backend.worker.warming.names()
        log.info("warmup: %d shapes to compile: %s", len(names), "; ".join(names))
    import uvicorn

    app = build_app(backend)  # restores the snapshot into the engine itself, as followers do
    if group:
        backend.worker.engine = multihost.Lockstep(backend.worker.engine)
    backend.worker.warmed = freeze_heap
    freeze_heap()
    backend.worker.start()
    log.info(
        "serving %s on http://%s:%d (pid %d)", backend.model_name, args.host, args.port, os.getpid()
    )
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, puts back the handlers it found and
    # raises the signal again: these handlers then let the shutdown snapshot run and the
    # process exit 0 (a signal during the snapshot itself is ignored: it completes)
    stops: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stops.append(signum))
    try:
        # requests still running get 10 s to finish, then the worker fails what is left (503)
        uvicorn.run(
            app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=10,
            http=header_deadline(backend.header_timeout_s),
        )  # fmt: skip
    finally:
        backend.worker.stop()
        save_at_shutdown(backend)
        if group:
            backend.worker.engine.stop()  # the followers return
