//! Host memory: where a loaded model's memory goes (`MemoryAccount`), the check that
//! its K/V and recurrent state fit before anything is allocated (invariant 5), how
//! much this process may still take (MemAvailable, or a tighter cgroup limit), and
//! mapping the weights into memory ahead of the CPU executor's first reads.

use model::ModelConfig;
use std::path::Path;

use crate::error::EngineError;

pub(crate) const GIB: f64 = (1u64 << 30) as f64;

/// Where the memory of a loaded model goes (printed at startup).
#[derive(Debug, Clone, serde::Serialize)]
pub struct MemoryAccount {
    /// Model file, memory-mapped (pages in on use; counted once).
    pub weights_mapped: u64,
    /// Of which routed experts.
    pub expert_bytes: u64,
    /// KV cache and recurrent state at most: the context pool's positions (shared
    /// by the slots) and every slot's recurrent state.
    pub state_bytes: u64,
    /// Slots, and the positions of the context pool they share.
    pub parallel: usize,
    pub pool_positions: usize,
    /// K/V bytes of one position, and recurrent-state bytes of one slot.
    pub bytes_per_position: u64,
    pub recurrent_bytes: u64,
    /// RAM the prompt cache may hold (0: off).
    pub prompt_cache: u64,
    /// The vision encoder's weights, dequantized in RAM (0: none).
    pub vision_bytes: u64,
    /// The vision encoder's weights and scratch on the GPU (0: none).
    pub vision_vram: u64,
    /// MemAvailable when loading, if known.
    pub available: Option<u64>,
}

impl MemoryAccount {
    /// The account of `file` loaded with a context pool of `n_ctx` positions shared by
    /// `parallel` slots and a prompt cache of `prompt_cache` bytes.
    pub(crate) fn new(
        file: &gguf::GgufFile,
        mcfg: &ModelConfig,
        n_ctx: usize,
        parallel: usize,
        prompt_cache: u64,
        available: Option<u64>,
    ) -> MemoryAccount {
        let expert_bytes = file
            .tensors()
            .iter()
            .filter(|t| model::tensors::is_routed_expert(&t.name))
            .map(|t| t.size)
            .sum();
        MemoryAccount {
            weights_mapped: file.tensors().iter().map(|t| t.size).sum(),
            expert_bytes,
            state_bytes: pool_state_bytes(mcfg, n_ctx, parallel) as u64,
            parallel,
            pool_positions: n_ctx,
            bytes_per_position: mcfg.kv_bytes_per_position() as u64,
            recurrent_bytes: mcfg.recurrent_state_bytes() as u64,
            prompt_cache,
            vision_bytes: 0,
            vision_vram: 0,
            available,
        }
    }

    /// One line for the startup log: where the memory goes.
    pub fn describe(&self) -> String {
        let gib = |b: u64| b as f64 / GIB;
        format!(
            "weights {:.2} GiB memory-mapped ({:.2} GiB routed experts, {:.2} GiB dense); \
             KV + recurrent state up to {:.3} GiB ({} positions shared by {} slot(s) × {:.1} KiB, \
             + {:.1} MiB recurrent per slot); prompt cache up to {:.2} GiB{}{}",
            gib(self.weights_mapped),
            gib(self.expert_bytes),
            gib(self.weights_mapped.saturating_sub(self.expert_bytes)),
            gib(self.state_bytes),
            self.pool_positions,
            self.parallel,
            self.bytes_per_position as f64 / 1024.0,
            self.recurrent_bytes as f64 / (1u64 << 20) as f64,
            gib(self.prompt_cache),
            match (self.vision_bytes, self.vision_vram) {
                (0, _) => String::new(),
                (r, 0) => format!("; vision encoder {:.2} GiB", gib(r)),
                (r, v) => format!(
                    "; vision encoder {:.2} GiB RAM + {:.2} GiB VRAM",
                    gib(r),
                    gib(v)
                ),
            },
            self.available
                .map(|a| format!("; {:.2} GiB RAM available", gib(a)))
                .unwrap_or_default()
        )
    }
}

/// The K/V and recurrent state of a context pool of `n_ctx` positions shared by
/// `parallel` slots: the positions are one pool (the CPU's K/V grow with use),
/// recurrent state is per slot. Saturates instead of wrapping (see
/// `ModelConfig::seq_state_bytes`).
fn pool_state_bytes(mcfg: &ModelConfig, n_ctx: usize, parallel: usize) -> usize {
    mcfg.seq_state_bytes(n_ctx)
        .saturating_add(mcfg.recurrent_state_bytes().saturating_mul(parallel - 1))
}

