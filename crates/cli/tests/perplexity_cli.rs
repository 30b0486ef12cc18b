//! `scoria perplexity` and its quality gate on a tiny fixture: the committed demo model
//! against its own Q8_0 requantization (`scoria quantize`), a few short windows of the
//! held-out text. The gate passes a close quantization, fails a threshold below what it
//! measures (exit status 1, one line), and a saved top-K base gives a lower bound of the
//! KL divergence a GGUF base gives.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn scoria(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_scoria"))
        .args(args)
        .env("SCORIA_LOG", "warn")
        .output()
        .expect("run scoria")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The value after `label` in a line of `out` (e.g. "Mean    KLD").
fn value(out: &str, label: &str) -> f64 {
    let line = out
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no `{label}` line in:\n{out}"));
    line.split(':')
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("scoria-ppl-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

#[test]
fn the_kld_gate_passes_a_close_quantization_and_fails_below_what_it_measures() {
    let dir = temp_dir("gate");
    let demo = root().join("models/demo.gguf");
    let heldout = root().join("tests/fixtures/demo/heldout.txt");
    let q8 = dir.join("demo-q8_0.gguf");
    let o = scoria(&["quantize", "-m", s(&demo), "-q", "q8_0", "-o", s(&q8)]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let window = [
        "-f",
        s(&heldout),
        "--ctx",
        "64",
        "--chunks",
        "2",
        "--device",
        "cpu",
    ];

    // The base: the default model (the demo), its top 32 tokens saved.
    let base = dir.join("base.npy");
    let mut args = vec!["perplexity"];
    args.extend(window);
    args.extend(["--save-logits", s(&base), "--save-top-k", "32"]);
    let o = scoria(&args);
    let out = text(&o.stdout);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let last = out.lines().last().unwrap_or("");
    assert!(last.starts_with("perplexity: "), "{out}");
    let base_ppl: f64 = last["perplexity: ".len()..].parse().unwrap();

    // Against the base GGUF run in the same process: the gate passes at 0.05.
    let mut args = vec!["perplexity", "-m", s(&q8)];
    args.extend(window);
    args.extend(["--kld-base", s(&demo), "--kld-max", "0.05"]);
    let o = scoria(&args);
    let out = text(&o.stdout);
    assert!(o.status.success(), "{}\n{}", out, text(&o.stderr));
    let full = value(&out, "Mean    KLD");
    assert!(full > 0.0 && full < 0.05, "{out}");
    assert!(
        (value(&out, "Mean PPL(base)") - base_ppl).abs() < 1e-3 * base_ppl,
        "{out}"
    );
    assert!(value(&out, "Same top-1") > 80.0, "{out}");
    assert!(
        out.lines().last().unwrap().starts_with("perplexity: "),
        "{out}"
    );

    // Against the saved top-32 base: a lower bound of the full divergence.
    let mut args = vec!["perplexity", "-m", s(&q8)];
    args.extend(window);
    args.extend(["--kld-base", s(&base)]);
    let o = scoria(&args);
    let out = text(&o.stdout);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let top = value(&out, "Mean    KLD");
    assert!(
        top > 0.0 && top <= full * (1.0 + 1e-4),
        "top-32 {top} vs full {full}"
    );
    assert!(
        (value(&out, "Mean PPL(base)") - base_ppl).abs() < 1e-3 * base_ppl,
        "{out}"
    );

    // A threshold below the measured divergence fails the command, in one line.
    let max = format!("{}", full / 2.0);
    let mut args = vec!["perplexity", "-m", s(&q8)];
    args.extend(window);
    args.extend(["--kld-base", s(&demo), "--kld-max", &max]);
    let o = scoria(&args);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains("KLD gate failed") && lines[0].contains(&max),
        "{err}"
    );
    // The numbers are still printed before the failure.
    assert!(text(&o.stdout)
        .lines()
        .last()
        .unwrap()
        .starts_with("perplexity: "));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn perplexity_errors_say_what_to_change() {
    let dir = temp_dir("errors");
    let short = dir.join("short.txt");
    std::fs::write(&short, "fn main() { println!(\"hello\"); }\n").unwrap();
    let o = scoria(&[
        "perplexity",
        "-f",
        s(&short),
        "--ctx",
        "64",
        "--device",
        "cpu",
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("needs at least 128") && err.contains("smaller --ctx"),
        "{err}"
    );

    // A base saved over other windows is named, not silently compared.
    let heldout = root().join("tests/fixtures/demo/heldout.txt");
    let base = dir.join("base.npy");
    let o = scoria(&[
        "perplexity",
        "-f",
        s(&heldout),
        "--ctx",
        "32",
        "--chunks",
        "2",
        "--device",
        "cpu",
        "--save-logits",
        s(&base),
        "--save-top-k",
        "8",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = scoria(&[
        "perplexity",
        "-f",
        s(&heldout),
        "--ctx",
        "48",
        "--chunks",
        "1",
        "--device",
        "cpu",
        "--kld-base",
        s(&base),
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("saved from another text, --ctx or tokenizer"),
        "{err}"
    );
    // --kld-max needs a base.
    let o = scoria(&["perplexity", "-f", s(&heldout), "--kld-max", "0.1"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}
