//! Checks of the kernel sources that need no GPU (they run in every test run).

use std::path::Path;

/// Kernels are launched with programmatic stream serialization on sm_90 and later
/// (`Gpu::launch`): a kernel may then be scheduled while the one before it runs, and
/// only `sc_pdl_enter()` at its top makes it wait for that one's writes. A kernel
/// without it would race with its predecessor, so every `__global__` function must
/// call it before anything else.
#[test]
fn every_kernel_waits_for_the_one_before_it() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("kernels/") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "cu") {
            continue;
        }
        let src = std::fs::read_to_string(&path).expect("read");
        for (i, _) in src.match_indices("__global__") {
            // The body starts at the first `{` after the signature.
            let body = &src[i..];
            let open = body.find('{').expect("a kernel body");
            let first = body[open + 1..]
                .trim_start_matches(|c: char| c.is_whitespace() || c == '\\')
                .to_string();
            assert!(
                first.starts_with("sc_pdl_enter();"),
                "{}: the kernel at byte {i} does not begin with sc_pdl_enter(): {}",
                path.display(),
                &body[..open.min(160)]
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 20,
        "only {checked} kernels found in {}",
        dir.display()
    );
}
