"""A FORGET holds in every tier and every copy (`serve.forgotten`, `PrefixCaches.purge`): a
snapshot taken before a FORGET never restores what it forgot (the session, the radix cache, a
lineage's private tree, the HTTP reply memory), a snapshot taken after it restores everything
it kept, and a session that adopted a lineage's KV before the FORGET never puts the purged
pages back. Each probe is also run where it finds the forgotten KV (before the FORGET, or
restoring without the log), so none can pass by finding nothing anywhere.
"""

from __future__ import annotations

import functools
import json
import shutil
import signal
import urllib.request

import jax.numpy as jnp
import pytest
from conftest import ALL_CONFIGS
from test_engine_verbs import toks
from test_engine_verbs import turn as verbs_turn

import leyline_jax as ll
from checkpoints.tiny import write_random_checkpoint
from leyline_jax.directives import Directive, Mode
from serve import forgotten, snapshot
from serve.engine import Engine

turn = functools.partial(verbs_turn, n=1)  # one token a turn here

PS = 8
SHAPE = dict(page_size=PS, max_seqs=4, max_seq_len=128, kv_dtype=jnp.float32, num_pages=64)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg = {**ALL_CONFIGS["glm4_moe_lite"], "num_hidden_layers": 2, "mlp_layer_types": ["dense"] * 2}
    return ll.load_model(write_random_checkpoint(tmp_path_factory.mktemp("forget"), cfg))


PROMPT = toks(20, 1) + toks(12, 2) + toks(20, 3)  # the secret: tokens 20 to 32
FORGET = Directive(20, 32, (), Mode.FORGET)


def cached(engine, salt: str = "") -> int:
    """How much of PROMPT the radix cache of `salt` holds."""
    return engine.caches.tree(salt).match(PROMPT)[1]


def test_an_older_snapshot_never_restores_what_a_forget_forgot(model, tmp_path):
    root, copy = tmp_path / "snaps", tmp_path / "without-log"
    eng = Engine(model, **SHAPE)
    eng.on_forget = forgotten.Log(root).append
    a = eng.open_session()
    turn(eng, a, PROMPT)
    snapshot.save(eng, root)  # holds the secret: session, radix path
    turn(eng, a, [7], directives=[FORGET])
    assert cached(eng) <= 16  # purged in memory from the secret's page on
    shutil.copytree(root, copy)
    (copy / forgotten.NAME).unlink()

    back = Engine(model, **SHAPE)
    extra = snapshot.restore(back, root)  # the crash: the snapshot before the FORGET
    assert back.sessions[a].tokens == PROMPT[:20] and back.sessions[a].cached <= 20
    assert cached(back) <= 16 and extra["forgotten_sessions"] == [a]
    old = Engine(model, **SHAPE)  # the failing case: the same snapshot without the log
    snapshot.restore(old, copy)
    assert old.sessions[a].tokens[:52] == PROMPT and cached(old) == 48

    snapshot.save(eng, root)  # after the FORGET: it reflects it, nothing more is cut
    again = Engine(model, **SHAPE)
    assert "forgotten_sessions" not in snapshot.restore(again, root)
    assert again.sessions[a].tokens == eng.sessions[a].tokens
    assert json.loads((root / forgotten.NAME).read_text().splitlines()[0])["session"] == a


def test_a_lineage_tree_purge_is_not_undone_by_a_session_that_adopted_it(model):
    """Session c of lineage "u" MOVEs within its own tokens: its KV (not a prefill's) goes to
    the lineage's private tree. d and e adopt it; e FORGETs the moved run. d's next turn must
    not put the purged pages back: a new session of the lineage then reuses only what precedes
    the FORGET (before it, the same probe reused the whole run)."""
    eng = Engine(model, move=True, **SHAPE)
    x = toks(32, 5)
    own = x + toks(2, 6) + x[4:20] + toks(3, 7)  # x[4:20] again at 34: moved, not prefilled
    c = eng.open_session(lineage="u")
    turn(eng, c, x)
    assert turn(eng, c, own[33:]).stats.moved_tokens == 16
    kept = list(eng.sessions[c].tokens)
    eng.close_session(c)
    d, e = eng.open_session(lineage="u"), eng.open_session(lineage="u")
    before = turn(eng, d, kept).stats.reused_tokens
    assert turn(eng, e, kept).stats.reused_tokens == before >= 48  # the moved run included
    turn(eng, e, [9], directives=[Directive(34, 50, (), Mode.FORGET)])
    turn(eng, d, [11])  # d's turn ends: its KV would re-enter the lineage's tree
    assert eng.sessions[d].foreign
    r = turn(eng, eng.open_session(lineage="u"), kept)
    assert r.stats.reused_tokens <= 32 < before