/// Refuses a context pool of `n_ctx` positions shared by `parallel` slots whose
/// state could not be allocated, or would not fit the `available` memory, naming
/// both numbers and the remedy.
pub(crate) fn check_state(
    mcfg: &ModelConfig,
    n_ctx: usize,
    parallel: usize,
    available: Option<u64>,
) -> Result<(), EngineError> {
    let state_bytes = pool_state_bytes(mcfg, n_ctx, parallel);
    if state_bytes > isize::MAX as usize {
        // No allocation can be this large (the count saturated or nearly so).
        return Err(EngineError::Memory(format!(
            "--max-context {n_ctx} is far too large: its KV cache and recurrent state would \
             need more memory than a 64-bit address space holds; lower --max-context \
             (this model was trained for {} tokens)",
            mcfg.n_ctx_train
        )));
    }
    if let Some(avail) = available {
        if state_bytes as u64 > avail {
            return Err(EngineError::Memory(format!(
                "the KV cache and recurrent state of a context of --max-context {n_ctx} positions shared by {parallel} slot(s) need {:.2} GiB, but only {:.2} GiB of RAM is available; lower --max-context or --parallel",
                state_bytes as f64 / GIB,
                avail as f64 / GIB
            )));
        }
    }
    Ok(())
}

/// The context pool's size: `--max-context`, or (`Auto`) the longest of
/// [`context_candidates`] the memory allows, chosen for the executor that holds the
/// K/V ([`auto_context_cpu`]; [`auto_context_gpu`] over the sizes a GPU's open
/// measures). A chosen size is printed with why; an asked one is granted or refused
/// (invariant 5), never shrunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContextAsk {
    Fixed(usize),
    Auto,
}

/// The shortest context `Auto` chooses (a model trained for less gets its own).
pub const MIN_AUTO_CONTEXT: usize = 4096;
/// Below this an agent's first request (Claude Code's system prompt and tools are
/// ~19k tokens) does not fit: a shorter chosen context is a warning. It is also the
/// most `Auto` gives a model whose routed experts are tiered on a GPU, where every
/// position of K/V takes VRAM from the expert slots.
pub const AGENT_CONTEXT: usize = 32768;

/// The lengths `Auto` tries, longest first: the trained length, then the powers of
/// two below it down to [`MIN_AUTO_CONTEXT`] (the trained length alone when it is no
/// longer than that).
pub fn context_candidates(trained: usize) -> Vec<usize> {
    let trained = trained.max(16);
    let mut out = vec![trained];
    let mut c = trained.next_power_of_two();
    while c > MIN_AUTO_CONTEXT {
        c /= 2;
        if c < trained {
            out.push(c);
        }
    }
    out
}

/// `Auto` on the CPU: the trained length if the K/V and recurrent state of a pool
/// that long (the K/V grows with use, so this is the most it can take) fit in half of
/// the RAM the weights leave; else the longest candidate that does; the shortest
/// when none does (`check_state` then refuses it with the numbers). Without a
/// reading of the available memory, at most [`AGENT_CONTEXT`]. Returns the length
/// and why, for the log.
pub(crate) fn auto_context_cpu(
    mcfg: &ModelConfig,
    parallel: usize,
    available: Option<u64>,
    weights: u64,
) -> (usize, String) {
    let trained = mcfg.n_ctx_train;
    let cands = context_candidates(trained);
    let Some(avail) = available else {
        let c = cands
            .iter()
            .copied()
            .find(|&c| c <= AGENT_CONTEXT)
            .unwrap_or(cands[cands.len() - 1]);
        return (c, "the available RAM could not be read".into());
    };
    let room = avail.saturating_sub(weights) / 2;
    let need = |c: usize| pool_state_bytes(mcfg, c, parallel) as u64;
    match cands.iter().copied().find(|&c| need(c) <= room) {
        Some(c) if c == cands[0] => (c, "the model's trained length".into()),
        found => {
            let c = found.unwrap_or(cands[cands.len() - 1]);
            let why = format!(
                "the trained {trained} would take up to {:.2} GiB of K/V and state, more than half of the {:.2} GiB of RAM the weights leave",
                need(trained) as f64 / GIB,
                avail.saturating_sub(weights) as f64 / GIB
            );
            (c, why)
        }
    }
}

