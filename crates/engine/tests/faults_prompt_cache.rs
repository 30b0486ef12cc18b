//! Faults of the prompt-cache directory, real and injected through `engine::fault`
//! (sites `CacheCreate`, `CacheWrite`, `CacheRead`):
//! - a full disk, a read-only directory, a directory that is not one: logged, the
//!   conversations stay cached in memory (a later turn gets the cold run's bits), the
//!   directory holds no partial file, and saving resumes once the fault is gone;
//! - a corrupt or truncated entry, another model's, another format version's, one
//!   written by another scoria, one that cannot be read: skipped with the reason,
//!   never loaded, never fatal;
//! - a writer killed (`SIGKILL`) in the middle of an entry leaves only a temporary
//!   file, which the next start removes; nothing half-written is ever read.

mod common;

use common::bits;
use engine::exec::{LayerKv, RecurrentState, SeqSnapshot};
use engine::fault::{inject, Fault, Rule, Site};
use engine::prompt_cache::PromptCache;
use engine::{Engine, EngineConfig, Flow, GenerateRequest};
use model::synth::Preset;
use model::Arch;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn engine(path: &Path, dir: &Path) -> Engine {
    Engine::load(
        path,
        &EngineConfig {
            max_context: Some(512),
            parallel: Some(1),
            device: Some(common::test_device()),
            prompt_cache: Some(64 << 20),
            prompt_cache_dir: Some(dir.to_path_buf()),
            ..Default::default()
        },
    )
    .expect("load: the prompt-cache directory never keeps the engine from starting")
}

fn cold(path: &Path) -> Engine {
    Engine::load(
        path,
        &EngineConfig {
            max_context: Some(512),
            parallel: Some(1),
            device: Some(common::test_device()),
            prompt_cache: Some(0),
            ..Default::default()
        },
    )
    .expect("load")
}

fn tokens(n: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7919 + salt * 104_729 + 13) % 5000) as u32 + 100)
        .collect()
}

/// A chat's first turn and its second (which keeps the first up to its last message
/// start), and how many tokens the cache gives the second.
fn turns(eng: &Engine, salt: usize) -> (Vec<u32>, Vec<u32>, usize) {
    let s = eng.tokenizer().token_id("<|im_start|>").expect("im_start");
    let mut t1 = vec![s];
    t1.extend(tokens(40, salt));
    let boundary = t1.len();
    t1.push(s);
    t1.extend(tokens(10, salt + 1));
    let mut t2 = t1[..boundary].to_vec();
    t2.push(s);
    t2.extend(tokens(15, salt + 2));
    let reused = if eng.info().arch == "qwen3moe" {
        boundary + 1
    } else {
        boundary
    };
    (t1, t2, reused)
}

/// Tokens, logits bits, and the prompt tokens served from cached state.
fn solo(eng: &mut Engine, prompt: &[u32]) -> (Vec<u32>, Vec<Vec<u32>>, usize) {
    let mut logits = Vec::new();
    let c = eng
        .generate_with_logits(
            &GenerateRequest::greedy(prompt.to_vec(), 6),
            &mut |_| Flow::Continue,
            &mut |l| logits.push(bits(l)),
        )
        .expect("generate");
    (c.tokens, logits, c.timings.cache_n)
}

