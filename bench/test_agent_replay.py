"""bench/agent_replay.py: the recorded sessions, and the replay against a small stand-in
server (answers with speculation on must be the bytes of those with it off)."""

import contextlib
import http.server
import io
import json
import pathlib
import sys
import tempfile
import threading
import unittest
import unittest.mock

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import agent_replay  # noqa: E402


class Server(http.server.BaseHTTPRequestHandler):
    """Answers each chat request with its draft length in the text when `differ` is set,
    else with the same text; counts the requests."""

    differ = False
    seen = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Server.seen.append(body)
        n_max = body.get("speculative.n_max")
        text = f"answer {n_max}" if Server.differ else "answer"
        out = {
            "choices": [{"message": {"content": text}}],
            "timings": {"predicted_n": 10, "predicted_ms": 100.0 if n_max == 0 else 50.0,
                        **({} if n_max == 0 else {"draft_n": 8, "draft_n_accepted": 6})},
        }
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class AgentReplay(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        d = pathlib.Path(self.dir.name)
        (d / "a.rs").write_text("".join(f"fn f{i}() {{}}\n" for i in range(50)))
        (d / "b.sh").write_text("#!/bin/sh\necho hi\n")
        self.files = [str(d / "a.rs"), str(d / "b.sh")]

    def tearDown(self):
        self.dir.cleanup()

    def test_each_file_is_a_session_of_an_edit_and_a_reread(self):
        sessions = agent_replay.record(self.files)
        self.assertEqual([len(s) for s in sessions], [2, 2])
        (ask, edited), (_, head) = sessions[0]
        self.assertIn("fn f49() {}", ask)
        lines = edited.strip("`\n").splitlines()
        self.assertEqual(lines[:2], ["fn f0() {}", "// Reviewed: keep this file's behaviour unchanged."])
        self.assertEqual(len(lines), 51)
        self.assertEqual(len(head.strip("`\n").splitlines()), 40)
        self.assertTrue(sessions[1][0][1].splitlines()[2].startswith("# Reviewed"))

    def replay(self, differ):
        Server.differ, Server.seen = differ, []
        srv = http.server.HTTPServer(("127.0.0.1", 0), Server)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        argv = ["agent_replay.py", "--url", f"http://127.0.0.1:{srv.server_port}", *self.files]
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), unittest.mock.patch.object(sys, "argv", argv):
                rc = agent_replay.main()
        finally:
            srv.shutdown()
        return rc, out.getvalue()

    def test_the_replay_asks_each_turn_off_then_on_and_sums(self):
        rc, out = self.replay(differ=False)
        self.assertEqual(rc, 0, out)
        self.assertEqual([b.get("speculative.n_max") for b in Server.seen], [0, None] * 4)
        # A session's second turn carries the first turn's recorded answer; a new file
        # starts a new history.
        self.assertEqual(len(Server.seen[2]["messages"]), 4)
        self.assertEqual(len(Server.seen[4]["messages"]), 2)
        self.assertIn("drafted 32, accepted 24 (75.0%)", out)
        self.assertIn("2.00x; answers identical", out)

    def test_different_bytes_fail_the_replay(self):
        rc, out = self.replay(differ=True)
        self.assertEqual(rc, 1)
        self.assertIn("DIFFERENT BYTES", out)


if __name__ == "__main__":
    unittest.main()
