"""Contracts kept by the code's own types, checked: a step passes one batch value from the
scheduler to the runner and on to post-processing; every session fact has one writing module;
every engine method says how a multi-host group keeps it in lockstep, and the leader's wrapper
refuses one that does not.

Each checker is also run on a made-up case that breaks its rule, so none passes vacuously.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import inspect
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import leyline_jax as ll
from serve import multihost
from serve.engine import Engine, SamplingParams
from serve.engine.batch import Batch, Ran
from serve.engine.types import LOCKSTEP_KINDS, Session

REPO = Path(__file__).resolve().parents[1]
FIELDS = {f.name for f in dataclasses.fields(Session)} | {"tokens"}
MUTATORS = {"append", "extend", "insert", "remove", "pop", "popleft", "clear", "sort", "add"}


# ---- one writer per session fact ---------------------------------------------------------------
def _session_names(fn: ast.AST) -> set[str]:
    """Names a function binds to a `Session`: parameters annotated with it, names assigned
    from `<x>.session`, `Session(...)`, `<table>.get(...)` or `<x>.sessions[...]`, and loop
    variables over `<x>.sessions.values()` / `<x>.holding.values()`."""
    out = set()
    args = fn.args.args + fn.args.kwonlyargs if isinstance(fn, ast.FunctionDef) else []
    for a in args:
        if a.annotation is not None and "Session" in ast.unparse(a.annotation):
            out.add(a.arg)
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and len(n.targets) == 1:
            target, value = n.targets[0], n.value
            if isinstance(target, ast.Name) and _is_session(value, out):
                out.add(target.id)
        elif isinstance(n, (ast.For, ast.comprehension)) and isinstance(n.target, ast.Name):
            src = ast.unparse(n.iter)
            if src.endswith((".sessions.values()", ".holding.values()")):
                out.add(n.target.id)
    return out


def _is_session(e: ast.expr, names: set[str]) -> bool:
    if isinstance(e, ast.Name):
        return e.id in names
    if isinstance(e, ast.Attribute):
        return e.attr == "session"
    if isinstance(e, ast.Call):
        f = ast.unparse(e.func)
        return f == "Session" or f.endswith(("table.get", "self.get"))
    if isinstance(e, ast.Subscript):
        return ast.unparse(e.value).endswith(".sessions")
    return False


def session_writes(tree: ast.Module) -> list[tuple[str, int]]:
    """(field, line) of each write to a `Session` field outside the class itself: an
    assignment (augmented, to an item, or in a tuple) or a mutating call on it."""
    found = []
    fns = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for fn in fns:
        names = _session_names(fn)

        def hit(t: ast.expr, line: int, names=names) -> None:
            t = t.value if isinstance(t, ast.Subscript) else t
            if isinstance(t, ast.Attribute) and t.attr in FIELDS and _is_session(t.value, names):
                found.append((t.attr, line))

        for n in ast.walk(fn):
            if isinstance(n, ast.Assign):
                targets = n.targets
            elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
                targets = [n.target]
            elif isinstance(n, ast.Call) and getattr(n.func, "attr", None) in MUTATORS:
                targets = [n.func.value]
            else:
                continue
            for t in targets:
                for x in t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]:
                    hit(x, n.lineno)
    return sorted(set(found))


def writers(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Session field -> the modules writing it."""
    out = collections.defaultdict(set)
    for name, tree in modules.items():
        for field, _ in session_writes(tree):
            out[field].add(name)
    return dict(out)


def serve_modules() -> dict[str, ast.Module]:
    return {
        str(p.relative_to(REPO)): ast.parse(p.read_text())
        for pkg in ("serve", "checkpoints")
        for p in sorted((REPO / pkg).rglob("*.py"))
    }


def test_each_session_fact_has_one_writing_module():
    found = writers(serve_modules())
    several = {f: sorted(m) for f, m in found.items() if len(m) > 1}
    assert not several, several
    # the scan sees the writes it is for: every fact the engine changes is written somewhere
    assert {"seq", "clean", "active", "pins", "tokens", "foreign", "last_used"} <= set(found)
    assert set().union(*found.values()) == {"serve/engine/sessions.py"}


def test_the_writer_check_finds_a_second_writer():
    a = ast.parse("def f(s: Session):\n    s.clean = 0\n    s.pins.append((1, 2))\n")
    b = ast.parse(
        "def g(req):\n    s = req.session\n    s.clean += 1\n"
        "def h(table):\n    for x in table.holding.values():\n        x.foreign |= True\n"
        "def k(job, node):\n    job.salt = 'a'\n    node.last_used = 1\n"  # not sessions
    )
    assert session_writes(a) == [("clean", 2), ("pins", 3)]
    assert session_writes(b) == [("clean", 3), ("foreign", 6)]
    assert writers({"a": a, "b": b})["clean"] == {"a", "b"}


