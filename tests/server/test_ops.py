"""Operations: auth, /health, errors and CORS on every route, /metrics, /tokenize,
/slots, /stats.json, cancellation on disconnect, and the request queue."""

import json
import threading
import time

import anthropic
import openai
import pytest
import requests

from conftest import API_KEY, BASE_URL, TIMEOUT

LLAMACPP_METRICS = [
    "llamacpp:prompt_tokens_total",
    "llamacpp:prompt_seconds_total",
    "llamacpp:tokens_predicted_total",
    "llamacpp:tokens_predicted_seconds_total",
    "llamacpp:n_decode_total",
    "llamacpp:n_busy_slots_per_decode",
    "llamacpp:prompt_tokens_seconds",
    "llamacpp:predicted_tokens_seconds",
    "llamacpp:kv_cache_usage_ratio",
    "llamacpp:kv_cache_tokens",
    "llamacpp:requests_processing",
    "llamacpp:requests_deferred",
]

NO_THINK = {"enable_thinking": False}


def chat_body(model_id, max_tokens, stream=False, content="Tell me a long story."):
    return {
        "model": model_id,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "chat_template_kwargs": NO_THINK,
    }


# ---------------------------------------------------------------- auth


@pytest.mark.skipif(not API_KEY, reason="server started without --api-key")
@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/responses"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/messages/count_tokens"),
        ("GET", "/metrics"),
        ("GET", "/props"),
        ("GET", "/slots"),
        ("GET", "/stats.json"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/apply-template"),
    ],
)
def test_401_without_key(method, path):
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"x-api-key": "wrong-key"}):
        r = requests.request(method, BASE_URL + path, headers=headers, data="{}", timeout=TIMEOUT)
        assert r.status_code == 401, (path, headers, r.status_code, r.text)


