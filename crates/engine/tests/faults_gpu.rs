//! Faults of the GPU (GPU machine only; built with `--features cuda`, run by
//! `scripts/gpu-tests.sh run` as `test-engine-faults_gpu`):
//!
//! - Another process takes nearly all the free VRAM after the engine loaded (this
//!   executable run again as a child that holds it until it is killed): every
//!   request either gives the bytes it gives without the pressure or fails with the
//!   out-of-memory message naming the remedy, on an engine whose graphs were
//!   captured before and on a fresh one that must capture its first under the
//!   pressure; the engine is never fatal, and once the child is gone every request
//!   gives its bytes again.
//! - A CUDA graph that cannot be instantiated (out of VRAM, injected through
//!   `engine::fault`): the step runs the same kernels without a graph and gives
//!   the same bits, batched steps too; the warning stands, and clears after
//!   `engine::cuda::PRESSURE_RETRY`, when graphs are captured again. Tiered, a
//!   step's first segment that cannot be instantiated gives way to the kernels one
//!   by one (same bits); a later one fails its request with the message, and the
//!   next request gives its bits.
//! - A real sticky error (`SCORIA_TEST_CUDA_FAULT`: a kernel writes to an illegal
//!   address) ends the requests with `CUDA_ERROR_ILLEGAL_ADDRESS`, and the engine
//!   reports itself failed for good and refuses every later request (in a child
//!   process: the context stays unusable).
//!
//! Without a GPU these tests print why and pass, unless `SCORIA_REQUIRE_GPU=1`.
#![cfg(feature = "cuda")]

mod common;