/// What `Auto` weighs on a GPU, where every slot holds its whole context in VRAM from
/// the start (the sizes from the executor, which knows its kernels' scratch).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct GpuFit<'a> {
    /// VRAM the executor may use.
    pub budget: u64,
    /// Slots asked for (or the default), and whether one may be taken instead.
    pub seqs: usize,
    pub slots_flexible: bool,
    /// Every weight's bytes, and the dense part's (what stays when experts are tiered).
    pub weights: u64,
    pub dense: u64,
    /// The longest prompt chunk (tokens), whose scratch `fast` means.
    pub chunk: usize,
    /// K/V and state of one sequence of context c.
    pub state: &'a dyn Fn(usize) -> u64,
    /// Scratch at context c for steps of the longest prompt chunk (`fast`) or the
    /// shortest.
    pub scratch: &'a dyn Fn(usize, bool) -> u64,
}

/// `Auto` on a GPU: the longest candidate that keeps every weight in VRAM with room
/// for the longest prompt chunks (whose scratch the executor takes when it is at most a
/// quarter of what the weights and the state leave); else the longest that keeps every
/// weight in VRAM; with the slots asked for or, when they are the executor's to
/// choose, one. When none does, the routed experts are tiered: the longest up to
/// [`AGENT_CONTEXT`] whose K/V, state and scratch take at most a quarter of what the
/// dense weights leave, the rest going to expert slots (the shortest candidate when
/// none does; the executor then refuses it with the numbers). Returns it and why.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn auto_context_gpu(trained: usize, f: &GpuFit) -> (usize, String) {
    let cands = context_candidates(trained);
    let want = |c: usize, seqs: usize, fast: bool| {
        let state = (f.state)(c).saturating_mul(seqs as u64);
        let scratch = (f.scratch)(c, fast).saturating_mul(if fast { 4 } else { 1 });
        f.weights.saturating_add(state).saturating_add(scratch)
    };
    let full = |c: usize, fast: bool| {
        want(c, f.seqs, fast) <= f.budget
            || (f.slots_flexible && f.seqs > 1 && want(c, 1, fast) <= f.budget)
    };
    let whole = [true, false].into_iter().find_map(|fast| {
        cands
            .iter()
            .copied()
            .find(|&c| full(c, fast))
            .map(|c| (c, fast))
    });
    let shortest = cands[cands.len() - 1];
    match whole {
        Some((c, _)) if c == cands[0] => (c, "the model's trained length".to_string()),
        Some((c, fast)) => {
            let room = if fast {
                format!(" with room for prompt chunks of {} tokens", f.chunk)
            } else {
                String::new()
            };
            let more = want(trained, 1, fast).saturating_sub(f.budget) as f64 / GIB;
            let why = format!(
                "the longest that keeps every weight in VRAM{room} (the trained {trained} would need {more:.2} GiB more)"
            );
            (c, why)
        }
        None => {
            let seqs = if f.slots_flexible { 1 } else { f.seqs } as u64;
            let quarter = f.budget.saturating_sub(f.dense) / 4;
            let c = cands
                .iter()
                .copied()
                .filter(|&c| c <= AGENT_CONTEXT)
                .find(|&c| {
                    (f.state)(c)
                        .saturating_mul(seqs)
                        .saturating_add((f.scratch)(c, false))
                        <= quarter
                })
                .unwrap_or(shortest);
            let why = format!(
                "the routed experts are tiered even at {shortest} positions, so at most {AGENT_CONTEXT} (or what a quarter of the VRAM beside the dense weights holds), leaving the rest to expert slots"
            );
            (c, why)
        }
    }
}

/// Logs the context a load ended with: asked for, or chosen and why; a warning when
/// a chosen one is too short for coding agents.
pub(crate) fn log_context(n_ctx: usize, trained: usize, chosen: Option<&str>, per_slot: bool) {
    let unit = if per_slot {
        "positions per slot"
    } else {
        "positions shared by the slots"
    };
    match chosen {
        None => tracing::info!("context: {n_ctx} {unit} (--max-context)"),
        Some(why) => {
            tracing::info!("context: {n_ctx} {unit}: {why}; --max-context sets it");
            if n_ctx < AGENT_CONTEXT && trained >= AGENT_CONTEXT {
                tracing::warn!(
                    "a context of {n_ctx} is too short for coding agents (their first request is ~10-20k tokens): pass --max-context {AGENT_CONTEXT} or more, with less of the model in VRAM or more memory"
                );
            }
        }
    }
}

/// Memory this process may still take: MemAvailable, or less inside a cgroup whose
/// memory limit leaves less room (`None` where neither can be read).
pub(crate) fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok();
    let avail = s.and_then(|s| {
        let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    });
    let cg = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|c| cgroup_headroom(&c, Path::new("/sys/fs/cgroup")));
    match (avail, cg) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    }
}

