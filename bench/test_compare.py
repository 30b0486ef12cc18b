"""bench/compare.py on files shaped like `scoria bench -o json` and `llama-bench -o json`
(run: python3 -m unittest discover -s bench -p 'test_*.py')."""

import contextlib
import io
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402


def scoria_doc():
    def t(label, p, n, d, ts):
        return {"test": label, "n_prompt": p, "n_gen": n, "n_depth": d, "timed_tokens": p + n,
                "samples_ns": [int((p + n) * 1e9 / x) for x in ts], "samples_ts": ts,
                "avg_ts": sum(ts) / len(ts), "stddev_ts": 0.0, "median_ts": sorted(ts)[1]}
    return {
        "tool": "scoria bench", "build_commit": "scoria123", "backends": "CUDA",
        "command": "scoria bench -m q35.gguf --device cuda", "device": {"device": "cuda:0"},
        "model": {"filename": "/m/q35.gguf", "arch": "qwen35moe"},
        "tests": [
            t("pp512", 512, 0, 0, [5000.0, 6000.0, 5500.0]),
            t("tg128", 0, 128, 0, [200.0, 210.0, 190.0]),
            t("tg128 @ d4096", 0, 128, 4096, [180.0, 185.0, 170.0]),
            t("pp16384", 16384, 0, 0, [7000.0, 7100.0, 7200.0]),
        ],
    }


def peer_rows():
    def t(p, n, d, ts):
        return {"build_commit": "abcdef0", "build_number": 7000, "backends": "CUDA",
                "model_filename": "/m/q35.gguf", "n_prompt": p, "n_gen": n, "n_depth": d,
                "avg_ts": sum(ts) / len(ts), "stddev_ts": 1.0,
                "samples_ns": [1, 2, 3], "samples_ts": ts}
    return [
        t(512, 0, 0, [5374.0, 5300.0, 5400.0]),
        t(0, 128, 0, [252.0, 250.0, 260.0]),
        t(0, 128, 4096, [240.0, 230.0, 235.0]),
        t(4096, 0, 0, [9817.0, 9800.0, 9900.0]),
    ]


class CompareTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        self.s = self.path("scoria.json", json.dumps(scoria_doc(), indent=1))
        self.p = self.path("peer.json", json.dumps(peer_rows(), indent=2))
        self.results = self.path("results.jsonl", '{"old": 1}')  # no final newline

    def path(self, name, text):
        p = os.path.join(self.dir.name, name)
        with open(p, "w") as f:
            f.write(text)
        return p

    def run_main(self, *args):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = compare.main(list(args))
        return rc, out.getvalue(), err.getvalue()

    def test_names(self):
        self.assertEqual(compare.test_name(512, 0, 0), "pp512")
        self.assertEqual(compare.test_name(0, 128, 4096), "tg128@d4096")
        self.assertEqual(compare.test_name(512, 128, 0), "pp512+tg128")

    def test_matches_tests_and_appends_bench_md_lines(self):
        rc, out, err = self.run_main(
            self.s, self.p, "--profile", "FULL", "--model", "Q35 synthetic, random routing",
            "--machine", "H200", "--bound-tps", "tg128=300", "--bound-tps", "tg128@d4096=290",
            "--results", self.results, "--date", "2026-12-01")
        self.assertEqual(rc, 0, err)
        self.assertIn("| pp512 | 5500.00 |", out)
        self.assertIn("only in scoria (not compared): pp16384", out)
        self.assertIn("only in the peer (not compared): pp4096", out)
        with open(self.results) as f:
            lines = f.read().splitlines()
        self.assertEqual(json.loads(lines[0]), {"old": 1})
        rows = [json.loads(line) for line in lines[1:]]
        self.assertEqual([r["test"] for r in rows], ["pp512", "tg128", "tg128@d4096"])
        self.assertEqual(list(rows[0]), ["date", "commit", "machine", "profile", "model", "test",
                                         "scoria_tps", "peer", "peer_commit", "peer_tps", "ratio",
                                         "bound_tps", "command"])
        tg = rows[1]
        self.assertEqual(tg["scoria_tps"], 200.0)  # median of 200, 210, 190
        self.assertEqual(tg["peer_tps"], 252.0)
        self.assertAlmostEqual(tg["ratio"], 200.0 / 252.0, places=4)
        self.assertEqual(tg["bound_tps"], 300.0)
        self.assertEqual(rows[2]["bound_tps"], 290.0)
        self.assertIsNone(rows[0]["bound_tps"])
        self.assertEqual(tg["commit"], "scoria123")
        self.assertEqual(tg["peer_commit"], "abcdef0")
        self.assertEqual(tg["peer"], "llama.cpp CUDA")
        self.assertEqual(tg["date"], "2026-12-01")
        self.assertEqual(tg["profile"], "FULL")
        self.assertIn("scoria bench -m q35.gguf", tg["command"])

    def test_jsonl_and_truncated_peer_output(self):
        rows = peer_rows()
        jsonl = self.path("peer.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
        cut = json.dumps(rows, indent=2)
        cut = cut[: cut.index('"n_prompt": 4096')]  # llama-bench killed mid-test
        truncated = self.path("peer-cut.json", cut)
        for peer in (jsonl, truncated):
            rc, out, err = self.run_main(self.s, peer, "--no-append")
            self.assertEqual(rc, 0, err)
            self.assertIn("| tg128@d4096 |", out)
        _, tests = compare.load(truncated)
        self.assertEqual(len(tests), 3)

    def test_appending_needs_the_conditions(self):
        rc, _, err = self.run_main(self.s, self.p, "--results", self.results)
        self.assertEqual(rc, 2)
        self.assertIn("--profile, --model, --machine", err)
        with open(self.results) as f:
            self.assertEqual(f.read(), '{"old": 1}')

    def test_bad_input_is_one_line(self):
        bad = self.path("bad.json", "not json at all")
        rc, _, err = self.run_main(self.s, bad, "--no-append")
        self.assertEqual(rc, 2)
        self.assertEqual(len(err.strip().splitlines()), 1, err)


if __name__ == "__main__":
    unittest.main()
