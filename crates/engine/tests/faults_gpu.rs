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
//! - Tiered experts read from the model file (`engine::fault`, site `ExpertRead`,
//!   as `faults_disk.rs` on the CPU): a read that fails once or returns short
//!   changes no byte; one that fails again ends only the request routed to that
//!   expert, with the file, offset and cause, while the request beside it gives its
//!   bytes alone and the next one works; a read that stalls fails its request at the
//!   deadline, requests served from RAM and VRAM go on, reads resume when it comes
//!   back; a file written in place is refused from then on.
//!
//! Without a GPU these tests print why and pass, unless `SCORIA_REQUIRE_GPU=1`.
#![cfg(feature = "cuda")]

mod common;

use common::{bits, fault_requests, gate_reads, gpu, only_a_failed, solo, together, Seen};
use cuda::Gpu;
use engine::experts::{ExpertIndex, RoutingProfile};
use engine::fault::{inject, Fault, Rule, Site};
use engine::{Device, Engine, EngineConfig, Flow, GenerateRequest};
use model::synth::Preset;
use model::tensors::ExpertMatrix;
use std::io::BufRead;
use std::path::{Path, PathBuf};
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

// ---------------------------------------------------------------------------------
// Tiered experts read from the model file on the GPU: faults injected through
// `engine::fault` (site `ExpertRead`) into the real reads, as `faults_disk.rs` does
// on the CPU.

/// How long a step waits for an expert read in these tests.
const READ_DEADLINE: Duration = Duration::from_millis(500);

/// The model, an expert A routes to and B never does, B's routing profile and the
/// RAM that holds exactly B's experts, the VRAM budget that tiers the experts, and
/// A's and B's answers alone on a clean tiered engine.
struct DiskSetup {
    _dir: tempfile::TempDir,
    path: PathBuf,
    index: ExpertIndex,
    fault: (usize, usize),
    b_profile: PathBuf,
    b_bytes: u64,
    vram: u64,
    refs: Vec<Answer>,
}