/// The least room (limit − usage) of the memory limits on this process's cgroup and
/// its ancestors, from `/proc/self/cgroup`'s text and the cgroup mount `root` (v2:
/// `memory.max`/`memory.current`; v1: the memory controller's `limit_in_bytes` and
/// `usage_in_bytes`); `None` when no limit is set.
fn cgroup_headroom(self_cgroup: &str, root: &Path) -> Option<u64> {
    let read = |p: &Path| -> Option<u64> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
    let mut best: Option<u64> = None;
    for line in self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, ctrl, path) = (parts.next(), parts.next()?, parts.next()?);
        let (base, max, cur) = match ctrl {
            "" => (root.to_path_buf(), "memory.max", "memory.current"),
            c if c.split(',').any(|x| x == "memory") => (
                root.join("memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            ),
            _ => continue,
        };
        let mut dir = base.join(path.trim_start_matches('/'));
        loop {
            if let (Some(m), Some(c)) = (read(&dir.join(max)), read(&dir.join(cur))) {
                // v1 reports "no limit" as a huge number; v2 as "max" (unparsed: None).
                if m < (1u64 << 60) {
                    let room = m.saturating_sub(c);
                    best = Some(best.map_or(room, |b| b.min(room)));
                }
            }
            if dir == base || !dir.pop() {
                break;
            }
        }
    }
    best
}

