//! Builds the CUDA kernels (feature `cuda` only).
//!
//! Each `kernels/*.cu` becomes one fat binary holding a cubin for every architecture in
//! `SCORIA_CUDA_ARCHS` (comma-separated compute capabilities, default [`DEFAULT_ARCHS`]:
//! the A100, RTX 30, RTX 40, H100/H200, B200 and RTX 50 generations) plus PTX for the
//! highest, so that newer GPUs JIT-compile it. The driver picks the best image when
//! the module is loaded. The fat binaries are embedded with `include_bytes!` from
//! `OUT_DIR/kernels.rs`.
//!
//! The flags keep every float operation exactly as written (docs/design.md invariant 1): no
//! contraction into FMAs (`--fmad=false`), IEEE division and square root, no
//! flush-to-zero, and no fast-math intrinsics.
//!
//! nvcc is found through `NVCC`, then `CUDA_HOME/bin/nvcc`, then `PATH`, then the prefix
//! that `scripts/install-cuda-toolchain.sh` installs into.
//!
//! With or without the feature, it also writes `OUT_DIR/sc_grids.cuh`: the codebooks of
//! the IQ1/IQ2/IQ3 types as the kernels read them, generated from the quant crate's
//! own tables (`crates/quant/src/grids.rs`, compiled into this script), so there is one
//! copy of them. The kernels include it (nvcc gets `-I OUT_DIR`), and so does the host
//! test of the block formats (`tests/host_formats.rs`, which runs with no feature).

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The quant crate's codebooks, compiled here as they are there.
#[path = "../quant/src/grids.rs"]
#[allow(dead_code)]
mod grids;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../quant/src/grids.rs");
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_CUDA");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(out.join("sc_grids.cuh"), grids_header())
        .unwrap_or_else(|e| fail(&format!("cannot write sc_grids.cuh: {e}")));
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for v in [
        "NVCC",
        "CUDA_HOME",
        "SCORIA_CUDA_ARCHS",
        "SCORIA_CUDA_PREFIX",
        "SCORIA_NVCC_FLAGS",
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let manifest =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let kdir = manifest.join("kernels");
    println!("cargo:rerun-if-changed={}", kdir.display());

    let nvcc = find_nvcc().unwrap_or_else(|| {
        fail(
            "nvcc was not found (tried $NVCC, $CUDA_HOME/bin/nvcc, PATH and the prefix of \
             scripts/install-cuda-toolchain.sh). Install it with \
             `bash scripts/install-cuda-toolchain.sh` (CUDA 13.0 from pip, no root needed), \
             or build without `--features cuda`.",
        )
    });
    let archs = archs();

    let mut sources: Vec<PathBuf> = std::fs::read_dir(&kdir)
        .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", kdir.display())))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    for entry in std::fs::read_dir(&kdir).into_iter().flatten().flatten() {
        println!("cargo:rerun-if-changed={}", entry.path().display());
    }
    if sources.is_empty() {
        fail(&format!("no kernels/*.cu in {}", kdir.display()));
    }

    // The modules compile in parallel: nvcc is single-threaded and the kernels
    // are independent translation units.
    let jobs: Vec<_> = sources
        .iter()
        .map(|src| {
            let stem = src
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or_else(|| {
                    fail(&format!("kernel file name is not UTF-8: {}", src.display()))
                })
                .to_string();
            let dst = out.join(format!("{stem}.fatbin"));
            let mut cmd = Command::new(&nvcc);
            cmd.arg("-fatbin")
                .args([
                    "-O3",
                    "-std=c++17",
                    "--fmad=false",
                    "-prec-div=true",
                    "-prec-sqrt=true",
                    "-ftz=false",
                    "-lineinfo",
                    "-Werror",
                    "all-warnings",
                ])
                .arg("-I")
                .arg(&kdir)
                .arg("-I")
                .arg(&out);
            for a in &archs {
                cmd.arg("-gencode")
                    .arg(format!("arch=compute_{a},code=sm_{a}"));
            }
            let top = archs.last().expect("at least one arch");
            cmd.arg("-gencode")
                .arg(format!("arch=compute_{top},code=compute_{top}"));
            if let Ok(extra) = env::var("SCORIA_NVCC_FLAGS") {
                cmd.args(extra.split_whitespace());
            }
            cmd.arg("-o").arg(&dst).arg(src);
            let child = cmd
                .spawn()
                .unwrap_or_else(|e| fail(&format!("cannot run {}: {e}", nvcc.display())));
            (stem, dst, child, src.clone())
        })
        .collect();

    let mut modules = Vec::new();
    for (stem, dst, child, src) in jobs {
        let output = child
            .wait_with_output()
            .unwrap_or_else(|e| fail(&format!("nvcc on {}: {e}", src.display())));
        if !output.status.success() {
            fail(&format!(
                "nvcc failed on {} ({})",
                src.display(),
                output.status
            ));
        }
        modules.push((stem, dst));
    }

    let mut rs = String::from(
        "/// The kernel modules: (file stem, fat binary with cubins and PTX).\n\
         pub(crate) static MODULES: &[(&str, &[u8])] = &[\n",
    );
    for (stem, dst) in &modules {
        rs.push_str(&format!(
            "    ({stem:?}, include_bytes!({:?})),\n",
            dst.display().to_string()
        ));
    }
    rs.push_str("];\n");
    rs.push_str(&format!(
        "/// The architectures the cubins were built for.\npub(crate) static ARCHS: &[u32] = &{archs:?};\n"
    ));
    std::fs::write(out.join("kernels.rs"), rs)
        .unwrap_or_else(|e| fail(&format!("cannot write kernels.rs: {e}")));
}

