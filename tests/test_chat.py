"""The real tokenizers and the chat formats (DeepSeek's; ChatML with SmolLM2's GGUF tokenizer):
real vocabularies, exact spans, prefix stability, and ChatML against the GGUF's own template."""

from __future__ import annotations

import pytest

from serve.chat import (
    GIL_FREE,
    ChatTokenizer,
    TooLong,
    close_reply,
    model_path,
    render,
    tokenizer_for,
    tools_text,
)
from serve.chat_formats import (
    ASSISTANT,
    BOS,
    CALLS_BEGIN,
    CHATML,
    DEEPSEEK,
    EOS,
    IM_END,
    IM_START,
    SMOLLM2_SYSTEM,
    USER,
)


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer()


CONV = [
    {"role": "system", "content": "You are a helpful assistant with tools."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": '{"temp_c": 18, "sky": "clear"}'},
    {"role": "assistant", "content": "It is 18 °C and clear."},
]


def test_real_vocabulary_round_trip(tok):
    assert tok.vocab_size == 129280
    text = "Hello! 1 + 1 = 2, get_weather(city='Paris') 毕老师"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.special(USER) == 128803 and tok.special(BOS) == 0 and tok.special(EOS) == 1
    with pytest.raises(KeyError):
        tok.special("<not a token>")


def test_spans_are_exact(tok):
    r = render(tok, CONV)
    assert r.tokens[0] == tok.special(BOS) and r.tokens[-1] == tok.special(ASSISTANT)
    for span, m in zip(r.spans, CONV, strict=True):
        assert span.role == m["role"]
        assert tok.decode(r.tokens[span.content_start : span.content_end]) == m["content"]
    # spans tile the rendering between the BOS and the generation prompt
    assert r.spans[0].start == 1 and r.spans[-1].end == len(r.tokens) - 1
    for a, b in zip(r.spans, r.spans[1:], strict=False):
        assert a.end == b.start
    call = tok.decode(r.tokens[r.spans[2].start : r.spans[2].end])
    assert "get_weather" in call and '"city": "Paris"' in call


@pytest.mark.parametrize("long", [False, True])  # a short text, and one past GIL_FREE
def test_a_limit_refuses_exactly_what_would_not_fit(tok, long):
    """`render(..., limit=L)` refuses a conversation whose tokens outside assistant messages
    are more than L, and renders every other exactly as without a limit; the count the error
    gives is at least L + 1. The limit one below the count refuses; the count itself does not."""
    words = "the tool reports forty-two results for the query; " * (60 if long else 1)
    conv = [
        *CONV[:3],
        {"role": "tool", "content": words},
        {"role": "assistant", "content": words},  # a reply: not counted
        {"role": "user", "content": "and tomorrow?"},
    ]
    assert len(words) >= GIL_FREE or not long
    full = render(tok, conv)
    replies = sum(s.end - s.start for s in full.spans if s.role == "assistant")
    outside = len(full.tokens) - replies
    same = render(tok, conv, limit=outside)
    assert (same.tokens, same.spans) == (full.tokens, full.spans)
    with pytest.raises(TooLong) as e:
        render(tok, conv, limit=outside - 1)
    assert e.value.tokens >= outside
    assert tok.encode(words, limit=len(tok.encode(words))) == tok.encode(words)
    with pytest.raises(TooLong):
        tok.encode(words, limit=len(tok.encode(words)) - 1)


def test_rendering_is_prefix_stable(tok):
    """Appending messages never changes earlier tokens; with the generation prompt, neither does
    the assistant reply that follows it (the prompt is the reply's first token)."""
    for n in range(1, len(CONV)):
        a = render(tok, CONV[:n], add_generation_prompt=False).tokens
        b = render(tok, CONV[: n + 1], add_generation_prompt=False).tokens
        assert b[: len(a)] == a
        if CONV[n]["role"] == "assistant":
            a = render(tok, CONV[:n]).tokens
            assert b[: len(a)] == a


def test_unknown_role(tok):
    with pytest.raises(ValueError, match="role"):
        render(tok, [{"role": "robot", "content": "x"}])


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "ls", "description": "List files."}},
]


