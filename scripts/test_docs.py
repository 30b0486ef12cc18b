"""The repository's documents stand on their own (issue 9, item 12): nothing points at
files outside it, and every docs/*.md a document links to exists."""

import pathlib
import re
import subprocess
import unittest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file()]


class Docs(unittest.TestCase):
    def test_no_reference_outside_the_repository(self):
        outside = re.compile(r"DESIGN\.md|BENCH\.md|\.\./shared|shared/(tools|reference|seeds)/")
        for p in tracked():
            if p.suffix in (".gz", ".png", ".npy", ".gguf", ".bin"):
                continue
            try:
                text = p.read_text()
            except UnicodeDecodeError:
                continue
            for n, line in enumerate(text.splitlines(), 1):
                self.assertIsNone(outside.search(line), f"{p.relative_to(ROOT)}:{n}: {line.strip()}")

    def test_linked_docs_exist(self):
        for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
            for target in re.findall(r"\]\(([^)#:]+\.md)\)", p.read_text()):
                self.assertTrue((p.parent / target).exists(), f"{p.name} links {target}")


if __name__ == "__main__":
    unittest.main()
