//! `scoria bench` end to end on the CPU: a tiny synthetic model made by `scoria synth`,
//! the markdown table, the JSON (every sample, device, model), and the one-line errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn scoria(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_scoria"))
        .args(args)
        .env("SCORIA_COMMIT", "test-commit")
        .output()
        .expect("run scoria")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A fresh directory (one per test: `tag`) and a tiny qwen35moe (Q8_0, random weights)
/// in it.
fn tiny_model(tag: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("scoria-bench-cli-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let model = dir.join("tiny.gguf");
    let m = model.to_str().expect("utf-8 path");
    let out = scoria(&[
        "synth",
        "--geometry",
        "tiny-qwen35moe",
        "--quant",
        "q8_0",
        "--no-sync",
        "--force",
        "-o",
        m,
    ]);
    assert!(out.status.success(), "synth failed: {}", text(&out.stderr));
    (dir, model)
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[test]
fn bench_on_a_tiny_model_reports_table_and_json() {
    let (dir, model) = tiny_model("tests");
    let m = s(&model);

    // Markdown to stdout: llama-bench's header and one row per test, in its order.
    let out = scoria(&[
        "bench", "-m", m, "-p", "16", "-n", "4", "-d", "0,8", "-r", "1", "-t", "2",
    ]);
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[0].starts_with("| model ")
            && lines[0].contains("| backend ")
            && lines[0].contains("|                  t/s |")
            && lines[0].ends_with("|   median t/s |"),
        "{stdout}"
    );
    assert!(lines[1].starts_with("| ---"), "{stdout}");
    let tests: Vec<&str> = lines[2..6]
        .iter()
        .map(|l| l.split('|').nth(6).unwrap_or("").trim())
        .collect();
    assert_eq!(tests, ["pp16", "tg4", "pp16 @ d8", "tg4 @ d8"], "{stdout}");
    for l in &lines[2..6] {
        assert!(l.contains("| CPU "), "{l}");
        assert!(l.contains(" ± "), "{l}");
        let rate: f64 = l
            .split('|')
            .nth(7)
            .unwrap_or("")
            .split('±')
            .next()
            .unwrap_or("")
            .trim()
            .parse()
            .unwrap_or(0.0);
        assert!(rate > 0.0, "{l}");
    }
    assert!(stdout.contains("build: test-commit (scoria "), "{stdout}");
    assert!(stdout.contains("device: cpu ("), "{stdout}");
    assert!(stdout.contains("note: synthetic model"), "{stdout}");
    assert!(stderr.contains("scoria bench: device: cpu ("), "{stderr}");

    // JSON to a file: two repetitions, every sample kept, device and model described.
    let json_path = dir.join("out.json");
    let out = scoria(&[
        "bench",
        "-m",
        m,
        "-p",
        "8",
        "-n",
        "3",
        "-d",
        "5",
        "-r",
        "2",
        "-t",
        "2",
        "-o",
        "json",
        "--output",
        s(&json_path),
        "--seed",
        "9",
    ]);
    assert!(out.status.success(), "bench failed: {}", text(&out.stderr));
    assert!(out.stdout.is_empty(), "--output writes nothing to stdout");
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).expect("json written"))
            .expect("valid JSON");
    assert_eq!(j["tool"], "scoria bench");
    assert_eq!(j["build_commit"], "test-commit");
    assert_eq!(j["backends"], "CPU");
    assert_eq!(j["device"]["device"], "cpu");
    assert_eq!(j["model"]["arch"], "qwen35moe");
    assert_eq!(j["model"]["synthetic"], true);
    assert!(j["model"]["n_params"].as_u64().unwrap_or(0) > 0);
    assert_eq!(j["n_threads"], 2);
    assert_eq!(j["seed"], 9);
    // Just enough context for the largest test: pp8 @ d5 needs 5 + 8 + 1.
    assert_eq!(j["n_ctx"], 16);
    let t = j["tests"].as_array().expect("tests");
    assert_eq!(t.len(), 2);
    assert_eq!(t[0]["test"], "pp8 @ d5");
    assert_eq!(t[1]["test"], "tg3 @ d5");
    assert_eq!(
        (t[1]["n_gen"].as_u64(), t[1]["n_depth"].as_u64()),
        (Some(3), Some(5))
    );
    for test in t {
        let ts = test["samples_ts"].as_array().expect("samples_ts");
        let ns = test["samples_ns"].as_array().expect("samples_ns");
        assert_eq!((ts.len(), ns.len()), (2, 2), "{test}");
        for (r, n) in ts.iter().zip(ns) {
            let (r, n) = (r.as_f64().unwrap_or(0.0), n.as_f64().unwrap_or(0.0));
            let tokens = test["timed_tokens"].as_f64().unwrap_or(0.0);
            assert!(r > 0.0 && n > 0.0, "{test}");
            // samples_ns is rounded to the nanosecond.
            assert!((r - tokens * 1e9 / n).abs() / r < 1e-6, "{test}");
        }
        let med = test["median_ts"].as_f64().unwrap_or(0.0);
        let avg = test["avg_ts"].as_f64().unwrap_or(-1.0);
        assert!(
            (med - avg).abs() < 1e-9,
            "two samples: the median is the mean: {test}"
        );
    }

    // JSONL: one self-contained line per test.
    let out = scoria(&[
        "bench", "-m", m, "-p", "0", "-n", "2", "-r", "1", "-t", "2", "-o", "jsonl",
    ]);
    assert!(out.status.success(), "bench failed: {}", text(&out.stderr));
    let lines: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["test"], "tg2");
    assert_eq!(lines[0]["model"]["arch"], "qwen35moe");

    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_verify_times_verify_steps_against_a_decode_step() {
    let (dir, model) = tiny_model("verify");
    let m = s(&model);
    let base = [
        "bench", "-m", m, "--verify", "4,2", "-d", "0,8", "-r", "2", "-t", "2",
    ];

    let mut args = base.to_vec();
    args.extend(["--spec", "ngram", "--draft-max", "3", "-o", "jsonl"]);
    let out = scoria(&args);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "bench --verify failed: {stderr}");
    let rows: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    // Sizes sorted with the one-token step added, at every depth.
    let got: Vec<(u64, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["n_depth"].as_u64().unwrap(),
                r["tokens"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, [(0, 1), (0, 2), (0, 4), (8, 1), (8, 2), (8, 4)]);
    for r in &rows {
        let ms = r["ms"].as_array().expect("samples");
        assert_eq!(ms.len(), 2, "{r}");
        assert!(ms.iter().all(|x| x.as_f64().unwrap() > 0.0), "{r}");
        if r["tokens"] == 1 {
            assert_eq!(r["relative_to_one_token"], 1.0, "{r}");
            assert_eq!(r["implied_speedup"]["0.75"], 1.0, "{r}");
        }
    }
    // -o json: the same rows in one object.
    let mut args = base.to_vec();
    args.extend(["--spec", "ngram", "--draft-max", "3", "-o", "json"]);
    let out = scoria(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(j["rows"].as_array().map(Vec::len), Some(6), "{j}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_errors_are_one_line() {
    let missing = std::env::temp_dir().join("scoria-bench-cli-no-such-model.gguf");
    let out = scoria(&["bench", "-m", s(&missing)]);
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(
        e.contains("not found") && e.contains("no-such-model"),
        "{e}"
    );

    // The context check needs the model to exist: any file will do, it runs first.
    let dir = std::env::temp_dir().join(format!("scoria-bench-cli-e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let f = dir.join("any.gguf");
    std::fs::write(&f, b"not loaded").expect("write");
    let out = scoria(&[
        "bench",
        "-m",
        s(&f),
        "-p",
        "512",
        "-d",
        "4096",
        "-c",
        "2048",
    ]);
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(
        e.contains("pp512 @ d4096 needs a context of 4609 tokens")
            && e.contains("--max-context is 2048"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn version_names_the_commit_the_binary_was_built_from() {
    // A binary carried to another machine has no repository beside it: the commit it
    // was built from is compiled in (build.rs), which `scoria bench` records too.
    let out = Command::new(env!("CARGO_BIN_EXE_scoria"))
        .arg("--version")
        .env_remove("SCORIA_COMMIT")
        .output()
        .expect("run scoria --version");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v = text(&out.stdout);
    let commit = v
        .trim()
        .strip_prefix(concat!("scoria ", env!("CARGO_PKG_VERSION"), " ("))
        .and_then(|r| r.strip_suffix(')'))
        .unwrap_or_else(|| panic!("unexpected --version: {v:?}"));
    let hash = commit.strip_suffix("-dirty").unwrap_or(commit);
    assert!(
        commit == "unknown" || (hash.len() == 40 && hash.chars().all(|c| c.is_ascii_hexdigit())),
        "not a commit: {commit:?}"
    );
}