/// The CPU executor reads every weight from the file's mapping: when the file fits
/// in the available memory, its pages are mapped now (pieces of 64 MiB on every
/// core, with a progress bar) rather than by page faults inside the first tokens'
/// parallel loops (a fault per few pages of every expert a token reaches for the
/// first time). A file larger than memory is left to be paged in as it is read.
pub(crate) fn populate_weights(file: &gguf::GgufFile, available: Option<u64>) {
    use rayon::prelude::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    const PIECE: usize = 64 << 20;
    let size = file.file_size();
    if available.is_none_or(|a| size > a) {
        return;
    }
    let pieces: Vec<(usize, usize, usize)> = (0..file.shards().len())
        .flat_map(|k| {
            let len = file.shard_bytes(k).map_or(0, <[u8]>::len);
            (0..len)
                .step_by(PIECE)
                .map(move |at| (k, at, PIECE.min(len - at)))
        })
        .collect();
    let bar = indicatif::ProgressBar::new(size);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "mapping weights into memory {bar:30} {bytes}/{total_bytes} {bytes_per_sec}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let t0 = std::time::Instant::now();
    let done = AtomicU64::new(0);
    let outcome: std::io::Result<Vec<bool>> = pieces
        .par_iter()
        .map(|&(k, at, len)| {
            let ok = file.populate(k, at, len)?;
            bar.set_position(done.fetch_add(len as u64, Ordering::Relaxed) + len as u64);
            Ok(ok)
        })
        .collect();
    bar.finish_and_clear();
    match outcome {
        Ok(oks) if oks.iter().all(|&ok| ok) => tracing::info!(
            "mapped {:.2} GiB of weights in {:.1} s",
            size as f64 / GIB,
            t0.elapsed().as_secs_f64()
        ),
        // A system that cannot: the pages come in as they are read.
        Ok(_) => {}
        Err(e) => tracing::warn!("could not map the weights ahead of use: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::{
        auto_context_cpu, auto_context_gpu, cgroup_headroom, context_candidates, pool_state_bytes,
        GpuFit,
    };

    #[test]
    fn auto_context_tries_the_trained_length_then_powers_of_two() {
        assert_eq!(
            context_candidates(262144),
            [262144, 131072, 65536, 32768, 16384, 8192, 4096]
        );
        assert_eq!(context_candidates(40960), [40960, 32768, 16384, 8192, 4096]);
        assert_eq!(context_candidates(4096), [4096]);
        assert_eq!(context_candidates(2048), [2048]);
        assert_eq!(context_candidates(5000), [5000, 4096]);
    }

    #[test]
    fn auto_context_on_the_cpu_takes_what_half_the_ram_beside_the_weights_holds() {
        let mcfg = model::geometry::Geometry::by_name(None, "qwen3.6-35b-a3b")
            .expect("geometry")
            .config()
            .expect("config");
        assert_eq!(mcfg.n_ctx_train, 262144);
        let gib = 1u64 << 30;
        let weights = 20 * gib;
        let full = pool_state_bytes(&mcfg, 262144, 4) as u64;
        // Plenty: the trained length.
        let (c, why) = auto_context_cpu(&mcfg, 4, Some(weights + 2 * full), weights);
        assert_eq!((c, why.as_str()), (262144, "the model's trained length"));
        // A little more than half a full pool (the recurrent state does not halve):
        // the next power of two down, and why.
        let (c, why) = auto_context_cpu(&mcfg, 4, Some(weights + full + full / 8), weights);
        assert_eq!(c, 131072);
        assert!(why.contains("the trained 262144"), "{why}");
        // Nothing fits: the shortest candidate (check_state refuses it with numbers).
        assert_eq!(auto_context_cpu(&mcfg, 4, Some(weights), weights).0, 4096);
        // No reading: at most the agents' length.
        assert_eq!(auto_context_cpu(&mcfg, 4, None, weights).0, 32768);
    }

    #[test]
    fn auto_context_on_a_gpu_keeps_the_weights_in_vram_before_a_long_context() {
        // A sequence's state: 4 KiB a position (1 GiB at 262144); scratch 100 MiB
        // (for prompt chunks of 4096: 400 MiB, of which the executor wants 4× room);
        // 10 GiB of weights, 2 of them dense.
        const MIB: u64 = 1 << 20;
        let gib = 1u64 << 30;
        let state = |c: usize| c as u64 * 4096;
        let scratch = |_: usize, fast: bool| if fast { 400 * MIB } else { 100 * MIB };
        let fit = |budget: u64, seqs: usize, slots_flexible: bool| GpuFit {
            budget,
            seqs,
            slots_flexible,
            weights: 10 * gib,
            dense: 2 * gib,
            chunk: 4096,
            state: &state,
            scratch: &scratch,
        };
        // Four slots of 262144 (4 GiB) with the chunks' room (1.56 GiB) fit 16 GiB.
        let (c, why) = auto_context_gpu(262144, &fit(16 * gib, 4, true));
        assert_eq!((c, why.as_str()), (262144, "the model's trained length"));
        // 12.5 GiB: one slot of 131072 (12.06) is the longest that fits.
        let (c, why) = auto_context_gpu(262144, &fit(12 * gib + 512 * MIB, 4, true));
        assert_eq!(c, 131072);
        assert!(why.contains("with room for prompt chunks of 4096"), "{why}");
        // The four slots asked for: 32768 each (12.06).
        assert_eq!(
            auto_context_gpu(262144, &fit(12 * gib + 512 * MIB, 4, false)).0,
            32768
        );
        // No room for the chunks' scratch at any length, but one slot of 32768 fits.
        let (c, why) = auto_context_gpu(262144, &fit(10 * gib + 300 * MIB, 4, true));
        assert_eq!(c, 32768);
        assert!(!why.contains("prompt chunks"), "{why}");
        // Tiered: at most 32768, within a quarter of what the dense weights leave.
        let (c, why) = auto_context_gpu(262144, &fit(8 * gib, 4, true));
        assert_eq!(c, 32768);
        assert!(why.contains("tiered"), "{why}");
        let (c, _) = auto_context_gpu(262144, &fit(2 * gib + 800 * MIB, 4, true));
        assert_eq!(
            c, 16384,
            "a quarter of 800 MiB less 100 MiB of scratch holds 25600"
        );
        // A short trained length is taken as it is.
        assert_eq!(auto_context_gpu(2048, &fit(16 * gib, 4, true)).0, 2048);
    }

    #[test]
    fn the_tightest_limit_of_the_cgroup_and_its_ancestors_counts() {
        let d = tempfile::tempdir().expect("tempdir");
        let leaf = d.path().join("a/b");
        std::fs::create_dir_all(&leaf).expect("mkdir");
        let w = |p: &std::path::Path, name: &str, v: &str| {
            std::fs::write(p.join(name), v).expect("write")
        };
        w(&leaf, "memory.max", "max");
        w(&leaf, "memory.current", "100");
        assert_eq!(cgroup_headroom("0::/a/b\n", d.path()), None, "no limit set");
        w(&d.path().join("a"), "memory.max", "17179869184");
        w(&d.path().join("a"), "memory.current", "1073741824");
        assert_eq!(cgroup_headroom("0::/a/b\n", d.path()), Some(15 << 30));
        w(&leaf, "memory.max", "4096");
        assert_eq!(cgroup_headroom("0::/a/b\n", d.path()), Some(3996));
        // cgroup v1: the memory controller's own hierarchy.
        let v1 = d.path().join("memory/job");
        std::fs::create_dir_all(&v1).expect("mkdir");
        w(&v1, "memory.limit_in_bytes", "2000");
        w(&v1, "memory.usage_in_bytes", "500");
        assert_eq!(cgroup_headroom("4:memory:/job\n", d.path()), Some(1500));
        w(&v1, "memory.limit_in_bytes", "9223372036854771712");
        assert_eq!(
            cgroup_headroom("4:memory:/job\n", d.path()),
            None,
            "v1's 'unlimited'"
        );
    }
}