@pytest.mark.skipif(not API_KEY, reason="server started without --api-key")
def test_sdks_get_401_with_a_wrong_key(model_id):
    bad_oai = openai.OpenAI(base_url=BASE_URL + "/v1", api_key="wrong-key", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(openai.AuthenticationError):
        bad_oai.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    bad_claude = anthropic.Anthropic(base_url=BASE_URL, api_key="wrong-key", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(anthropic.AuthenticationError):
        bad_claude.messages.create(model=model_id, max_tokens=1, messages=[{"role": "user", "content": "hi"}])


def test_anthropic_wrong_key_is_an_authentication_error(model_id):
    bad = anthropic.Anthropic(base_url=BASE_URL, api_key="wrong", timeout=TIMEOUT, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=model_id, max_tokens=4, messages=[{"role": "user", "content": "Say hello."}])
    assert e.value.status_code == 401
    assert e.value.body["error"]["type"] == "authentication_error"


@pytest.mark.skipif(not API_KEY, reason="server started without --api-key")
def test_anthropic_header_key_is_accepted(raw, model_id):
    r = requests.post(
        BASE_URL + "/v1/messages/count_tokens",
        headers={"x-api-key": API_KEY, "content-type": "application/json"},
        data=json.dumps({"model": model_id, "messages": [{"role": "user", "content": "hi"}]}),
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text


def test_health_without_key():
    r = requests.get(BASE_URL + "/health", timeout=TIMEOUT)
    assert r.status_code == 200
    h = r.json()
    assert h["status"] == "ok"
    caps = h["capabilities"]
    assert "temperature" in caps["sampling"]
    assert set(caps["token_budget_aliases"]) >= {"max_tokens", "max_completion_tokens", "max_output_tokens"}
    assert "reasoning_effort" in caps["reasoning"]["controls"]
    assert h["model"]["n_ctx"] > 0
    assert h["version"]


def test_health_hides_settings_and_path():
    h = requests.get(BASE_URL + "/health", timeout=TIMEOUT).json()
    assert "settings" not in h
    assert "path" not in h["model"]


def test_wrong_method_is_json(raw):
    r = raw.get("/v1/chat/completions")
    assert r.status_code == 405
    assert "POST" in r.json()["error"]["message"]
    assert "post" in r.headers.get("allow", "").lower()


def test_cors_off_unless_configured():
    r = requests.options(
        BASE_URL + "/v1/chat/completions",
        headers={"Origin": "https://app.example.com", "Access-Control-Request-Method": "POST"},
        timeout=TIMEOUT,
    )
    assert "access-control-allow-origin" not in {k.lower() for k in r.headers}


def test_stats_page_is_served(raw):
    # The page holds no data; /stats.json behind it needs the key.
    r = requests.get(BASE_URL + "/", timeout=TIMEOUT)
    assert r.status_code == 200, r.status_code
    assert "text/html" in r.headers["content-type"]
    assert "/stats.json" in r.text
    s = raw.get("/stats.json")
    assert s.status_code == 200
    j = s.json()
    for k in ("state", "speed", "context", "queue", "totals", "requests", "gpu", "model"):
        assert k in j, k
    assert j["context"]["total"] > 0


# ---------------------------------------------------------------- tokenize


def test_tokenize_round_trip(raw):
    text = "Hello, world! naïve café 数字 <think>"
    t = raw.post("/tokenize", {"content": text})
    assert t.status_code == 200, t.text
    tokens = t.json()["tokens"]
    assert all(isinstance(i, int) for i in tokens) and len(tokens) > 3
    d = raw.post("/detokenize", {"tokens": tokens})
    assert d.json()["content"] == text
    p = raw.post("/tokenize", {"content": "hi there", "with_pieces": True}).json()["tokens"]
    assert "".join(x["piece"] for x in p) == "hi there"


def test_tokenize_bad_input_is_400(raw):
    r = raw.post("/tokenize", data="{oops")
    assert r.status_code == 400
    r = raw.post("/detokenize", {"tokens": ["a"]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tokens"


def test_apply_template(raw):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = raw.post("/apply-template", {"messages": msgs})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert "Be brief." in prompt and "Hi there" in prompt
    assert "<|im_start|>assistant" in prompt


# ---------------------------------------------------------------- metrics


def test_metrics_names_and_counters(raw, model_id):
    text = raw.get("/metrics")
    assert text.headers["content-type"].startswith("text/plain")
    for name in LLAMACPP_METRICS:
        assert f"# HELP {name} " in text.text, name
        assert f"# TYPE {name} " in text.text, name
    before = raw.metrics()
    for name in LLAMACPP_METRICS + ["scoria:queue_depth", "scoria:errors_total", "scoria:prompt_tokens_cached_total"]:
        assert name in before, name
    r = raw.post("/v1/chat/completions", chat_body(model_id, 8))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    after = raw.metrics()
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == usage["completion_tokens"]
    assert after["llamacpp:n_decode_total"] > before["llamacpp:n_decode_total"]
    done = sum(v for k, v in after.items() if k.startswith("scoria:requests_total{"))
    done_before = sum(v for k, v in before.items() if k.startswith("scoria:requests_total{"))
    assert done == done_before + 1
    assert after["llamacpp:requests_processing"] == 0


# ---------------------------------------------------------------- cancellation


def _read_sse_events(resp, n):
    got = 0
    for line in resp.iter_lines():
        if line.startswith(b"data:"):
            got += 1
            if got >= n:
                return got
    return got


@pytest.mark.parametrize("route", ["chat", "messages"])
def test_disconnect_cancels(raw, model_id, n_ctx, route):
    budget = max(64, n_ctx - 256)
    if route == "chat":
        path, body = "/v1/chat/completions", chat_body(model_id, budget, stream=True)
    else:
        path = "/v1/messages"
        body = {
            "model": model_id,
            "max_tokens": budget,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "stream": True,
            "thinking": {"type": "disabled"},
        }
    resp = raw.post(path, body, stream=True)
    assert resp.status_code == 200
    assert _read_sse_events(resp, 4) >= 4
    resp.close()
    raw.wait_idle(within=2.0)
    log = raw.get("/stats.json").json()["requests"]
    last = log[0]
    assert last["finish"] == "cancelled", last
    assert last["timings"]["predicted_n"] < budget, last
    # A new request runs at once.
    t0 = time.monotonic()
    r = raw.post("/v1/chat/completions", chat_body(model_id, 4))
    assert r.status_code == 200
    assert time.monotonic() - t0 < 30


def test_a_cancelled_request_counts_what_it_did(raw, model_id, n_ctx):
    """Issue 45: a request whose client leaves mid-stream counts the prompt tokens it
    reused and the tokens it generated in the metrics (and its log line says so)."""
    budget = max(64, n_ctx - 256)
    body = {
        "model": model_id,
        "max_tokens": 1,
        "system": "Cancellation test. " + "Keep going. " * 30,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "thinking": {"type": "disabled"},
        "temperature": 0,
    }
    assert raw.post("/v1/messages", body).status_code == 200
    before = raw.metrics()
    resp = raw.post("/v1/messages", {**body, "max_tokens": budget, "stream": True}, stream=True)
    assert resp.status_code == 200
    start = None
    deltas = 0
    for line in resp.iter_lines():
        if not line.startswith(b"data:"):
            continue
        ev = json.loads(line[5:])
        if ev["type"] == "message_start":
            start = ev["message"]["usage"]
        elif ev["type"] == "content_block_delta":
            deltas += 1
            if deltas >= 4:
                break
    resp.close()
    raw.wait_idle(within=2.0)
    after = raw.metrics()
    last = raw.get("/stats.json").json()["requests"][0]
    assert last["finish"] == "cancelled", last
    reused = start["cache_read_input_tokens"]
    assert reused > 0, start
    assert after["scoria:prompt_tokens_cached_total"] - before["scoria:prompt_tokens_cached_total"] == reused
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] >= 1


def test_disconnect_cancels_non_streamed(raw, model_id, n_ctx):
    budget = max(64, n_ctx - 256)
    done = threading.Event()

    def fire():
        try:
            requests.post(
                BASE_URL + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
                data=json.dumps(chat_body(model_id, budget)),
                timeout=1.0,  # the client gives up (closes) after 1 s
            )
        except requests.exceptions.RequestException:
            pass
        done.set()

    th = threading.Thread(target=fire)
    th.start()
    assert done.wait(10)
    th.join()
    raw.wait_idle(within=2.5)
    last = raw.get("/stats.json").json()["requests"][0]
    assert last["finish"] == "cancelled", last
    assert last["timings"]["predicted_n"] < budget, last


# ---------------------------------------------------------------- queue


def test_queue_runs_in_arrival_order(raw, model_id, n_ctx):
    raw.wait_idle(within=5)
    slots = raw.get("/props").json()["total_slots"]
    results = {}

    def run(name, max_tokens):
        r = raw.post("/v1/chat/completions", chat_body(model_id, max_tokens, content=f"Request {name}."))
        results[name] = (r.status_code, r.json())

    # Fill every slot with a long request, then queue two short ones in order.
    longs = [
        threading.Thread(target=run, args=(f"a{i}", min(160, (n_ctx - 256) // slots))) for i in range(slots)
    ]
    for th in longs:
        th.start()
    t0 = time.monotonic()
    while sum(s["is_processing"] for s in raw.get("/slots").json()) < slots:
        assert time.monotonic() - t0 < 10, "the slots never all started"
        time.sleep(0.01)
    second = threading.Thread(target=run, args=("b", 8))
    second.start()
    time.sleep(0.1)
    third = threading.Thread(target=run, args=("c", 8))
    third.start()
    time.sleep(0.1)
    m = raw.metrics()
    all_running = not any(name.startswith("a") for name in results)
    for th in longs + [second, third]:
        th.join(TIMEOUT)
    for name, (status, body) in results.items():
        assert status == 200, body
    assert len(results) == slots + 2
    if all_running and m["llamacpp:requests_processing"] == slots:
        assert m["scoria:queue_depth"] == 2, m
        assert m["llamacpp:requests_deferred"] == 2, m
    log = raw.get("/stats.json").json()["requests"][: slots + 2]
    # The two short ones waited for a slot, and b was admitted before c.
    short = sorted((e for e in log if e["timings"]["predicted_n"] <= 8), key=lambda e: e["id"])
    assert len(short) == 2, log
    b, c = short
    assert b["queue_ms"] > 0 and c["queue_ms"] > 0, log
    assert b["queued_at_ms"] + b["queue_ms"] <= c["queued_at_ms"] + c["queue_ms"] + 1, log


def test_requests_decoded_together_answer_as_they_do_alone(raw, model_id):
    """Batching is invisible: greedy answers are the same alone and side by side."""
    raw.wait_idle(within=5)
    slots = raw.get("/props").json()["total_slots"]
    prompts = [f"Side by side {i}: " + "word " * (3 * i) for i in range(max(slots, 2))]

    def ask(p):
        r = raw.post("/v1/chat/completions", chat_body(model_id, 24, content=p))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    alone = [ask(p) for p in prompts]
    together = [None] * len(prompts)

    def run(i):
        together[i] = ask(prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT)
    assert together == alone


# ---------------------------------------------------------------- timings on streams


def _find_timings(obj):
    if isinstance(obj, dict):
        if isinstance(obj.get("timings"), dict):
            return obj["timings"]
        for v in obj.values():
            t = _find_timings(v)
            if t is not None:
                return t
    return None


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 6}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 6}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}),
    ],
    ids=["chat", "completions", "responses", "messages"],
)
def test_timings_on_the_last_stream_frames(raw, model_id, path, body):
    body = dict(body, model=model_id, stream=True, temperature=0)
    r = raw.post(path, body, stream=True)
    assert r.status_code == 200, r.text
    frames = []
    for line in r.iter_lines():
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data and data != b"[DONE]":
                frames.append(json.loads(data))
    assert frames
    timings = [_find_timings(f) for f in frames[-3:]]
    t = next((x for x in reversed(timings) if x), None)
    assert t is not None, f"no timings in the last frames of {path}: {frames[-3:]}"
    assert t["predicted_n"] > 0 and t["prompt_n"] + t["cache_n"] > 0
    # And on the non-streamed body.
    plain = raw.post(path, dict(body, stream=False))
    assert _find_timings(plain.json()) is not None, plain.text


def test_metrics_text_format(raw):
    import re

    text = raw.get("/metrics").text
    assert text.endswith("\n")
    typed, helped = {}, set()
    name_re = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped.add(line.split(" ")[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge"), line
            assert name not in typed, f"{name} declared twice"
            typed[name] = kind
        elif line:
            name, _, value = line.rpartition(" ")
            bare = name.split("{")[0]
            assert name_re.match(bare), line
            assert bare in typed and bare in helped, f"sample without HELP/TYPE: {line}"
            float(value)
    for name in LLAMACPP_METRICS:
        assert name in typed
