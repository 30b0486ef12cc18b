#!/usr/bin/env python3
"""Compare `scoria bench -o json` with `llama-bench -o json` from the same run.

    bench/compare.py SCORIA.json PEER.json --profile FULL --model "Q35 synthetic, random routing" \
        --machine "H200 host, 16 cores" [--commit C] [--peer-commit C] [--peer NAME] \
        [--bound-tps tg128=252 --bound-tps pp512=...] [--command "..."] \
        [--results bench/results.jsonl ...] [--no-append]

Tests are matched on (n_prompt, n_gen, n_depth). For each match it prints scoria's median,
the peer's median and the ratio (scoria / peer), and appends one JSON object per test to each
--results file (default: bench/results.jsonl beside this script) in the shape
docs/benchmarks.md asks for:

    {"date", "commit", "machine", "profile", "model", "test", "scoria_tps", "peer",
     "peer_commit", "peer_tps", "ratio", "bound_tps", "command"}

Both inputs may be a JSON document or JSON lines (llama-bench's -o jsonl, scoria's -o jsonl);
a llama-bench JSON array cut off by a timeout is read up to its last complete test.
Medians are of every sample (`samples_ts`); without samples, the mean (`avg_ts`).
Python 3 standard library only.
"""

import argparse
import datetime
import json
import os
import statistics
import sys

PROFILES = ("FULL", "W24", "W16", "W12-R16", "RAM", "CPU-16T")
MODELS = ("N80", "Q35", "M30", "Q122", "Q397", "DEMO")
HERE = os.path.dirname(os.path.abspath(__file__))


def _loads_lenient(text):
    """A JSON document, JSON lines, or a JSON array cut off after its last complete element."""
    text = text.strip()
    if not text:
        return []
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    rows = []
    try:
        for line in text.splitlines():
            if line.strip():
                rows.append(json.loads(line))
        return rows
    except json.JSONDecodeError:
        pass
    if text.startswith("["):
        # Truncated array: keep whole objects, decoding one after another.
        dec = json.JSONDecoder()
        i, rows = 1, []
        while True:
            while i < len(text) and text[i] in " \t\r\n,":
                i += 1
            if i >= len(text) or text[i] == "]":
                break
            try:
                obj, i = dec.raw_decode(text, i)
            except json.JSONDecodeError:
                break
            rows.append(obj)
        if rows:
            return rows
    raise ValueError("neither JSON nor JSON lines")


def test_name(n_prompt, n_gen, n_depth):
    """docs/benchmarks.md's compact test name: pp512, tg128, tg128@d4096."""
    if n_gen == 0:
        name = f"pp{n_prompt}"
    elif n_prompt == 0:
        name = f"tg{n_gen}"
    else:
        name = f"pp{n_prompt}+tg{n_gen}"
    return name + (f"@d{n_depth}" if n_depth else "")


def load(path):
    """(meta, {(n_prompt, n_gen, n_depth): test}) from either tool's output.

    meta: build_commit, backends, command (when the file says); each test: name,
    samples (tokens/s), median, mean, stddev."""
    with open(path, encoding="utf-8") as f:
        doc = _loads_lenient(f.read())
    if isinstance(doc, dict) and isinstance(doc.get("tests"), list):
        meta, rows = doc, doc["tests"]  # scoria bench -o json
    elif isinstance(doc, list):
        rows = doc
        meta = rows[0] if rows else {}
    elif isinstance(doc, dict):
        rows, meta = [doc], doc
    else:
        raise ValueError(f"{path}: unexpected JSON ({type(doc).__name__})")
    tests = {}
    for r in rows:
        try:
            key = (int(r["n_prompt"]), int(r["n_gen"]), int(r.get("n_depth", 0) or 0))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: a test without n_prompt / n_gen: {str(r)[:200]}")
        samples = [float(x) for x in (r.get("samples_ts") or [])]
        if samples:
            median = statistics.median(samples)
            mean = statistics.fmean(samples)
            sd = statistics.stdev(samples) if len(samples) > 1 else 0.0
        elif r.get("avg_ts") is not None:
            median = mean = float(r["avg_ts"])
            sd = float(r.get("stddev_ts") or 0.0)
        else:
            raise ValueError(f"{path}: test {test_name(*key)} has no samples_ts or avg_ts")
        tests[key] = {
            "name": test_name(*key),
            "samples": samples,
            "median": median,
            "mean": mean,
            "stddev": sd,
        }
    info = {
        "build_commit": meta.get("build_commit"),
        "backends": meta.get("backends"),
        "command": meta.get("command"),
        "model_filename": (meta.get("model") or {}).get("filename")
        if isinstance(meta.get("model"), dict)
        else meta.get("model_filename"),
    }
    return info, tests


def parse_bounds(values):
    """--bound-tps VALUE (every test) or TEST=VALUE (one test, docs/benchmarks.md's name)."""
    every, per = None, {}
    for v in values or []:
        if "=" in v:
            name, _, num = v.partition("=")
            per[name.strip().replace(" ", "")] = float(num)
        else:
            every = float(v)
    return lambda name: per.get(name, every)


def known(value, default="unknown"):
    return value if value and value != "unknown" else default


