"""bench/ab.sh alternates two builds and tabulates their medians: run here on two
stand-in binaries that print what `scoria bench` prints."""

import os
import pathlib
import subprocess
import tempfile
import unittest

AB = pathlib.Path(__file__).resolve().parent / "ab.sh"

FAKE = """#!/usr/bin/env bash
# A stand-in for `scoria bench`: one median line per test, scaled by $SPEED.
[ "$*" = "bench -m x.gguf -n 128" ] || { echo "scoria bench: error: arguments: $*" >&2; exit 3; }
[ -n "${FAIL:-}" ] && { echo "scoria bench: error: no GPU" >&2; exit 1; }
n=$(cat "$0.count" 2>/dev/null || echo 0); echo $((n + 1)) > "$0.count"
awk -v s="${SPEED:-1}" -v n="$n" 'BEGIN {
  printf "scoria bench: tg128: %.2f t/s median, 1 ± 0 mean over 3 runs\\n", 100 * s + n
  printf "scoria bench: tg128 x4: %.2f t/s median, 1 ± 0 mean over 3 runs\\n", 250 * s + n
}' >&2
echo "| table |"
"""


class Ab(unittest.TestCase):
    def run_ab(self, a, b, env=None):
        d = tempfile.mkdtemp()
        fake = pathlib.Path(d) / "scoria"
        fake.write_text(FAKE)
        fake.chmod(0o755)
        log = pathlib.Path(d) / "log"
        out = subprocess.run(
            ["bash", str(AB), "2", str(log), a.replace("BIN", str(fake)),
             b.replace("BIN", str(fake)), "--", "-m", "x.gguf", "-n", "128"],
            capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})
        return out, log

    def test_alternates_and_tabulates_each_sides_medians(self):
        out, log = self.run_ab("BIN", "BIN,SPEED=2")
        self.assertEqual(out.returncode, 0, out.stderr)
        runs = (log / "runs.txt").read_text().splitlines()
        # a, b, a, b: the runs alternate (the stand-in counts its calls).
        self.assertEqual(
            [line for line in runs if "tg128:" in line],
            ["a round 1: tg128: 100.00 t/s median", "b round 1: tg128: 201.00 t/s median",
             "a round 2: tg128: 102.00 t/s median", "b round 2: tg128: 203.00 t/s median"])
        summary = (log / "summary.txt").read_text()
        self.assertIn("| tg128 | 100.00, 102.00 | 201.00, 203.00 | 2.000 |", summary)
        self.assertIn("| tg128 x4 | 250.00, 252.00 | 501.00, 503.00 | 2.000 |", summary)
        self.assertTrue((log / "b-2.md").read_text().startswith("| table |"))

    def test_a_failing_run_is_reported_and_the_rounds_go_on(self):
        out, log = self.run_ab("BIN,FAIL=1", "BIN")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("a round 1: exit 1", out.stdout)
        self.assertIn("a round 2: exit 1", out.stdout)
        self.assertIn("| tg128 | — | 100.00, 101.00 | — |", (log / "summary.txt").read_text())


if __name__ == "__main__":
    unittest.main()
