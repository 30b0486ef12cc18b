//! Faults of the disk tier, injected through `engine::fault` (site `ExpertRead`) into
//! real reads of a real model file:
//! - a read that fails (`EIO`), returns short, or hits the end of the file; a read
//!   that stalls past the deadline; a file written to, deleted or replaced under the
//!   reader — each with its message, and what still works;
//! - the same faults under a running engine with tiered experts on the CPU: the
//!   request that needed the expert ends with an error naming the file, the offset
//!   and the cause, the request beside it goes on with the bytes it gets alone, and
//!   the next request works.

mod common;

use common::{fault_requests, gate_reads, only_a_failed, solo, together, Bits};
use engine::experts::{
    AlignedBuf, ExpertIndex, ExpertReader, ReadError, ReadPolicy, ReaderOptions, RoutingProfile,
};
use engine::fault::{inject, Fault, Rule, Site};
use engine::{Device, Engine, EngineConfig, GenerateRequest};
use gguf::GgufFile;
use model::synth::Preset;
use model::tensors::ExpertMatrix;
use model::{Arch, ModelConfig};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_millis(500);

fn open(path: &Path) -> (Arc<GgufFile>, ModelConfig, ExpertIndex) {
    let file = Arc::new(GgufFile::open(path).expect("open"));
    let cfg = ModelConfig::from_gguf(&file).expect("config");
    let index = ExpertIndex::build(&file, &cfg).expect("index");
    (file, cfg, index)
}

fn reader(index: &ExpertIndex) -> ExpertReader<AlignedBuf> {
    reader_with(index, ReaderOptions::default())
}

fn reader_with(index: &ExpertIndex, opts: ReaderOptions) -> ExpertReader<AlignedBuf> {
    let policy = ReadPolicy {
        reader: opts,
        deadline: DEADLINE,
    };
    ExpertReader::open(index, policy, |n| Ok(AlignedBuf::zeroed(n))).expect("reader")
}

/// Every way of reading: io_uring or pread, O_DIRECT or buffered.
fn modes() -> Vec<ReaderOptions> {
    let mut v = Vec::new();
    for io_uring in [true, false] {
        for direct in [true, false] {
            v.push(ReaderOptions {
                io_uring,
                direct,
                ..Default::default()
            });
        }
    }
    v
}

/// Expert `e` of layer `l` as the mapped file holds it.
fn want(file: &GgufFile, index: &ExpertIndex, l: usize, e: usize) -> Vec<Vec<u8>> {
    index
        .expert(l, e)
        .expect("expert")
        .iter()
        .map(|m| {
            file.shard_bytes(m.shard).expect("shard")
                [m.offset as usize..(m.offset + m.len) as usize]
                .to_vec()
        })
        .collect()
}

/// One expert's gate, up and down bytes, or why it could not be read.
type Expert = Result<Vec<Vec<u8>>, String>;

/// Reads `experts` of layer `l`: each one's bytes, or its error's message.
fn read(
    r: &mut ExpertReader<AlignedBuf>,
    l: usize,
    experts: &[u32],
) -> Result<Vec<Expert>, ReadError> {
    let f = r.read(l, experts)?;
    let out = (0..experts.len())
        .map(|i| {
            f.expert(i)
                .map(|m| m.iter().map(|b| b.to_vec()).collect())
                .map_err(|e| e.to_string())
        })
        .collect();
    r.recycle(f.into_buf());
    Ok(out)
}

fn tiny(dir: &Path, arch: Arch) -> PathBuf {
    common::synth_tiny(dir, arch, Preset::Q8_0, 11)
}

#[test]
fn a_failed_read_is_retried_once_and_names_the_file_offset_and_cause() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), Arch::Qwen3Moe);
    let (file, _, index) = open(&path);
    for opts in modes() {
        failed_reads(&path, &file, &index, opts);
    }
}

