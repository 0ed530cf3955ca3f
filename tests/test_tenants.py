"""Tenants (`serve.http.auth`): with API keys, a tenant never reads, continues, deletes or
infers another's sessions or cached prefixes — checked through the official `openai` client on
a live server; the engine's salted radix caches beneath it (`Engine.open_session(salt=)`) and
their snapshot; the keys' parsing.

The failing cases: the same probes on a single-tenant server (no keys) do see the other
client's session and prefix, so each check below can tell the two apart.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import jax.numpy as jnp
import pytest

openai = pytest.importorskip("openai")

import leyline_jax as ll  # noqa: E402
from checkpoints.tiny import ensure_default_checkpoints  # noqa: E402
from serve import chat, snapshot  # noqa: E402
from serve.engine import Engine, SamplingParams  # noqa: E402
from serve.http.auth import Tenants  # noqa: E402
from serve.http.backend import Backend  # noqa: E402
from serve.http.server import ServerThread  # noqa: E402

ENGINE = dict(num_pages=128, page_size=16, max_seqs=4, kv_dtype=jnp.float32)
KEY_A, KEY_B, KEY_C = "key-of-tenant-a", "key-of-tenant-b", "key-of-tenant-c"
ADMIN = "the-admin-key"
HISTORY = [
    {"role": "system", "content": "You are a terse assistant. " * 6},
    {"role": "user", "content": "What is the capital of France? Answer in one word please."},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return ll.load_model(ensure_default_checkpoints(root)["deepseek_v3"])


def serve(model, tenants: Tenants, **kw) -> ServerThread:
    backend = Backend.for_engine(Engine(model, **ENGINE), chat.ChatTokenizer(), "tiny", **kw)
    backend.tenants = tenants
    return ServerThread(backend)


@pytest.fixture(scope="module")
def server(model):
    keys = {KEY_A: "tenant-a", KEY_B: "tenant-b", KEY_C: "tenant-c"}
    with serve(model, Tenants(keys, [ADMIN])) as srv:
        yield srv


@pytest.fixture(scope="module")
def open_server(model):
    """No keys: the single tenant (the failing case)."""
    with serve(model, Tenants()) as srv:
        yield srv


def client(srv, key: str = "none"):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def turn(c, messages, session: str | None = None, **extra):
    body = {"session_id": session} if session else {}
    r = c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, temperature=0, extra_body=body | extra
    )
    return r, r.usage.model_dump()


def call(srv, method: str, path: str, key: str | None, body=None) -> tuple[int, dict]:
    req = urllib.request.Request(srv.url + path, method=method)
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, data, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_a_key_is_needed_and_names_the_tenant(server):
    with pytest.raises(openai.AuthenticationError):
        turn(client(server, "not-a-key-at-all"), HISTORY)
    status, body = call(server, "GET", "/v1/models", None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert call(server, "GET", "/health", None)[0] == 200  # open, as in vLLM
    assert call(server, "GET", "/v1/models", KEY_A)[0] == 200


def probe(srv, key_a: str, key_b: str, key_c: str) -> dict:
    """A runs a history in sessions "s" and "t"; then C sends A's history in a session of its
    own, B names session "s" with that history and one more message, and deletes "t"."""
    a, b = client(srv, key_a), client(srv, key_b)
    first, _ = turn(a, HISTORY, "s")
    turn(a, HISTORY, "t")
    reply = {"role": "assistant", "content": first.choices[0].message.content}
    history = [*HISTORY, reply, {"role": "user", "content": "And of Spain?"}]
    _, fresh = turn(client(srv, key_c), HISTORY, "c-own")
    _, cont = turn(b, history, "s")
    deleted = call(srv, "DELETE", "/v1/sessions/t", key_b)[0]
    _, again = turn(a, history, "s")  # A's session is still there, and still A's
    assert call(srv, "DELETE", "/v1/sessions/t", key_a)[0] == (200 if deleted == 404 else 404)
    return {"continue": cont, "fresh": fresh, "deleted": deleted, "a_again": again}


def test_another_tenant_cannot_continue_delete_or_infer(server, open_server):
    got = probe(server, KEY_A, KEY_B, KEY_C)
    assert got["continue"]["reused_tokens"] == 0  # "s" is B's own, new session
    assert got["fresh"]["prompt_tokens_details"]["cached_tokens"] == 0  # A's prefix: unseen
    assert got["deleted"] == 404
    assert got["a_again"]["reused_tokens"] > 0
    # the failing case: one tenant, the same probe sees the session and the prefix
    shared = probe(open_server, "none", "none", "none")
    assert shared["continue"]["reused_tokens"] > 0
    assert shared["fresh"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert shared["deleted"] == 200


def test_usage_is_the_same_whether_or_not_another_tenant_cached_it(model):
    """B's usage for a history is what it is on a server where nobody sent it before."""
    keys = {KEY_A: "tenant-a", KEY_B: "tenant-b"}
    with serve(model, Tenants(keys)) as srv:
        _, alone = turn(client(srv, KEY_B), HISTORY)
    with serve(model, Tenants(keys)) as srv:
        turn(client(srv, KEY_A), HISTORY)
        _, after_a = turn(client(srv, KEY_B), HISTORY)
        _, a_again = turn(client(srv, KEY_A), HISTORY)
    assert after_a == alone
    assert a_again["prompt_tokens_details"]["cached_tokens"] > 0  # A's own cache holds it


