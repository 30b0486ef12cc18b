//! The mistakes of a newcomer's first hour get messages that say what to do
//! (issue 9, item 13): a directory as the model or as synth's output, an address that is
//! not this machine's, the sampling flags described in `run --help`, one range for
//! `--temp`, and `--no-think` without `--chat`.

use std::process::{Command, Output};

fn scoria(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_scoria"))
        .args(args)
        .output()
        .expect("run scoria")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("scoria-first-hour-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

#[test]
fn a_directory_as_the_model_says_so_once() {
    let dir = temp_dir("model");
    let d = dir.to_str().unwrap();
    let out = scoria(&["run", "-m", d, "-p", "hi"]);
    let e = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{e}");
    assert!(e.contains("is a directory"), "{e}");
    assert!(!e.contains("No such device"), "{e}");
    assert_eq!(e.matches(d).count(), 1, "the path once: {e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn serve_on_a_foreign_address_does_not_blame_the_port() {
    // 192.0.2.1 (TEST-NET-1) is never an address of this machine.
    let out = scoria(&["serve", "--host", "192.0.2.1", "--port", "18599"]);
    let e = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{e}");
    assert!(e.contains("cannot listen on 192.0.2.1:18599"), "{e}");
    assert!(!e.contains("another"), "{e}");
    assert!(e.contains("not an address of this machine"), "{e}");
}

#[test]
fn synth_to_a_directory_names_a_file_to_give() {
    let dir = temp_dir("synth");
    let d = dir.to_str().unwrap();
    for force in [false, true] {
        let mut args = vec!["synth", "--geometry", "tiny-qwen3moe", "-o", d];
        if force {
            args.push("--force");
        }
        let out = scoria(&args);
        let e = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{e}");
        assert!(e.contains("is a directory"), "{e}");
        assert!(!e.contains("pass --force"), "{e}");
        assert!(e.contains(".gguf"), "{e}");
    }
    assert!(dir.is_dir());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn run_help_describes_every_sampling_flag() {
    let out = scoria(&["run", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    for flag in [
        "--temp",
        "--top-k",
        "--top-p",
        "--min-p",
        "--repeat-penalty",
        "--seed",
    ] {
        let line = help
            .lines()
            .skip_while(|l| !l.trim_start().starts_with(flag))
            .take(3)
            .collect::<Vec<_>>()
            .join(" ");
        // A described flag has words after its name and value placeholder.
        let words = line
            .split_whitespace()
            .filter(|w| w.chars().all(char::is_alphabetic))
            .count();
        assert!(words >= 3, "{flag} is undescribed: {line:?}");
    }
}

#[test]
fn temp_has_the_servers_range_and_no_think_needs_chat() {
    let out = scoria(&["run", "-m", "/nonexistent.gguf", "-p", "hi", "--temp", "5"]);
    let e = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{e}");
    assert!(e.contains("--temp 5 is out of range [0, 2]"), "{e}");
    let out = scoria(&["run", "-m", "/nonexistent.gguf", "-p", "hi", "--no-think"]);
    let e = stderr(&out);
    assert!(!out.status.success());
    assert!(e.contains("--chat"), "{e}");
}