def compare(scoria, peer):
    """Rows for the tests both files have, in scoria's order; and the unmatched names."""
    rows = []
    for key, s in scoria.items():
        p = peer.get(key)
        if p is None:
            continue
        ratio = s["median"] / p["median"] if p["median"] > 0 else None
        rows.append((key, s, p, ratio))
    only_s = [s["name"] for k, s in scoria.items() if k not in peer]
    only_p = [p["name"] for k, p in peer.items() if k not in scoria]
    return rows, only_s, only_p


def table(rows, peer_label):
    out = [
        f"| test | scoria median t/s | scoria mean ± sd | {peer_label} median t/s | "
        f"{peer_label} mean ± sd | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for _, s, p, ratio in rows:
        out.append(
            f"| {s['name']} | {s['median']:.2f} | {s['mean']:.2f} ± {s['stddev']:.2f} | "
            f"{p['median']:.2f} | {p['mean']:.2f} ± {p['stddev']:.2f} | "
            + (f"{ratio:.3f} |" if ratio is not None else "– |")
        )
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scoria_file", metavar="SCORIA", help="scoria bench -o json (or jsonl) output")
    ap.add_argument("peer_file", metavar="PEER", help="llama-bench -o json (or jsonl) output")
    ap.add_argument("--profile", help="FULL, W24, W16, W12-R16, RAM or CPU-16T (docs/benchmarks.md)")
    ap.add_argument("--model", help='e.g. "Q35 synthetic, random routing" (first word N80, Q35, M30, Q122, Q397 or DEMO)')
    ap.add_argument("--machine", help="where it ran, e.g. the GPU and CPU")
    ap.add_argument("--commit", help="scoria's commit (default: the JSON's build_commit, $SCORIA_COMMIT)")
    ap.add_argument("--peer-commit", help="the peer's commit (default: llama-bench's build_commit)")
    ap.add_argument("--peer", help='peer name (default: "llama.cpp " + its backends)')
    ap.add_argument("--bound-tps", action="append", metavar="[TEST=]TPS",
                    help="the physical bound, for every test or one (repeatable; e.g. tg128=252)")
    ap.add_argument("--command", help="the command that produced both files")
    ap.add_argument("--date", help="YYYY-MM-DD (default: today, UTC)")
    ap.add_argument("--results", action="append",
                    help="JSONL file to append to (repeatable; default bench/results.jsonl)")
    ap.add_argument("--no-append", action="store_true", help="print the comparison only")
    a = ap.parse_args(argv)

    try:
        s_info, s_tests = load(a.scoria_file)
        p_info, p_tests = load(a.peer_file)
    except (OSError, ValueError) as e:
        print(f"compare.py: error: {e}", file=sys.stderr)
        return 2
    peer_label = a.peer or ("llama.cpp " + (p_info.get("backends") or "")).strip()
    rows, only_s, only_p = compare(s_tests, p_tests)
    print(table(rows, "peer"))
    print(f"\npeer: {peer_label}; ratio = scoria median / peer median")
    if only_s:
        print("only in scoria (not compared): " + ", ".join(only_s))
    if only_p:
        print("only in the peer (not compared): " + ", ".join(only_p))
    if not rows:
        print("compare.py: error: no test is in both files", file=sys.stderr)
        return 1
    if a.no_append:
        return 0

    missing = [f for f in ("profile", "model", "machine") if not getattr(a, f)]
    if missing:
        print("compare.py: error: to append results give --" + ", --".join(missing)
              + " (or --no-append)", file=sys.stderr)
        return 2
    if a.profile not in PROFILES:
        print(f"compare.py: warning: profile {a.profile!r} is not one of {', '.join(PROFILES)}",
              file=sys.stderr)
    if a.model.split()[0] not in MODELS:
        print(f"compare.py: warning: model {a.model!r} should start with {', '.join(MODELS)}",
              file=sys.stderr)
    try:
        bound = parse_bounds(a.bound_tps)
    except ValueError as e:
        print(f"compare.py: error: --bound-tps: {e}", file=sys.stderr)
        return 2
    commit = (a.commit or known(s_info.get("build_commit"), None)
              or known(os.environ.get("SCORIA_COMMIT")))
    peer_commit = a.peer_commit or known(p_info.get("build_commit"))
    command = a.command or "scoria: {}; peer: llama-bench (command not recorded)".format(
        s_info.get("command") or "scoria bench")
    date = a.date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    lines = []
    for _, s, p, ratio in rows:
        lines.append(json.dumps({
            "date": date,
            "commit": commit,
            "machine": a.machine,
            "profile": a.profile,
            "model": a.model,
            "test": s["name"],
            "scoria_tps": round(s["median"], 2),
            "peer": peer_label,
            "peer_commit": peer_commit,
            "peer_tps": round(p["median"], 4),
            "ratio": round(ratio, 4) if ratio is not None else None,
            "bound_tps": bound(s["name"]),
            "command": command,
        }, ensure_ascii=False))
    for path in a.results or [os.path.join(HERE, "results.jsonl")]:
        # A file whose last line lacks its newline gets one first.
        ends_open = False
        if os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                ends_open = f.read(1) != b"\n"
        with open(path, "a", encoding="utf-8") as f:
            if ends_open:
                f.write("\n")
            for line in lines:
                f.write(line + "\n")
        print(f"appended {len(lines)} line(s) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
