//! Routing locality: how well VRAM slots holding a fraction (a third by default) of a
//! model's routed experts serve its decode tokens, for the model's own routing against
//! uniformly random routing of the same geometry, under the expert store's policy
//! (recency plus frequency, `engine::experts::ExpertStore`) and under a static set of the
//! most used experts that never changes (what placing experts with llama.cpp's `-ot`
//! approximates).
//!
//! ```text
//! cargo run --release -p scoria-engine --example routing_locality -- \
//!     [--model FILE.gguf] [--profile PROFILE.txt] [--text TEXT.txt] [--fraction 0.3333] \
//!     [--seed 1] [--grid]
//! ```
//!
//! Defaults: the demo model, the profile recorded over README.md and the replay over
//! tests/fixtures/demo/heldout.txt. The profile is what `scoria profile -m FILE
//! --prompt-file PROFILE.txt` records (`engine::record_profile`); the replayed routing is
//! the model's own, recorded token by token on the CPU over `--text`, then fed to the
//! store one token per step (a decode step each), every layer in turn. Every expert is in
//! the RAM copy, so a miss is one expert's bytes copied into a slot (or computed by the
//! CPU); the table gives the share of routes that hit a slot and the miss bytes per token.
//! The random rows replay uniformly random top-k routes (`--seed`) over as many tokens,
//! their profile another random sequence of that length. Two policies frame the store's:
//! least recently used, and Belady's (evict the expert used again furthest in the future:
//! the most any policy could hit, knowing the future). `--grid` adds the store's score
//! (recency plus a weight times a decayed use count) over a grid of weights and
//! half-lives, replayed by a mirror of its rule (`engine::experts::FREQ_WEIGHT` and
//! `HALF_LIFE` are the store's own), on the learned routing.

use std::path::{Path, PathBuf};

use engine::experts::{plan, ExpertIndex, ExpertStore, PlanRequest, RoutingProfile};
use engine::{Device, Engine, EngineConfig, Flow, GenerateRequest, ProfileInput};
use gguf::GgufFile;
use model::ModelConfig;
use rand::{Rng, SeedableRng};

struct Args {
    model: Option<PathBuf>,
    profile: PathBuf,
    text: PathBuf,
    fraction: f64,
    seed: u64,
    grid: bool,
}

fn root() -> PathBuf {
    let r = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    r.canonicalize().unwrap_or(r)
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        model: None,
        profile: root().join("README.md"),
        text: root().join("tests/fixtures/demo/heldout.txt"),
        fraction: 1.0 / 3.0,
        seed: 1,
        grid: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = Some(PathBuf::from(value()?)),
            "--profile" => a.profile = PathBuf::from(value()?),
            "--text" => a.text = PathBuf::from(value()?),
            "--fraction" => {
                a.fraction = value()?.parse().map_err(|e| format!("--fraction: {e}"))?
            }
            "--seed" => a.seed = value()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--grid" => a.grid = true,
            _ => {
                return Err(format!(
                "unknown argument {flag} (--model, --profile, --text, --fraction, --seed, --grid)"
            ))
            }
        }
    }
    if !(a.fraction > 0.0 && a.fraction <= 1.0) {
        return Err(format!("--fraction {}: give a share in (0, 1]", a.fraction));
    }
    Ok(a)
}

