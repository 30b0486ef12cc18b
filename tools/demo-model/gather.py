#!/usr/bin/env python3
"""Collect the demo model's training corpus and chat data (runs on the development machine).

Sources (every one permissively licensed; `manifest.json` lists each file's source,
package version and licence):

* `python-stdlib`, `python-tests`: the Python standard library's source and its test suite,
  of the Python running this script (PSF-2.0).
* `python-docs`: the reStructuredText sources of the Python documentation, from the Debian
  package `python3.11-doc` (PSF-2.0).
* `sphinx-docs`: the reStructuredText sources in the Debian documentation packages of
  pandas, pytest, Sphinx, Flask, Click, Jinja2, attrs and Requests (SPHINX_DEBS: BSD, MIT,
  Apache-2.0).
* `rust-docs`, `rust-std`, `rust-compiler`: the Markdown sources of the Rust books (The Rust
  Programming Language, the Reference, the Rustonomicon, Rust by Example, ...), the source
  of `core`, `alloc`, `std`, `proc_macro` and `test`, and of the compiler, from the Debian
  package `rust-src` (MIT OR Apache-2.0).
* `crates`: Rust crates in cargo's local registry cache (`$CARGO_HOME/registry/src`), the
  newest version of each crate whose `license` field allows MIT, Apache-2.0 or BSD terms
  alone; `.rs` files and Markdown documentation.

Debian packages are fetched with `apt-get download` into `--work` (never installed) unless
they are there already. Output (`--out`, default `.demo-data/` at the repository root,
which git ignores):

* `train.xz`, `valid.xz`: documents separated by NUL bytes, in a fixed shuffled order;
  1% of documents (chosen by a hash of their source and path) are held out in `valid.xz`.
* `chat.xz`, `chat_valid.xz`: conversations rendered with the repository's qwen35 chat
  template (`crates/model/assets/templates/qwen35.jinja`), NUL-separated (see `chat.py`).
* `manifest.json`: sources, versions, licences, per-source counts and bytes, every file
  used, and the outputs' sha256.

Deterministic given its inputs (the same files give the same bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import subprocess
import sys
import sysconfig
import time
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import chat  # noqa: E402

DEBS = {
    "python3.11-doc": "PSF-2.0",
    "rust-src": "MIT OR Apache-2.0",
}
# Debian packages of Python projects' Sphinx documentation that ship the reStructuredText
# sources (html/_sources); licences from each package's debian/copyright.
SPHINX_DEBS = {
    "python-pandas-doc": "BSD-3-Clause",
    "python-pytest-doc": "MIT",
    "sphinx-doc": "BSD-2-Clause",
    "python-flask-doc": "BSD-3-Clause",
    "python-click-doc": "BSD-3-Clause",
    "python-jinja2-doc": "BSD-3-Clause",
    "python-attr-doc": "MIT",
    "python-requests-doc": "Apache-2.0",
}
PERMISSIVE = {"MIT", "MIT-0", "Apache-2.0", "BSD-2-Clause", "BSD-3-Clause", "0BSD"}
MAX_FILE = 160_000       # bytes; larger files are mostly generated tables
MIN_FILE = 200
MAX_LINE = 400           # a longer line marks generated or minified content
VALID_PER_MILLE = 10


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def h64(s: str) -> int:
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], "little")


# ----------------------------------------------------------------------------- licences

def _spdx_tokens(expr: str) -> list[str]:
    expr = expr.replace("/", " OR ")
    return re.findall(r"\(|\)|[A-Za-z0-9.+\-]+", expr)


def spdx_permissive(expr: str) -> bool:
    """Whether an SPDX expression can be satisfied with licences in PERMISSIVE alone."""
    toks = _spdx_tokens(expr)
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def factor() -> bool:
        nonlocal pos
        t = peek()
        if t == "(":
            pos += 1
            v = disj()
            if peek() != ")":
                raise ValueError(expr)
            pos += 1
            return v
        pos += 1
        ok = t in PERMISSIVE
        if peek() == "WITH":
            pos += 2  # an exception only widens what the licence allows
        return ok

    def conj() -> bool:
        nonlocal pos
        v = factor()
        while peek() == "AND":
            pos += 1
            v = factor() and v
        return v

    def disj() -> bool:
        nonlocal pos
        v = conj()
        while peek() == "OR":
            pos += 1
            v = conj() or v
        return v

    try:
        v = disj()
        return v and pos == len(toks)
    except (ValueError, IndexError):
        return False


# ----------------------------------------------------------------------------- files

def clean(raw: bytes) -> str | None:
    """The text of a file fit for training, or None."""
    if b"\0" in raw or not (MIN_FILE <= len(raw) <= MAX_FILE):
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if text.startswith("\ufeff"):
        text = text[1:]
    head = text[:2000].lower()
    if "@generated" in head or "automatically generated" in head or "do not edit" in head \
            or "auto-generated" in head or "autogenerated" in head:
        return None
    lines = text.split("\n")
    if max(len(x) for x in lines) > MAX_LINE:
        return None
    # tables of numbers (unicode data, test vectors) are poor training text
    digits = sum(c.isdigit() for c in text)
    if digits > 0.25 * len(text):
        return None
    return text.rstrip() + "\n"


class Corpus:
    def __init__(self):
        self.docs: list[dict] = []       # {source, path, text}
        self.seen: set[str] = set()
        self.sources: dict[str, dict] = {}

    def source(self, sid: str, **info) -> None:
        self.sources[sid] = dict(info, files=0, bytes=0, skipped=0, duplicates=0)

    def add(self, sid: str, path: str, raw: bytes, cap: int | None = None, meta: dict | None = None) -> bool:
        s = self.sources[sid]
        text = clean(raw)
        if text is None:
            s["skipped"] += 1
            return False
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in self.seen:
            s["duplicates"] += 1
            return False
        if cap is not None and s["bytes"] + len(text) > cap:
            s["skipped"] += 1
            return False
        self.seen.add(digest)
        self.docs.append(dict(source=sid, path=path, text=text, sha256=digest, **(meta or {})))
        s["files"] += 1
        s["bytes"] += len(text.encode())
        return True


def walk(root: Path, suffixes: tuple[str, ...], skip_dirs: set[str] = frozenset()) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith(suffixes):
                out.append(Path(dirpath) / f)
    return out


def by_hash(paths: list[Path], root: Path) -> list[Path]:
    """A fixed pseudo-random order, so a byte cap keeps a spread of files, not the first ones."""
    return sorted(paths, key=lambda p: h64(str(p.relative_to(root))))


# ----------------------------------------------------------------------------- sources

def deb(work: Path, name: str, download: bool) -> tuple[Path, str]:
    """The unpacked Debian package `name` (downloaded into work/debs if missing)."""
    debs = work / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{name}_*.deb"))
    if not found:
        if not download:
            raise SystemExit(f"{name}: no .deb in {debs}; run with --download (apt-get download)")
        subprocess.run(["apt-get", "download", name], cwd=debs, check=True)
        found = sorted(debs.glob(f"{name}_*.deb"))
    pkg = found[-1]
    version = pkg.name.split("_")[1]
    dest = work / "unpacked" / name
    if not (dest / ".done").exists():
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run(["dpkg-deb", "-x", str(pkg), str(dest)], check=True)
        (dest / ".done").write_text(version)
    return dest, version


def python_stdlib(c: Corpus, cap: int) -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    c.source("python-stdlib", what="Python standard library source", version=sys.version.split()[0],
             licence="PSF-2.0", origin="the Python interpreter running gather.py")
    skip = {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data",
            "lib2to3", "ensurepip", "turtledemo"}
    for p in by_hash(walk(root, (".py",), skip), root):
        c.add("python-stdlib", f"Lib/{p.relative_to(root)}", p.read_bytes(), cap)


def python_tests(c: Corpus, cap: int) -> None:
    root = Path(sysconfig.get_paths()["stdlib"]) / "test"
    c.source("python-tests", what="Python standard library test suite", version=sys.version.split()[0],
             licence="PSF-2.0", origin="the Python interpreter running gather.py")
    for p in by_hash(walk(root, (".py",), {"__pycache__", "data", "test_lib2to3", "encoded_modules"}), root):
        c.add("python-tests", f"Lib/test/{p.relative_to(root)}", p.read_bytes(), cap)


def sphinx_docs(c: Corpus, work: Path, download: bool, cap: int) -> None:
    c.source("sphinx-docs", what="documentation of Python projects (reStructuredText sources)",
             licence="each package's own (packages below)", packages={})
    for name, lic in SPHINX_DEBS.items():
        dest, version = deb(work, name, download)
        c.sources["sphinx-docs"]["packages"][name] = {"version": version, "licence": lic}
        roots = sorted(p for p in dest.rglob("_sources") if p.is_dir())
        for root in roots:
            for p in by_hash(walk(root, (".rst.txt", ".md.txt", ".txt")), root):
                rel = str(p.relative_to(root))
                if "changelog" in rel.lower() or "release" in rel.lower() or "whatsnew" in rel.lower():
                    continue
                c.add("sphinx-docs", f"{name}/{rel.removesuffix('.txt')}", p.read_bytes(), cap)


def python_docs(c: Corpus, work: Path, download: bool, cap: int) -> None:
    dest, version = deb(work, "python3.11-doc", download)
    root = dest / "usr/share/doc/python3.11/html/_sources"
    c.source("python-docs", what="Python documentation (reStructuredText sources)",
             package="python3.11-doc (Debian)", version=version, licence=DEBS["python3.11-doc"])
    for p in by_hash(walk(root, (".rst.txt",)), root):
        rel = str(p.relative_to(root))
        if rel.startswith("whatsnew/changelog"):
            continue
        c.add("python-docs", f"Doc/{rel[:-4]}", p.read_bytes(), cap)


def rust_src(c: Corpus, work: Path, download: bool, cap_docs: int, cap_std: int, cap_compiler: int) -> None:
    dest, version = deb(work, "rust-src", download)
    base = next((dest / "usr/src").glob("rustc-*"))
    c.source("rust-docs", what="Rust books and guides (Markdown sources)", package="rust-src (Debian)",
             version=version, licence=DEBS["rust-src"])
    c.source("rust-std", what="Rust standard library source (core, alloc, std, proc_macro, test)",
             package="rust-src (Debian)", version=version, licence=DEBS["rust-src"])
    c.source("rust-compiler", what="the Rust compiler's source (compiler/)",
             package="rust-src (Debian)", version=version, licence=DEBS["rust-src"])
    books = ["book", "reference", "nomicon", "rust-by-example", "edition-guide", "embedded-book",
             "rustc", "rustdoc", "rustc-dev-guide", "unstable-book"]
    docs = []
    for b in books:
        docs += walk(base / "src/doc" / b, (".md",))
    for p in by_hash(docs, base):
        c.add("rust-docs", str(p.relative_to(base)), p.read_bytes(), cap_docs)
    code = []
    for lib in ["core", "alloc", "std", "proc_macro", "test"]:
        code += walk(base / "library" / lib / "src", (".rs",), {"tests", "benches"})
    for p in by_hash(code, base):
        c.add("rust-std", str(p.relative_to(base)), p.read_bytes(), cap_std)
    comp = walk(base / "compiler", (".rs",), {"tests", "benches"})
    for p in by_hash(comp, base):
        c.add("rust-compiler", str(p.relative_to(base)), p.read_bytes(), cap_compiler)


def crates(c: Corpus, registry: Path, cap: int, per_crate: int) -> list[dict]:
    c.source("crates", what="Rust crates (source and Markdown docs) from cargo's registry cache",
             licence="each crate's own: MIT, Apache-2.0 or BSD terms (per crate below)")
    newest: dict[str, tuple[tuple, Path, dict]] = {}
    for index in sorted(registry.glob("*")):
        for d in sorted(index.iterdir()):
            try:
                pkg = tomllib.loads((d / "Cargo.toml").read_text("utf-8"))["package"]
            except Exception:
                continue
            name, version = pkg.get("name"), str(pkg.get("version", ""))
            key = tuple(int(x) if x.isdigit() else -1 for x in re.split(r"[.+-]", version))
            if name and (name not in newest or key > newest[name][0]):
                newest[name] = (key, d, pkg)
    used = []
    for name in sorted(newest, key=lambda n: h64("crate:" + n)):
        _, d, pkg = newest[name]
        lic = pkg.get("license")
        if not isinstance(lic, str) or not spdx_permissive(lic):
            c.sources["crates"].setdefault("rejected_licence", []).append(f"{name} {pkg.get('version')}: {lic}")
            continue
        files = walk(d, (".rs", ".md"), {"target", "benches", "fuzz", "data", "fixtures", "testdata"})
        files = [p for p in files if not p.name.lower().startswith(("changelog", "changes", "license",
                                                                  "licence", "copyright", "release"))]
        taken = 0
        n_before = c.sources["crates"]["files"]
        for p in by_hash(files, d):
            raw = p.read_bytes()
            if taken + len(raw) > per_crate:
                continue
            if c.add("crates", f"{name}-{pkg['version']}/{p.relative_to(d)}", raw, cap,
                     meta={"crate": name}):
                taken += len(raw)
        if c.sources["crates"]["files"] > n_before:
            used.append({"crate": name, "version": str(pkg.get("version")), "license": lic,
                         "files": c.sources["crates"]["files"] - n_before, "bytes": taken})
    return used


# ----------------------------------------------------------------------------- output

def write_xz(path: Path, docs: list[str]) -> dict:
    data = "\0".join(docs).encode("utf-8")
    tmp = path.with_suffix(".tmp")
    with lzma.open(tmp, "wb", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write(data)
    os.replace(tmp, path)
    return {"file": path.name, "documents": len(docs), "bytes": len(data), "xz_bytes": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / ".demo-data"))
    ap.add_argument("--work", default="/tmp/demo-gather", help="Debian packages are downloaded/unpacked here")
    ap.add_argument("--download", action="store_true", help="apt-get download missing Debian packages")
    ap.add_argument("--registry", default=str(Path(os.environ.get("CARGO_HOME", Path.home() / ".cargo"))
                                              / "registry" / "src"))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every byte cap (0.05 for a smoke test)")
    ap.add_argument("--chat-conversations", type=int, default=40_000)
    args = ap.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    mb = lambda x: int(x * 1e6 * args.scale)  # noqa: E731

    c = Corpus()
    log("python stdlib")
    python_stdlib(c, mb(14))
    python_tests(c, mb(15))
    log("python docs")
    python_docs(c, work, args.download, mb(12))
    sphinx_docs(c, work, args.download, mb(10))
    log("rust-src")
    rust_src(c, work, args.download, mb(7), mb(14), mb(22))
    log("crates")
    crate_list = crates(c, Path(args.registry), mb(90), int(6e6))
    for sid, s in c.sources.items():
        log(f"  {sid}: {s['files']} files, {s['bytes'] / 1e6:.1f} MB ({s['skipped']} skipped, "
            f"{s['duplicates']} duplicates)")

    train, valid = [], []
    for d in sorted(c.docs, key=lambda d: h64("order:" + d["sha256"])):
        d["split"] = "valid" if h64("split:" + d["source"] + d["path"]) % 1000 < VALID_PER_MILLE else "train"
        (valid if d["split"] == "valid" else train).append(d)

    log(f"chat data ({args.chat_conversations} conversations)")
    convs = chat.build(train, args.chat_conversations, seed=1234)  # held-out files stay unseen
    chat_train = [x for i, x in enumerate(convs) if i % 100 != 0]
    chat_valid = [x for i, x in enumerate(convs) if i % 100 == 0]

    log("compressing")
    outputs = [write_xz(out / "train.xz", [d["text"] for d in train]),
               write_xz(out / "valid.xz", [d["text"] for d in valid]),
               write_xz(out / "chat.xz", chat_train),
               write_xz(out / "chat_valid.xz", chat_valid)]
    for o in outputs:
        log(f"  {o['file']}: {o['documents']} docs, {o['bytes'] / 1e6:.1f} MB -> {o['xz_bytes'] / 2**20:.2f} MiB")

    manifest = {
        "sources": c.sources,
        "crates": crate_list,
        "chat": chat.describe(),
        "outputs": outputs,
        "split": f"a document is held out when sha256('split:' + source + path) mod 1000 < {VALID_PER_MILLE}",
        "files": [{"source": d["source"], "path": d["path"], "sha256": d["sha256"],
                   "split": d["split"]} for d in c.docs],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"wrote {out}/manifest.json")


if __name__ == "__main__":
    main()
