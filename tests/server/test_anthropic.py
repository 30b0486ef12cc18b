"""Anthropic Messages API through the official SDK."""

import uuid

import anthropic
import pytest

from conftest import extra

HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]
# This SDK's types no longer declare sampling fields; the server reads them from the body.
GREEDY = {"temperature": 0}
NO_THINK = {"thinking": {"type": "disabled"}, **GREEDY}


def text_of(msg):
    return "".join(b.text for b in msg.content if b.type == "text")


def prompt_of(usage):
    """The whole prompt: Anthropic's input_tokens leave out the cached tokens."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def test_messages_plain(claude, model_id):
    m = claude.messages.create(
        model=model_id, max_tokens=16, messages=HELLO, system="You are terse.", extra_body=NO_THINK
    )
    assert m.type == "message" and m.role == "assistant"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert text_of(m)
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 16
    t = extra(m, "timings")
    assert isinstance(t, dict) and t["predicted_n"] == m.usage.output_tokens


def test_messages_system_reaches_prompt(claude, model_id):
    a = claude.messages.create(model=model_id, max_tokens=1, messages=HELLO, extra_body=NO_THINK)
    b = claude.messages.create(
        model=model_id,
        max_tokens=1,
        messages=HELLO,
        system="You are a very terse assistant that answers in one word.",
        extra_body=NO_THINK,
    )
    assert prompt_of(b.usage) > prompt_of(a.usage)


def test_messages_streamed(claude, model_id):
    with claude.messages.stream(
        model=model_id, max_tokens=16, messages=HELLO, extra_body=NO_THINK
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == text_of(final)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0
    plain = claude.messages.create(model=model_id, max_tokens=16, messages=HELLO, extra_body=NO_THINK)
    assert text_of(plain) == text


def test_messages_stream_events(claude, model_id):
    kinds = []
    stream = claude.messages.create(
        model=model_id, max_tokens=8, messages=HELLO, stream=True, extra_body=NO_THINK
    )
    for ev in stream:
        kinds.append(ev.type)
    assert kinds[0] == "message_start"
    assert "content_block_start" in kinds and "content_block_delta" in kinds
    assert kinds[-2:] == ["message_delta", "message_stop"]


def test_messages_thinking_split(claude, model_id):
    m = claude.messages.create(
        model=model_id,
        max_tokens=48,
        messages=HELLO,
        thinking={"type": "enabled", "budget_tokens": 8},
        extra_body=GREEDY,
    )
    kinds = [b.type for b in m.content]
    assert "thinking" in kinds and "text" in kinds, kinds
    assert kinds.index("thinking") < kinds.index("text")
    thinking = next(b for b in m.content if b.type == "thinking")
    assert thinking.thinking
    assert text_of(m)


def test_messages_no_thinking_when_disabled(claude, model_id):
    m = claude.messages.create(model=model_id, max_tokens=16, messages=HELLO, extra_body=NO_THINK)
    assert all(b.type != "thinking" for b in m.content)


def test_messages_stop_sequence(claude, model_id):
    first = claude.messages.create(model=model_id, max_tokens=40, messages=HELLO, extra_body=NO_THINK)
    text = text_of(first)
    stop = None
    for start in range(max(1, len(text) // 3), len(text) - 3):
        s = text[start : start + 3]
        if s.strip() and text.find(s) == start:
            stop, at = s, start
            break
    if stop is None:
        pytest.skip(f"greedy output too short to pick a stop from: {text!r}")
    m = claude.messages.create(
        model=model_id, max_tokens=40, messages=HELLO, stop_sequences=[stop], extra_body=NO_THINK
    )
    assert m.stop_reason == "stop_sequence"
    assert m.stop_sequence == stop
    assert text_of(m) == text[:at]


TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def test_anthropic_prefill_is_continued(claude, model_id):
    prefill = "Hello, my name"
    m = claude.messages.create(
        model=model_id,
        max_tokens=4,
        messages=[{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": prefill}],
        extra_body=NO_THINK,
    )
    # The answer is the continuation only, never a repeat of the prefill.
    text = "".join(b.text for b in m.content if b.type == "text")
    assert not text.startswith(prefill)
    assert m.usage.output_tokens > 0


def test_messages_tool_use_round_trip(claude, model_id):
    first = [{"role": "user", "content": "What is the weather in Paris?"}]
    turn = first + [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}]},
    ]
    a = claude.messages.create(model=model_id, max_tokens=8, messages=first, tools=TOOLS, extra_body=GREEDY)
    b = claude.messages.create(model=model_id, max_tokens=8, messages=turn, tools=TOOLS, extra_body=GREEDY)
    assert b.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert prompt_of(b.usage) > prompt_of(a.usage)


def test_count_tokens(claude, model_id):
    c = claude.messages.count_tokens(model=model_id, messages=HELLO, system="You are terse.")
    assert c.input_tokens > 0
    m = claude.messages.create(
        model=model_id, max_tokens=1, messages=HELLO, system="You are terse.", extra_body=GREEDY
    )
    assert c.input_tokens == prompt_of(m.usage)
    with_tools = claude.messages.count_tokens(model=model_id, messages=HELLO, system="You are terse.", tools=TOOLS)
    assert with_tools.input_tokens > c.input_tokens


def test_messages_unknown_role_is_400(claude, model_id):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model_id, max_tokens=8, messages=[{"role": "wizard", "content": "hi"}])
    assert "role" in str(e.value)


def test_messages_bad_temperature_is_400(claude, model_id):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model_id, max_tokens=8, messages=HELLO, extra_body={"temperature": -1})
    assert "temperature" in str(e.value)


# ---------------------------------------------------------------- usage and the prompt cache (issue 45)


def _session_request(model_id, suffix, nonce):
    """A Claude Code session's first request: its billing header (whose suffix changes
    per session) as the first system block, then the system prompt."""
    return dict(
        model=model_id,
        max_tokens=1,
        system=[
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{suffix}; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": f"Session test {nonce}. " + "You are a careful coding agent. " * 20},
        ],
        messages=[{"role": "user", "content": "Read hello.txt and tell me what it says."}],
        extra_body=NO_THINK,
    )


def test_usage_is_anthropics_and_a_second_session_reuses_the_first(claude, model_id):
    nonce = uuid.uuid4().hex
    first = claude.messages.create(**_session_request(model_id, "f2f", nonce))
    total = prompt_of(first.usage)
    assert isinstance(first.usage.cache_read_input_tokens, int)
    assert first.usage.cache_creation_input_tokens == 0
    # Another session: another header suffix, the same prompt once the header is gone.
    second = claude.messages.create(**_session_request(model_id, "58e", nonce))
    u = second.usage
    assert prompt_of(u) == total, (first.usage, u)
    assert u.cache_read_input_tokens > 0, u
    assert u.cache_read_input_tokens >= total - 16, (total, u)
    assert u.input_tokens == total - u.cache_read_input_tokens

    # Streamed: message_start and message_delta both carry the cache counts.
    events = list(claude.messages.create(**_session_request(model_id, "a01", nonce), stream=True))
    start = next(e for e in events if e.type == "message_start")
    assert isinstance(start, anthropic.types.RawMessageStartEvent)
    su = start.message.usage
    assert su.cache_read_input_tokens > 0, su
    assert su.input_tokens + su.cache_read_input_tokens + su.cache_creation_input_tokens == total
    delta = next(e for e in events if e.type == "message_delta")
    du = delta.usage
    read = getattr(du, "cache_read_input_tokens", None) or (du.model_extra or {}).get("cache_read_input_tokens")
    assert read == su.cache_read_input_tokens, du
    assert du.output_tokens >= 1


def test_messages_without_max_tokens_is_400(raw, model_id):
    r = raw.post("/v1/messages", {"model": model_id, "messages": HELLO})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    assert "max_tokens is required" in r.json()["error"]["message"]


def test_lone_surrogate_is_a_clear_400(raw, model_id):
    body = '{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "cut \\ud800 here"}]}' % model_id
    r = raw.post("/v1/messages", data=body)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "lone UTF-16 surrogate" in msg and "line 1 column" in msg, msg
