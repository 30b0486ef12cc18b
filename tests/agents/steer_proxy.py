#!/usr/bin/env python3
"""A recording, steering proxy between a real coding agent and `scoria serve`.

A model with random weights never ends its turn on its own and never calls a tool,
so a real agent client run against it would neither stop nor exercise a tool round
trip. This proxy (the test harness, not the server) steers it:

  * every generation request gets a `logit_bias` of +100 on the end-of-turn token
    (asked of the server's /tokenize), so each answer ends at once;
  * the first generation request that offers the chosen tool, and carries no tool
    result yet, is forwarded to the server as usual (its answer is read and checked),
    but the client receives a canned answer in the route's own shape: one call of that
    tool. The client runs the tool and sends the result, and that turn reaches the
    server like every other.

Every request is recorded as one JSON line (method, path, status, whether it was
streamed, canned, carried a tool result, and whether the stream ended properly).
`steer_proxy.py check RECORD` reads a record back and says what went wrong, if
anything. Standard library only.

  steer_proxy.py serve --upstream http://127.0.0.1:PORT --record FILE \\
      --tool-file PATH [--port-file FILE] [--dump-dir DIR]
  steer_proxy.py replay --upstream http://127.0.0.1:PORT [--key KEY] [--expect-cache] DIR...
  steer_proxy.py check --record FILE [--client claude|codex --transcript FILE]
      [--expect-cache] [--expect-session-cache | --report-session-cache]
"""

import argparse
import http.client
import http.server
import json
import re
import sys
import threading
import time
import urllib.parse

GENERATION_ROUTES = ("/v1/messages", "/v1/responses", "/v1/chat/completions")
# Headers that belong to one connection, not to the request; content-length is
# recomputed, accept-encoding dropped so bodies stay readable.
HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
    "trailer", "upgrade", "host", "content-length", "accept-encoding",
}


class Proxy:
    def __init__(self, upstream, record_path, tool_file, dump_dir=None):
        self.dump_dir = dump_dir
        u = urllib.parse.urlsplit(upstream)
        self.host, self.port = u.hostname, u.port or 80
        self.record_path = record_path
        self.tool_file = tool_file
        self.lock = threading.Lock()
        self.canned = False
        self.eot = None
        self.seq = 0

    def record(self, rec):
        with self.lock:
            with open(self.record_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")

    def next_id(self):
        with self.lock:
            self.seq += 1
            return self.seq

    def end_of_turn_id(self, headers):
        """The end-of-turn token id, asked of the server once."""
        if self.eot is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
            auth = {k: v for k, v in headers.items() if k.lower() in ("authorization", "x-api-key")}
            body = json.dumps({"content": "<|im_end|>", "parse_special": True})
            conn.request("POST", "/tokenize", body, {"content-type": "application/json", **auth})
            resp = conn.getresponse()
            data = json.loads(resp.read() or b"{}")
            conn.close()
            tokens = data.get("tokens") or []
            if resp.status != 200 or len(tokens) != 1:
                raise RuntimeError(f"/tokenize answered {resp.status}: {data}")
            tok = tokens[0]
            self.eot = tok["id"] if isinstance(tok, dict) else tok
        return self.eot


def tools_of(body):
    """(name, parameter schema) of every function tool a request offers."""
    out = []
    for t in body.get("tools") or []:
        if not isinstance(t, dict):
            continue
        if t.get("type") == "namespace":
            out.extend(tools_of({"tools": t.get("tools")}))
            continue
        f = t.get("function") if isinstance(t.get("function"), dict) else t
        name = f.get("name")
        schema = f.get("input_schema") or f.get("parameters") or {}
        if name:
            out.append((name, schema))
    return out


def has_tool_result(body):
    for m in body.get("messages") or []:
        content = m.get("content")
        if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") == "tool_result" for b in content
        ):
            return True
        if m.get("role") == "tool":
            return True
    items = body.get("input")
    if isinstance(items, list):
        return any(
            isinstance(i, dict) and i.get("type") in ("function_call_output", "custom_tool_call_output")
            for i in items
        )
    return False


def has_image(body):
    """Whether a tool result of the request carries an image (Claude Code's Read of a
    picture file sends it as an `image` block inside the `tool_result`)."""
    for m in body.get("messages") or []:
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for b in content:
            if isinstance(b, dict) and b.get("type") == "tool_result" and isinstance(b.get("content"), list):
                if any(isinstance(c, dict) and c.get("type") == "image" for c in b["content"]):
                    return True
    return False