/// The files of `dir`: entries (`.pcache`) and everything else.
fn files(dir: &Path) -> (Vec<String>, Vec<String>) {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|l| {
            l.map(|f| f.expect("entry").file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names.into_iter().partition(|n| n.ends_with(".pcache"))
}

#[test]
fn a_full_disk_or_a_read_only_directory_keeps_the_cache_in_memory_and_saving_resumes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(tmp.path(), Arch::Qwen35Moe, Preset::Q8_0, 5);
    let cases = [
        // The disk fills up in the middle of an entry.
        (
            "full",
            Site::CacheWrite,
            libc::ENOSPC,
            "No space left on device",
            3,
        ),
        (
            "read-only",
            Site::CacheCreate,
            libc::EROFS,
            "Read-only file system",
            0,
        ),
        (
            "no permission",
            Site::CacheCreate,
            libc::EACCES,
            "Permission denied",
            0,
        ),
    ];
    for (i, (case, site, errno, cause, skip)) in cases.into_iter().enumerate() {
        let dir = tmp.path().join(format!("cache-{i}"));
        let mut c = cold(&path);
        let (a1, a2, reused) = turns(&c, 11 + i);
        let (b1, _, _) = turns(&c, 23 + i);
        let (c1, _, _) = turns(&c, 37 + i);
        let want = solo(&mut c, &a2);

        let mut eng = engine(&path, &dir);
        let fault = inject(Rule::new(site, dir.to_string_lossy(), Fault::Errno(errno)).skip(skip));
        solo(&mut eng, &a1);
        // B takes the one slot: A goes into the cache, and its save fails.
        solo(&mut eng, &b1);
        let got = solo(&mut eng, &a2);
        assert_eq!(
            got.2, reused,
            "{case}: A's turn comes from the cache in memory"
        );
        assert_eq!((&got.0, &got.1), (&want.0, &want.1), "{case}: cold bits");
        eng.flush_prompt_cache();
        assert!(fault.fired() > 0, "{case}");
        let disk = eng.cache_report().disk.expect("a directory");
        assert!(
            disk.failures > 0 && disk.files_written == 0,
            "{case}: {disk:?}"
        );
        let why = disk.failing.clone().expect("failing");
        assert!(
            why.contains(cause) && why.contains(&dir.to_string_lossy().into_owned()),
            "{case}: {why}"
        );
        let (entries, others) = files(&dir);
        assert!(
            entries.is_empty() && others.is_empty(),
            "{case}: {entries:?} {others:?}"
        );

        // The fault gone, the next save writes what the cache holds.
        drop(fault);
        solo(&mut eng, &c1);
        eng.flush_prompt_cache();
        let disk = eng.cache_report().disk.expect("a directory");
        assert!(
            disk.failing.is_none() && disk.files_written >= 2,
            "{case}: {disk:?}"
        );
        let (entries, others) = files(&dir);
        assert!(
            entries.len() >= 2 && others.is_empty(),
            "{case}: {entries:?} {others:?}"
        );
        drop(eng);
        // And a restart finds A's conversation there.
        let mut again = engine(&path, &dir);
        let got = solo(&mut again, &a2);
        assert_eq!(got.2, reused, "{case}: from the files");
        assert_eq!((&got.0, &got.1), (&want.0, &want.1), "{case}: cold bits");
    }
}

#[test]
fn a_cache_directory_that_is_not_a_directory_is_logged_and_the_engine_serves() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(tmp.path(), Arch::Qwen3Moe, Preset::Q8_0, 5);
    let not_a_dir = tmp.path().join("cache");
    std::fs::write(&not_a_dir, b"a file").expect("write");
    let mut c = cold(&path);
    let (a1, a2, reused) = turns(&c, 3);
    let (b1, _, _) = turns(&c, 5);
    let want = solo(&mut c, &a2);
    let mut eng = engine(&path, &not_a_dir);
    solo(&mut eng, &a1);
    solo(&mut eng, &b1);
    let got = solo(&mut eng, &a2);
    assert_eq!(got.2, reused);
    assert_eq!((&got.0, &got.1), (&want.0, &want.1));
    eng.flush_prompt_cache();
    let disk = eng.cache_report().disk.expect("a directory");
    let why = disk.failing.expect("failing");
    assert!(
        why.contains(&not_a_dir.to_string_lossy().into_owned()),
        "{why}"
    );
}

/// A snapshot of `n` positions with DeltaNet state, values from `seed`.
fn snap(n: usize, seed: f32) -> SeqSnapshot {
    let vals = |len: usize| (0..len).map(|i| seed + i as f32).collect();
    SeqSnapshot {
        pos: n,
        kv_pos: n,
        kv: vec![LayerKv {
            k: vals(n * 8),
            v: vals(n * 8),
        }],
        recurrent: vec![RecurrentState {
            conv: vals(6),
            ssm: vals(16),
        }],
    }
}

/// Replaces `from` by `to` (the same length) in an entry file and fixes its checksum:
/// a well-formed file that says something else.
fn rewrite(path: &Path, from: &[u8], to: &[u8]) {
    assert_eq!(from.len(), to.len());
    let mut b = std::fs::read(path).expect("read");
    let at = b
        .windows(from.len())
        .position(|w| w == from)
        .expect("the bytes to replace");
    b[at..at + to.len()].copy_from_slice(to);
    let n = b.len() - 32;
    let sum = Sha256::digest(&b[..n]);
    b[n..].copy_from_slice(&sum);
    std::fs::write(path, b).expect("write");
}