def test_tool_schemas_follow_the_system_prompt(tok):
    plain = render(tok, CONV)
    r = render(tok, CONV, TOOLS)
    assert plain.tools is None and r.tools is not None
    t0, t1 = r.tools
    sys_end = r.spans[0].end
    assert t0 == sys_end  # right after the system message, before the user's
    assert r.spans[1].start == t1
    text = tok.decode(r.tokens[t0:t1])
    assert text == tools_text(TOOLS)
    assert "### get_weather" in text and '"city": {"type": "string"}' in text and "### ls" in text
    assert tok.special(CALLS_BEGIN) in r.tokens[t0:t1]  # the format line's special tokens
    # everything else is what it was without tools, shifted by the section
    n = t1 - t0
    assert r.tokens[:t0] == plain.tokens[:t0] and r.tokens[t1:] == plain.tokens[t0:]
    for a, b in zip(plain.spans[1:], r.spans[1:], strict=True):
        assert (b.start, b.content_start) == (a.start + n, a.content_start + n)
    # prefix-stable with tools too
    for k in range(1, len(CONV)):
        a = render(tok, CONV[:k], TOOLS, add_generation_prompt=False).tokens
        b = render(tok, CONV[: k + 1], TOOLS, add_generation_prompt=False).tokens
        assert b[: len(a)] == a


def test_tool_schemas_without_a_system_prompt(tok):
    r = render(tok, CONV[1:], TOOLS)
    assert r.tools[0] == 1 and r.spans[0].start == r.tools[1]  # right after BOS
    only_system = render(tok, CONV[:1], TOOLS)
    assert only_system.tools[0] == only_system.spans[0].end


def test_close_reply_continues_as_render_places_the_next_message(tok):
    """A generated reply (ending with EOS, or cut by its budget) plus `close_reply` is what the
    rendering of the conversation with that reply holds before the next message."""
    _check_close_reply(tok)


def _check_close_reply(tok):
    stop = tok.stop_tokens[0]
    before = CONV[:2]
    reply = "It is 18 °C and clear."
    after = [*before, {"role": "assistant", "content": reply}, {"role": "user", "content": "ok"}]
    full = render(tok, after, add_generation_prompt=False)
    prompt = render(tok, before).tokens
    for generated in (tok.encode(reply) + [stop], tok.encode(reply)):
        ids = prompt + generated + close_reply(tok, generated)
        assert ids == full.tokens[: full.spans[3].start]


# ---- ChatML (SmolLM2's GGUF tokenizer) --------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    from leyline_jax import gguf

    try:
        return gguf.smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' tokenizer of the GGUF (the file's own chat template); loaded once."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)


@pytest.fixture(scope="module")
def ml(reference):
    """The ChatML tokenizer on the same backend (`from_gguf` builds this very backend through
    `leyline_jax.gguf.gguf_tokenizer`; loading it twice would cost seconds)."""
    return ChatTokenizer.from_tokenizer(reference.backend_tokenizer, CHATML)


def _template(reference, messages, add_generation_prompt=True) -> list[int]:
    out = reference.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    return list(out if isinstance(out, list) else out["input_ids"])


def test_from_gguf_is_the_files_tokenizer_with_chatml(smollm2, reference, monkeypatch):
    from leyline_jax import gguf

    seen = []
    monkeypatch.setattr(
        gguf, "gguf_tokenizer", lambda p: seen.append(p) or reference.backend_tokenizer
    )
    t = ChatTokenizer.from_gguf(smollm2)
    assert seen == [smollm2] and t.format is CHATML and t.vocab_size == 49152
    assert t.special(IM_START) == 1 and t.special(IM_END) == 2 and t.stop_tokens == (2,)
    assert ChatTokenizer.from_gguf().format is CHATML and seen[-1] == smollm2  # the default file
    assert tokenizer_for("smollm2").format is CHATML and str(seen[-1]) == str(smollm2)
    assert tokenizer_for(str(smollm2)).format is CHATML
    assert model_path("smollm2") == str(smollm2) and model_path("some/dir") == "some/dir"