fn failed_reads(path: &Path, file: &GgufFile, index: &ExpertIndex, opts: ReaderOptions) {
    let mut r = reader_with(index, opts);
    let (l, e) = (1, 5);
    let at = gate_reads(index, l, e);
    let p = path.to_string_lossy().into_owned();

    // Once: the retry reads it.
    {
        let f = inject(
            Rule::new(Site::ExpertRead, &p, Fault::Errno(libc::EIO))
                .at(at.clone())
                .times(1),
        );
        let got = read(&mut r, l, &[4, 5, 6]).expect("read");
        assert_eq!(f.fired(), 1);
        for (i, ex) in [4, 5, 6].into_iter().enumerate() {
            assert_eq!(
                got[i].as_ref().expect("read again"),
                &want(file, index, l, ex)
            );
        }
        assert_eq!(r.counters().retries, 1);
        assert_eq!(r.counters().failed, 0);
    }
    // Always: that expert fails, naming the file, the offset and the cause; the
    // others of the same read are served.
    {
        let _f = inject(Rule::new(Site::ExpertRead, &p, Fault::Errno(libc::EIO)).at(at.clone()));
        let got = read(&mut r, l, &[4, 5, 6]).expect("read");
        assert_eq!(got[0].as_ref().expect("4"), &want(file, index, l, 4));
        assert_eq!(got[2].as_ref().expect("6"), &want(file, index, l, 6));
        let msg = got[1].as_ref().expect_err("5 fails");
        let gate = index.matrix(l, e, ExpertMatrix::Gate).expect("gate");
        for part in [
            p.as_str(),
            &format!("reading {} bytes at offset {}", gate.len, gate.offset),
            "Input/output error",
            "again when retried",
        ] {
            assert!(msg.contains(part), "{opts:?}: {part:?} not in {msg:?}");
        }
        assert_eq!(r.counters().failed, 1);
    }
    // The fault gone, the expert reads again.
    let got = read(&mut r, l, &[5]).expect("read");
    assert_eq!(got[0].as_ref().expect("5"), &want(file, index, l, 5));
    assert!(r.standing_fault().is_none());
}

#[test]
fn short_reads_are_continued_and_the_end_of_the_file_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), Arch::Qwen3Moe);
    let (file, cfg, index) = open(&path);
    let mut r = reader(&index);
    let p = path.to_string_lossy().into_owned();
    {
        // Every read returns at most one block: each is continued to its end.
        let f = inject(Rule::new(Site::ExpertRead, &p, Fault::Short(4096)));
        let all: Vec<u32> = (0..cfg.n_expert as u32).collect();
        let got = read(&mut r, 2, &all).expect("read");
        assert!(
            f.fired() > 3 * all.len() as u32,
            "{} short reads",
            f.fired()
        );
        for (i, g) in got.iter().enumerate() {
            assert_eq!(g.as_ref().expect("read"), &want(&file, &index, 2, i));
        }
        assert_eq!(r.counters().retries, 0);
    }
    {
        // A read that meets the end of the file (a file truncated under the reader,
        // as the kernel reports it): never zeros, an error naming where it ended.
        let at = gate_reads(&index, 0, 3);
        let _f = inject(Rule::new(Site::ExpertRead, &p, Fault::Eof).at(at.clone()));
        let got = read(&mut r, 0, &[3]).expect("read");
        let msg = got[0].as_ref().expect_err("fails");
        assert!(
            msg.contains(&format!("the file ends at byte {}", at.start)),
            "{msg}"
        );
        assert!(msg.contains("truncated while in use?"), "{msg}");
    }
}