#[test]
fn unusable_entries_are_skipped_with_the_reason_and_never_loaded() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("cache");
    let mut c = PromptCache::new(1 << 20);
    for (i, n) in [3usize, 4, 5, 6, 7, 8, 9].into_iter().enumerate() {
        c.insert(
            (0..n as u32).map(|t| t + 100 * i as u32).collect(),
            snap(n, i as f32),
        )
        .expect("insert");
    }
    assert_eq!(c.save_dir(&dir, "model-a").expect("save"), 7);
    let mut other = PromptCache::new(1 << 20);
    other.insert(vec![1, 2, 3], snap(3, 9.0)).expect("insert");
    other.save_dir(&dir, "model-b").expect("save");
    let (mut entries, _) = files(&dir);
    // model-b's file is the one model-a's store does not know.
    let mut ours = PromptCache::new(1 << 20);
    let first = ours.load_dir(&dir, "model-a").expect("load");
    assert_eq!((first.loaded, first.skipped), (7, 1), "{first:?}");
    let foreign = first.skipped_files[0].0.clone();
    entries.retain(|e| !foreign.ends_with(e));
    let p: Vec<PathBuf> = entries.iter().map(|e| dir.join(e)).collect();

    // Corrupt (one bit), truncated, another format version, another scoria, junk, and
    // one that cannot be read.
    let mut b = std::fs::read(&p[0]).expect("read");
    let mid = b.len() / 2;
    b[mid] ^= 0x10;
    std::fs::write(&p[0], &b).expect("write");
    let b = std::fs::read(&p[1]).expect("read");
    std::fs::write(&p[1], &b[..b.len() - 100]).expect("write");
    let mut b = std::fs::read(&p[2]).expect("read");
    b[8..12].copy_from_slice(&1u32.to_le_bytes());
    std::fs::write(&p[2], &b).expect("write");
    let writer = format!("scoria {}", env!("CARGO_PKG_VERSION"));
    let elsewhere: String = writer
        .chars()
        .map(|ch| if ch.is_ascii_digit() { '9' } else { ch })
        .collect();
    rewrite(&p[3], writer.as_bytes(), elsewhere.as_bytes());
    std::fs::write(dir.join("junk.pcache"), b"SCORIAPC").expect("write");
    let unreadable = p[4].clone();
    let f = inject(Rule::new(
        Site::CacheRead,
        unreadable.to_string_lossy(),
        Fault::Errno(libc::EIO),
    ));

    let mut back = PromptCache::new(1 << 20);
    let r = back.load_dir(&dir, "model-a").expect("never fatal");
    assert_eq!(f.fired(), 1);
    assert_eq!((r.loaded, r.skipped), (2, 7), "{r:?}");
    assert_eq!(back.len(), 2);
    let why = |path: &Path| -> String {
        r.skipped_files
            .iter()
            .find(|(q, _)| q == path)
            .map(|(_, w)| w.clone())
            .unwrap_or_else(|| panic!("{} was not skipped: {r:?}", path.display()))
    };
    assert!(why(&p[0]).contains("checksum does not match"), "{r:?}");
    assert!(why(&p[1]).contains("checksum does not match"), "{r:?}");
    assert!(
        why(&p[2]).contains("format version 1, this build reads 2"),
        "{r:?}"
    );
    assert!(
        why(&p[3]).contains(&format!("written by {elsewhere:?}, this is {writer:?}")),
        "{r:?}"
    );
    assert!(why(&dir.join("junk.pcache")).contains("truncated"), "{r:?}");
    assert!(
        why(&unreadable).contains("cannot read it: Input/output error"),
        "{r:?}"
    );
    assert!(
        why(&foreign).contains("written for model \"model-b\""),
        "{r:?}"
    );
    // What loaded is what was saved.
    for q in &p[5..] {
        assert!(!r.skipped_files.iter().any(|(x, _)| x == q));
    }
    // A save of model-a removes its own unusable files, never model-b's.
    back.save_dir(&dir, "model-a").expect("save");
    let (left, _) = files(&dir);
    assert_eq!(
        left.len(),
        2 + 1 + 1,
        "model-a's two, model-b's, junk: {left:?}"
    );
    assert!(foreign.exists());
}

