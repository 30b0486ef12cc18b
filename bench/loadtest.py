#!/usr/bin/env python3
"""Load test for `scoria serve`: many clients at once for a while, some leaving early.

    python3 bench/loadtest.py --url http://127.0.0.1:8080 [--key KEY] \
        [--clients 32] [--seconds 300] [--cancel 0.2] [--pid PID]

Each client loops: a streamed chat request (greedy, a prompt of its own, 16-64 tokens),
and with probability --cancel it closes the stream after a few chunks. Checked:

* no stream lost or mixed: every completed stream's text equals the text the same
  request gets alone (each distinct request is asked once alone first, then reused
  under load; greedy decoding makes the answer a function of the request);
* `/health` answers 200 throughout (polled every 0.5 s; the longest gap is reported);
* with --pid, the server's resident memory (VmRSS) stays within the startup account
  (--max-rss GiB; read it from the `scoria serve: memory:` line).

Standard library only. Prints one summary line per check and exits 1 on a failure.
"""

import argparse
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse


def conn(url, timeout=600):
    u = urllib.parse.urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)


def headers(key):
    h = {"Content-Type": "application/json"}
    if key:
        h["Authorization"] = f"Bearer {key}"
    return h


def body(model, prompt, max_tokens, stream):
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )


def ask(url, key, model, prompt, max_tokens, cancel_after=None):
    """Streams one request; the text, or None when it left after `cancel_after` chunks."""
    c = conn(url)
    c.request("POST", "/v1/chat/completions", body(model, prompt, max_tokens, True), headers(key))
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"status {r.status}: {r.read()[:300]!r}")
    text, chunks, done = [], 0, False
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        ev = json.loads(data)
        for ch in ev.get("choices", []):
            text.append(ch.get("delta", {}).get("content") or "")
        chunks += 1
        if cancel_after is not None and chunks >= cancel_after:
            c.close()
            return None
    c.close()
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return "".join(text)


def rss_gib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / (1 << 20)
    return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--key", default="")
    ap.add_argument("--model", default="scoria")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--cancel", type=float, default=0.2, help="share of requests that leave early")
    ap.add_argument("--distinct", type=int, default=24, help="distinct requests")
    ap.add_argument("--pid", type=int, help="the server's pid, for its memory")
    ap.add_argument("--max-rss", type=float, help="GiB the server may hold (its startup account)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()

    rng = random.Random(a.seed)
    reqs = [
        (f"Load test request {i}: " + " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(8 + 4 * i)),
         rng.randint(16, 64))
        for i in range(a.distinct)
    ]
    print(f"loadtest: {a.distinct} distinct requests, each asked alone first", flush=True)
    alone = [ask(a.url, a.key, a.model, p, n) for p, n in reqs]

    stop = time.monotonic() + a.seconds
    lock = threading.Lock()
    stats = {"done": 0, "cancelled": 0, "mismatch": [], "errors": []}
    health = {"checks": 0, "bad": 0, "max_gap": 0.0}
    rss = {"max": 0.0}

    def client(k):
        r = random.Random(a.seed * 1000 + k)
        while time.monotonic() < stop:
            i = r.randrange(len(reqs))
            leave = r.random() < a.cancel
            try:
                got = ask(a.url, a.key, a.model, reqs[i][0], reqs[i][1], r.randint(1, 6) if leave else None)
            except Exception as e:  # noqa: BLE001 - every failure is reported
                with lock:
                    stats["errors"].append(f"client {k}: {e}")
                continue
            with lock:
                if got is None:
                    stats["cancelled"] += 1
                else:
                    stats["done"] += 1
                    if got != alone[i]:
                        stats["mismatch"].append(i)

    def watch():
        last = time.monotonic()
        while time.monotonic() < stop + 1:
            try:
                c = conn(a.url, timeout=5)
                c.request("GET", "/health")
                ok = c.getresponse().status == 200
                c.close()
            except Exception:  # noqa: BLE001
                ok = False
            now = time.monotonic()
            with lock:
                health["checks"] += 1
                if ok:
                    health["max_gap"] = max(health["max_gap"], now - last)
                    last = now
                else:
                    health["bad"] += 1
            if a.pid:
                rss["max"] = max(rss["max"], rss_gib(a.pid))
            time.sleep(0.5)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(a.clients)]
    threads.append(threading.Thread(target=watch))
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - t0
    problems = []
    print(f"loadtest: {a.clients} clients for {took:.0f} s: {stats['done']} streams completed, "
          f"{stats['cancelled']} left early, {len(stats['errors'])} errors")
    if stats["mismatch"]:
        problems.append(f"{len(stats['mismatch'])} completed streams differ from their answer alone "
                        f"(requests {sorted(set(stats['mismatch']))[:10]})")
    else:
        print("loadtest: every completed stream equals its answer alone")
    problems.extend(stats["errors"][:10])
    print(f"loadtest: /health {health['checks']} checks, {health['bad']} not 200, "
          f"longest gap between 200s {health['max_gap']:.2f} s")
    if health["bad"]:
        problems.append(f"/health failed {health['bad']} times")
    if a.pid:
        print(f"loadtest: server resident memory peaked at {rss['max']:.2f} GiB")
        if a.max_rss and rss["max"] > a.max_rss:
            problems.append(f"resident memory {rss['max']:.2f} GiB exceeds the account's {a.max_rss:.2f} GiB")
    for p in problems:
        print(f"loadtest: PROBLEM: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
