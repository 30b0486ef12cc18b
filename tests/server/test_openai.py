"""OpenAI API (chat completions, completions, responses) through the official SDK.

The model is tiny with random weights, so its text is noise: the tests check the
protocol (shapes, finish reasons, usage, timings, stops, determinism), never
the words.
"""

import json
import uuid

import openai
import pytest

from conftest import extra

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]

TIMING_KEYS = ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "prompt_per_second", "predicted_per_second", "cache_n")


def check_timings(t, completion_tokens=None, prompt_tokens=None):
    assert isinstance(t, dict), f"no timings object: {t!r}"
    for k in TIMING_KEYS:
        assert k in t, f"timings lacks {k}: {t}"
        assert t[k] >= 0
    if completion_tokens is not None:
        assert t["predicted_n"] == completion_tokens
    if prompt_tokens is not None:
        # prompt_n counts evaluated tokens; the rest came from the kept state.
        assert t["prompt_n"] + t["cache_n"] == prompt_tokens
    if t["predicted_n"] > 0 and t["predicted_ms"] > 0:
        assert t["predicted_per_second"] == pytest.approx(t["predicted_n"] * 1000 / t["predicted_ms"], rel=0.02)


# ---------------------------------------------------------------- chat


def test_models_lists_the_model(oai, model_id):
    ids = [m.id for m in oai.models.list().data]
    assert model_id in ids


def test_models_retrieve(oai, model_id):
    m = oai.models.retrieve(model_id)
    assert m.id == model_id and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("no-such-model")
    assert "no-such-model" in str(e.value)


def test_chat_plain(oai, model_id):
    r = oai.chat.completions.create(model=model_id, messages=HELLO, max_tokens=16, temperature=0, extra_body=NO_THINK)
    assert r.object == "chat.completion"
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.finish_reason in ("stop", "length")
    assert isinstance(c.message.content, str)
    u = r.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.completion_tokens <= 16
    if c.finish_reason == "length":
        assert u.completion_tokens == 16
    check_timings(extra(r, "timings"), u.completion_tokens, u.prompt_tokens)


def test_chat_streamed(oai, model_id):
    stream = oai.chat.completions.create(
        model=model_id,
        messages=HELLO,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_THINK,
    )
    text, finish, usage, timings, n_chunks = "", None, None, None, 0
    for chunk in stream:
        n_chunks += 1
        assert chunk.object == "chat.completion.chunk"
        for ch in chunk.choices:
            if ch.delta and ch.delta.content:
                text += ch.delta.content
            if ch.finish_reason:
                finish = ch.finish_reason
        if chunk.usage:
            usage = chunk.usage
        timings = extra(chunk, "timings") or timings
    assert n_chunks >= 2
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 0
    check_timings(timings, usage.completion_tokens)
    # The stream says what the plain call says.
    plain = oai.chat.completions.create(model=model_id, messages=HELLO, max_tokens=16, temperature=0, extra_body=NO_THINK)
    assert plain.choices[0].message.content == text


def test_chat_greedy_is_deterministic(oai, model_id):
    a = oai.chat.completions.create(model=model_id, messages=HELLO, max_tokens=24, temperature=0, extra_body=NO_THINK)
    b = oai.chat.completions.create(model=model_id, messages=HELLO, max_tokens=24, temperature=0, extra_body=NO_THINK)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_seed_reproduces(oai, model_id):
    def run(seed):
        r = oai.chat.completions.create(
            model=model_id, messages=HELLO, max_tokens=24, temperature=1.0, top_p=0.95, seed=seed, extra_body=NO_THINK
        )
        return r.choices[0].message.content

    a, b = run(1234), run(1234)
    assert a == b
    others = {run(s) for s in (1, 2, 3)}
    assert len(others | {a}) > 1, "different seeds all gave the same text"


