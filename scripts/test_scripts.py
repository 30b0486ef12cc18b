"""The shell scripts find cargo's output where cargo puts it (issue 9, item 11):
`bash scripts/test.sh` must work with and without CARGO_TARGET_DIR."""

import os
import pathlib
import re
import subprocess
import tempfile
import unittest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))


def target_dir(env_extra):
    """Runs server-tests.sh's `cargo_target_dir` function with `env_extra` set."""
    text = (ROOT / "scripts" / "server-tests.sh").read_text()
    fn = re.search(r"^cargo_target_dir\(\) \{.*?^\}", text, re.S | re.M).group(0)
    env = dict(os.environ)
    env.pop("CARGO_TARGET_DIR", None)
    env.update(env_extra)
    out = subprocess.run(
        ["bash", "-c", f'ROOT="{ROOT}"\n{fn}\ncargo_target_dir'],
        env=env, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


class TargetDir(unittest.TestCase):
    def test_no_script_hard_codes_the_binary_path(self):
        for s in SCRIPTS:
            for n, line in enumerate(s.read_text().splitlines(), 1):
                if line.lstrip().startswith("#"):
                    continue
                self.assertNotRegex(line, r"target/(release|debug)/",
                                    f"{s.name}:{n} assumes cargo's target dir: {line}")

    def test_the_binary_follows_cargo_target_dir(self):
        with tempfile.TemporaryDirectory() as d:
            self.assertEqual(target_dir({"CARGO_TARGET_DIR": d}), d)
        self.assertTrue(target_dir({}).endswith("target"))


if __name__ == "__main__":
    unittest.main()
