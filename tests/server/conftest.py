"""Fixtures for the server suite.

The suite drives an already running scoria server (scripts/server-tests.sh
starts one on a tiny model): SCORIA_URL is its base address
(http://127.0.0.1:PORT) and SCORIA_API_KEY the key it was started with.
"""

import json
import os
import time

import anthropic
import openai
import pytest
import requests

BASE_URL = os.environ.get("SCORIA_URL", "http://127.0.0.1:8080").rstrip("/")
API_KEY = os.environ.get("SCORIA_API_KEY", "")
# Bounded everywhere: a hung server fails the test instead of the CI job.
TIMEOUT = float(os.environ.get("SCORIA_TEST_TIMEOUT", "120"))


def auth_headers(key=None):
    key = API_KEY if key is None else key
    return {"Authorization": f"Bearer {key}"} if key else {}


class Raw:
    """Plain HTTP with the key, for what the SDKs cannot send."""

    def __init__(self, base, key):
        self.base = base
        self.key = key

    def get(self, path, key=None, **kw):
        kw.setdefault("timeout", TIMEOUT)
        return requests.get(self.base + path, headers=auth_headers(key if key is not None else self.key), **kw)

    def post(self, path, body=None, key=None, data=None, **kw):
        kw.setdefault("timeout", TIMEOUT)
        headers = auth_headers(key if key is not None else self.key)
        headers["Content-Type"] = "application/json"
        if data is None:
            data = json.dumps(body)
        return requests.post(self.base + path, headers=headers, data=data, **kw)

    def metrics(self):
        """The Prometheus text as {name or name{labels}: value}."""
        r = self.get("/metrics")
        r.raise_for_status()
        out = {}
        for line in r.text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
        return out

    def wait_idle(self, within=2.0):
        """Seconds until /slots shows no request processing and the queue empty
        (raises after `within` seconds)."""
        t0 = time.monotonic()
        while True:
            slots = self.get("/slots").json()
            if not any(s.get("is_processing") for s in slots) and all(
                s.get("queue_depth", 0) == 0 for s in slots
            ):
                return time.monotonic() - t0
            if time.monotonic() - t0 > within:
                raise AssertionError(f"server still busy after {within} s: {slots}")
            time.sleep(0.05)


@pytest.fixture(scope="session")
def raw():
    return Raw(BASE_URL, API_KEY)


@pytest.fixture(scope="session")
def model_id(raw):
    r = raw.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


@pytest.fixture(scope="session")
def n_ctx(raw):
    return int(raw.get("/props").json()["default_generation_settings"]["n_ctx"])


@pytest.fixture(scope="session")
def oai():
    return openai.OpenAI(base_url=BASE_URL + "/v1", api_key=API_KEY or "none", timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="session")
def claude():
    return anthropic.Anthropic(base_url=BASE_URL, api_key=API_KEY or "none", timeout=TIMEOUT, max_retries=0)


def extra(obj, name):
    """A field the SDK's types do not declare (timings, reasoning_content)."""
    v = getattr(obj, name, None)
    if v is None and getattr(obj, "model_extra", None):
        v = obj.model_extra.get(name)
    return v