def test_a_kept_gguf_tokenizer_is_read_back(smollm2, reference, monkeypatch, tmp_path):
    """With the compile cache on, the GGUF tokenizer transformers built once is read back by a
    later start (no second build), and encodes as transformers' does; with it off, each call
    builds it."""
    from leyline_jax import gguf
    from serve import compile_cache

    seen = []
    monkeypatch.setattr(
        gguf, "gguf_tokenizer", lambda p: seen.append(p) or reference.backend_tokenizer
    )
    monkeypatch.setattr(compile_cache, "_text_dir", tmp_path)
    a, b = ChatTokenizer.from_gguf(smollm2), ChatTokenizer.from_gguf(smollm2)
    text = "Kept tokenizers read back: 3 colours."
    assert len(seen) == 1 and a.encode(text) == b.encode(text) == reference(text).input_ids
    monkeypatch.setattr(compile_cache, "_text_dir", None)
    ChatTokenizer.from_gguf(smollm2)
    assert len(seen) == 2


def test_tokenizer_for_defaults_to_deepseek(tmp_path):
    assert tokenizer_for(None).format is DEEPSEEK
    assert tokenizer_for(str(tmp_path)).format is DEEPSEEK  # a checkpoint directory


PLAIN = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?\nThanks, 毕老师 ☺"},
    ],
    [
        {"role": "user", "content": "List two colours."},
        {"role": "assistant", "content": "Red\n- Blue\n\n"},
        {"role": "user", "content": " and  one more "},
    ],
]


@pytest.mark.parametrize("messages", PLAIN, ids=["user", "system-multi-turn", "whitespace"])
def test_chatml_matches_the_gguf_chat_template(ml, reference, messages):
    """Without tools, the token ids are those of the GGUF's own Jinja template through
    transformers (default system prompt and generation prompt included)."""
    assert render(ml, messages).tokens == _template(reference, messages)
    assert render(ml, messages, add_generation_prompt=False).tokens == _template(
        reference, messages, add_generation_prompt=False
    )


def test_chatml_differs_from_the_template_only_at_a_piece_boundary(ml, reference):
    """A content starting with two or more whitespace characters: the template's one string
    tokenizes the newline after the role together with them ("\\n\\n" + "\\n"), `render` encodes
    the content alone ("\\n" | "\\n", "\\n"). Same text, different token boundaries."""
    for content in ("\n\nHello", "  Hello"):
        messages = [{"role": "user", "content": content}]
        ours, theirs = render(ml, messages).tokens, _template(reference, messages)
        assert ours != theirs and ml.decode(ours) == ml.decode(theirs)
        r = render(ml, messages)
        span = r.spans[0]
        assert ml.decode(r.tokens[span.content_start : span.content_end]) == content


def test_chatml_spans_are_exact(ml):
    r = render(ml, CONV)
    gen = [ml.special(IM_START), *ml.encode("assistant\n")]
    assert r.tokens[-len(gen) :] == gen
    assert r.spans[0].start == 0 and r.spans[-1].end == len(r.tokens) - len(gen)
    for a, b in zip(r.spans, r.spans[1:], strict=False):
        assert a.end == b.start
    for span, m in zip(r.spans, CONV, strict=True):
        assert span.role == m["role"]
        assert ml.decode(r.tokens[span.content_start : span.content_end]) == m["content"]
        whole = ml.decode(r.tokens[span.start : span.end])
        assert whole.startswith(f"{IM_START}{m['role']}\n{m['content']}")
        assert whole.endswith(f"{IM_END}\n")
    call = ml.decode(r.tokens[r.spans[2].content_end : r.spans[2].end])
    assert call == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        f"</tool_call>{IM_END}\n"
    )
    tool = ml.decode(r.tokens[r.spans[3].start : r.spans[3].end])
    assert tool == f'{IM_START}tool\n{{"temp_c": 18, "sky": "clear"}}{IM_END}\n'


