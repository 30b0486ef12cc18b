//! The demo model: the small `qwen35moe` trained by `tools/demo-model/` and committed as
//! `models/demo.gguf`, which `scoria serve`, `run`, `bench` and `perplexity` load when no
//! model is given.
//!
//! It is found at run time, never compiled in (every executable linking this crate would
//! carry its 39 MB): first at the path the build knows (the checkout `cargo` built from,
//! so `cargo run` in a clone always has it), then at `models/demo.gguf` under the current
//! directory (an executable copied elsewhere and run from a checkout's root). The first
//! time a process uses a file its sha256 is checked (about 0.1 s), so a damaged or
//! replaced file is named instead of producing wrong text.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use sha2::{Digest, Sha256};

/// Where the demo model lives in a checkout.
pub const DEMO_MODEL_FILE: &str = "models/demo.gguf";

/// sha256 of `models/demo.gguf`. A retrained demo model changes it in the same commit
/// (with `tests/fixtures/demo/`, whose `reference.json` records the same hash).
pub const DEMO_MODEL_SHA256: &str =
    "98e707ebffa6c72b58a26d50c49afb8e2326f57ddf8f465e1c77ab823bfc4823";

/// Why the demo model cannot be used; each names the file(s) and the remedy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DemoError {
    #[error(
        "no model given, and the demo model is not here ({}); give a model with --model FILE, \
         or write the random-weight demo with `scoria synth --geometry tiny --arch qwen35moe -o FILE` \
         and give that",
        list(.tried)
    )]
    Missing { tried: Vec<PathBuf> },
    #[error("{}: cannot read the demo model: {msg}", .path.display())]
    Io { path: PathBuf, msg: String },
    #[error(
        "{} is damaged or not the demo model: its sha256 is {got}, the demo model's is {want}; \
         restore it (`git checkout -- {DEMO_MODEL_FILE}` in the checkout) or give a model with --model FILE",
        .path.display()
    )]
    Damaged {
        path: PathBuf,
        got: String,
        want: String,
    },
}

fn list(paths: &[PathBuf]) -> String {
    let names: Vec<String> = paths
        .iter()
        .map(|p| format!("{} does not exist", p.display()))
        .collect();
    names.join(", ")
}

/// The places the demo model is looked for, in order: the checkout this crate was built
/// from, then `models/demo.gguf` under the current directory (once if they are the same).
pub fn demo_model_candidates() -> Vec<PathBuf> {
    let mut out = Vec::with_capacity(2);
    if let Some(root) = Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2) {
        out.push(root.join(DEMO_MODEL_FILE));
    }
    if let Ok(cwd) = std::env::current_dir() {
        let here = cwd.join(DEMO_MODEL_FILE);
        let same = out.iter().any(|p| {
            p == &here
                || matches!(
                    (p.canonicalize(), here.canonicalize()),
                    (Ok(a), Ok(b)) if a == b
                )
        });
        if !same {
            out.push(here);
        }
    }
    out
}

/// The trained demo model's path (see the module docs), its sha256 checked the first
/// time this process uses it.
pub fn demo_model_path() -> Result<PathBuf, DemoError> {
    find_demo_model(&demo_model_candidates(), DEMO_MODEL_SHA256)
}

/// Files whose hash this process has checked and found right.
static CHECKED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// The first of `candidates` that is a file, once its sha256 is `want`.
pub fn find_demo_model(candidates: &[PathBuf], want: &str) -> Result<PathBuf, DemoError> {
    let Some(path) = candidates.iter().find(|p| p.is_file()) else {
        return Err(DemoError::Missing {
            tried: candidates.to_vec(),
        });
    };
    let path = path.canonicalize().unwrap_or_else(|_| path.clone());
    let mut checked = CHECKED.lock().unwrap_or_else(|e| e.into_inner());
    if checked.contains(&path) {
        return Ok(path);
    }
    let got = sha256_file(&path)?;
    if got != want {
        return Err(DemoError::Damaged {
            path,
            got,
            want: want.to_string(),
        });
    }
    checked.push(path.clone());
    Ok(path)
}

/// The sha256 of the file at `path`, in lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String, DemoError> {
    let io = |e: std::io::Error| DemoError::Io {
        path: path.to_path_buf(),
        msg: e.to_string(),
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("scoria-demo-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn the_checkouts_demo_model_is_found_and_whole() {
        let p = demo_model_path().expect("the demo model of this checkout");
        assert!(p.ends_with(DEMO_MODEL_FILE), "{}", p.display());
        // Checked once: the second call finds it in the list.
        assert_eq!(demo_model_path().unwrap(), p);
    }

    #[test]
    fn a_missing_demo_model_names_both_places_and_the_remedies() {
        let d = temp("missing");
        let tried = vec![d.join("a/demo.gguf"), d.join("b/demo.gguf")];
        let e = find_demo_model(&tried, DEMO_MODEL_SHA256).unwrap_err();
        let msg = e.to_string();
        for p in &tried {
            assert!(msg.contains(&p.display().to_string()), "{msg}");
        }
        assert!(msg.contains("--model FILE"), "{msg}");
        assert!(
            msg.contains("scoria synth --geometry tiny --arch qwen35moe -o FILE"),
            "{msg}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_damaged_demo_model_is_named_with_both_hashes() {
        let d = temp("damaged");
        let p = d.join("demo.gguf");
        std::fs::write(&p, b"GGUF, but cut short").unwrap();
        let got = sha256_file(&p).unwrap();
        let e = find_demo_model(std::slice::from_ref(&p), DEMO_MODEL_SHA256).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("is damaged"), "{msg}");
        assert!(
            msg.contains(&got) && msg.contains(DEMO_MODEL_SHA256),
            "{msg}"
        );
        assert!(msg.contains("git checkout -- models/demo.gguf"), "{msg}");
        // The right hash passes (and the first candidate that exists is the one used).
        let found = find_demo_model(&[d.join("absent.gguf"), p.clone()], &got).expect("right hash");
        assert_eq!(found, p.canonicalize().unwrap());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_fixture_was_made_from_this_file() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .ancestors()
            .nth(2)
            .unwrap();
        let text =
            std::fs::read_to_string(root.join("tests/fixtures/demo/reference.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["model_sha256"], DEMO_MODEL_SHA256);
    }
}