#[test]
fn a_stalled_read_fails_at_the_deadline_and_reads_resume_when_it_comes_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), Arch::Qwen3Moe);
    let (file, _, index) = open(&path);
    let mut r = reader(&index);
    let p = path.to_string_lossy().into_owned();
    let stall = Duration::from_secs(3);
    let f = inject(
        Rule::new(Site::ExpertRead, &p, Fault::Stall(stall))
            .at(gate_reads(&index, 3, 7))
            .times(1),
    );
    let t0 = Instant::now();
    let err = read(&mut r, 3, &[7]).expect_err("stalls");
    let waited = t0.elapsed();
    assert!(matches!(err, ReadError::Stalled { .. }), "{err}");
    assert!(waited >= DEADLINE && waited < stall, "waited {waited:?}");
    let msg = err.to_string();
    assert!(msg.contains(&p) && msg.contains("0.5 s deadline"), "{msg}");
    assert_eq!(r.counters().stalls, 1);
    // While it is out, reads fail at once (a request needing the disk fails fast),
    // and the reader says why.
    let t1 = Instant::now();
    let err = read(&mut r, 0, &[0]).expect_err("stuck");
    assert!(t1.elapsed() < DEADLINE, "{:?}", t1.elapsed());
    assert!(matches!(err, ReadError::Stuck { .. }), "{err}");
    assert!(err.to_string().contains("has not come back for"), "{err}");
    assert!(r.standing_fault().is_some());
    // When it comes back, reads work again.
    while r.standing_fault().is_some() {
        assert!(t0.elapsed() < stall * 3, "the stalled read never came back");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(f.fired(), 1);
    let got = read(&mut r, 3, &[7]).expect("read");
    assert_eq!(got[0].as_ref().expect("7"), &want(&file, &index, 3, 7));
}

#[test]
fn a_file_written_under_the_reader_is_refused_and_a_replaced_one_is_read_as_loaded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), Arch::Qwen3Moe);
    let (file, _, index) = open(&path);
    let before = want(&file, &index, 1, 2);

    // Replaced (a new file renamed over the path) and deleted: the open reader
    // still reads the loaded file; a reader opened now refuses the new one.
    let mut r = reader(&index);
    let other = dir.path().join("other.gguf");
    std::fs::write(&other, vec![0x5a; 1 << 20]).expect("write");
    std::fs::rename(&other, &path).expect("rename");
    let got = read(&mut r, 1, &[2]).expect("read");
    assert_eq!(got[0].as_ref().expect("2"), &before);
    let err = ExpertReader::open(&index, ReadPolicy::default(), |n| Ok(AlignedBuf::zeroed(n)))
        .err()
        .expect("refused");
    assert!(err.to_string().contains("it was replaced"), "{err}");
    std::fs::remove_file(&path).expect("rm");
    let got = read(&mut r, 1, &[2]).expect("read");
    assert_eq!(got[0].as_ref().expect("2"), &before);
    drop(r);

    // Written in place (here: grown): every read is refused from then on.
    let dir2 = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir2.path(), Arch::Qwen3Moe);
    let (_file, _, index) = open(&path);
    let mut r = reader(&index);
    read(&mut r, 1, &[2]).expect("read").remove(0).expect("2");
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .expect("open");
    f.write_all(b"more").expect("append");
    drop(f);
    let got = read(&mut r, 1, &[2]).expect("read");
    let msg = got[0].as_ref().expect_err("changed");
    assert!(
        msg.contains("changed while scoria was serving it") && msg.contains("its size went from"),
        "{msg}"
    );
    let err = read(&mut r, 1, &[3]).expect_err("refused from now on");
    assert!(matches!(err, ReadError::Changed { .. }), "{err}");
    assert!(r.standing_fault().is_some());
}

// ---------------------------------------------------------------------------------
// Under a running engine.

fn load(path: &Path, ram_budget: Option<u64>, profile: Option<&Path>, record: bool) -> Engine {
    Engine::load(
        path,
        &EngineConfig {
            max_context: Some(256),
            parallel: Some(2),
            device: Some(Device::Cpu),
            prompt_cache: Some(0),
            ram_budget,
            expert_profile: profile.map(Path::to_path_buf),
            expert_read_deadline: Some(DEADLINE),
            record_routing: record,
            ..Default::default()
        },
    )
    .expect("load")
}