/// The model's routing over `text`, token by token: per layer, top-k experts per token.
fn trace(path: &Path, text: &str) -> Result<(Vec<Vec<u32>>, usize), String> {
    let mut eng = Engine::load(
        path,
        &EngineConfig {
            max_context: Some(text.len() + 16),
            parallel: Some(1),
            prompt_cache: Some(0),
            device: Some(Device::Cpu),
            record_routing: true,
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let tokens = eng
        .tokenizer()
        .encode(text, true)
        .map_err(|e| e.to_string())?;
    let rc = eng.routing_counts().ok_or("no routing recorder")?;
    rc.start_trace();
    // The prompt pass only: one token is chosen from its last logits and never fed.
    eng.generate(&GenerateRequest::greedy(tokens.clone(), 1), &mut |_| {
        Flow::Continue
    })
    .map_err(|e| e.to_string())?;
    let t = eng
        .routing_counts()
        .ok_or("no routing recorder")?
        .take_trace();
    Ok((t, tokens.len()))
}

/// Uniformly random routing: `k` distinct experts of `n` per token and layer.
fn random_trace(n_layer: usize, n: usize, k: usize, tokens: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n_layer)
        .map(|_| {
            let mut out = Vec::with_capacity(tokens * k);
            for _ in 0..tokens {
                let mut pick: Vec<u32> = Vec::with_capacity(k);
                while pick.len() < k {
                    let e = rng.random_range(0..n as u32);
                    if !pick.contains(&e) {
                        pick.push(e);
                    }
                }
                out.extend(pick);
            }
            out
        })
        .collect()
}

/// A profile with the counts of `trace`.
fn profile_of(trace: &[Vec<u32>], cfg: &ModelConfig, name: &str) -> RoutingProfile {
    let n = cfg.n_expert;
    let counts: Vec<Vec<u64>> = trace
        .iter()
        .map(|l| {
            let mut c = vec![0u64; n];
            for &e in l {
                c[e as usize] += 1;
            }
            c
        })
        .collect();
    RoutingProfile {
        model: name.to_string(),
        arch: cfg.arch.name().to_string(),
        n_layer: cfg.n_layer,
        n_expert: n,
        top_k: cfg.n_expert_used,
        tokens: (trace[0].len() / cfg.n_expert_used) as u64,
        counts,
    }
}

/// Hit rate and miss bytes per token.
struct Outcome {
    hit_rate: f64,
    bytes_per_token: f64,
}

/// Replays `trace` one token per step through an expert store with `plan`'s slots
/// (warmed from the profile's most used experts when `warm`).
fn replay_store(
    index: &ExpertIndex,
    p: &engine::experts::Plan,
    trace: &[Vec<u32>],
    k: usize,
    warm: bool,
) -> Outcome {
    let mut store = ExpertStore::new(index.clone(), p.clone());
    if warm {
        store.warm(&p.resident_order);
    }
    let tokens = trace[0].len() / k;
    for t in 0..tokens {
        for (l, routes) in trace.iter().enumerate() {
            store
                .step(l, &routes[t * k..(t + 1) * k], &|_| 0)
                .expect("a decode step fits the slots");
        }
    }
    let s = store.stats();
    Outcome {
        hit_rate: s.hit_rate(),
        bytes_per_token: (s.ram_bytes + s.disk_bytes) as f64 / tokens as f64,
    }
}

/// Replays `trace` against fixed slots: each layer's `slots` most used experts of
/// `counts`, never evicted.
fn replay_static(
    p: &engine::experts::Plan,
    counts: &[Vec<u64>],
    trace: &[Vec<u32>],
    k: usize,
) -> Outcome {
    let (mut hits, mut uses, mut bytes) = (0u64, 0u64, 0u64);
    for (l, routes) in trace.iter().enumerate() {
        let lp = &p.layers[l];
        let mut order: Vec<usize> = (0..counts[l].len()).collect();
        order.sort_by(|&a, &b| counts[l][b].cmp(&counts[l][a]).then(a.cmp(&b)));
        let mut held = vec![false; counts[l].len()];
        for &e in order.iter().take(lp.slots) {
            held[e] = true;
        }
        for &e in routes {
            uses += 1;
            if held[e as usize] {
                hits += 1;
            } else {
                bytes += lp.expert_bytes;
            }
        }
    }
    let tokens = trace[0].len() / k;
    Outcome {
        hit_rate: hits as f64 / uses as f64,
        bytes_per_token: bytes as f64 / tokens as f64,
    }
}

/// Policies replayed by [`replay_simple`] for comparison with the store's.
#[derive(Clone, Copy)]
enum Simple {
    /// Evict the least recently used expert.
    Lru,
    /// Evict the expert used again furthest in the future (the best possible).
    Belady,
    /// The store's rule: evict the lowest last use + `weight` × a use count that halves
    /// every `half_life` steps (a mirror of `ExpertStore`, to try other constants).
    Score { weight: f64, half_life: f64 },
}

/// Replays `trace` against each layer's `p` slots under `policy`; a token's own experts
/// are never evicted for one another.
fn replay_simple(
    p: &engine::experts::Plan,
    trace: &[Vec<u32>],
    k: usize,
    policy: Simple,
) -> Outcome {
    let (mut hits, mut uses, mut bytes) = (0u64, 0u64, 0u64);
    let tokens = trace[0].len() / k;
    for (l, routes) in trace.iter().enumerate() {
        let lp = &p.layers[l];
        let n = p.n_expert;
        // next[t * k + r]: the next token after t that routes to that expert again.
        let mut next = vec![usize::MAX; routes.len()];
        let mut seen = vec![usize::MAX; n];
        for t in (0..tokens).rev() {
            for r in 0..k {
                next[t * k + r] = seen[routes[t * k + r] as usize];
            }
            for r in 0..k {
                seen[routes[t * k + r] as usize] = t;
            }
        }
        let mut held = vec![false; n];
        let mut n_held = 0;
        // Per expert: last use, next use, decayed use count and when it was decayed.
        let (mut last, mut next_use) = (vec![0usize; n], vec![0usize; n]);
        let (mut count, mut at) = (vec![0f64; n], vec![0usize; n]);
        for t in 0..tokens {
            let step = t + 1;
            let decayed = |c: f64, a: usize, half_life: f64| {
                c * (-((step - a) as f64 / half_life) * std::f64::consts::LN_2).exp()
            };
            let now = &routes[t * k..(t + 1) * k];
            let mut misses = Vec::new();
            for (r, &e) in now.iter().enumerate() {
                let e = e as usize;
                uses += 1;
                if held[e] {
                    hits += 1;
                    if let Simple::Score { half_life, .. } = policy {
                        count[e] = decayed(count[e], at[e], half_life) + 1.0;
                        at[e] = step;
                    }
                } else {
                    misses.push(e);
                }
                last[e] = step;
                next_use[e] = next[t * k + r];
            }
            for e in misses {
                bytes += lp.expert_bytes;
                if n_held == lp.slots {
                    let candidates = (0..n).filter(|&v| held[v] && !now.contains(&(v as u32)));
                    let victim = match policy {
                        Simple::Lru => candidates.min_by_key(|&v| last[v]),
                        Simple::Belady => candidates.max_by_key(|&v| next_use[v]),
                        Simple::Score { weight, half_life } => candidates.min_by(|&a, &b| {
                            let s = |v: usize| {
                                last[v] as f64 + weight * decayed(count[v], at[v], half_life)
                            };
                            s(a).total_cmp(&s(b))
                        }),
                    };
                    if let Some(v) = victim {
                        held[v] = false;
                        n_held -= 1;
                    }
                }
                held[e] = true;
                n_held += 1;
                count[e] = 1.0;
                at[e] = step;
            }
        }
    }
    Outcome {
        hit_rate: hits as f64 / uses as f64,
        bytes_per_token: bytes as f64 / tokens as f64,
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("routing_locality: error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let a = args()?;
    let model = match &a.model {
        Some(m) => m.clone(),
        None => model::synth::demo_model_path().map_err(|e| e.to_string())?,
    };
    let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()));
    let file = GgufFile::open(&model).map_err(|e| e.to_string())?;
    let cfg = ModelConfig::from_gguf(&file).map_err(|e| e.to_string())?;
    let index = ExpertIndex::build(&file, &cfg).map_err(|e| e.to_string())?;
    let (n, k, n_layer) = (cfg.n_expert, cfg.n_expert_used, cfg.n_layer);

    let profile = engine::record_profile(&model, &ProfileInput::Text(read(&a.profile)?), 0)
        .map_err(|e| e.to_string())?
        .profile;
    let (learned, tokens) = trace(&model, &read(&a.text)?)?;
    let random = random_trace(n_layer, n, k, tokens, a.seed);
    let random_profile = profile_of(
        &random_trace(n_layer, n, k, profile.tokens as usize, a.seed ^ 0x9E37),
        &cfg,
        "random",
    );

    let bytes = index.trunk_expert_bytes();
    let all: u64 = bytes.iter().sum::<u64>() * n as u64;
    let vram = (all as f64 * a.fraction) as u64;
    let req = PlanRequest {
        expert_bytes: bytes.clone(),
        n_expert: n,
        top_k: k,
        vram_budget: vram,
        ram_budget: all,
        mem_available: None,
    };
    let even = plan(&req, None).map_err(|e| e.to_string())?;
    let by_learned = plan(&req, Some(&profile)).map_err(|e| e.to_string())?;
    let by_random = plan(&req, Some(&random_profile)).map_err(|e| e.to_string())?;
    let slots = |p: &engine::experts::Plan| {
        p.layers
            .iter()
            .map(|l| l.slots.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!(
        "model {} ({} layers, {} experts top-{k}, {} bytes per expert); VRAM slots for {:.1}% of the experts ({} of {}): per layer even {} / by profile {}",
        model.display(),
        n_layer,
        n,
        bytes[0],
        100.0 * a.fraction,
        even.n_slots(),
        n * n_layer,
        slots(&even),
        slots(&by_learned),
    );
    println!(
        "profile: {} tokens of {}; replay: {tokens} tokens of {} (every miss: {:.1} KB per token)",
        profile.tokens,
        a.profile.display(),
        a.text.display(),
        (k as u64 * bytes.iter().sum::<u64>()) as f64 / 1e3,
    );
    println!();
    println!("| routing | policy | slots per layer | hit rate | miss KB per token |");
    println!("|---|---|---|---:|---:|");
    let row = |routing: &str, policy: &str, p: &engine::experts::Plan, o: Outcome| {
        println!(
            "| {routing} | {policy} | {} | {:.1}% | {:.1} |",
            slots(p),
            100.0 * o.hit_rate,
            o.bytes_per_token / 1e3
        );
    };
    let oracle = profile_of(&learned, &cfg, "oracle");
    let random_oracle = profile_of(&random, &cfg, "oracle");
    for (name, tr, prof, by_prof, own) in [
        ("learned", &learned, &profile, &by_learned, &oracle),
        (
            "random",
            &random,
            &random_profile,
            &by_random,
            &random_oracle,
        ),
    ] {
        row(
            name,
            "recency+frequency, cold",
            &even,
            replay_store(&index, &even, tr, k, false),
        );
        row(
            name,
            "recency only (LRU), cold",
            &even,
            replay_simple(&even, tr, k, Simple::Lru),
        );
        row(
            name,
            "recency+frequency, slots by profile, warmed from it",
            by_prof,
            replay_store(&index, by_prof, tr, k, true),
        );
        row(
            name,
            "static: the profile's most used, never evicted",
            by_prof,
            replay_static(by_prof, &prof.counts, tr, k),
        );
        row(
            name,
            "static: the replayed text's own most used (oracle)",
            by_prof,
            replay_static(by_prof, &own.counts, tr, k),
        );
        row(
            name,
            "optimal (Belady: knows the future), cold",
            &even,
            replay_simple(&even, tr, k, Simple::Belady),
        );
    }
    if a.grid {
        println!();
        println!(
            "The store's score on the learned routing, by weight and half-life (the store: weight {}, half-life {} steps):",
            engine::experts::FREQ_WEIGHT,
            engine::experts::HALF_LIFE
        );
        println!();
        let lives = [8.0, 32.0, 64.0, 256.0, f64::INFINITY];
        println!(
            "| weight | {} |",
            lives.map(|h| format!("half-life {h}")).join(" | ")
        );
        println!("|---:|{}", "---:|".repeat(lives.len()));
        for weight in [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0] {
            let cells: Vec<String> = lives
                .iter()
                .map(|&half_life| {
                    let o = replay_simple(&even, &learned, k, Simple::Score { weight, half_life });
                    format!("{:.1}%", 100.0 * o.hit_rate)
                })
                .collect();
            println!("| {weight} | {} |", cells.join(" | "));
        }
    }
    Ok(())
}
