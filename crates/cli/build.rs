//! Embeds the commit the binary is built from as `SCORIA_BUILD_COMMIT`: `git rev-parse
//! HEAD`, with `-dirty` when tracked files differ from it, or `unknown` outside a git
//! checkout. `scoria --version` prints it and `scoria bench` records it, so a binary
//! carried to another machine (no repository there) still says what it is.

use std::path::Path;
use std::process::Command;

fn git(root: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(root)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let commit = match git(&root, &["rev-parse", "HEAD"]) {
        Some(head) if !head.is_empty() => {
            let dirty = git(&root, &["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{head}-dirty")
            } else {
                head
            }
        }
        _ => "unknown".to_string(),
    };
    println!("cargo:rustc-env=SCORIA_BUILD_COMMIT={commit}");
    // Look again when HEAD moves, the index changes or a source file does.
    if let Some(dir) = git(&root, &["rev-parse", "--absolute-git-dir"]) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/index");
        if let Some(r) = git(&root, &["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={dir}/{r}");
        }
    }
    for d in ["crates", "Cargo.toml", "Cargo.lock"] {
        println!("cargo:rerun-if-changed={}", root.join(d).display());
    }
}
