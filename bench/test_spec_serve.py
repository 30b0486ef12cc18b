"""bench/spec_serve.py against a small stand-in server that speaks both engines' endpoints:
the prompts rendered by the server, each engine's request shape, the sums of its timings,
and digests that follow the texts."""

import contextlib
import http.server
import io
import json
import pathlib
import sys
import threading
import unittest
import unittest.mock

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import spec_serve  # noqa: E402


class Server(http.server.BaseHTTPRequestHandler):
    """Renders a chat as `<user>TEXT`; answers a completion with its prompt's length in
    the text (so texts follow prompts), 10 tokens in 40 ms and 6 of 8 drafts kept."""

    seen = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Server.seen.append((self.path, body))
        timings = {"predicted_n": 10, "predicted_ms": 40.0, "draft_n": 8, "draft_n_accepted": 6}
        if self.path == "/apply-template":
            out = {"prompt": "<user>" + body["messages"][0]["content"]}
        elif self.path == "/v1/completions":
            out = {"choices": [{"text": f"s{len(body['prompt'])}"}], "timings": timings}
        elif self.path == "/completion":
            out = {"content": f"s{len(body['prompt'])}", "timings": timings}
        else:
            self.send_error(404)
            return
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class SpecServeTest(unittest.TestCase):
    def setUp(self):
        Server.seen = []
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Server)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def tearDown(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def run_main(self, engine):
        out = io.StringIO()
        argv = ["spec_serve.py", "--url", self.url, "--engine", engine, "--label", "L",
                "--tokens", "7"]
        with unittest.mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(out):
            spec_serve.main()
        return json.loads(out.getvalue())

    def test_each_engine_gets_its_request_and_the_timings_add_up(self):
        for engine, path in [("scoria", "/v1/completions"), ("llama", "/completion")]:
            Server.seen = []
            r = self.run_main(engine)
            n = len(spec_serve.PROMPTS)
            # Rendered once each, then a warm-up pass and the measured pass.
            paths = [p for p, _ in Server.seen]
            self.assertEqual(paths, ["/apply-template"] * n + [path] * (2 * n))
            bodies = [b for p, b in Server.seen if p == path]
            self.assertTrue(all(b["prompt"].startswith("<user>") for b in bodies))
            self.assertTrue(all(b["temperature"] == 0 and b["ignore_eos"] for b in bodies))
            tokens = [b.get("max_tokens", b.get("n_predict")) for b in bodies]
            self.assertEqual(tokens, [7] * (2 * n))
            # The measured pass only.
            self.assertEqual((r["tokens"], r["predicted_ms"]), (10 * n, 40.0 * n))
            self.assertEqual((r["draft_n"], r["draft_n_accepted"]), (8 * n, 6 * n))
            self.assertEqual((r["tps"], r["acceptance"]), (250.0, 0.75))
            self.assertEqual((r["label"], r["engine"]), ("L", engine))

    def test_digests_follow_the_texts_and_the_prompts(self):
        a = self.run_main("scoria")
        b = self.run_main("llama")
        # The same prompts and the same texts from either endpoint: the same digests.
        self.assertEqual(a["prompts_sha256"], b["prompts_sha256"])
        self.assertEqual(a["texts_sha256"], b["texts_sha256"])
        prompts = [spec_serve.render(self.url, p) for p in spec_serve.PROMPTS]
        r = spec_serve.run(self.url, "scoria", prompts[:-1], 7)
        self.assertNotEqual(r["texts_sha256"], a["texts_sha256"])


if __name__ == "__main__":
    unittest.main()
