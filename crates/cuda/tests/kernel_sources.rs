//! Checks of the kernel sources that need no GPU (they run in every test run).

use std::path::Path;

/// Kernels are launched with programmatic stream serialization on sm_90 and later
/// (`Gpu::launch`): a kernel may then be scheduled while the one before it runs, and
/// only `sc_pdl_enter()` makes it wait for that one's writes. A kernel that touched
/// memory before it would race with its predecessor, so every `__global__` function
/// calls it first; before it a kernel may only compute indices (no memory access:
/// no `[`), ask L2 for weight rows (`sc_prefetch_l2`) and load weight rows into
/// registers (`router_row_load`), weights being memory no kernel writes.
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
            let open = body.find('{').expect("a kernel body") + 1;
            let next = body[open..]
                .find("__global__")
                .map_or(body.len(), |n| open + n);
            let wait = body[open..next].find("sc_pdl_enter();").unwrap_or_else(|| {
                panic!(
                    "{}: the kernel at byte {i} never calls sc_pdl_enter(): {}",
                    path.display(),
                    &body[..open.min(160)]
                )
            });
            let before = &body[open..open + wait];
            let stripped: String = before
                .lines()
                .map(|l| {
                    l.split("//")
                        .next()
                        .unwrap_or("")
                        .split("/*")
                        .next()
                        .unwrap_or("")
                })
                .collect();
            assert!(
                !stripped.contains('['),
                "{}: the kernel at byte {i} reads or writes memory before sc_pdl_enter(): {}",
                path.display(),
                before
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