def _pick_stop(text):
    """A stop string from the middle of `text` whose first occurrence is there."""
    for start in range(max(1, len(text) // 3), len(text) - 3):
        s = text[start : start + 3]
        if s.strip() and text.find(s) == start:
            return s, start
    return None, None


def test_chat_stop_sequence(oai, model_id):
    first = oai.chat.completions.create(model=model_id, messages=HELLO, max_tokens=40, temperature=0, extra_body=NO_THINK)
    text = first.choices[0].message.content
    stop, at = _pick_stop(text)
    if stop is None:
        pytest.skip(f"greedy output too short to pick a stop from: {text!r}")
    second = oai.chat.completions.create(
        model=model_id, messages=HELLO, max_tokens=40, temperature=0, stop=[stop], extra_body=NO_THINK
    )
    c = second.choices[0]
    assert c.finish_reason == "stop"
    assert c.message.content == text[:at]
    assert stop not in c.message.content


def test_reasoning_split_with_budget(oai, model_id):
    # The template opens <think>; with a thinking budget the server closes the
    # block, so the reply has both reasoning and an answer.
    r = oai.chat.completions.create(
        model=model_id, messages=HELLO, max_tokens=48, temperature=0, extra_body={"max_thinking_tokens": 8}
    )
    m = r.choices[0].message
    reasoning = extra(m, "reasoning_content")
    assert reasoning, f"no reasoning_content: {m}"
    assert m.content, f"no content after the thinking budget: {m}"
    assert "<think>" not in m.content and "</think>" not in m.content


def test_reasoning_split_streamed(oai, model_id):
    stream = oai.chat.completions.create(
        model=model_id,
        messages=HELLO,
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_body={"max_thinking_tokens": 8},
    )
    reasoning, content = "", ""
    for chunk in stream:
        for ch in chunk.choices:
            reasoning += extra(ch.delta, "reasoning_content") or ""
            content += ch.delta.content or ""
    assert reasoning and content


@pytest.mark.parametrize(
    "controls",
    [
        {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
        {"reasoning_effort": "none"},
    ],
    ids=["enable_thinking_false", "reasoning_effort_none"],
)
def test_no_reasoning_when_thinking_off(oai, model_id, controls):
    r = oai.chat.completions.create(model=model_id, messages=HELLO, max_tokens=24, temperature=0, **controls)
    m = r.choices[0].message
    assert not extra(m, "reasoning_content")
    assert m.content


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def test_chat_tools_accepted_and_round_trip(oai, model_id, raw):
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = oai.chat.completions.create(model=model_id, messages=messages, tools=TOOLS, max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The tool definitions and the round trip reach the prompt.
    p = raw.post("/apply-template", {"messages": messages, "tools": TOOLS})
    assert p.status_code == 200, p.text
    prompt = p.json()["prompt"]
    assert "get_weather" in prompt
    assert "sunny, 21 C" in prompt
    assert "Paris" in prompt
    # More prompt than without the tool turn.
    bare = oai.chat.completions.create(model=model_id, messages=messages[:1], tools=TOOLS, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens


# ---------------------------------------------------------------- completions


def test_chat_logprobs(oai, model_id):
    r = oai.chat.completions.create(
        model=model_id, messages=HELLO, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_THINK
    )
    plain = oai.chat.completions.create(model=model_id, messages=HELLO, max_tokens=12, temperature=0, extra_body=NO_THINK)
    assert r.choices[0].message.content == plain.choices[0].message.content, "asking for logprobs changes nothing"
    content = r.choices[0].logprobs.content
    eog = 1 if r.choices[0].finish_reason == "stop" else 0
    assert len(content) == r.usage.completion_tokens - eog
    for e in content:
        assert e.logprob <= 0.0
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
        tops = e.top_logprobs
        assert len(tops) == 3
        assert all(a.logprob >= b.logprob for a, b in zip(tops, tops[1:]))
        # Greedy: the token is the most likely one.
        assert tops[0].token == e.token and tops[0].logprob == pytest.approx(e.logprob)
    # The tokens' bytes are the message's text (no thinking, no tool calls here).
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")
    assert text.strip() == r.choices[0].message.content.strip()


def test_completions_logprobs(oai, model_id):
    r = oai.completions.create(model=model_id, prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) > 0
    if not any("\ufffd" in t for t in lp.tokens):
        assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0
    for tok, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert l <= 0.0 and len(top) <= 2 and max(top.values()) == pytest.approx(l)


def test_logprobs_streamed_are_the_unstreamed_ones(oai, model_id):
    kw = dict(model=model_id, messages=HELLO, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2, extra_body=NO_THINK)
    whole = oai.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = []
    for ch in oai.chat.completions.create(stream=True, **kw):
        if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content:
            streamed.extend(ch.choices[0].logprobs.content)
    key = lambda es: [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in es]
    assert key(streamed) == key(whole)

    ckw = dict(model=model_id, prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=1)
    c = oai.completions.create(**ckw).choices[0].logprobs
    toks, offs, lps = [], [], []
    for ch in oai.completions.create(stream=True, **ckw):
        lp = ch.choices[0].logprobs if ch.choices else None
        if lp and lp.tokens:
            toks += lp.tokens
            offs += lp.text_offset
            lps += lp.token_logprobs
    assert (toks, offs, lps) == (c.tokens, c.text_offset, c.token_logprobs)


def test_completions_plain_and_stop(oai, model_id):
    r = oai.completions.create(model=model_id, prompt="Once upon a time", max_tokens=40, temperature=0)
    assert r.object == "text_completion"
    text = r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0
    check_timings(extra(r, "timings"), r.usage.completion_tokens, r.usage.prompt_tokens)
    stop, at = _pick_stop(text)
    if stop is None:
        pytest.skip(f"greedy output too short to pick a stop from: {text!r}")
    s = oai.completions.create(model=model_id, prompt="Once upon a time", max_tokens=40, temperature=0, stop=stop)
    assert s.choices[0].finish_reason == "stop"
    assert s.choices[0].text == text[:at]


def test_completions_streamed(oai, model_id):
    text, finish, timings = "", None, None
    for chunk in oai.completions.create(model=model_id, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True):
        for ch in chunk.choices:
            text += ch.text or ""
            finish = ch.finish_reason or finish
        timings = extra(chunk, "timings") or timings
    assert finish in ("stop", "length")
    check_timings(timings)
    plain = oai.completions.create(model=model_id, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert plain.choices[0].text == text


# ---------------------------------------------------------------- responses


def test_responses_plain(oai, model_id):
    r = oai.responses.create(
        model=model_id, input="Say hello.", max_output_tokens=16, temperature=0, reasoning={"effort": "none"}
    )
    assert r.status in ("completed", "incomplete")
    assert isinstance(r.output_text, str) and r.output_text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    check_timings(extra(r, "timings"), r.usage.output_tokens)


def test_responses_streamed(oai, model_id):
    deltas, completed = "", None
    stream = oai.responses.create(
        model=model_id, input="Say hello.", max_output_tokens=16, temperature=0, stream=True, reasoning={"effort": "none"}
    )
    types = []
    for ev in stream:
        types.append(ev.type)
        if ev.type == "response.output_text.delta":
            deltas += ev.delta
        if ev.type in ("response.completed", "response.incomplete"):
            completed = ev.response
    assert types[0] == "response.created"
    assert completed is not None, types
    assert completed.output_text == deltas
    assert completed.usage.output_tokens > 0


def test_responses_function_call_round_trip(oai, model_id):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }
    ]
    first = [{"role": "user", "content": "What is the weather in Paris?"}]
    turn = first + [
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    ]
    a = oai.responses.create(model=model_id, input=first, tools=tools, max_output_tokens=8, temperature=0)
    b = oai.responses.create(model=model_id, input=turn, tools=tools, max_output_tokens=8, temperature=0)
    assert b.status in ("completed", "incomplete")
    assert b.usage.input_tokens > a.usage.input_tokens


def test_responses_reasoning_split(oai, model_id):
    r = oai.responses.create(
        model=model_id, input="Say hello.", max_output_tokens=48, temperature=0, extra_body={"max_thinking_tokens": 8}
    )
    kinds = [item.type for item in r.output]
    assert "reasoning" in kinds and "message" in kinds, kinds
    assert r.output_text


def test_responses_metadata_echoed_and_store_refused(oai, model_id):
    r = oai.responses.create(
        model=model_id, input="hi", max_output_tokens=4, metadata={"run": "r1"},
        reasoning={"effort": "none"},
    )
    assert r.metadata == {"run": "r1"}
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model_id, input="hi", max_output_tokens=4, store=True)
    assert "store" in str(e.value)


# ---------------------------------------------------------------- errors


def _bad(fn):
    with pytest.raises(openai.BadRequestError) as e:
        fn()
    assert e.value.status_code == 400
    return e.value


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"n": 2}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ],
    ids=["n2", "temperature", "top_p", "budget_disagree"],
)
def test_chat_bad_fields_are_400(oai, model_id, kwargs, field):
    err = _bad(lambda: oai.chat.completions.create(model=model_id, messages=HELLO, **kwargs))
    body = err.body if isinstance(err.body, dict) else {}
    param = body.get("param") if "param" in body else (body.get("error") or {}).get("param")
    assert field in (param or "") or field in str(err), f"400 does not name {field}: {err}"


