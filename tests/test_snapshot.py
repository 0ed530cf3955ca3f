"""Durable sessions: the engine's sessions saved (`serve.snapshot`) and restored into a new
engine, and the snapshot files' crash safety (`checkpoints.sessions`).

The round trip runs a mix of sessions (an AMORTIZE-spliced one, a FORGET-edited one, one
sharing the system prompt through the radix cache, an offloaded one, one with a turn queued,
one mid-prefill), saves, restores into a fresh engine and checks: every saved page
bit-identical (raw storage), sharing kept (one restored page per saved one), refcounts exact,
lineage kept (spliced KV never enters the radix cache), and each session's next turn equal in
both engines (greedy tokens and reused / spliced / prefilled counts). Tiny default model;
fp32 and bf16 moved bands. `test_the_round_trip_checks_can_fail` restores deliberately wrong
snapshots and shows these checks fire.

Crash safety: a real writer process SIGKILLed mid-write (asserted to have died before its
snapshot became current, retried with larger arrays otherwise), and every step of the writer
interrupted in process; the previous snapshot stays readable, and the next write succeeds.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import leyline_jax as ll
from checkpoints import sessions as snapfiles
from checkpoints.sessions import read_snapshot, write_snapshot
from checkpoints.tiny import TINY_HF_CONFIGS, ensure_default_checkpoints, write_random_checkpoint
from leyline_jax import CheckpointError
from serve import snapshot
from serve.engine import Engine
from serve.sampling import SamplingParams

PS = 8
SYSTEM = np.random.default_rng(11).integers(0, 256, 21).tolist()
ENGINE = dict(num_pages=192, page_size=PS, max_seqs=5, prefill_chunk=16)
REPO = Path(__file__).resolve().parents[1]


def rand(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return ensure_default_checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def model(ckpts):
    return ll.load_model(ckpts["deepseek_v3"])


def make_engine(model, kv_dtype=jnp.float32, **kw) -> Engine:
    return Engine(model, **{**ENGINE, "kv_dtype": kv_dtype, **kw})


# ---- the checks (each shown to fire in test_the_round_trip_checks_can_fail) --------------------
def check_refcounts(engine: Engine) -> None:
    """Every page's refcount = references from open sequences' page tables + the radix tree
    and the lineages' private trees."""
    st = engine.state
    want = np.zeros(st.num_pages, np.int32)
    for q in np.flatnonzero(st.active):
        np.add.at(want, st.page_table[q, : -(-int(st.lengths[q]) // PS)], 1)
    np.add.at(want, np.asarray(engine.cache_pages(), np.int64), 1)
    np.testing.assert_array_equal(st.refcount, want)


def page_pairs(e1: Engine, e2: Engine, tokens: dict[int, list[int]]) -> list[tuple[int, int]]:
    """(page in e1, page in e2) for every page a session's row or its radix path holds, with
    the sessions' metadata compared on the way (`tokens`: each session's full token list in
    e1 at the save, whose radix path is compared)."""
    pairs = []
    for sid, s1 in e1.sessions.items():
        s2 = e2.sessions[sid]
        busy = e1.table.busy(s1)
        cached = s1.cached if s1.seq is not None else 0
        assert s2.tokens == (s1.tokens[:cached] if busy else s1.tokens), sid
        assert (s2.cached, s2.clean) == (cached, min(s1.clean, cached)), sid
        assert (s2.seq is None) == (cached == 0) and not e2.table.busy(s2), sid
        if cached:
            n = -(-cached // PS)
            r1, r2 = e1.state.page_table[s1.seq, :n], e2.state.page_table[s2.seq, :n]
            assert e2.state.token_ids[s2.seq].tolist() == s1.tokens[:cached]
            pairs += zip(r1.tolist(), r2.tolist(), strict=True)
        (p1, n1), (p2, n2) = e1.radix.peek(tokens[sid]), e2.radix.peek(tokens[sid])
        assert n1 == n2, sid
        pairs += zip(p1, p2, strict=True)
    return pairs


def check_same_kv(e1: Engine, e2: Engine, tokens: dict[int, list[int]]) -> None:
    """Every saved page is bit-identical in both bands of every layer (raw storage: a 16-bit
    band as its bits), and the sharing is the same: one e2 page per e1 page, both ways."""
    pairs = sorted(set(page_pairs(e1, e2, tokens)))
    assert pairs
    a, b = np.array(pairs).T
    assert len(set(a)) == len(set(b)) == len(pairs)  # a bijection: shared pages saved once
    for band1, band2 in ((e1.state.moved, e2.state.moved), (e1.state.rotated, e2.state.rotated)):
        x, y = np.asarray(band1)[:, a], np.asarray(band2)[:, b]
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def lineage_hit(engine: Engine, tokens: list[int]) -> int:
    """Tokens a new session with prompt `tokens` reuses from the radix cache."""
    r = engine.submit(engine.open_session(), tokens, sampling=SamplingParams(max_new_tokens=1))
    r.result()
    return r.stats.reused_tokens


def stats(r) -> tuple[int, int, int, int]:
    st = r.stats
    return st.prompt_tokens, st.reused_tokens, st.spliced_tokens, st.prefilled_tokens


# ---- the scenario -------------------------------------------------------------------------------
def populate(engine: Engine) -> dict:
    """Sessions in every condition a save meets. Returns their ids and the turns in flight."""
    g = SamplingParams
    ids = {}

    def turn(name, tokens, n, directives=()):
        if name not in ids:
            ids[name] = engine.open_session()
        r = engine.submit(ids[name], tokens, directives=directives, sampling=g(n))
        r.result()
        return r

    turn("offloaded", SYSTEM + rand(12, 1), 2)  # least recently used: offloaded below
    turn("amortize", SYSTEM + rand(20, 2), 3)
    assert turn("radix", SYSTEM + rand(5, 3), 2).stats.reused_tokens == 16  # the system prompt
    turn("forget", SYSTEM + rand(15, 4), 3)
    turn("forget", [7], 2, [ll.Directive(25, 31, [], ll.Mode.FORGET)])
    spliced = turn("amortize", [5, 6], 3, [ll.Directive(24, 30, [9, 9])])
    assert spliced.stats.spliced_tokens > 0
    turn("queued", SYSTEM[:10] + rand(30, 5), 3)
    ids["prefill"] = engine.open_session()  # a sixth session: the oldest idle one is offloaded
    running = engine.submit(ids["prefill"], rand(60, 6), sampling=g(2))
    engine.step()
    engine.step()
    assert running.status == "prefill" and engine.sessions[ids["prefill"]].cached == 32
    assert engine.sessions[ids["offloaded"]].seq is None
    q = engine.sessions[ids["queued"]]
    queued = engine.submit_prompt(ids["queued"], q.tokens + rand(4, 7), sampling=g(3))
    return {"ids": ids, "running": running, "queued": queued}


NEXT = {"offloaded": 41, "amortize": 42, "forget": 43, "radix": 44}  # next turns' token seeds


def next_turns(engine: Engine, ids: dict, prompts: dict, inflight: dict | None) -> dict:
    """Each session's next turn, one at a time, in a fixed order; {name: (output, stats)}. With
    `inflight` (the original engine) the turns in flight finish; without it (the restored
    engine) the same turns are submitted again, as whole prompts (`prompts`)."""
    out = {}
    for name in ("queued", "prefill", "offloaded", "amortize", "forget", "radix"):
        n = 2 if name == "prefill" else 3
        if name in prompts and inflight is not None:
            r = inflight[name]
        elif name in prompts:
            r = engine.submit_prompt(ids[name], prompts[name], sampling=SamplingParams(n))
        else:
            r = engine.submit(ids[name], rand(3, NEXT[name]), sampling=SamplingParams(n))
        out[name] = (r.result(), stats(r))
    return out


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_round_trip(model, kv_dtype, tmp_path):
    e1 = make_engine(model, kv_dtype)
    run = populate(e1)
    ids = run["ids"]
    prompts = {"queued": run["queued"].prompt, "prefill": rand(60, 6)}
    tokens = {sid: list(s.tokens) for sid, s in e1.sessions.items()}
    extra = {"http": {str(ids["amortize"]): {"messages": ["hi"]}}}
    snapshot.save(e1, tmp_path, extra)
    assert run["queued"].status == "queued" and run["running"].status == "prefill"

    e2 = make_engine(model, kv_dtype)
    assert snapshot.restore(e2, tmp_path) == extra
    check_same_kv(e1, e2, tokens)
    check_refcounts(e2)
    spliced = e2.sessions[ids["amortize"]]
    assert spliced.clean == 24 < spliced.cached  # lineage: only the clean prefix is shareable
    cached = spliced.cached
    assert e2.open_session() > max(ids.values())

    want = next_turns(e1, ids, prompts, {"queued": run["queued"], "prefill": run["running"]})
    got = next_turns(e2, ids, prompts, None)
    for name in want:
        assert got[name][0] == want[name][0], name  # greedy tokens
        if name != "prefill":  # (the original turn was admitted before the save)
            assert got[name][1] == want[name][1], name  # prompt, reused, spliced, prefilled
    # the restored KV is reused, and counted: all of it
    assert got["prefill"][1][1] == 32
    assert got["queued"][1][1] == len(tokens[ids["queued"]]) - 1
    assert got["amortize"][1][1] == cached  # spliced KV included
    check_refcounts(e1)
    check_refcounts(e2)
    # a new session sent the spliced session's tokens gets its clean prefix only, in both
    hits = [lineage_hit(e, tokens[ids["amortize"]]) for e in (e1, e2)]
    assert hits == [24, 24]


def test_round_trip_on_gqa(np_ckpt, tmp_path):
    """The GQA family (V and K bands [P, page_size, G, D]): pages and outputs equal."""
    m = ll.load_model(np_ckpt("llama"))
    e1 = make_engine(m, jnp.bfloat16)
    sids = [e1.open_session() for _ in range(3)]
    for i, sid in enumerate(sids):
        e1.submit(sid, SYSTEM + rand(7 + i, 20 + i), sampling=SamplingParams(3)).result()
    e1.submit(sids[0], [3], directives=[ll.Directive(17, 22, [1])]).result()
    tokens = {sid: list(s.tokens) for sid, s in e1.sessions.items()}
    snapshot.save(e1, tmp_path)
    e2 = make_engine(m, jnp.bfloat16)
    assert snapshot.restore(e2, tmp_path) == {}  # no extra given; None means no snapshot
    check_same_kv(e1, e2, tokens)
    check_refcounts(e2)
    for sid in sids:
        r1 = e1.submit(sid, [4, 5], sampling=SamplingParams(3))
        r2 = e2.submit(sid, [4, 5], sampling=SamplingParams(3))
        assert r1.result() == r2.result() and stats(r1) == stats(r2)


RESTORER = textwrap.dedent(
    """
    import json, sys
    import jax.numpy as jnp
    import leyline_jax as ll
    from serve import snapshot
    from serve.engine import Engine
    from serve.sampling import SamplingParams

    ckpt, root, engine_kw, turns = sys.argv[1], sys.argv[2], *map(json.loads, sys.argv[3:])
    engine = Engine(ll.load_model(ckpt), kv_dtype=jnp.float32, **engine_kw)
    extra = snapshot.restore(engine, root)
    out = []
    for sid, tokens in turns:
        r = engine.submit(sid, tokens, sampling=SamplingParams(3))
        st = r.stats
        out.append([r.result(), st.prompt_tokens, st.reused_tokens, st.spliced_tokens])
    print(json.dumps({"extra": extra, "turns": out}))
    """
)


def kept_state(engine: Engine) -> dict:
    """What a restart must keep beside the KV: each session's pins, lineage and MOVE flags,
    the radix pins, each lineage's private tree (its paths' tokens) and the lineage each
    cached radix page of those paths came from."""
    caches = engine.caches
    pages = [p for tokens, _ in caches.radix.paths() for p in engine.radix.peek(tokens)[0]]
    return {
        "sessions": {
            sid: (s.pins, s.lineage, s.private, s.foreign) for sid, s in engine.sessions.items()
        },
        "radix_pins": sorted((tuple(t), n) for t, n in engine.radix.pin_ends()),
        "trees": {k: sorted(tuple(t) for t, _ in v.paths()) for k, v in caches.private.items()},
        "lineages": sorted(caches.lineage_of.get(p) or "" for p in pages),
    }


def verbs_scenario(engine: Engine) -> dict:
    """Sessions of a named lineage that ran MOVE (one closed: its KV lives on in the
    lineage's tree), pins on two sessions, a pinned radix prefix."""
    g = SamplingParams
    x = rand(40, 30)
    a = engine.open_session(lineage="t")
    engine.submit(a, SYSTEM + x, sampling=g(2)).result()
    engine.submit(a, [4] + x[3:27] + [5], sampling=g(2), move=True).result()  # moved
    history = list(engine.sessions[a].tokens)
    engine.close_session(a)
    b = engine.open_session(lineage="t")
    engine.submit(b, SYSTEM + rand(12, 31), sampling=g(2), move=True).result()
    engine.pin(b, 2, 9)
    c = engine.open_session()
    engine.submit(c, SYSTEM + rand(30, 32), sampling=g(2)).result()
    engine.pin(c, 21, 40)
    assert engine.pin_prefix(SYSTEM + x) == 56
    return {"x": x, "b": b, "c": c, "history": history}


def verbs_next_turns(engine: Engine, ids: dict) -> list:
    """Turns whose outcome depends on what the restart kept: a new session of lineage "t"
    re-sending the closed session's history (its private tree), one moving X's pages from the
    radix cache, a turn cutting into a pin, and a pool squeeze the radix pin survives."""
    g, x = SamplingParams, ids["x"]
    out = []
    d = engine.open_session(lineage="t")
    r = engine.submit(d, ids["history"] + [9], sampling=g(3))
    out.append((r.result(), stats(r)))
    e = engine.open_session(lineage="t")
    r = engine.submit(e, rand(5, 33) + x[11:35] + [7, 7], sampling=g(3), move=True)
    out.append((r.result(), stats(r), r.stats.moved_tokens))
    r = engine.submit(ids["c"], [1], directives=[ll.Directive(20, 30, [2])], sampling=g(1))
    engine.run_until_idle()
    out.append(type(r.error).__name__)
    out.append(sorted(engine.radix.pinned_pages()) != [])
    return out


def test_round_trip_keeps_pins_lineages_and_trees(model, tmp_path):
    """Pins (a session's spans and the radix cache's pinned prefixes), named lineages, MOVE's
    private trees and the lineage of cached pages come back as they were: the next turns
    (a lineage-tree hit, a MOVE from the radix cache, a turn refused by a pin) equal those of
    the engine that never restarted. A restore that loses them (their defaults written over
    them) is seen to differ: the check can fail."""
    e1 = make_engine(model, move=True)
    ids = verbs_scenario(e1)
    snapshot.save(e1, tmp_path / "full")
    e2 = make_engine(model, move=True)
    snapshot.restore(e2, tmp_path / "full")
    assert kept_state(e2) == kept_state(e1)
    assert e2.caches.private["t"].paths() and e2.radix.pin_ends()
    check_refcounts(e2)
    clean = e1.radix.peek(ids["history"])[1]
    want = verbs_next_turns(e1, ids)
    assert want[0][1][1] > clean  # the lineage tree's KV reused, past the radix cache's
    assert want[1][2] > 0 and want[2] == "DirectiveError"
    assert verbs_next_turns(e2, ids) == want
    check_refcounts(e1)
    check_refcounts(e2)

    def defaults(arrays, meta):  # the lineage trees stay: their pages are bound to them
        meta["radix_pins"] = []
        for r in meta["sessions"]:
            r |= {"pins": [], "lineage": f"session:{r['id']}", "private": False, "foreign": False}
        for p in meta["prefixes"]:
            p["lineages"] = [None] * len(p["pages"])

    tamper(tmp_path / "full", tmp_path / "old", defaults)
    e3 = make_engine(model, move=True)
    snapshot.restore(e3, tmp_path / "old")
    assert kept_state(e3) != kept_state(e1)
    e4 = make_engine(model, move=True)
    snapshot.restore(e4, tmp_path / "full")
    assert verbs_next_turns(e3, ids) != verbs_next_turns(e4, ids)


def test_restore_in_a_new_process(model, ckpts, tmp_path):
    """The use it is for: save, then restore in another process (the model loaded again from
    its checkpoint) and run each session's next turn there: tokens and counts equal."""
    e1 = make_engine(model)
    a, b = e1.open_session(), e1.open_session()
    e1.submit(a, SYSTEM + rand(20, 50), sampling=SamplingParams(3)).result()
    e1.submit(b, SYSTEM + rand(9, 51), sampling=SamplingParams(3)).result()
    e1.submit(
        a, [5], directives=[ll.Directive(22, 29, [1, 2])], sampling=SamplingParams(2)
    ).result()
    snapshot.save(e1, tmp_path, {"who": "test"})
    turns = [[a, rand(2, 52)], [b, rand(3, 53)]]
    proc = subprocess.run(
        [sys.executable, "-c", RESTORER, str(ckpts["deepseek_v3"]), str(tmp_path)]
        + [json.dumps(ENGINE), json.dumps(turns)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["extra"] == {"who": "test"}
    for (sid, tokens), row in zip(turns, got["turns"], strict=True):
        cached = e1.sessions[sid].cached
        r = e1.submit(sid, tokens, sampling=SamplingParams(3))
        st = r.stats
        assert row == [r.result(), st.prompt_tokens, st.reused_tokens, st.spliced_tokens]
        assert st.reused_tokens == cached  # every cached token, spliced ones included


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """A snapshot of a small engine: (root, number of saved pages)."""
    root = tmp_path_factory.mktemp("saved")
    e = make_engine(model)
    for i in range(2):
        e.submit(e.open_session(), SYSTEM + rand(9, 30 + i), sampling=SamplingParams(2)).result()
    snapshot.save(e, root, {"k": 1})
    return root, read_snapshot(root)[0]["moved"].shape[1]


def untouched(engine: Engine):
    st = engine.state
    return (
        dict(engine.sessions),
        st.refcount.copy(),
        st.page_table.copy(),
        np.asarray(st.moved).copy(),
        np.asarray(st.rotated).copy(),
    )


@pytest.mark.parametrize(
    "case, match",
    [
        ("page_size", "page_size: snapshot 8, engine 16"),
        ("family", "config.model_type"),
        ("weights", "params: the model's weights differ"),
        ("kv_dtype", "moved_dtype: snapshot 'float32', engine 'bfloat16'"),
        ("pool", "KV pages; this engine's pool has"),
        ("slots", "free sequence slots"),
        ("max_seq_len", "more than this engine's max_seq_len"),
        ("not_fresh", "needs a fresh engine"),
    ],
)
def test_a_mismatched_engine_is_refused_and_unchanged(model, ckpts, saved, tmp_path, case, match):
    root, k = saved
    kw, m = {}, model
    if case == "page_size":
        kw = dict(page_size=16)
    elif case == "family":
        m = ll.load_model(ckpts["deepseek_v2"])
    elif case == "weights":  # the same config, other weights
        m = ll.load_model(write_random_checkpoint(tmp_path, TINY_HF_CONFIGS["deepseek_v3"], seed=9))
    elif case == "kv_dtype":
        kw = dict(kv_dtype=jnp.bfloat16)
    elif case == "pool":
        kw = dict(num_pages=k - 1)
    elif case == "slots":
        kw = dict(max_seqs=1)
    elif case == "max_seq_len":
        kw = dict(max_seq_len=20)
    engine = make_engine(m, **kw)
    if case == "not_fresh":
        engine.open_session()
    before = untouched(engine)
    with pytest.raises(ValueError, match=match):
        snapshot.restore(engine, root)
    after = untouched(engine)
    assert before[0] == after[0]
    for x, y in zip(before[1:], after[1:], strict=True):
        np.testing.assert_array_equal(x, y)
    if case != "not_fresh":
        assert engine.open_session() == 0  # ids untouched too


def test_restore_without_a_snapshot_returns_none(model, tmp_path):
    e = make_engine(model)
    assert snapshot.restore(e, tmp_path / "none") is None
    assert not e.sessions and not e.state.refcount.any()


def tamper(root: Path, out: Path, fn) -> None:
    """Write a copy of the snapshot under `root` to `out` with `fn(arrays, meta)` applied."""
    arrays, meta = read_snapshot(root)
    fn(arrays, meta)
    write_snapshot(out, arrays, meta)


def test_the_round_trip_checks_can_fail(model, tmp_path):
    """Wrong restores are caught: a session whose `clean` is dropped (set to `cached`) leaks
    spliced KV to the radix cache; pages shifted by one are not bit-identical; a wrong
    refcount and a session's wrong metadata are seen."""
    e1 = make_engine(model)
    a = e1.open_session()
    b = e1.open_session()
    e1.submit(a, SYSTEM + rand(20, 2), sampling=SamplingParams(3)).result()
    e1.submit(b, SYSTEM + rand(20, 3), sampling=SamplingParams(3)).result()
    e1.submit(a, [5, 6], directives=[ll.Directive(24, 30, [9, 9])]).result()
    tokens = {sid: list(s.tokens) for sid, s in e1.sessions.items()}
    snapshot.save(e1, tmp_path / "good")
    e2 = make_engine(model)
    snapshot.restore(e2, tmp_path / "good")
    check_same_kv(e1, e2, tokens)  # the good restore passes
    check_refcounts(e2)
    assert lineage_hit(e2, tokens[a]) == 24

    def drop_clean(arrays, meta):
        rec = next(r for r in meta["sessions"] if r["id"] == a)
        rec["clean"] = rec["cached"]

    tamper(tmp_path / "good", tmp_path / "dirty", drop_clean)
    e3 = make_engine(model)
    snapshot.restore(e3, tmp_path / "dirty")
    assert lineage_hit(e3, tokens[a]) > 24  # spliced KV served to another session
    with pytest.raises(AssertionError):
        check_same_kv(e1, e3, tokens)  # and the session's clean differs

    def shift(arrays, meta):  # every page one place over
        for name in ("moved", "rotated"):
            arrays[name] = np.roll(arrays[name], 1, axis=1)

    tamper(tmp_path / "good", tmp_path / "shifted", shift)
    e4 = make_engine(model)
    snapshot.restore(e4, tmp_path / "shifted")
    with pytest.raises(AssertionError, match="not equal"):
        check_same_kv(e1, e4, tokens)
    e4.state = ll.allocator.retain(e4.state, [int(e4.state.page_table[e4.sessions[a].seq, 0])])
    with pytest.raises(AssertionError):
        check_refcounts(e4)


# ---- snapshot files ------------------------------------------------------------------------------
def small(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n)
    return {
        "bits": rng.integers(0, 2**16, (3, 5, 7), dtype=np.uint16),
        "f32": rng.standard_normal(64).astype(np.float32),
        "empty": np.zeros((2, 0, 4), np.uint16),
    }


def assert_snapshot(root: Path, n: int) -> None:
    got = read_snapshot(root)
    assert got is not None
    arrays, meta = got
    assert meta == {"n": n}
    want = small(n)
    assert set(arrays) == set(want)
    for k, v in want.items():
        assert arrays[k].dtype == v.dtype
        np.testing.assert_array_equal(arrays[k], v)


def snapshot_dirs(root: Path) -> tuple[list[str], list[str]]:
    names = sorted(p.name for p in root.iterdir() if p.is_dir())
    return [x for x in names if x.startswith("snapshot-")], [
        x for x in names if x.startswith(".tmp")
    ]


def test_write_and_read(tmp_path):
    assert read_snapshot(tmp_path / "missing") is None
    assert read_snapshot(tmp_path) is None
    write_snapshot(tmp_path, small(1), {"n": 1})
    assert_snapshot(tmp_path, 1)
    write_snapshot(tmp_path, small(2), {"n": 2})
    assert_snapshot(tmp_path, 2)
    assert snapshot_dirs(tmp_path) == (["snapshot-000002"], [])  # the older one removed
    (tmp_path / ".tmp-snapshot-000007").mkdir()  # a dead writer's leftover: ignored, then removed
    assert_snapshot(tmp_path, 2)
    write_snapshot(tmp_path, small(3), {"n": 3})
    assert snapshot_dirs(tmp_path) == (["snapshot-000003"], [])  # (numbers in use: 2)


@pytest.mark.parametrize(
    "arrays, meta",
    [
        ({"a/b": np.zeros(2)}, {}),
        ({"a": [1, 2]}, {}),
        ({"a": np.zeros(2)}, {"x": object()}),
        ({"a": np.zeros(2)}, ["not", "a", "dict"]),
    ],
)
def test_bad_arguments_write_nothing(tmp_path, arrays, meta):
    write_snapshot(tmp_path, small(1), {"n": 1})
    with pytest.raises(ValueError):
        write_snapshot(tmp_path, arrays, meta)
    assert snapshot_dirs(tmp_path) == (["snapshot-000001"], [])
    assert_snapshot(tmp_path, 1)


STEPS = ["_write_arrays", "_write_meta", "_fsync_tree", "_commit", "_remove_old"]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("step", STEPS)
def test_an_interrupted_write_keeps_the_last_good_snapshot(tmp_path, monkeypatch, step, when):
    """A step of the writer raises (before or after doing its work): until the commit (the
    rename) has happened, the previous snapshot is current; from then on the new one."""
    write_snapshot(tmp_path, small(1), {"n": 1})
    real = getattr(snapfiles, step)

    def broken(*args):
        if when == "after":
            real(*args)
        raise OSError(f"injected: {step} {when}")

    monkeypatch.setattr(snapfiles, step, broken)
    with pytest.raises(OSError, match="injected"):
        write_snapshot(tmp_path, small(2), {"n": 2})
    committed = STEPS.index(step) > STEPS.index("_commit") or (
        step == "_commit" and when == "after"
    )
    assert_snapshot(tmp_path, 2 if committed else 1)
    monkeypatch.undo()
    write_snapshot(tmp_path, small(3), {"n": 3})
    assert_snapshot(tmp_path, 3)
    done, temp = snapshot_dirs(tmp_path)
    assert len(done) == 1 and not temp  # leftovers and the older snapshot removed


WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from checkpoints import sessions

    root, mib, pause = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "pause"
    if pause:  # stop just before the commit, everything written and fsynced
        def commit(temp, done):
            print("commit", flush=True)
            time.sleep(600)

        sessions._commit = commit
    rng = np.random.default_rng(0)
    arrays = {f"a{i}": rng.integers(0, 2**16, (mib, 1 << 19), dtype=np.uint16) for i in range(4)}
    print("ready", flush=True)
    sessions.write_snapshot(root, arrays, {"n": 99})
    print("done", flush=True)
    """
)


def temp_bytes(root: Path) -> int | None:
    """Bytes in the writer's temporary directory so far; None while there is none."""
    temp = [p for p in root.iterdir() if p.name.startswith(".tmp-snapshot-")]
    if not temp:
        return None
    try:
        return sum(f.stat().st_size for f in temp[0].rglob("*") if f.is_file())
    except OSError:  # orbax renames its own temporary files as it goes: look again
        return 0


def kill_mid_write(root: Path, mib: int, when: str) -> bool:
    """Run a writer process and SIGKILL it mid-write: once its temporary directory appears
    ("temp"), once it holds data ("data"), or at its commit ("pause"). True when it was killed
    before its snapshot became current; False when it got there first."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), str(mib), "pause" if when == "pause" else "-"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        if when == "pause":
            assert proc.stdout.readline().strip() == "commit"
        else:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                size = temp_bytes(root)
                if size is not None and (when == "temp" or size > 1 << 20):
                    break
                time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    killed = proc.returncode == -signal.SIGKILL
    done, temp = snapshot_dirs(root)
    return killed and done == ["snapshot-000001"] and len(temp) == 1


@pytest.mark.parametrize("when", ["temp", "data", "pause"])
def test_a_writer_killed_mid_write_keeps_the_last_good_snapshot(tmp_path, when):
    write_snapshot(tmp_path, small(1), {"n": 1})
    for mib in (16, 64, 256):  # larger arrays if the writer finished before the kill
        if kill_mid_write(tmp_path, mib, when):
            break
        for p in tmp_path.iterdir():  # start again from the one good snapshot
            if p.is_dir() and p.name != "snapshot-000001":
                snapfiles.shutil.rmtree(p)
    else:
        pytest.fail("the writer was never killed mid-write")
    assert_snapshot(tmp_path, 1)  # the previous snapshot, whole; the leftover is ignored
    write_snapshot(tmp_path, small(2), {"n": 2})
    assert_snapshot(tmp_path, 2)
    assert snapshot_dirs(tmp_path) == (["snapshot-000002"], [])  # the leftover removed


def damage(root: Path, how: str) -> None:
    snap = root / "snapshot-000001"
    meta = snap / snapfiles.META_FILE
    if how == "garbage_meta":
        meta.write_text("{not json")
    elif how == "no_meta":
        meta.unlink()
    elif how == "no_arrays":
        snapfiles.shutil.rmtree(snap / snapfiles.ARRAYS_DIR)
    elif how == "flipped_byte":
        biggest = max((f for f in snap.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
        data = bytearray(biggest.read_bytes())
        data[len(data) // 2] ^= 0xFF
        biggest.write_bytes(bytes(data))
    elif how == "truncated":
        biggest = max((f for f in snap.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
        biggest.write_bytes(biggest.read_bytes()[:100])
    elif how == "wrong_crc":
        doc = json.loads(meta.read_text())
        doc["arrays"]["f32"]["crc32"] ^= 1
        meta.write_text(json.dumps(doc))
    elif how == "format":
        doc = json.loads(meta.read_text())
        doc["format"] = 99
        meta.write_text(json.dumps(doc))
    elif how == "changed_meta":  # one value of the meta: its SHA-256 no longer matches
        doc = json.loads(meta.read_text())
        doc["meta"]["n"] += 1
        meta.write_text(json.dumps(doc))
    elif how == "huge_shape":  # refused before anything is allocated (no MemoryError)
        doc = json.loads(meta.read_text())
        doc["arrays"]["f32"]["shape"] = [10**6, 10**6, 10**6]
        meta.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "how",
    ["garbage_meta", "no_meta", "no_arrays", "flipped_byte", "truncated", "wrong_crc", "format",
     "changed_meta", "huge_shape"],
)  # fmt: skip
def test_a_damaged_snapshot_is_a_checkpoint_error(tmp_path, how):
    arrays = {"big": np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32)}
    write_snapshot(tmp_path, {**arrays, **small(1)}, {"n": 1})
    damage(tmp_path, how)
    with pytest.raises(CheckpointError, match="snapshot-000001"):
        read_snapshot(tmp_path)


@pytest.mark.parametrize("how", ["token", "swapped_pages"])
def test_a_tampered_session_snapshot_is_refused(model, saved, tmp_path, how):
    """One token id changed, or two sessions' page lists swapped (each would run on the
    other's KV): the meta's SHA-256 no longer matches, and the engine is left untouched."""
    root = tmp_path / "tampered"
    shutil.copytree(saved[0], root)
    meta = next(root.glob("snapshot-*")) / snapfiles.META_FILE
    doc = json.loads(meta.read_text())
    a, b = doc["meta"]["sessions"][:2]
    if how == "token":
        a["tokens"][3] = (a["tokens"][3] + 1) % 256
    else:
        a["pages"], b["pages"] = b["pages"], a["pages"]
    meta.write_text(json.dumps(doc))
    e = make_engine(model)
    free = e.pool.free_count()
    with pytest.raises(CheckpointError, match="SHA-256"):
        snapshot.restore(e, root)
    assert not e.sessions and e.pool.free_count() == free
    assert snapshot.restore(make_engine(model), saved[0]) is not None  # untampered: restored


@pytest.mark.parametrize(
    "how", ["token", "swapped_pages", "no_page_tokens", "format 1", "format 2"]
)
def test_a_rewritten_session_snapshot_is_refused(model, saved, tmp_path, how):
    """The same tampering written as a whole new snapshot (its SHA-256 and crc32s made anew):
    each record's tokens are bound to the tokens its pages were saved with. A snapshot of an
    older format is refused, saying how to keep its sessions."""

    def change(arrays, meta):
        a, b = [s for s in meta["sessions"] if s["cached"] > 0][:2]
        if how == "token":
            a["tokens"][3] = (a["tokens"][3] + 1) % 256
        elif how == "swapped_pages":
            a["pages"], b["pages"] = b["pages"], a["pages"]
        elif how == "no_page_tokens":
            del arrays["page_tokens"]
        else:
            meta["format"] = int(how[-1])

    tamper(saved[0], tmp_path / "rewritten", change)
    e = make_engine(model)
    free = e.pool.free_count()
    match = "page_tokens|do not hold the tokens|disagree"
    if how.startswith("format"):
        match = "reads format 3 only. To keep its sessions, restore it on a server of a release"
    with pytest.raises(CheckpointError, match=match):
        snapshot.restore(e, tmp_path / "rewritten")
    assert not e.sessions and e.pool.free_count() == free