/// A tiered engine of two slots: VRAM `vram`, RAM `ram` (with B's profile when
/// given), reads waiting [`READ_DEADLINE`].
fn load_tiered(path: &Path, vram: u64, ram: u64, profile: Option<&Path>) -> Engine {
    Engine::load(
        path,
        &EngineConfig {
            max_context: Some(256),
            parallel: Some(2),
            device: Some(Device::Cuda(0)),
            prompt_cache: Some(0),
            vram_budget: Some(vram),
            ram_budget: Some(ram),
            expert_profile: profile.map(Path::to_path_buf),
            expert_read_deadline: Some(READ_DEADLINE),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn disk_setup() -> DiskSetup {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(dir.path(), model::Arch::Qwen35Moe, Preset::Q8_0, 11);
    let reqs = fault_requests();
    // The routing of each request alone, recorded on the CPU (the GPU routes alike).
    let routed = |req: &GenerateRequest| {
        let mut e = Engine::load(
            &path,
            &EngineConfig {
                max_context: Some(256),
                parallel: Some(1),
                device: Some(Device::Cpu),
                prompt_cache: Some(0),
                record_routing: true,
                ..Default::default()
            },
        )
        .expect("load on the CPU");
        solo(&mut e, req);
        let counts = e.routing_counts().expect("recording");
        let p = RoutingProfile::from_counts("test", e.config(), counts).expect("profile");
        (p, counts.snapshot())
    };
    let (_, a) = routed(&reqs[0]);
    let (b_profile, b) = routed(&reqs[1]);
    let fault = (0..a.len())
        .flat_map(|l| (0..a[l].len()).map(move |e| (l, e)))
        .find(|&(l, e)| a[l][e] > 0 && b[l][e] == 0)
        .expect("an expert A routes to and B does not (make B shorter)");
    let file = gguf::GgufFile::open(&path).expect("open");
    let cfg = model::ModelConfig::from_gguf(&file).expect("config");
    let index = ExpertIndex::build(&file, &cfg).expect("index");
    let b_bytes = (0..b.len())
        .map(|l| b[l].iter().filter(|&&n| n > 0).count() as u64 * index.expert_bytes(l).expect("l"))
        .sum();
    let profile_path = dir.path().join("b.profile.json");
    b_profile.save(&profile_path).expect("save");
    let used = load(&path, 2, (None, None)).device_report().vram_used;
    let vram = common::tiering_budgets(&path, used)
        .0
        .expect("a VRAM budget");
    // The references: each request alone on a clean tiered engine, every expert
    // outside the slots read from the file.
    let mut eng = load_tiered(&path, vram, 0, None);
    assert!(eng.expert_stats().is_some(), "the experts are not tiered");
    let refs = reqs.iter().map(|r| solo(&mut eng, r)).collect();
    assert!(eng.expert_stats().expect("tiered").disk_misses > 0);
    DiskSetup {
        _dir: dir,
        path,
        index,
        fault,
        b_profile: profile_path,
        b_bytes,
        vram,
        refs,
    }
}

impl DiskSetup {
    fn fault_rule(&self, fault: Fault) -> Rule {
        let (l, e) = self.fault;
        Rule::new(Site::ExpertRead, self.path.to_string_lossy(), fault).at(gate_reads(
            &self.index,
            l,
            e,
        ))
    }

    /// A and B side by side: both give their answers alone.
    fn both_work(&self, seen: &[Seen]) {
        for (i, s) in seen.iter().enumerate() {
            assert!(
                matches!(s.done, Some(Ok(_))),
                "request {i}: {:?}",
                s.done.as_ref().map(|r| r.as_ref().err())
            );
            assert_eq!(
                (s.tokens.clone(), s.logits.clone()),
                self.refs[i],
                "request {i}"
            );
        }
    }

    /// A alone gives its answer again.
    fn a_works(&self, eng: &mut Engine) {
        assert_eq!(solo(eng, &fault_requests()[0]), self.refs[0], "A after");
    }
}

#[test]
fn an_expert_read_failing_once_or_short_changes_nothing_on_the_gpu() {
    let _one = one_at_a_time();
    if gpu().is_none() {
        return;
    }
    let s = disk_setup();
    let mut eng = load_tiered(&s.path, s.vram, 0, None);
    let short = inject(Rule::new(
        Site::ExpertRead,
        s.path.to_string_lossy(),
        Fault::Short(4096),
    ));
    let once = inject(s.fault_rule(Fault::Errno(libc::EIO)).times(1));
    let seen = together(&mut eng, &fault_requests());
    assert!(short.fired() > 0, "no read went to the file");
    assert_eq!(once.fired(), 1, "the faulty expert was not read");
    s.both_work(&seen);
    let c = eng.expert_reads().expect("reads");
    assert_eq!((c.retries, c.failed), (1, 0), "{c:?}");
    assert!(eng.standing_fault().is_none());
    assert!(eng.fatal().is_none());
}

#[test]
fn an_expert_read_failing_again_ends_only_its_request_on_the_gpu() {
    let _one = one_at_a_time();
    if gpu().is_none() {
        return;
    }
    let s = disk_setup();
    // Nothing in RAM: B's experts are read from the file too, in the same steps.
    let mut eng = load_tiered(&s.path, s.vram, 0, None);
    {
        let _f = inject(s.fault_rule(Fault::Errno(libc::EIO)));
        let seen = together(&mut eng, &fault_requests());
        let gate = s
            .index
            .matrix(s.fault.0, s.fault.1, ExpertMatrix::Gate)
            .expect("gate");
        only_a_failed(
            &seen,
            &s.refs,
            &[
                "read expert",
                &s.path.to_string_lossy(),
                &format!("layer {} expert {}", s.fault.0, s.fault.1),
                &format!("at offset {}", gate.offset),
                "Input/output error",
                "again when retried",
            ],
        );
        // Still failing: the next request needing it fails the same way, B works.
        let seen = together(&mut eng, &fault_requests());
        only_a_failed(&seen, &s.refs, &["Input/output error"]);
        let c = eng.expert_reads().expect("reads");
        assert!(c.failed >= 2 && c.retries >= 2, "{c:?}");
        assert!(eng.fatal().is_none());
    }
    // The fault gone, A works again (its slot started over, and no VRAM slot holds
    // bytes of the expert that did not arrive).
    s.a_works(&mut eng);
    let seen = together(&mut eng, &fault_requests());
    s.both_work(&seen);
    assert!(eng.standing_fault().is_none());
}

#[test]
fn a_stalled_expert_read_on_the_gpu_fails_its_request_at_the_deadline_and_the_others_go_on() {
    let _one = one_at_a_time();
    if gpu().is_none() {
        return;
    }
    let s = disk_setup();
    // B's experts in the pinned RAM copy (and the first slots): B never waits for
    // the disk.
    let mut eng = load_tiered(&s.path, s.vram, s.b_bytes, Some(&s.b_profile));
    let stall = Duration::from_secs(4);
    let f = inject(s.fault_rule(Fault::Stall(stall)).times(1));
    let t0 = Instant::now();
    let seen = together(&mut eng, &fault_requests());
    assert!(
        t0.elapsed() < stall,
        "the step waited for the stalled read: {:?}",
        t0.elapsed()
    );
    only_a_failed(
        &seen,
        &s.refs,
        &[
            &s.path.to_string_lossy(),
            "no answer within the 0.5 s deadline",
        ],
    );
    assert_eq!(f.fired(), 1);
    // While the read is out: the engine says so, and requests needing the disk fail
    // fast while B, served from RAM and VRAM, works.
    let fault = eng.standing_fault().expect("a read is out");
    assert!(fault.contains("has not come back for"), "{fault}");
    let seen = together(&mut eng, &fault_requests());
    only_a_failed(&seen, &s.refs, &["has not come back for"]);
    // Once it is back, everything works again.
    while eng.standing_fault().is_some() {
        assert!(t0.elapsed() < stall * 3, "the stalled read never came back");
        std::thread::sleep(Duration::from_millis(50));
    }
    s.a_works(&mut eng);
    let c = eng.expert_reads().expect("reads");
    assert_eq!(c.stalls, 1, "{c:?}");
    assert!(eng.fatal().is_none());
}

#[test]
fn a_model_file_written_in_place_is_never_served_on_the_gpu() {
    let _one = one_at_a_time();
    if gpu().is_none() {
        return;
    }
    let s = disk_setup();
    let mut eng = load_tiered(&s.path, s.vram, s.b_bytes, Some(&s.b_profile));
    // Written in place (grown by a few bytes): A's experts from the file are refused.
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&s.path)
        .expect("open");
    f.write_all(&[0; 16]).expect("append");
    drop(f);
    let seen = together(&mut eng, &fault_requests());
    only_a_failed(
        &seen,
        &s.refs,
        &[
            &s.path.to_string_lossy(),
            "the model file changed while scoria was serving it",
            "restart scoria",
        ],
    );
    let fault = eng.standing_fault().expect("standing");
    assert!(
        fault.contains("changed while scoria was serving it"),
        "{fault}"
    );
    // B, served from RAM and VRAM, still works; A keeps failing (a restart is the
    // remedy).
    let seen = together(&mut eng, &fault_requests());
    only_a_failed(&seen, &s.refs, &["changed while scoria was serving it"]);
    assert!(eng.fatal().is_none());
}