def canned_call(body, tool_file):
    """(name, arguments) of the call to make, for a tool this request offers."""
    offered = dict(tools_of(body))
    if "Read" in offered:
        return "Read", {"file_path": tool_file}
    for name, schema in offered.items():
        props = (schema or {}).get("properties") or {}
        if name in ("shell", "shell_command", "exec_command", "local_shell", "Bash"):
            if "command" in props and props["command"].get("type") == "array":
                return name, {"command": ["cat", tool_file]}
            if "command" in props:
                args = {"command": f"cat {tool_file}"}
                if name == "Bash":
                    args["description"] = "Show the test file"
                return name, args
            if "cmd" in props:
                return name, {"cmd": f"cat {tool_file}"}
    return None


def sse(event, data):
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class Canned:
    """An answer calling tool `name` with `args`, in the route's own shape. A stream is
    sent as head (at once), keep-alives (one per piece of the server's own answer, while
    that runs), and tail: the client's idle watchdog counts events its SDK yields, so a
    keep-alive is an empty text delta (Anthropic) or `response.in_progress` (Responses),
    as the server itself sends."""

    def __init__(self, path, body, name, args):
        self.anthropic = path == "/v1/messages"
        self.stream = bool(body.get("stream"))
        self.model = body.get("model", "model")
        self.name, self.args = name, args
        self.seq = 0

    def ctype(self):
        return "text/event-stream" if self.stream else "application/json"

    def ev(self, kind, data):
        if not self.anthropic:
            data = dict(data, type=kind, sequence_number=self.seq)
            self.seq += 1
        return sse(kind, data)

    # ---- Anthropic: an empty text block (the keep-alives' home), then the tool_use.
    def _message(self, content, stop_reason):
        return {"id": "msg_canned1", "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": None,
                "usage": {"input_tokens": 1, "output_tokens": 1}}

    def _tool_use(self, input_):
        return {"type": "tool_use", "id": "toolu_canned1", "name": self.name, "input": input_}

    # ---- Responses: one function_call item.
    def _item(self, **over):
        return dict({"type": "function_call", "id": "fc_canned1", "call_id": "call_canned1",
                     "name": self.name, "arguments": json.dumps(self.args), "status": "completed"},
                    **over)

    def _response(self, status, output):
        usage = {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": 2} if status == "completed" else None
        return {"id": "resp_canned1", "object": "response", "created_at": int(time.time()),
                "status": status, "model": self.model, "output": output, "usage": usage,
                "error": None, "incomplete_details": None}

    def whole(self):
        """The non-streamed answer."""
        if self.anthropic:
            return json.dumps(self._message([self._tool_use(self.args)], "tool_use")).encode()
        return json.dumps(self._response("completed", [self._item()])).encode()

    def head(self):
        if self.anthropic:
            out = self.ev("message_start", {"type": "message_start", "message": self._message([], None)})
            return out + self.ev("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}})
        started = self._response("in_progress", [])
        return (self.ev("response.created", {"response": started})
                + self.ev("response.in_progress", {"response": started}))

    def keepalive(self):
        if self.anthropic:
            return self.ev("content_block_delta", {"type": "content_block_delta", "index": 0,
                           "delta": {"type": "text_delta", "text": ""}})
        return self.ev("response.in_progress", {"response": self._response("in_progress", [])})

    def tail(self):
        if self.anthropic:
            out = self.ev("content_block_stop", {"type": "content_block_stop", "index": 0})
            out += self.ev("content_block_start", {"type": "content_block_start", "index": 1,
                           "content_block": self._tool_use({})})
            out += self.ev("content_block_delta", {"type": "content_block_delta", "index": 1,
                           "delta": {"type": "input_json_delta", "partial_json": json.dumps(self.args)}})
            out += self.ev("content_block_stop", {"type": "content_block_stop", "index": 1})
            out += self.ev("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": {"input_tokens": 1, "output_tokens": 1}})
            return out + self.ev("message_stop", {"type": "message_stop"})
        item = self._item()
        out = self.ev("response.output_item.added", {"output_index": 0,
                      "item": self._item(arguments="", status="in_progress")})
        out += self.ev("response.function_call_arguments.delta",
                       {"item_id": item["id"], "output_index": 0, "delta": item["arguments"]})
        out += self.ev("response.function_call_arguments.done",
                       {"item_id": item["id"], "output_index": 0, "arguments": item["arguments"]})
        out += self.ev("response.output_item.done", {"output_index": 0, "item": item})
        return out + self.ev("response.completed", {"response": self._response("completed", [item])})


CACHE_N = re.compile(rb'"cache_n":\s*(\d+)')
PROMPT_N = re.compile(rb'"prompt_n":\s*(\d+)')


def note_timings(rec, data):
    """The server's prompt_n / cache_n for this request (from its `timings`)."""
    for key, pat in (("cache_n", CACHE_N), ("prompt_n", PROMPT_N)):
        found = pat.findall(data)
        if found:
            rec[key] = int(found[-1])


def stream_ended(path, data):
    """Whether a streamed answer ended as its protocol says it must."""
    if path.endswith("/v1/messages"):
        return b"event: message_stop" in data
    if path.endswith("/v1/responses"):
        return b"response.completed" in data or b"response.incomplete" in data
    return b"data: [DONE]" in data


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "steer-proxy"
    proxy: Proxy = None  # set by serve()

    def log_message(self, fmt, *args):  # the record is the log
        pass

    def do_GET(self):
        self.forward()

    def do_HEAD(self):
        self.forward()

    def do_POST(self):
        self.forward()

    def do_DELETE(self):
        self.forward()

    def forward(self):
        p = self.proxy
        started = time.time()
        n = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(n) if n else b""
        path = urllib.parse.urlsplit(self.path).path
        rec = {"id": p.next_id(), "method": self.command, "path": path,
               "user_agent": self.headers.get("user-agent", "")}
        body = None
        if raw and "json" in (self.headers.get("content-type") or ""):
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        canned = None
        if self.command == "POST" and isinstance(body, dict) and path in GENERATION_ROUTES:
            rec.update(stream=bool(body.get("stream")), model=body.get("model"),
                       tool_result=has_tool_result(body), image=has_image(body),
                       tools=[t for t, _ in tools_of(body)][:50])
            bias = body.get("logit_bias") if isinstance(body.get("logit_bias"), dict) else {}
            bias[str(p.end_of_turn_id(headers))] = 100
            body["logit_bias"] = bias
            raw = json.dumps(body).encode()
            if p.dump_dir:
                name = f"{p.dump_dir}/{rec['id']:03d}{path.replace('/', '-')}.json"
                with open(name, "wb") as f:
                    f.write(raw)
            with p.lock:
                if not p.canned and not rec["tool_result"]:
                    canned = canned_call(body, p.tool_file)
                    if canned:
                        p.canned = True
            rec["canned"] = canned is not None
        conn = http.client.HTTPConnection(p.host, p.port, timeout=1800)
        try:
            conn.request(self.command, self.path, raw if raw else None,
                         dict(headers, **({"content-length": str(len(raw))} if raw else {})))
            resp = conn.getresponse()
            rec["status"] = resp.status
            if canned is not None:
                # The server answers this turn as any other; the client gets the call.
                rec["status"] = resp.status
                if rec["stream"] and resp.status // 100 == 2:
                    self.canned_stream(resp, rec, path, body, canned)
                    return
                upstream = resp.read()
                note_timings(rec, upstream)
                rec["upstream_ended"] = (not rec["stream"]) or stream_ended(path, upstream)
                if resp.status // 100 != 2:
                    rec["error"] = upstream[:500].decode("utf-8", "replace")
                    with p.lock:
                        p.canned = False  # the next request gets the call instead
                    self.reply(resp.status, resp.getheader("content-type", "application/json"), upstream)
                else:
                    rec["canned_call"] = {"name": canned[0], "arguments": canned[1]}
                    self.reply(200, "application/json", Canned(path, body, *canned).whole())
            else:
                self.pipe(resp, rec, path)
        except (BrokenPipeError, ConnectionResetError):
            rec["client_left"] = True
        finally:
            conn.close()
            rec["seconds"] = round(time.time() - started, 3)
            p.record(rec)

    def chunk(self, data):
        """One piece of a chunked body (empty: the end)."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def canned_stream(self, resp, rec, path, body, canned):
        """Streams the canned call: its head at once, a keep-alive for every piece of
        the server's own answer while that runs, then its tail."""
        c = Canned(path, body, *canned)
        rec["canned_call"] = {"name": canned[0], "arguments": canned[1]}
        self.send_response(200)
        self.send_header("content-type", c.ctype())
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        self.chunk(c.head())
        seen = bytearray()
        while True:
            piece = resp.read1(65536)
            if not piece:
                break
            seen.extend(piece)
            self.chunk(c.keepalive())
        note_timings(rec, bytes(seen))
        rec["upstream_ended"] = stream_ended(path, bytes(seen))
        self.chunk(c.tail())
        self.chunk(b"")

    def reply(self, status, ctype, data):
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def pipe(self, resp, rec, path):
        """Copies the upstream answer as it arrives (streams stay streams)."""
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in HOP_BY_HOP:
                self.send_header(k, v)
        if self.command == "HEAD":
            self.send_header("content-length", resp.getheader("content-length", "0"))
            self.end_headers()
            return
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        seen = bytearray()
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                break
            if len(seen) < (8 << 20):
                seen.extend(chunk)
            self.chunk(chunk)
        self.chunk(b"")
        note_timings(rec, bytes(seen))
        if rec.get("stream"):
            rec["upstream_ended"] = stream_ended(path, bytes(seen))
        if resp.status // 100 != 2:
            rec["error"] = bytes(seen[:500]).decode("utf-8", "replace")


def serve(args):
    Handler.proxy = Proxy(args.upstream, args.record, args.tool_file, args.dump_dir)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    srv.daemon_threads = True
    port = srv.server_address[1]
    if args.port_file:
        with open(args.port_file, "w", encoding="utf-8") as f:
            f.write(str(port))
    print(f"steer-proxy: http://127.0.0.1:{port} -> {args.upstream}", flush=True)
    srv.serve_forever()


def check(args):
    """Exit 1, naming each problem, unless the record shows a clean tool round trip."""
    with open(args.record, encoding="utf-8") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    problems = []
    for r in recs:
        status = r.get("status")
        if status is None or status // 100 != 2:
            problems.append(f"#{r['id']} {r['method']} {r['path']} answered {status}: {r.get('error', '')}")
        if r.get("stream") and r.get("status") == 200 and not r.get("upstream_ended"):
            problems.append(f"#{r['id']} {r['path']}: the stream did not end properly")
    gens = [r for r in recs if r.get("path") in GENERATION_ROUTES and r.get("method") == "POST"]
    canned = [r for r in gens if r.get("canned")]
    if not canned:
        offered = sorted({t for r in gens for t in r.get("tools", [])})
        problems.append(f"no request offered a tool to call (tools seen: {offered})")
    else:
        after = [r for r in gens if r["id"] > canned[0]["id"] and r.get("tool_result")]
        if not after:
            problems.append("the client never sent the tool result back")
        elif not any(r.get("status") == 200 for r in after):
            problems.append("the server did not accept the tool-result turn")
        elif args.expect_image and not any(r.get("image") and r.get("status") == 200 for r in after):
            problems.append("no accepted tool-result turn carried the image the tool read")
    print(f"steer-proxy: {len(recs)} requests, {len(gens)} generations, "
          f"{'1 canned tool call' if canned else 'no tool call'}, "
          f"{sum(1 for r in gens if r.get('tool_result'))} with a tool result")
    for r in recs:
        print(f"  #{r['id']} {r['method']} {r['path']} {r.get('status')} "
              f"{'stream ' if r.get('stream') else ''}{'canned ' if r.get('canned') else ''}"
              f"{'tool_result ' if r.get('tool_result') else ''}{'image ' if r.get('image') else ''}"
              f"{r.get('seconds')}s")
    # The prompt cache on agent turns: a follow-up turn resends the conversation, so it
    # shares a long prefix with the turn before (issue 12, item 6).
    follow = [r for r in gens if r.get("tool_result") and r.get("status") == 200]
    for r in follow:
        print(f"steer-proxy: follow-up turn #{r['id']}: {r.get('cache_n', '?')} prompt tokens "
              f"reused from the cache, {r.get('prompt_n', '?')} evaluated")
    if args.expect_cache and not any((r.get("cache_n") or 0) > 0 for r in follow):
        problems.append("no follow-up turn reused the cached prefix of the turn before")
    # A new session after another (issue 45): its first turn shares the system prompt
    # and tools of the session before, once the server drops the per-session billing
    # header Claude Code puts in front of them.
    first = next((r for r in gens if r.get("tools") and not r.get("tool_result")), None)
    if args.expect_session_cache or args.report_session_cache:
        if first is None:
            problems.append("no first turn offering tools to compare with the session before")
        else:
            print(f"steer-proxy: this session's first turn #{first['id']}: "
                  f"{first.get('cache_n', '?')} prompt tokens reused from the session before, "
                  f"{first.get('prompt_n', '?')} evaluated")
            if args.expect_session_cache and not (first.get("cache_n") or 0) > 0:
                problems.append("the first turn of this session reused nothing of the session "
                                "before (the shared system prompt and tools)")
    if args.transcript:
        problems.extend(transcript_problems(args.client, args.transcript))
    for p in problems:
        print(f"steer-proxy: PROBLEM: {p}")
    return 1 if problems else 0


def first_turn(dump_dir):
    """The first generation request in a dump directory that offers tools and carries
    no tool result: a session's first turn."""
    import os
    for name in sorted(os.listdir(dump_dir)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(dump_dir, name), encoding="utf-8") as f:
            body = json.load(f)
        if tools_of(body) and not has_tool_result(body):
            return name, body
    return None, None


def replay(args):
    """Sends each session's first turn (from its dump directory), in order, to a fresh
    server, and reports the prompt-cache reuse of each: a later session's first turn
    shares the system prompt and tools of the one before, once the server drops the
    billing header whose suffix differs between them (issue 45)."""
    u = urllib.parse.urlsplit(args.upstream)
    problems = []
    last = None
    for d in args.dirs:
        name, body = first_turn(d)
        if body is None:
            problems.append(f"{d}: no first turn offering tools")
            continue
        header = next((b.get("text", "") for b in body.get("system") or []
                       if isinstance(b, dict) and "billing-header" in b.get("text", "")), "")
        body = dict(body, stream=False, max_tokens=1)
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=600)
        conn.request("POST", "/v1/messages", json.dumps(body),
                     {"content-type": "application/json", "x-api-key": args.key})
        resp = conn.getresponse()
        data = json.loads(resp.read() or b"{}")
        conn.close()
        usage = data.get("usage") or {}
        print(f"steer-proxy: replayed {d}/{name} ({header.strip() or 'no billing header'}): "
              f"{resp.status}, input_tokens {usage.get('input_tokens')}, "
              f"cache_read_input_tokens {usage.get('cache_read_input_tokens')}")
        if resp.status != 200:
            problems.append(f"{d}/{name} answered {resp.status}: {data}")
            continue
        for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
            if not isinstance(usage.get(key), int):
                problems.append(f"{d}/{name}: usage has no {key}: {usage}")
        last = usage
    if args.expect_cache and last is not None and not (last.get("cache_read_input_tokens") or 0) > 0:
        problems.append("the later session's first turn reused nothing of the earlier one's "
                        "(the shared system prompt and tools)")
    for p in problems:
        print(f"steer-proxy: PROBLEM: {p}")
    return 1 if problems else 0


