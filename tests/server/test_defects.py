"""Issue 9's defects where a real client matters: what the official SDKs see."""

import anthropic
import openai
import pytest
import requests

from conftest import BASE_URL, TIMEOUT

HELLO = [{"role": "user", "content": "Say hello."}]
NO_THINK = {"thinking": {"type": "disabled"}, "temperature": 0}


def test_models_retrieve(oai, model_id):
    m = oai.models.retrieve(model_id)
    assert m.id == model_id and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("no-such-model")
    assert "no-such-model" in str(e.value)


def test_anthropic_wrong_key_is_an_authentication_error(model_id):
    bad = anthropic.Anthropic(base_url=BASE_URL, api_key="wrong", timeout=TIMEOUT, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=model_id, max_tokens=4, messages=HELLO)
    assert e.value.status_code == 401
    assert e.value.body["error"]["type"] == "authentication_error"


def test_anthropic_prefill_is_continued(claude, model_id):
    prefill = "Hello, my name"
    m = claude.messages.create(
        model=model_id,
        max_tokens=4,
        messages=HELLO + [{"role": "assistant", "content": prefill}],
        extra_body=NO_THINK,
    )
    # The answer is the continuation only, never a repeat of the prefill.
    text = "".join(b.text for b in m.content if b.type == "text")
    assert not text.startswith(prefill)
    assert m.usage.output_tokens > 0


def test_responses_metadata_echoed_and_store_refused(oai, model_id):
    r = oai.responses.create(
        model=model_id, input="hi", max_output_tokens=4, metadata={"run": "r1"},
        reasoning={"effort": "none"},
    )
    assert r.metadata == {"run": "r1"}
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model_id, input="hi", max_output_tokens=4, store=True)
    assert "store" in str(e.value)


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


def test_health_hides_settings_and_path():
    h = requests.get(BASE_URL + "/health", timeout=TIMEOUT).json()
    assert "settings" not in h
    assert "path" not in h["model"]