def test_chat_unknown_role_is_400(oai, model_id):
    err = _bad(lambda: oai.chat.completions.create(model=model_id, messages=[{"role": "wizard", "content": "hi"}]))
    assert "role" in str(err)


def test_malformed_json_is_400(raw):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        r = raw.post(path, data='{"model": "x", "messages": [')
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert "error" in r.json()


# ---------------------------------------------------------------- issue 45: usage, conformance, custom tools


def test_usage_counts_cached_tokens_inside_the_prompt(oai, model_id):
    messages = [{"role": "system", "content": f"Usage test {uuid.uuid4().hex}. " + "Be brief. " * 30}] + HELLO
    kw = dict(model=model_id, messages=messages, max_tokens=1, temperature=0, extra_body=NO_THINK)
    a = oai.chat.completions.create(**kw)
    b = oai.chat.completions.create(**kw)
    assert b.usage.prompt_tokens == a.usage.prompt_tokens
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= b.usage.prompt_tokens, b.usage
    assert b.usage.total_tokens == b.usage.prompt_tokens + b.usage.completion_tokens
    # Streamed, the usage chunk says the same.
    usage = None
    for chunk in oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
    assert usage.prompt_tokens == a.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0
    # Responses: input_tokens include the cached ones too.
    rkw = dict(model=model_id, instructions=messages[0]["content"], input=HELLO[0]["content"],
               max_output_tokens=16, temperature=0, reasoning={"effort": "none"})
    oai.responses.create(**rkw)
    r = oai.responses.create(**rkw)
    assert 0 < r.usage.input_tokens_details.cached_tokens <= r.usage.input_tokens, r.usage


