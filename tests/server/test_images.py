"""Images through the official SDKs, end to end: a second `scoria serve` of its own on
the demo model with the random vision encoder made for it
(tests/fixtures/qwen35moe-vision/mmproj-demo-f16.gguf), sent a fixture image by the
`openai` SDK (chat completions) and the `anthropic` SDK (a user message and a
tool_result), each answered 200 with generated text.

The binary is SCORIA_BIN (scripts/server-tests.sh exports the one it built), else
target/release/scoria.
"""

import base64
import os
import pathlib
import socket
import subprocess
import time

import anthropic
import openai
import pytest
import requests

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "qwen35moe-vision"
START_TIMEOUT = float(os.environ.get("SCORIA_START_TIMEOUT", "300"))
TIMEOUT = float(os.environ.get("SCORIA_TEST_TIMEOUT", "120"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vision_url(tmp_path_factory):
    binary = os.environ.get("SCORIA_BIN") or str(ROOT / "target" / "release" / "scoria")
    if not os.path.exists(binary):
        pytest.skip(f"no scoria binary at {binary} (set SCORIA_BIN)")
    port = free_port()
    log = tmp_path_factory.mktemp("vision") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [binary, "serve", "--port", str(port), "--mmproj", str(FIXTURES / "mmproj-demo-f16.gguf")],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"scoria serve exited ({proc.returncode}):\n{log.read_text()}")
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"not ready after {START_TIMEOUT} s:\n{log.read_text()}")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def b64(name):
    return base64.b64encode((FIXTURES / name).read_bytes()).decode()


def test_props_say_vision(vision_url):
    props = requests.get(vision_url + "/props", timeout=TIMEOUT).json()
    assert props["modalities"] == {"vision": True, "audio": False}


def test_openai_chat_with_an_image(vision_url):
    client = openai.OpenAI(base_url=vision_url + "/v1", api_key="none", timeout=TIMEOUT)
    r = client.chat.completions.create(
        model="scoria-demo",
        max_tokens=16,
        temperature=0,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64("image.png")}},
                    {"type": "text", "text": "What is in this picture?"},
                ],
            }
        ],
        extra_body={"enable_thinking": False},
    )
    assert r.choices[0].message.content
    assert r.usage.prompt_tokens > 12  # the image's rows count as prompt tokens


def image_block(name):
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(name)}}


def test_anthropic_message_with_an_image(vision_url):
    client = anthropic.Anthropic(base_url=vision_url, api_key="none", timeout=TIMEOUT)
    r = client.messages.create(
        model="scoria-demo",
        max_tokens=16,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [image_block("odd.png"), {"type": "text", "text": "Describe it."}]}],
    )
    assert any(b.type == "text" and b.text for b in r.content) or any(b.type == "thinking" for b in r.content)


def test_anthropic_tool_result_with_an_image(vision_url):
    client = anthropic.Anthropic(base_url=vision_url, api_key="none", timeout=TIMEOUT)
    r = client.messages.create(
        model="scoria-demo",
        max_tokens=16,
        extra_body={"temperature": 0},
        tools=[{"name": "screenshot", "description": "Takes a screenshot.", "input_schema": {"type": "object", "properties": {}}}],
        messages=[
            {"role": "user", "content": "Take a screenshot and tell me what you see."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "here"}, image_block("image.png")]}
                ],
            },
        ],
    )
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert r.content