/// The model, the solo bytes of A and B on the mapped file, and an expert (layer,
/// expert) A routes to and B never does, with B's routing profile saved in `dir`.
struct Setup {
    _dir: tempfile::TempDir,
    path: PathBuf,
    refs: Vec<Bits>,
    fault: (usize, usize),
    index: ExpertIndex,
    b_profile: PathBuf,
    /// RAM that holds exactly B's experts.
    b_bytes: u64,
}

fn setup(arch: Arch) -> Setup {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), arch);
    let reqs = fault_requests();
    let mut eng = load(&path, None, None, false);
    let refs: Vec<Bits> = reqs
        .iter()
        .map(|r| {
            eng.reset().expect("reset");
            solo(&mut eng, r)
        })
        .collect();
    drop(eng);
    let routed = |req: &GenerateRequest| {
        let mut e = load(&path, None, None, true);
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
    let (_, _, index) = open(&path);
    let b_bytes = (0..b.len())
        .map(|l| b[l].iter().filter(|&&n| n > 0).count() as u64 * index.expert_bytes(l).expect("l"))
        .sum();
    let profile_path = dir.path().join("b.profile.json");
    b_profile.save(&profile_path).expect("save");
    Setup {
        _dir: dir,
        path,
        refs,
        fault,
        index,
        b_profile: profile_path,
        b_bytes,
    }
}

impl Setup {
    fn fault_rule(&self, fault: Fault) -> Rule {
        let (l, e) = self.fault;
        Rule::new(Site::ExpertRead, self.path.to_string_lossy(), fault).at(gate_reads(
            &self.index,
            l,
            e,
        ))
    }

    /// Checks `eng` still serves A (alone, from a clean start) with its solo bytes.
    fn a_works(&self, eng: &mut Engine) {
        let reqs = fault_requests();
        assert_eq!(solo(eng, &reqs[0]), self.refs[0], "A after the fault");
    }
}

#[test]
fn tiered_experts_on_the_cpu_give_the_mapped_bits() {
    let s = setup(Arch::Qwen35Moe);
    let reqs = fault_requests();
    for budget in [0, s.b_bytes] {
        let mut eng = load(&s.path, Some(budget), Some(&s.b_profile), false);
        let seen = together(&mut eng, &reqs);
        for (i, r) in seen.iter().enumerate() {
            assert!(matches!(r.done, Some(Ok(_))), "request {i}");
            assert_eq!(
                (r.tokens.clone(), r.logits.clone()),
                s.refs[i],
                "budget {budget}: request {i}"
            );
        }
        let st = eng.expert_stats().expect("tiered");
        assert!(st.disk_misses > 0, "{st:?}");
        assert_eq!(budget > 0, st.cpu_misses > 0, "{st:?}");
        assert_eq!(eng.expert_reads().expect("reads").failed, 0);
    }
}

#[test]
fn a_failed_expert_read_ends_only_the_request_that_needed_it() {
    let s = setup(Arch::Qwen35Moe);
    let reqs = fault_requests();
    // Every expert from the file: B's experts are read in the same batches as A's.
    let mut eng = load(&s.path, Some(0), None, false);
    {
        let _f = inject(s.fault_rule(Fault::Errno(libc::EIO)));
        let seen = together(&mut eng, &reqs);
        let gate = s
            .index
            .matrix(s.fault.0, s.fault.1, ExpertMatrix::Gate)
            .expect("gate");
        only_a_failed(
            &seen,
            &s.refs,
            &[
                &s.path.to_string_lossy(),
                &format!("layer {} expert {}", s.fault.0, s.fault.1),
                &format!("at offset {}", gate.offset),
                "Input/output error",
            ],
        );
        // Still failing: the next request needing it fails the same way, B works.
        let seen = together(&mut eng, &reqs);
        only_a_failed(&seen, &s.refs, &["Input/output error"]);
        assert!(eng.expert_reads().expect("reads").failed >= 2);
    }
    // The fault gone, A works again (its slot started over).
    s.a_works(&mut eng);
    assert!(eng.standing_fault().is_none());
}