/// `sc_grids.cuh`: each codebook as an array the kernels index by row. Rows of 8 bytes
/// are two little-endian words (value i in byte i of the pair), rows of 4 bytes one.
/// `SC_TABLE` (sc_formats.cuh) makes them `__device__` data on the GPU and plain
/// constants on the host.
fn grids_header() -> String {
    let mut h = String::from(
        "// Generated by crates/cuda/build.rs from crates/quant/src/grids.rs (the quant\n\
         // crate's codebooks): do not edit. Included by sc_formats.cuh.\n#pragma once\n",
    );
    let rows8: [(&str, &[u64]); 4] = [
        ("sc_grid_iq2xxs", &grids::IQ2XXS_GRID),
        ("sc_grid_iq2xs", &grids::IQ2XS_GRID),
        ("sc_grid_iq2s", &grids::IQ2S_GRID),
        ("sc_grid_iq1s", &grids::IQ1S_GRID),
    ];
    for (name, rows) in rows8 {
        let _ = writeln!(h, "SC_TABLE uint32_t {name}[{}][2] = {{", rows.len());
        for chunk in rows.chunks(4) {
            let items: Vec<String> = chunk
                .iter()
                .map(|&r| format!("{{0x{:08x}u, 0x{:08x}u}}", r as u32, (r >> 32) as u32))
                .collect();
            let _ = writeln!(h, "  {},", items.join(", "));
        }
        h.push_str("};\n");
    }
    let rows4: [(&str, &[u32]); 2] = [
        ("sc_grid_iq3xxs", &grids::IQ3XXS_GRID),
        ("sc_grid_iq3s", &grids::IQ3S_GRID),
    ];
    for (name, rows) in rows4 {
        let _ = writeln!(h, "SC_TABLE uint32_t {name}[{}] = {{", rows.len());
        for chunk in rows.chunks(8) {
            let items: Vec<String> = chunk.iter().map(|&r| format!("0x{r:08x}u")).collect();
            let _ = writeln!(h, "  {},", items.join(", "));
        }
        h.push_str("};\n");
    }
    h
}

fn fail(msg: &str) -> ! {
    eprintln!("error: scoria-cuda: {msg}");
    panic!("scoria-cuda build failed: {msg}");
}

/// The architectures a build without `SCORIA_CUDA_ARCHS` covers: sm_80 (A100), sm_86
/// (RTX 30, A-series), sm_89 (RTX 40, L4/L40), sm_90 (H100/H200), sm_100 (B200) and
/// sm_120 (RTX 50); a GPU of the same major version and a higher minor one runs the
/// cubin of its major version, and GPUs after sm_120 JIT its PTX.
const DEFAULT_ARCHS: &str = "80,86,89,90,100,120";

/// The oldest architecture the kernels run on: the prompt GEMMs use the int8
/// tensor-core `mma.sync` shapes of sm_80.
const MIN_ARCH: u32 = 80;

/// `SCORIA_CUDA_ARCHS`, sorted ascending and deduplicated (default [`DEFAULT_ARCHS`]).
fn archs() -> Vec<u32> {
    let raw = env::var("SCORIA_CUDA_ARCHS").unwrap_or_else(|_| DEFAULT_ARCHS.to_string());
    let mut v: Vec<u32> = raw
        .split([',', ' ', ';'])
        .filter(|s| !s.is_empty())
        .map(|s| {
            let s = s
                .trim()
                .trim_start_matches("sm_")
                .trim_start_matches("compute_");
            s.parse::<u32>()
                .ok()
                .filter(|&a| (50..=200).contains(&a))
                .unwrap_or_else(|| {
                    fail(&format!(
                    "SCORIA_CUDA_ARCHS={raw:?}: `{s}` is not a compute capability such as 90 or 120"
                ))
                })
        })
        .inspect(|&a| {
            if a < MIN_ARCH {
                fail(&format!(
                    "SCORIA_CUDA_ARCHS={raw:?}: sm_{a} is older than the kernels support \
                     (sm_{MIN_ARCH}, Ampere, and newer: they use its int8 tensor-core \
                     instructions); build without `--features cuda` for that GPU's machine"
                ))
            }
        })
        .collect();
    v.sort_unstable();
    v.dedup();
    if v.is_empty() {
        fail("SCORIA_CUDA_ARCHS is empty");
    }
    v
}

fn runs(p: &Path) -> bool {
    p.is_file()
        && Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
}

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC") {
        let p = PathBuf::from(p);
        if runs(&p) {
            return Some(p);
        }
        fail(&format!(
            "NVCC={} does not run (`--version` failed)",
            p.display()
        ));
    }
    if let Some(home) = env::var_os("CUDA_HOME") {
        let p = PathBuf::from(home).join("bin").join("nvcc");
        if runs(&p) {
            return Some(p);
        }
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let p = dir.join("nvcc");
            if runs(&p) {
                return Some(p);
            }
        }
    }
    let prefix = env::var_os("SCORIA_CUDA_PREFIX")
        .map(PathBuf::from)
        .or_else(|| {
            env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/scoria/cuda-13.0"))
        })?;
    let p = prefix.join("bin").join("nvcc");
    runs(&p).then_some(p)
}
