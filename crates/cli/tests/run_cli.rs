//! `scoria run` end to end on a tiny synthetic model: what `--dump-logits` reports and
//! writes, and the flags refused before any work (a dump path that cannot be written,
//! thread counts of 0 or thousands, a context no machine holds).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn scoria(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_scoria"))
        .args(args)
        .output()
        .expect("run scoria")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// A fresh directory and a tiny qwen3moe (Q8_0, random weights) in it.
fn tiny_model(tag: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("scoria-run-cli-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let model = dir.join("tiny.gguf");
    let out = scoria(&[
        "synth",
        "--geometry",
        "tiny-qwen3moe",
        "--quant",
        "q8_0",
        "--no-sync",
        "--force",
        "-o",
        s(&model),
    ]);
    assert!(out.status.success(), "synth failed: {}", text(&out.stderr));
    (dir, model)
}

/// The shape in a .npy header: `(rows, cols)`.
fn npy_shape(path: &Path) -> (usize, usize) {
    let b = std::fs::read(path).expect("read npy");
    assert_eq!(&b[..6], b"\x93NUMPY", "not a .npy");
    let len = u16::from_le_bytes([b[8], b[9]]) as usize;
    let header = String::from_utf8_lossy(&b[10..10 + len]).into_owned();
    let shape = header
        .split("'shape': (")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap_or_else(|| panic!("no shape in {header}"));
    let dims: Vec<usize> = shape
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.parse().expect("dim"))
        .collect();
    assert_eq!(dims.len(), 2, "{header}");
    let (rows, cols) = (dims[0], dims[1]);
    assert_eq!(b.len() - 10 - len, rows * cols * 4, "data size");
    (rows, cols)
}

#[test]
fn dump_logits_reports_the_prompt_it_evaluated_and_checks_its_path_first() {
    let (dir, model) = tiny_model("dump");
    let m = s(&model);

    // A fresh prompt of 5 tokens is evaluated (by the pass that keeps every position's
    // logits): the report says so, not `prompt: 0 tokens ..., 5 cached`.
    let npy = dir.join("logits.npy");
    let out = scoria(&[
        "run",
        "-m",
        m,
        "--prompt-ids",
        "11,22,33,44,55",
        "-n",
        "3",
        "--ignore-eos",
        "--dump-logits",
        s(&npy),
    ]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "run failed: {stderr}");
    assert!(stderr.contains("prompt: 5 tokens in "), "{stderr}");
    assert!(!stderr.contains("cached"), "{stderr}");
    assert!(stderr.contains("generation: 3 tokens"), "{stderr}");
    // 5 prompt positions + 2 generated tokens fed back (the last is never fed).
    assert_eq!(npy_shape(&npy), (7, 151_936));

    // A dump path that cannot be created is refused before the model is even loaded:
    // no generation runs, and the message names the flag and the path.
    let bad = dir.join("no-such-dir").join("logits.npy");
    let out = scoria(&[
        "run",
        "-m",
        m,
        "--prompt-ids",
        "11,22,33",
        "-n",
        "3",
        "--dump-logits",
        s(&bad),
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--dump-logits") && stderr.contains(s(&bad)),
        "{stderr}"
    );
    assert!(
        !stderr.contains("generation:") && !stderr.contains("loaded in"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn absurd_threads_and_context_are_refused_with_the_flag_named() {
    let (dir, model) = tiny_model("flags");
    let m = s(&model);
    let refused = |extra: &[&str], needle: &str| {
        let mut args = vec!["run", "-m", m, "--prompt-ids", "1,2,3", "-n", "2"];
        args.extend_from_slice(extra);
        let out = scoria(&args);
        let stderr = text(&out.stderr);
        // Exit code 1 is an error message; a panic exits with 101.
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    };
    refused(&["-t", "0"], "-t/--threads 0");
    refused(&["-t", "10000"], "-t/--threads 10000");
    refused(
        &["--max-context", "18446744073709551615"],
        "--max-context 18446744073709551615",
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}

/// `--spec ngram` and `--spec mtp` on the demo model (whose answer loops, so prompt
/// lookup drafts; its MTP head was trained): the same text as `--spec off`, and the
/// drafted and accepted counts after the speeds.
#[test]
fn speculation_keeps_the_text_and_prints_its_counts() {
    let prompt = "Repeat this code exactly:\nfn add(a: i32, b: i32) -> i32 {\n    a + b\n}\n";
    let run = |spec: &str| {
        scoria(&[
            "run",
            "--chat",
            "--no-think",
            "-p",
            prompt,
            "-n",
            "48",
            "--temp",
            "0",
            "--ignore-eos",
            "--spec",
            spec,
        ])
    };
    let off = run("off");
    assert!(off.status.success(), "{}", text(&off.stderr));
    assert!(!text(&off.stderr).contains("speculation ("));
    for mode in ["ngram", "mtp"] {
        let on = run(mode);
        assert!(on.status.success(), "{}", text(&on.stderr));
        assert_eq!(text(&off.stdout), text(&on.stdout), "--spec {mode}");
        let err = text(&on.stderr);
        let head = format!("speculation ({mode}): ");
        let line = err
            .lines()
            .find(|l| l.starts_with(&head))
            .unwrap_or_else(|| panic!("no speculation line: {err}"));
        assert!(
            line.contains(" drafted, ") && line.contains(" accepted ("),
            "{line}"
        );
        assert!(!line.starts_with(&format!("{head}0 drafted")), "{line}");
    }
}

const VISION: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/fixtures/qwen35moe-vision/"
);

/// `--image` without a vision encoder is refused with the remedy; a missing image file
/// is named.
#[test]
fn an_image_needs_a_vision_encoder() {
    let image = format!("{VISION}image.png");
    let out = scoria(&[
        "run",
        "--no-mmproj",
        "--image",
        &image,
        "-p",
        "What is this?",
        "-n",
        "2",
    ]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("--image: this model has no vision encoder: give --mmproj FILE"),
        "{err}"
    );
    let out = scoria(&["run", "--image", &image, "--prompt-ids", "1,2"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--prompt-ids"),
        "{}",
        text(&out.stderr)
    );
}

/// The demo model with its random encoder: two images then the prompt, generated
/// through.
#[test]
fn images_then_the_prompt_generate_on_the_demo_model() {
    let mmproj = format!("{VISION}mmproj-demo-f16.gguf");
    let out = scoria(&[
        "run",
        "--mmproj",
        &mmproj,
        "--image",
        &format!("{VISION}image.png"),
        "--image",
        &format!("{VISION}odd.png"),
        "-p",
        "Describe both pictures.",
        "-n",
        "8",
        "--temp",
        "0",
        "--print-ids",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!text(&out.stdout).trim().is_empty());
}