def test_chatml_default_system_prompt(ml):
    r = render(ml, CONV[1:])
    default = f"{IM_START}system\n{SMOLLM2_SYSTEM}{IM_END}\n"
    assert SMOLLM2_SYSTEM == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert ml.decode(r.tokens[: r.spans[0].start]) == default  # no span: not a message
    assert [s.index for s in r.spans] == [0, 1, 2, 3]
    assert render(ml, []).tokens == [ml.special(IM_START), *ml.encode("assistant\n")]
    assert render(ml, [], add_generation_prompt=False).tokens == []


@pytest.mark.parametrize("fmt", ["deepseek", "chatml"])
def test_prefix_stable_in_both_formats(tok, ml, fmt):
    t = tok if fmt == "deepseek" else ml
    for tools in (None, TOOLS):
        for n in range(1, len(CONV)):
            a = render(t, CONV[:n], tools, add_generation_prompt=False).tokens
            b = render(t, CONV[: n + 1], tools, add_generation_prompt=False).tokens
            assert b[: len(a)] == a
            if CONV[n]["role"] == "assistant":
                a = render(t, CONV[:n], tools).tokens
                assert b[: len(a)] == a


def test_chatml_close_reply(ml):
    _check_close_reply(ml)


def test_chatml_tool_schemas_go_into_the_system_message(ml):
    plain = render(ml, CONV)
    r = render(ml, CONV, TOOLS)
    t0, t1 = r.tools
    system = r.spans[0]
    assert system.content_end == t0 and t1 < system.end  # inside it, after its content
    text = ml.decode(r.tokens[t0:t1])
    assert text == CHATML.tools_text(TOOLS)
    assert text.startswith("\n\n## Tools\n") and "### get_weather" in text and "<tool_call>" in text
    n = t1 - t0
    assert r.tokens[:t0] == plain.tokens[:t0] and r.tokens[t1:] == plain.tokens[t0:]
    assert system.end == plain.spans[0].end + n
    for a, b in zip(plain.spans[1:], r.spans[1:], strict=True):
        assert (b.start, b.content_start) == (a.start + n, a.content_start + n)
    # without a system message: into the default one, before the first message
    r = render(ml, CONV[1:], TOOLS)
    assert r.tools[1] < r.spans[0].start
    assert ml.decode(r.tokens[: r.spans[0].start]) == (
        f"{IM_START}system\n{SMOLLM2_SYSTEM}{CHATML.tools_text(TOOLS)}{IM_END}\n"
    )


def test_chatml_unknown_role(ml):
    with pytest.raises(ValueError, match="role"):
        render(ml, [{"role": "robot", "content": "x"}])


def test_demo_script_edits_land_on_the_rendered_spans(ml):
    """`python -m serve --model smollm2`'s script, without a model: the session's tokens after
    each turn (directives applied, new tokens appended) are exactly the rendering of its message
    list, stubbed tool outputs and replies (stopped or cut by the budget) included."""
    from types import SimpleNamespace

    from leyline_jax.directives import apply_to_list
    from serve.__main__ import ChatScript
    from serve.policies import STUB

    script = ChatScript(ml, SimpleNamespace(sessions=2, turns=4, seed=0, max_new=8))
    assert script.sampling.stop_tokens == (ml.special(IM_END),)
    for i in range(2):
        tokens, output, edits = [], [], []
        for turn in range(4):
            new, ds, edit = script.turn(i, turn, len(tokens), output)
            edits.append(edit)
            tokens = apply_to_list(tokens, ds) + new
            assert tokens == render(ml, script.messages[i]).tokens
            output = ml.encode(f"Reply {turn}.") + ([ml.special(IM_END)] if turn % 2 else [])
            tokens += output
        assert edits == ["", "amortize", "amortize", "forget" if i == 0 else "amortize"]
        tools = [m for m in script.messages[i] if m["role"] == "tool"]
        assert [m["content"] == STUB for m in tools] == [True, True, True, False]