def test_cache_salt_splits_a_tenants_cache(server):
    a = client(server, KEY_A)
    turn(a, HISTORY, cache_salt="one")
    _, same = turn(a, HISTORY, cache_salt="one")
    _, other = turn(a, HISTORY, cache_salt="two")
    assert same["prompt_tokens_details"]["cached_tokens"] > 0
    assert other["prompt_tokens_details"]["cached_tokens"] == 0
    with pytest.raises(openai.BadRequestError) as e:  # a session keeps its salt
        turn(a, HISTORY, "salted", cache_salt="one")
        turn(a, HISTORY, "salted", cache_salt="two")
    assert e.value.body["param"] == "cache_salt"


def test_admin_routes_need_the_admin_key(server, model):
    assert call(server, "POST", "/v1/snapshot", KEY_B)[0] == 403
    status, body = call(server, "POST", "/v1/snapshot", ADMIN)
    assert status == 409 and body["error"]["code"] == "no_snapshot_dir"  # past the key check
    with serve(model, Tenants({KEY_A: "tenant-a"})) as srv:  # keys, no admin key: closed
        assert call(srv, "POST", "/v1/snapshot", KEY_A)[0] == 403


def test_salted_radix_caches_and_their_snapshot(model, tmp_path):
    eng = Engine(model, **ENGINE)
    prompt = list(range(1, 70))
    greedy = SamplingParams(max_new_tokens=1)
    for salt in ("a", "a", "b"):
        eng.submit_prompt(eng.open_session(salt=salt), prompt, sampling=greedy)
        eng.run_until_idle()
    assert eng.counters["reused"] == 64  # the second "a" only: "b" found nothing
    snapshot.save(eng, tmp_path)
    back = Engine(model, **ENGINE)
    snapshot.restore(back, tmp_path)
    assert back.caches.tree("a").match(prompt)[1] == 64
    assert back.caches.tree("b").match(prompt)[1] == 64
    assert back.caches.tree("").match(prompt)[1] == 0
    assert {s.salt for s in back.sessions.values()} == {"a", "b"}


def test_keys_are_read_and_checked(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# tenants\nalice key-of-alice-1\n\nkey-without-a-name\n")
    t = Tenants.from_args(["key-from-the-cli"], str(f), [ADMIN])
    assert t.tenant("Bearer key-of-alice-1") == "alice"
    assert t.tenant("Bearer key-without-a-name").startswith("key-")
    assert t.tenant("bearer key-from-the-cli") != t.tenant("Bearer key-without-a-name")
    assert t.tenant(f"Bearer {ADMIN}") == "admin"
    assert Tenants().single and Tenants().tenant(None) == ""
    for bad in ("a b c\n", "bad/name key-of-someone\n"):
        f.write_text(bad)
        with pytest.raises(ValueError, match="TENANT KEY"):
            Tenants.from_args((), str(f))
    with pytest.raises(ValueError, match="8 to 512"):
        Tenants({"short": "t"})
    with pytest.raises(ValueError, match="--admin-key needs"):
        Tenants.from_args((), None, [ADMIN])