def test_forget_over_http_survives_a_crash(tmp_path):
    """A real server process: a session whose history holds a secret, a snapshot, a FORGET of
    the secret's message, SIGKILL, restart. The secret's KV is served nowhere: the session
    sent its old history reuses only what precedes the secret, a stranger sending it finds
    only that prefix cached (before the FORGET it found more), and the shutdown snapshot's
    reply memory no longer holds the reply that came after the secret."""
    from test_http import Process  # the server process helper (tiny model, fp32 KV)

    from checkpoints.sessions import read_snapshot

    secret = "The vault code is " + "7 3 9 1 " * 8
    history = [
        {"role": "system", "content": "You are a terse assistant. " * 4},
        {"role": "user", "content": secret},
    ]
    snaps, cache = tmp_path / "snaps", tmp_path / "xla"
    root = tmp_path / "ckpt"
    srv = Process(root, snaps, cache)
    r, prompt, _ = srv.turn(history)
    history.append({"role": "assistant", "content": r.choices[0].message.content})
    history.append({"role": "user", "content": "Thanks."})
    srv.turn(history)
    r, _, _ = srv.turn(history, session=None)  # a stranger, before the FORGET
    before = r.usage.prompt_tokens_details.cached_tokens
    post = urllib.request.Request(srv.url + "/v1/snapshot", data=b"", method="POST")
    urllib.request.urlopen(post).close()
    forgot = [history[0], {"role": "user", "content": "[removed]"}]
    _, forget_prompt, _ = srv.turn(forgot, mode="forget")
    keep = next(i for i, (a, b) in enumerate(zip(prompt, forget_prompt, strict=False)) if a != b)
    assert before > keep  # the probe finds the secret's KV while it is there
    r, _, _ = srv.turn(history, session="probe-0")  # a stranger, before the crash
    assert r.usage.prompt_tokens_details.cached_tokens <= keep
    srv.stop(signal.SIGKILL)

    # each probe on a restart of its own: a probe sending the old history caches it again
    srv = Process(root, snaps, cache)
    r, _, _ = srv.turn(history, session="probe-1")  # a stranger, after the restart
    assert r.usage.prompt_tokens_details.cached_tokens <= keep
    srv.stop(signal.SIGKILL)
    srv = Process(root, snaps, cache)
    r, _, _ = srv.turn(history)  # the forgetting session itself, sent its old history
    assert r.usage.model_extra["reused_tokens"] <= keep
    srv.stop(signal.SIGTERM)
    replies = read_snapshot(snaps)[1]["extra"]["replies"].get("durable", [])
    assert history[2]["content"] not in [text for text, _ in replies]


def test_reply_memory_forgets_what_a_forget_evicts():
    """The HTTP sessions' reply memory: a FORGET turn keeps only the replies its history still
    holds (so the shutdown snapshot does not store an evicted reply), and a restore drops the
    replies of sessions a later FORGET cut."""
    from serve.http.sessions import HttpSessions

    hs = HttpSessions(len)
    hs.bind("a", 0)
    hs.bind("b", 1)
    for name in ("a", "b"):
        hs.remember(name, "the secret reply", [1, 2])
        hs.remember(name, "a kept reply", [3])
    hs.keep_replies("a", [{"role": "assistant", "content": "a kept reply"}])
    assert [t for t, _ in hs.export()["replies"]["a"]] == ["a kept reply"]
    assert len(hs.export()["replies"]["b"]) == 2  # another session's are its own
    back = HttpSessions(len)
    back.load({**hs.export(), "forgotten_sessions": [1]})
    assert "b" not in back.export()["replies"] and "a" in back.export()["replies"]


def test_the_log_reads_back_and_refuses_damage(tmp_path):
    """A last line cut short by a crash is no FORGET (its turn never ran); any other damage is
    a CheckpointError, as is a snapshot's count that is not one."""
    log = forgotten.Log(tmp_path)
    rec = {"session": 3, "start": 20, "salt": "", "lineage": "session:3", "page_size": 8,
           "page_hash": "ab"}  # fmt: skip
    log.append(rec)
    log.append({**rec, "start": 40})
    assert [r["start"] for r in log.records()] == [20, 40]
    assert log.since(1) == [{**rec, "start": 40}]
    with open(log.path, "a") as f:
        f.write('{"session": 3, "sta')  # the crash, mid-append
    assert len(log.records()) == 2
    log.path.write_text(log.path.read_text().replace('"start": 20', '"start": "x"'))
    with pytest.raises(ll.CheckpointError, match="damaged"):
        log.records()
    with pytest.raises(ll.CheckpointError, match="count"):
        log.since(-1)