#[test]
fn an_engine_starts_over_unusable_entries_and_serves_the_good_one() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(tmp.path(), Arch::Qwen35Moe, Preset::Q8_0, 5);
    let dir = tmp.path().join("cache");
    let mut c = cold(&path);
    let (a1, a2, reused) = turns(&c, 11);
    let (b1, _, _) = turns(&c, 23);
    let want = solo(&mut c, &a2);
    {
        let mut eng = engine(&path, &dir);
        solo(&mut eng, &a1);
        solo(&mut eng, &b1);
        eng.flush_prompt_cache();
    }
    let (entries, _) = files(&dir);
    assert_eq!(entries.len(), 1, "{entries:?}");
    // Beside A's entry: a corrupt copy of it under another name, a truncated one, and
    // an entry of another model of the same name and size (another seed).
    let good = dir.join(&entries[0]);
    let bytes = std::fs::read(&good).expect("read");
    let mut bad = bytes.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 1;
    let prefix = &entries[0][..13];
    std::fs::write(dir.join(format!("{prefix}corrupt.pcache")), &bad).expect("write");
    std::fs::write(
        dir.join(format!("{prefix}short.pcache")),
        &bytes[..bytes.len() / 3],
    )
    .expect("write");
    let twin_dir = tmp.path().join("twin");
    std::fs::create_dir(&twin_dir).expect("mkdir");
    let twin = common::synth_tiny(&twin_dir, Arch::Qwen35Moe, Preset::Q8_0, 6);
    assert_eq!(
        std::fs::metadata(&twin).expect("twin").len(),
        std::fs::metadata(&path).expect("model").len()
    );
    {
        let mut eng = engine(&twin, &dir);
        solo(&mut eng, &a1);
        solo(&mut eng, &b1);
        eng.flush_prompt_cache();
    }
    assert_eq!(files(&dir).0.len(), 4);
    let mut eng = engine(&path, &dir);
    let store = eng.cache_report().store.expect("a store");
    assert_eq!(store.entries, 1, "only A's good entry loads: {store:?}");
    let got = solo(&mut eng, &a2);
    assert_eq!(got.2, reused, "from the file");
    assert_eq!((&got.0, &got.1), (&want.0, &want.1), "cold bits");
}

/// The child of `a_writer_killed_mid_entry_leaves_nothing_a_restart_reads`: saves
/// entries into `$SCORIA_TEST_KILLED_WRITER`, slowly (every write stalls), until it
/// is killed. Run only by that test.
#[test]
#[ignore = "run by a_writer_killed_mid_entry_leaves_nothing_a_restart_reads"]
fn killed_writer_child() {
    let dir = PathBuf::from(std::env::var("SCORIA_TEST_KILLED_WRITER").expect("the directory"));
    let mut c = PromptCache::new(1 << 30);
    c.insert(vec![1, 2, 3], snap(3, 0.0)).expect("insert");
    c.save_dir(&dir, "model-a").expect("save");
    // The second entry's writes stall: the parent kills this process in one of them.
    let _slow = inject(Rule::new(
        Site::CacheWrite,
        dir.to_string_lossy(),
        Fault::Stall(Duration::from_millis(200)),
    ));
    c.insert(vec![4, 5, 6, 7], snap(4, 1.0)).expect("insert");
    c.save_dir(&dir, "model-a").expect("save");
    panic!("the parent should have killed this process by now");
}

#[test]
fn a_writer_killed_mid_entry_leaves_nothing_a_restart_reads() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("cache");
    let mut child = std::process::Command::new(std::env::current_exe().expect("exe"))
        .args(["--ignored", "--exact", "killed_writer_child", "--nocapture"])
        .env("SCORIA_TEST_KILLED_WRITER", &dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn the writer");
    // Wait until the second entry is being written (its temporary file exists).
    let t0 = Instant::now();
    let tmp_name = loop {
        let (entries, others) = files(&dir);
        let writing = others.iter().find(|n| n.contains(".pcache.tmp-"));
        if let (1, Some(t)) = (entries.len(), writing) {
            // Still there a moment later: the slow second entry, not the first one
            // caught between its creation and its rename.
            std::thread::sleep(Duration::from_millis(50));
            if files(&dir).1.contains(t) {
                break t.clone();
            }
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the writer ended before it was killed: {status}");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no temporary file appeared"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    child.kill().expect("SIGKILL");
    child.wait().expect("reap");
    let pid = child.id();
    assert!(tmp_name.ends_with(&format!(".tmp-{pid}")), "{tmp_name}");
    // A temporary of a live process (pid 1) is left alone.
    let live = format!(".{}.tmp-1", files(&dir).0[0]);
    std::fs::write(dir.join(&live), b"being written").expect("write");

    let mut back = PromptCache::new(1 << 30);
    let r = back.load_dir(&dir, "model-a").expect("load");
    assert_eq!(
        (r.loaded, r.skipped, r.temporaries_removed),
        (1, 0, 1),
        "{r:?}"
    );
    assert_eq!(back.lookup(&[1, 2, 3, 9]).map(|h| h.matched), Some(3));
    let (entries, others) = files(&dir);
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(others, vec![live], "the dead writer's temporary is gone");
}