# ---- the step as values --------------------------------------------------------------------------
def test_a_step_passes_one_batch_from_the_scheduler_to_the_runner(np_ckpt, monkeypatch):
    """The batch `schedule` returns is the one the runner executes and post-processing
    reads, with what the runner returned; the runner is handed nothing else."""
    model = ll.load_model(np_ckpt("llama"))
    engine = Engine(model, num_pages=64, page_size=8, max_seqs=4, kv_dtype=jnp.float32)
    seen = []
    schedule, execute, post = (
        engine.scheduler.schedule,
        engine.runner.execute,
        engine.postprocess.apply,
    )

    def spy(name, fn):
        def call(*args):
            out = fn(*args)
            seen.append((name, args, out))
            return out

        return call

    monkeypatch.setattr(engine.scheduler, "schedule", spy("schedule", schedule))
    monkeypatch.setattr(engine.runner, "execute", spy("execute", execute))
    monkeypatch.setattr(engine.postprocess, "apply", spy("apply", post))
    s = engine.open_session()
    r = engine.submit(s, list(range(3, 40)), sampling=SamplingParams(max_new_tokens=3))
    engine.step()
    (_, (), batch), (_, (given,), ran), (_, (b2, r2), _) = seen
    assert isinstance(batch, Batch) and isinstance(ran, Ran)
    assert given is batch and b2 is batch and r2 is ran
    assert [e.request for e in batch.edits] == [r] and [x.request for x in batch.rows] == [r]
    assert ran.fed == (tuple(range(3, 40)),) and [x.row for x in ran.samples] == [0]
    assert r.result() and len(r.output) == 3


# ---- lockstep marks ------------------------------------------------------------------------------
def unmarked(cls) -> list[str]:
    """Public methods of `cls` with no lockstep mark (`serve.engine.lockstep`)."""
    return [
        name
        for name, fn in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and getattr(fn, "lockstep", None) not in LOCKSTEP_KINDS
    ]


class _Grown(Engine):
    def evict_everything(self):  # a new method that changes the engine, left unmarked
        return self.reset_prefix_cache()


def test_every_engine_method_is_marked_and_lockstep_has_the_own_ones():
    assert unmarked(Engine) == []
    own = [n for n, fn in inspect.getmembers(Engine, inspect.isfunction)
           if getattr(fn, "lockstep", None) == "own"]  # fmt: skip
    assert own and all(n in vars(multihost.Lockstep) for n in own), own
    assert unmarked(_Grown) == ["evict_everything"]


def test_lockstep_refuses_what_followers_would_not_make(np_ckpt, monkeypatch):
    monkeypatch.setattr(multihost, "_collectives_at_start", lambda engine: None)
    model = ll.load_model(np_ckpt("llama"))
    leader = multihost.Lockstep(_Grown(model, num_pages=32, page_size=8, max_seqs=2))
    with pytest.raises(AttributeError, match="evict_everything.*not marked"):
        leader.evict_everything()
    with pytest.raises(AttributeError, match="restore_session.*setup"):
        leader.restore_session(9, [1, 2])
    s = leader.open_session()  # a replay: recorded for the followers
    assert leader._record == [("open_session", (), {})] and leader.pins(s) == []
    assert leader.idle() and leader.page_size == 8  # reads pass through, unrecorded
    assert len(leader._record) == 1


def test_read_methods_change_nothing(np_ckpt):
    """Each method marked "read", called on an engine with sessions, KV and a cached prefix,
    leaves the engine's host state, pools and counters as they were."""
    model = ll.load_model(np_ckpt("llama"))
    engine = Engine(model, num_pages=64, page_size=8, max_seqs=4, kv_dtype=jnp.float32)
    s = engine.open_session()
    engine.submit(s, list(range(3, 30)), sampling=SamplingParams(max_new_tokens=2)).result()
    engine.pin(s, 2, 5)

    def fingerprint():
        st = engine.state
        host = [np.asarray(a).tobytes() for a in (st.page_table, st.lengths, st.refcount)]
        facts = [(x.tokens, x.seq, x.clean, x.pins, x.active) for x in engine.sessions.values()]
        return host, facts, dict(engine.counters), sorted(engine.cache_pages())

    calls = {"pins": (s,), "cache_pages": (), "idle": ()}
    reads = [n for n, fn in inspect.getmembers(Engine, inspect.isfunction)
             if getattr(fn, "lockstep", None) == "read"]  # fmt: skip
    assert sorted(reads) == sorted(calls)
    before = fingerprint()
    for name in reads:
        getattr(engine, name)(*calls[name])
    assert fingerprint() == before
    engine.reset_prefix_cache()  # a "replay" one: the fingerprint sees it
    assert fingerprint() != before
