"""Moving a drained replica's sessions to another live one (`POST /v1/sessions/import`): the
sessions of replica A's snapshot join replica B beside B's own, with their KV, so a moved
session's next turn reuses it (not re-prefilled) and answers as A would have (greedy); B's own
sessions are untouched; a name B already serves keeps B's session; what cannot be imported is
a 400 naming `snapshot_dir`. Two in-process servers of the tiny model, fp32 KV."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def turn(server, session: str, history: list, n: int = 4):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(
        model="tiny", messages=history, max_tokens=n, temperature=0,
        extra_headers={"X-Session-Id": session},
    )  # fmt: skip
    history.append({"role": "assistant", "content": r.choices[0].message.content})
    return r


def test_a_drained_replicas_sessions_continue_on_another(tiny_replicas):
    a, b = tiny_replicas
    moved = [{"role": "user", "content": "Plan a trip to the coast for the weekend."}]
    turn(a, "trip", moved)
    moved.append({"role": "user", "content": "Add a museum on Sunday."})
    turn(a, "trip", moved)
    own = [{"role": "user", "content": "Something else entirely."}]
    turn(b, "mine", own)
    assert post(a.url + "/v1/snapshot", {})[0] == 200  # A is drained: its sessions saved
    status, body = post(b.url + "/v1/sessions/import", {"snapshot_dir": a.backend.snapshot_dir})
    assert status == 200 and body["sessions"] == 1, body
    nxt = [*moved, {"role": "user", "content": "And dinner?"}]
    on_b = turn(b, "trip", [*nxt])
    on_a = turn(a, "trip", [*nxt])  # what A answers, had it kept serving
    assert on_b.choices[0].message.content == on_a.choices[0].message.content
    used = on_b.usage.model_extra
    assert used["reused_tokens"] == on_a.usage.model_extra["reused_tokens"] > 20  # its KV moved
    assert used["prefilled_tokens"] == on_a.usage.model_extra["prefilled_tokens"]
    own.append({"role": "user", "content": "More."})
    assert turn(b, "mine", own).usage.model_extra["reused_tokens"] > 5  # B's own: untouched
    # a name B serves already keeps B's session: nothing taken the second time
    status, body = post(b.url + "/v1/sessions/import", {"snapshot_dir": a.backend.snapshot_dir})
    assert status == 200 and body["sessions"] == 0, body


@pytest.mark.parametrize("where", ["/nonexistent/snapshot", ""])
def test_what_cannot_be_imported_is_named(tiny_replicas, where):
    status, body = post(tiny_replicas[1].url + "/v1/sessions/import", {"snapshot_dir": where})
    assert status == 400 and body["error"]["param"] == "snapshot_dir", body