def transcript_problems(client, path):
    """What the client's own JSON-lines output says went wrong (Claude Code's
    stream-json, `codex exec --json`)."""
    events = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    if client == "claude":
        results = [e for e in events if e.get("type") == "result"]
        if not results:
            return ["Claude Code wrote no result"]
        r = results[-1]
        if r.get("is_error") or r.get("subtype") != "success":
            return [f"Claude Code's result is an error: {r.get('subtype')} {r.get('result')!r}"]
        return []
    failed = [e for e in events if e.get("type") in ("turn.failed", "error")]
    if failed:
        return [f"Codex reported: {json.dumps(failed[0])[:300]}"]
    if not any(e.get("type") == "turn.completed" for e in events):
        return ["Codex never completed its turn"]
    return []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--upstream", required=True)
    s.add_argument("--record", required=True)
    s.add_argument("--tool-file", required=True, help="the file the canned call reads")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--port-file")
    s.add_argument("--dump-dir", help="write each generation request body here")
    r = sub.add_parser("replay", help="replay sessions' first turns against a fresh server")
    r.add_argument("--upstream", required=True)
    r.add_argument("--key", default="")
    r.add_argument("--expect-cache", action="store_true",
                   help="fail unless the last session's first turn reused cached prompt tokens")
    r.add_argument("dirs", nargs="+", help="the sessions' --dump-dir directories, in order")
    c = sub.add_parser("check")
    c.add_argument("--record", required=True)
    c.add_argument("--client", choices=["claude", "codex"])
    c.add_argument("--transcript", help="the client's JSON-lines output, checked too")
    c.add_argument("--expect-session-cache", action="store_true",
                   help="fail unless the first turn offering tools reused cached prompt tokens "
                        "(a second session after a first one)")
    c.add_argument("--report-session-cache", action="store_true",
                   help="print what the first turn offering tools reused, require nothing")
    c.add_argument("--expect-image", action="store_true",
                   help="a tool-result turn must carry an image and be answered 200")
    c.add_argument("--expect-cache", action="store_true",
                   help="fail unless a follow-up turn reused cached prompt tokens")
    args = ap.parse_args()
    if args.cmd == "serve":
        serve(args)
    elif args.cmd == "replay":
        sys.exit(replay(args))
    else:
        sys.exit(check(args))


if __name__ == "__main__":
    main()