def test_stream_options_without_stream_is_400(oai, model_id):
    err = _bad(lambda: oai.chat.completions.create(
        model=model_id, messages=HELLO, max_tokens=4, stream_options={"include_usage": True}))
    assert "stream_options is only allowed with stream: true" in str(err)


def test_tool_parameters_must_be_an_object(oai, model_id):
    tools = [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]
    err = _bad(lambda: oai.chat.completions.create(model=model_id, messages=HELLO, max_tokens=4, tools=tools))
    assert "tools[0].function.parameters must be a JSON Schema object" in str(err)


def test_response_format_string_is_a_clear_400(raw, model_id):
    r = raw.post("/v1/chat/completions", {"model": model_id, "messages": HELLO, "response_format": "json"})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "response_format must be an object" in msg and '"json"' in msg, msg


def test_responses_echo_sampling_values_as_sent(oai, model_id):
    r = oai.responses.create(model=model_id, input="hi", max_output_tokens=4, temperature=0.6, top_p=0.9,
                             reasoning={"effort": "none"})
    assert r.temperature == 0.6 and r.top_p == 0.9, (r.temperature, r.top_p)


CUSTOM_TOOLS = [{
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'},
}]


def test_responses_custom_tool_call(oai, model_id, raw):
    # The template sees the tool.
    plain = raw.post("/v1/responses", {"model": model_id, "input": "hi", "max_output_tokens": 1}).json()
    offered = raw.post("/v1/responses", {"model": model_id, "input": "hi", "max_output_tokens": 1,
                                          "tools": CUSTOM_TOOLS}).json()
    assert offered["usage"]["input_tokens"] > plain["usage"]["input_tokens"] + 20
    # Forced, a call comes back as a custom_tool_call item with its raw input.
    r = oai.responses.create(
        model=model_id, input="Add hello.txt.", tools=CUSTOM_TOOLS, max_output_tokens=256, temperature=0,
        tool_choice={"type": "custom", "name": "apply_patch"}, reasoning={"effort": "none"},
    )
    calls = [i for i in r.output if i.type == "custom_tool_call"]
    assert calls, r.output
    assert calls[0].name == "apply_patch" and isinstance(calls[0].input, str) and calls[0].call_id
    assert r.tools[0].type == "custom"
    # The call and its output go back as the next turn's input.
    nxt = oai.responses.create(
        model=model_id, tools=CUSTOM_TOOLS, max_output_tokens=4, reasoning={"effort": "none"},
        input=[{"role": "user", "content": "Add hello.txt."},
               {"type": "custom_tool_call", "call_id": calls[0].call_id, "name": "apply_patch",
                "input": calls[0].input},
               {"type": "custom_tool_call_output", "call_id": calls[0].call_id, "output": "Done!"}],
    )
    assert nxt.status in ("completed", "incomplete")