use common::{bits, gpu, together, Seen};
use cuda::Gpu;
use engine::fault::{inject, Fault, Rule, Site};
use engine::{Device, Engine, EngineConfig, Flow, GenerateRequest};
use model::synth::Preset;
use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What the child process does (`hog`: hold the free VRAM; `sticky`: meet a
/// sticky error).
const CHILD: &str = "SCORIA_TEST_FAULTS_GPU_CHILD";

/// The tests of this file one at a time: the child's VRAM and the injected faults
/// would reach the others' engines.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn load(path: &Path, parallel: usize, budgets: (Option<u64>, Option<u64>)) -> Engine {
    Engine::load(
        path,
        &EngineConfig {
            max_context: Some(256),
            parallel: Some(parallel),
            device: Some(Device::Cuda(0)),
            vram_budget: budgets.0,
            ram_budget: budgets.1,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The model of these tests and two prompts. A short context: with half the
/// experts' VRAM less than a resident load, the tiered load does tier them.
fn model(dir: &Path) -> std::path::PathBuf {
    common::synth_tiny(dir, model::Arch::Qwen35Moe, Preset::Q8_0, 5)
}

fn prompts() -> [Vec<u32>; 2] {
    [
        (0..20).map(|i| 100 + i * 7).collect(),
        (0..13).map(|i| 900 + i * 11).collect(),
    ]
}

const TOKENS: usize = 12;

/// A greedy request's tokens and the logits bits of each (the host sampler's path).
type Answer = (Vec<u32>, Vec<Vec<u32>>);

fn answer(eng: &mut Engine, prompt: &[u32]) -> Result<Answer, String> {
    let req = GenerateRequest::greedy(prompt.to_vec(), TOKENS);
    let mut logits = Vec::new();
    let c = eng
        .generate_with_logits(&req, &mut |_| Flow::Continue, &mut |l| logits.push(bits(l)))
        .map_err(|e| e.to_string())?;
    Ok((c.tokens, logits))
}

/// Plain greedy (the token picked on the device: the other captured step).
fn greedy(eng: &mut Engine, prompt: &[u32]) -> Result<Vec<u32>, String> {
    eng.generate(
        &GenerateRequest::greedy(prompt.to_vec(), TOKENS),
        &mut |_| Flow::Continue,
    )
    .map(|c| c.tokens)
    .map_err(|e| e.to_string())
}

/// Both prompts side by side (batched decode steps).
fn side_by_side(eng: &mut Engine) -> Vec<Result<Answer, String>> {
    let reqs: Vec<GenerateRequest> = prompts()
        .iter()
        .map(|p| GenerateRequest::greedy(p.clone(), TOKENS))
        .collect();
    together(eng, &reqs).into_iter().map(seen_answer).collect()
}

fn seen_answer(s: Seen) -> Result<Answer, String> {
    match s.done {
        Some(Ok(_)) => Ok((s.tokens, s.logits)),
        Some(Err(e)) => Err(e),
        None => Err("the request never ended".into()),
    }
}

/// The message a request that ran out of VRAM fails with (engine::cuda's
/// `cuda_err`): the cause and the remedy.
fn is_out_of_vram_message(e: &str) -> bool {
    e.contains("the GPU is out of memory: another process took VRAM") && e.contains("--vram-budget")
}

/// The message of a pinned host buffer that could not be had (the prompt cache's
/// snapshots pass through one, allocated at the first).
fn is_pinning_message(e: &str) -> bool {
    e.contains("cuMemHostAlloc")
        && e.contains("CUDA_ERROR_OUT_OF_MEMORY")
        && e.contains("--ram-budget")
}

/// Under the pressure: `got` is `want`, or an out-of-memory error. True for a
/// VRAM one (which the engine's warning must report).
fn bytes_or_oom<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: &Result<T, String>,
    want: &T,
) -> bool {
    match got {
        Ok(g) => {
            assert_eq!(g, want, "{what}: other bytes under VRAM pressure");
            false
        }
        Err(e) => {
            assert!(
                is_out_of_vram_message(e) || is_pinning_message(e),
                "{what}: failed under VRAM pressure with another error: {e}"
            );
            eprintln!("{what}: out of memory: {e}");
            is_out_of_vram_message(e)
        }
    }
}

/// This executable run again as the child `role`.
fn run_child(role: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("test executable"));
    c.args([
        "--ignored",
        "--exact",
        "child",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD, role);
    c
}

/// The child that holds the GPU's free memory; killed when dropped.
struct Hog(std::process::Child);

impl Hog {
    /// Starts it and waits until it holds the memory (its line may follow the test
    /// harness's `test child ... ` on the same line).
    fn start() -> Hog {
        let mut c = run_child("hog")
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the child");
        let out = c.stdout.take().expect("the child's stdout");
        let hog = Hog(c);
        for line in std::io::BufReader::new(out).lines() {
            let line = line.expect("the child's stdout");
            if line.contains("HOLDING ") {
                eprintln!("the child {line}");
                return hog;
            }
        }
        panic!("the child ended before it held the VRAM");
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until `gpu` sees at least `free` bytes free again (the driver releases a
/// killed process's memory shortly after it ends).
fn wait_free(gpu: &Gpu, free: u64) {
    let t0 = Instant::now();
    loop {
        let (now, _) = gpu.mem_info().expect("mem_info");
        if now >= free {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the child's VRAM was not freed ({now} bytes free, {free} before it)"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The child process: `hog` allocates the GPU's free memory, down to chunks of
/// 2 MiB, prints `HOLDING <bytes> FREE <bytes>` and waits to be killed; `sticky`
/// runs [`sticky_child`].
#[test]
#[ignore = "run by the other tests of this file as a child process"]
fn child() {
    match std::env::var(CHILD).as_deref() {
        Ok("hog") => {
            let gpu = Gpu::open(0).expect("GPU 0");
            let mut held = Vec::new();
            let mut chunk = 1usize << 30;
            while chunk >= 2 << 20 {
                match gpu.alloc::<u8>(chunk, "VRAM held by the test") {
                    Ok(b) => held.push(b),
                    Err(_) => chunk /= 2,
                }
            }
            let bytes: u64 = held.iter().map(|b| b.bytes()).sum();
            let (free, _) = gpu.mem_info().expect("mem_info");
            println!("HOLDING {bytes} FREE {free}");
            use std::io::Write;
            std::io::stdout().flush().expect("flush");
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        Ok("sticky") => sticky_child(),
        other => panic!("{CHILD} is {other:?}: run by the other tests"),
    }
}

#[test]
fn requests_under_vram_pressure_give_their_bytes_or_a_clear_error() {
    let _one = one_at_a_time();
    let Some(probe) = gpu() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model(dir.path());
    let [pa, pb] = prompts();
    // The references, from an engine that then keeps its captured graphs.
    let mut warm = load(&path, 2, (None, None));
    let want_a = answer(&mut warm, &pa).expect("a");
    let want_b = answer(&mut warm, &pb).expect("b");
    for (i, got) in side_by_side(&mut warm).into_iter().enumerate() {
        let want = if i == 0 { &want_a } else { &want_b };
        assert_eq!(&got.expect("side by side"), want, "batched = alone");
    }
    let want_greedy = greedy(&mut warm, &pa).expect("greedy");
    assert_eq!(want_greedy, want_a.0, "device argmax = host sampler");
    // An engine that has not run a step yet: its first prompt and first captures
    // come under the pressure.
    let mut fresh = load(&path, 2, (None, None));

    let (free_before, _) = probe.mem_info().expect("mem_info");
    let hog = Hog::start();
    let mut oom = [0usize; 2];
    for round in 0..2 {
        for (e, eng) in [&mut warm, &mut fresh].into_iter().enumerate() {
            let name = if e == 0 { "warm" } else { "fresh" };
            let mut n = 0;
            let mut count = |failed: bool| n += usize::from(failed);
            count(bytes_or_oom(
                &format!("{name} {round}: a"),
                &answer(eng, &pa),
                &want_a,
            ));
            count(bytes_or_oom(
                &format!("{name} {round}: b"),
                &answer(eng, &pb),
                &want_b,
            ));
            for (i, got) in side_by_side(eng).iter().enumerate() {
                let want = if i == 0 { &want_a } else { &want_b };
                count(bytes_or_oom(
                    &format!("{name} {round}: side by side {i}"),
                    got,
                    want,
                ));
            }
            count(bytes_or_oom(
                &format!("{name} {round}: device greedy"),
                &greedy(eng, &pa),
                &want_greedy,
            ));
            assert!(eng.fatal().is_none(), "{name}: {:?}", eng.fatal());
            if n > 0 {
                let w = eng
                    .standing_warning()
                    .unwrap_or_else(|| panic!("{name}: ran out of VRAM without a warning"));
                assert!(
                    w.contains("VRAM pressure") && w.contains("another process took VRAM"),
                    "{w}"
                );
            }
            oom[e] += n;
        }
    }
    eprintln!(
        "under VRAM pressure: {} request(s) of the warm engine and {} of the fresh one \
         failed with the out-of-VRAM message, the others gave their bytes or failed \
         pinning host memory; warnings: {:?} / {:?}",
        oom[0],
        oom[1],
        warm.standing_warning(),
        fresh.standing_warning()
    );

    drop(hog);
    wait_free(&probe, free_before.saturating_sub(64 << 20));
    for (name, eng) in [("warm", &mut warm), ("fresh", &mut fresh)] {
        assert_eq!(
            answer(eng, &pa).expect("a after"),
            want_a,
            "{name}: a after"
        );
        assert_eq!(
            answer(eng, &pb).expect("b after"),
            want_b,
            "{name}: b after"
        );
        for (i, got) in side_by_side(eng).into_iter().enumerate() {
            let want = if i == 0 { &want_a } else { &want_b };
            assert_eq!(
                &got.expect("side by side after"),
                want,
                "{name}: batched after"
            );
        }
        assert_eq!(greedy(eng, &pa).expect("greedy after"), want_greedy);
        assert!(eng.fatal().is_none());
    }
}

#[test]
fn graphs_without_vram_give_way_to_the_same_kernels() {
    let _one = one_at_a_time();
    if gpu().is_none() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model(dir.path());
    let [pa, pb] = prompts();
    let mut plain = load(&path, 2, (None, None));
    let want_a = answer(&mut plain, &pa).expect("a");
    let want_b = answer(&mut plain, &pb).expect("b");
    let want_greedy = greedy(&mut plain, &pa).expect("greedy");
    assert!(plain.standing_warning().is_none());

    // Every graph's instantiation fails: the steps run without graphs.
    let mut eng = load(&path, 2, (None, None));
    let rule = inject(Rule::new(
        Site::GpuGraph,
        "cuda graph",
        Fault::Errno(libc::ENOMEM),
    ));
    assert_eq!(answer(&mut eng, &pa).expect("a without graphs"), want_a);
    assert!(rule.fired() >= 1, "no graph was instantiated");
    let w = eng.standing_warning().expect("a warning");
    assert!(
        w.contains("VRAM pressure") && w.contains("cuGraphInstantiate"),
        "{w}"
    );
    assert_eq!(answer(&mut eng, &pb).expect("b without graphs"), want_b);
    for (i, got) in side_by_side(&mut eng).into_iter().enumerate() {
        let want = if i == 0 { &want_a } else { &want_b };
        assert_eq!(&got.expect("batched without graphs"), want);
    }
    assert_eq!(greedy(&mut eng, &pa).expect("greedy"), want_greedy);
    drop(rule);
    assert!(eng.fatal().is_none());
    // Once the shortage is PRESSURE_RETRY old, the warning is gone and graphs are
    // captured again (this one fails again, and its step still runs).
    std::thread::sleep(engine::cuda::PRESSURE_RETRY + Duration::from_secs(1));
    assert!(
        eng.standing_warning().is_none(),
        "the warning outlived its time"
    );
    let again =
        inject(Rule::new(Site::GpuGraph, "cuda graph", Fault::Errno(libc::ENOMEM)).times(1));
    assert_eq!(answer(&mut eng, &pa).expect("a, capturing again"), want_a);
    assert_eq!(again.fired(), 1, "no graph was captured after the pause");
    assert!(eng.standing_warning().is_some());
    drop(again);
    assert_eq!(answer(&mut eng, &pb).expect("b, paused again"), want_b);
    assert!(eng.fatal().is_none());
}

#[test]
fn tiered_segments_without_vram_give_way_or_fail_clearly() {
    let _one = one_at_a_time();
    if gpu().is_none() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model(dir.path());
    let [pa, _] = prompts();
    let used = load(&path, 1, (None, None)).device_report().vram_used;
    let budgets = common::tiering_budgets(&path, used);
    let mut plain = load(&path, 1, budgets);
    assert!(plain.expert_stats().is_some(), "the experts are not tiered");
    let want = answer(&mut plain, &pa).expect("tiered reference");
    drop(plain);

    // The first segment of the first decode step cannot be instantiated: nothing of
    // the step ran, so it runs kernel by kernel, with the same bits.
    let mut eng = load(&path, 1, budgets);
    let first =
        inject(Rule::new(Site::GpuGraph, "cuda graph", Fault::Errno(libc::ENOMEM)).times(1));
    assert_eq!(answer(&mut eng, &pa).expect("first segment"), want);
    assert_eq!(first.fired(), 1);
    assert!(eng.standing_warning().is_some());
    drop(first);
    drop(eng);

    // The second segment: the step's first one ran, so the request fails with the
    // message; the next request gives its bits.
    let mut eng = load(&path, 1, budgets);
    let second = inject(
        Rule::new(Site::GpuGraph, "cuda graph", Fault::Errno(libc::ENOMEM))
            .skip(1)
            .times(1),
    );
    let e = answer(&mut eng, &pa).expect_err("a step half run");
    assert!(is_out_of_vram_message(&e), "{e}");
    assert_eq!(second.fired(), 1);
    drop(second);
    assert!(eng.fatal().is_none());
    assert_eq!(answer(&mut eng, &pa).expect("the next request"), want);
}

#[test]
fn a_kernel_fault_is_fatal_and_the_engine_refuses_more() {
    let _one = one_at_a_time();
    if gpu().is_none() {
        return;
    }
    // The fourth step faults: the prompt and two decode steps go well first.
    let out = run_child("sticky")
        .env(engine::switches::TEST_CUDA_FAULT, "4")
        .output()
        .expect("run the child");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.contains("sticky child: done"),
        "the child failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
}

/// In the child (its context is unusable after the fault).
fn sticky_child() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = model(dir.path());
    let mut eng = load(&path, 1, (None, None));
    assert!(eng.fatal().is_none());
    let [p, _] = prompts();
    // One slot: the second request waits while the first one runs.
    let seen = together(
        &mut eng,
        &[
            GenerateRequest::greedy(p.clone(), 8),
            GenerateRequest::greedy(p.clone(), 8),
        ],
    );
    common::assert_device_lost(&mut eng, &seen, "CUDA_ERROR_ILLEGAL_ADDRESS", &p);
    let fatal = eng.fatal().unwrap_or_default().to_string();
    println!("sticky child: done ({fatal})");
}