#[test]
fn a_read_failing_once_or_returning_short_changes_nothing() {
    let s = setup(Arch::Qwen3Moe);
    let reqs = fault_requests();
    let mut eng = load(&s.path, Some(0), None, false);
    let short = inject(Rule::new(
        Site::ExpertRead,
        s.path.to_string_lossy(),
        Fault::Short(4096),
    ));
    let once = inject(s.fault_rule(Fault::Errno(libc::EIO)).times(1));
    let seen = together(&mut eng, &reqs);
    assert!(short.fired() > 0 && once.fired() == 1);
    for (i, r) in seen.iter().enumerate() {
        assert!(
            matches!(r.done, Some(Ok(_))),
            "request {i}: {:?}",
            r.done.as_ref().map(|r| r.as_ref().err())
        );
        assert_eq!(
            (r.tokens.clone(), r.logits.clone()),
            s.refs[i],
            "request {i}"
        );
    }
    let c = eng.expert_reads().expect("reads");
    assert_eq!((c.retries, c.failed), (1, 0), "{c:?}");
}

#[test]
fn a_stalled_expert_read_fails_its_request_at_the_deadline_and_the_others_go_on() {
    let s = setup(Arch::Qwen35Moe);
    let reqs = fault_requests();
    // B's experts in RAM: B never waits for the disk.
    let mut eng = load(&s.path, Some(s.b_bytes), Some(&s.b_profile), false);
    let stall = Duration::from_secs(4);
    let f = inject(s.fault_rule(Fault::Stall(stall)).times(1));
    let t0 = Instant::now();
    let seen = together(&mut eng, &reqs);
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
    // fast while B, served from RAM, works.
    let fault = eng.standing_fault().expect("a read is out");
    assert!(fault.contains("has not come back for"), "{fault}");
    let seen = together(&mut eng, &reqs);
    only_a_failed(&seen, &s.refs, &["has not come back for"]);
    // Once it is back, everything works again.
    while eng.standing_fault().is_some() {
        assert!(t0.elapsed() < stall * 3, "the stalled read never came back");
        std::thread::sleep(Duration::from_millis(50));
    }
    s.a_works(&mut eng);
    let c = eng.expert_reads().expect("reads");
    assert_eq!(c.stalls, 1, "{c:?}");
}

#[test]
fn a_model_file_changed_under_the_engine_is_never_served() {
    let s = setup(Arch::Qwen35Moe);
    let reqs = fault_requests();
    let mut eng = load(&s.path, Some(s.b_bytes), Some(&s.b_profile), false);
    // Written in place (grown by a few bytes): A's experts from the file are refused.
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&s.path)
        .expect("open");
    f.write_all(&[0; 16]).expect("append");
    drop(f);
    let seen = together(&mut eng, &reqs);
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
    // B, served from RAM, still works; A keeps failing (a restart is the remedy).
    let seen = together(&mut eng, &reqs);
    only_a_failed(&seen, &s.refs, &["changed while scoria was serving it"]);
}

#[test]
fn a_model_file_deleted_or_replaced_under_the_engine_is_still_read_as_loaded() {
    let s = setup(Arch::Qwen3Moe);
    let reqs = fault_requests();
    let mut eng = load(&s.path, Some(0), None, false);
    std::fs::remove_file(&s.path).expect("rm");
    std::fs::write(&s.path, vec![0x77; 1 << 16]).expect("another file at the path");
    let seen = together(&mut eng, &reqs);
    for (i, r) in seen.iter().enumerate() {
        assert!(matches!(r.done, Some(Ok(_))), "request {i}");
        assert_eq!(
            (r.tokens.clone(), r.logits.clone()),
            s.refs[i],
            "request {i}"
        );
    }
    assert!(eng.standing_fault().is_none());
}
