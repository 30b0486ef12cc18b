//! The expert store's CPU-side foundations on synthetic models of every arch:
//! - the index addresses exactly the bytes the loader hands the executor, split
//!   models included;
//! - direct reads (io_uring and pread, O_DIRECT and buffered) return the file's bytes,
//!   and refuse bad ranges with the file, offset and length;
//! - a recorded routing profile counts every route of the prefill and decode paths.

mod common;

use engine::experts::{
    AlignedBuf, DirectReader, ExpertIndex, ReadError, ReadRequest, ReaderOptions, RoutingProfile,
    MATRICES,
};
use engine::{record_profile, ProfileInput};
use gguf::GgufFile;
use model::geometry::ARCHS;
use model::synth::Preset;
use model::tensors::ExpertMatrix;
use model::{Arch, ModelConfig, ModelWeights};
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn open(path: &Path) -> (Arc<GgufFile>, ModelConfig) {
    let file = Arc::new(GgufFile::open(path).expect("open"));
    let cfg = ModelConfig::from_gguf(&file).expect("config");
    (file, cfg)
}

/// Every (layer, expert, matrix) of the index is the loader's `matrix_bytes(e)`: the
/// same bytes of the same map, with the loader's type and shape.
fn check_index_against_loader(file: &Arc<GgufFile>, cfg: &ModelConfig, index: &ExpertIndex) {
    let w = ModelWeights::load(file, cfg).expect("weights");
    assert_eq!(index.n_layer(), cfg.n_layer);
    assert_eq!(index.n_blocks(), cfg.n_layer + cfg.n_nextn);
    assert_eq!(index.n_expert(), cfg.n_expert);
    assert_eq!(index.shard_paths(), file.paths());
    for (l, layer) in w.layers.iter().enumerate() {
        for e in 0..cfg.n_expert {
            for m in MATRICES {
                let weight = match m {
                    ExpertMatrix::Gate => &layer.moe.gate_exps,
                    ExpertMatrix::Up => &layer.moe.up_exps,
                    ExpertMatrix::Down => &layer.moe.down_exps,
                };
                let loc = index.matrix(l, e, m).expect("in range");
                let shard = file.shard_bytes(loc.shard).expect("shard");
                let got = &shard[loc.offset as usize..(loc.offset + loc.len) as usize];
                let want = weight.matrix_bytes(e);
                assert_eq!(got.as_ptr(), want.as_ptr(), "layer {l} expert {e} {m:?}");
                assert_eq!(got.len(), want.len(), "layer {l} expert {e} {m:?}");
                assert_eq!(loc.ty, weight.ty);
                assert_eq!(loc.rows, weight.n_rows());
                assert_eq!(loc.cols, weight.row_len());
            }
        }
        let per_expert: u64 = [
            &layer.moe.gate_exps,
            &layer.moe.up_exps,
            &layer.moe.down_exps,
        ]
        .iter()
        .map(|w| w.matrix_bytes(0).len() as u64)
        .sum();
        assert_eq!(index.expert_bytes(l), Some(per_expert));
        assert_eq!(index.block_bytes(l), Some(per_expert * cfg.n_expert as u64));
    }
    // MTP blocks (not loaded by the CPU executor): the e-th slice of the file's tensor.
    for b in cfg.n_layer..index.n_blocks() {
        for (m, name) in MATRICES
            .iter()
            .zip(["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"])
        {
            let t = file
                .tensor(&format!("blk.{b}.{name}.weight"))
                .expect("mtp tensor");
            let all = file.tensor_data(t);
            let per = all.len() / cfg.n_expert;
            for e in 0..cfg.n_expert {
                let loc = index.matrix(b, e, *m).expect("in range");
                let shard = file.shard_bytes(loc.shard).expect("shard");
                let got = &shard[loc.offset as usize..(loc.offset + loc.len) as usize];
                assert_eq!(got.as_ptr(), all[e * per..].as_ptr(), "block {b} {m:?}");
                assert_eq!(got.len(), per);
            }
        }
    }
    let routed: u64 = file
        .tensors()
        .iter()
        .filter(|t| model::tensors::is_routed_expert(&t.name))
        .map(|t| t.size)
        .sum();
    assert_eq!(index.total_bytes(), routed);
    assert_eq!(index.trunk_expert_bytes().len(), cfg.n_layer);
    assert!(index.matrix(0, cfg.n_expert, ExpertMatrix::Gate).is_none());
    assert!(index
        .matrix(index.n_blocks(), 0, ExpertMatrix::Up)
        .is_none());
    assert!(index.expert(0, cfg.n_expert).is_none());
}

#[test]
fn the_index_addresses_the_loaders_expert_bytes_in_every_arch() {
    let dir = tempfile::tempdir().expect("tempdir");
    for arch in ARCHS {
        // Q4_K_M mixes types: ffn_down is Q6_K on some layers, so layers differ in size.
        let path = common::synth_tiny(dir.path(), arch, Preset::Q4KM, 3);
        let (file, cfg) = open(&path);
        let index = ExpertIndex::build(&file, &cfg).expect("index");
        check_index_against_loader(&file, &cfg, &index);
        let sizes = index.trunk_expert_bytes();
        if arch == Arch::Qwen3Moe {
            assert!(
                sizes.iter().any(|&s| s != sizes[0]),
                "Q4_K_M should give layers of different expert sizes: {sizes:?}"
            );
        }
        std::fs::remove_file(&path).expect("rm");
    }
}

/// Rewrites `path` as a split model of `n` shards; returns the first shard.
fn split(path: &Path, dir: &Path, n: usize) -> PathBuf {
    let src = GgufFile::open(path).expect("open");
    let mut w = gguf::GgufWriter::new();
    for (k, v) in src.metadata() {
        w.add_kv(k.clone(), v.clone()).expect("kv");
    }
    for t in src.tensors() {
        w.add_tensor(t.name.clone(), &t.dims, t.ty).expect("tensor");
    }
    // By tensor count: by bytes, the vocabulary tensors would take shards of their own
    // and every expert would land in one.
    let total = src.tensors().len();
    let per = total.div_ceil(n);
    let counts: Vec<usize> = (0..total)
        .step_by(per)
        .map(|start| per.min(total - start))
        .collect();
    let shards = w.into_shards(&counts).expect("split");
    let count = shards.len() as u32;
    assert!(count >= 2, "{count} shards");
    let mut next = 0;
    let mut first = None;
    for (k, mut shard) in shards.into_iter().enumerate() {
        let p = dir.join(gguf::shard_file_name("split", k as u32 + 1, count));
        let m = shard.tensor_count();
        let data: Vec<&[u8]> = src.tensors()[next..next + m]
            .iter()
            .map(|t| src.tensor_data(t))
            .collect();
        next += m;
        shard.write_to_path(&p, &data).expect("write shard");
        first.get_or_insert(p);
    }
    first.expect("a shard")
}

#[test]
fn the_index_of_a_split_model_names_each_shard_and_reads_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(dir.path(), Arch::Qwen3Moe, Preset::Q8_0, 3);
    let first = split(&path, dir.path(), 4);
    let (file, cfg) = open(&first);
    assert!(file.paths().len() >= 3);
    let index = ExpertIndex::build(&file, &cfg).expect("index");
    check_index_against_loader(&file, &cfg, &index);
    let shards: std::collections::BTreeSet<usize> = (0..cfg.n_layer)
        .flat_map(|l| MATRICES.map(|m| index.matrix(l, 0, m).map(|x| x.shard)))
        .flatten()
        .collect();
    assert!(shards.len() >= 2, "experts all in one shard: {shards:?}");
    // Each expert read from its own shard file matches the map.
    let mut readers: Vec<DirectReader> = index
        .shard_paths()
        .iter()
        .map(|p| DirectReader::open(p).expect("reader"))
        .collect();
    for l in 0..cfg.n_layer {
        let locs = index.expert(l, 5).expect("expert");
        for loc in locs {
            let mut buf = AlignedBuf::zeroed(engine::experts::io::batch_bytes(&[(
                loc.offset,
                loc.len as usize,
            )]));
            let mut reqs = [ReadRequest::new(loc.offset, loc.len as usize, &mut buf)];
            readers[loc.shard].read_batch(&mut reqs).expect("read");
            let want = &file.shard_bytes(loc.shard).expect("shard")
                [loc.offset as usize..(loc.offset + loc.len) as usize];
            assert!(reqs[0].data() == want, "layer {l} shard {}", loc.shard);
        }
    }
}

/// Every way of reading: io_uring or pread, O_DIRECT or buffered.
fn all_modes(depth: u32) -> Vec<ReaderOptions> {
    let mut v = Vec::new();
    for io_uring in [true, false] {
        for direct in [true, false] {
            v.push(ReaderOptions {
                queue_depth: depth,
                io_uring,
                direct,
            });
        }
    }
    v
}

#[test]
fn direct_reads_of_random_expert_ranges_match_the_map() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(dir.path(), Arch::Qwen35Moe, Preset::Q4KM, 3);
    let (file, cfg) = open(&path);
    let index = ExpertIndex::build(&file, &cfg).expect("index");
    let map = file.shard_bytes(0).expect("map");
    let size = map.len() as u64;
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    // Random expert matrices (MTP block included), whole experts, and odd ranges: the
    // first bytes of the file, the last bytes (their covering span runs past the end of
    // the file when its length is not a multiple of 4096), single bytes, a zero-length
    // range.
    let mut ranges: Vec<(u64, usize)> = (0..40)
        .map(|_| {
            let b = rng.random_range(0..index.n_blocks());
            let e = rng.random_range(0..cfg.n_expert);
            let m = MATRICES[rng.random_range(0..3)];
            let loc = index.matrix(b, e, m).expect("in range");
            (loc.offset, loc.len as usize)
        })
        .collect();
    for loc in index.expert(3, 7).expect("expert") {
        ranges.push((loc.offset, loc.len as usize));
    }
    ranges.extend([
        (0, 24),
        (size - 1, 1),
        (size - 5000, 5000),
        (4096, 4096),
        (4095, 2),
        (12_345, 0),
    ]);
    for _ in 0..10 {
        let off = rng.random_range(0..size - 1);
        let len = rng.random_range(1..(size - off).min(300_000)) as usize;
        ranges.push((off, len));
    }
    assert!(
        ranges.iter().any(|&(o, _)| o % 4096 != 0),
        "no unaligned range"
    );
    for depth in [1, 4, 32] {
        for opts in all_modes(depth) {
            let mut reader = DirectReader::with_options(&path, opts).expect("reader");
            assert_eq!(reader.file_size(), size);
            // What was asked for off is off; what was asked for on may fall back (a
            // filesystem without O_DIRECT, a kernel without io_uring).
            if !opts.direct {
                assert!(!reader.is_direct());
            }
            if !opts.io_uring {
                assert!(!reader.uses_io_uring());
            }
            eprintln!("{reader:?}");
            // Fill with a pattern first, so a byte left unread cannot pass as a zero.
            let mut buf = AlignedBuf::zeroed(engine::experts::io::batch_bytes(&ranges));
            buf.iter_mut().for_each(|b| *b = 0xA5);
            let mut reqs = ReadRequest::carve(&mut buf, &ranges).expect("carve");
            reader.read_batch(&mut reqs).expect("read_batch");
            for (r, &(o, l)) in reqs.iter().zip(&ranges) {
                assert_eq!(r.data().len(), l);
                assert!(
                    r.data() == &map[o as usize..o as usize + l],
                    "{opts:?}: {l} bytes at {o} differ from the map"
                );
            }
        }
    }
}

fn read_err(r: Result<(), ReadError>) -> String {
    match r {
        Err(e @ ReadError::Read { .. }) => e.to_string(),
        Err(e) => panic!("expected a read error, got {e}"),
        Ok(()) => panic!("expected an error"),
    }
}

#[test]
fn bad_ranges_are_errors_naming_the_file_offset_and_length() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("data.bin");
    let size = 3 * 4096 + 100;
    let bytes: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&path, &bytes).expect("write");
    let name = path.display().to_string();
    for opts in all_modes(8) {
        let mut reader = DirectReader::with_options(&path, opts).expect("reader");
        let mut buf = AlignedBuf::zeroed(4 * 4096);
        // Past the end of the file.
        let e =
            read_err(reader.read_batch(&mut [ReadRequest::new(size as u64 - 10, 20, &mut buf)]));
        assert!(e.contains(&name), "{e}");
        assert!(e.contains(&format!("offset {}", size - 10)), "{e}");
        assert!(e.contains("reading 20 bytes"), "{e}");
        assert!(e.contains("past the end of the file"), "{e}");
        let e = read_err(reader.read_batch(&mut [ReadRequest::new(u64::MAX - 2, 8, &mut buf)]));
        assert!(e.contains("past the end of the file"), "{e}");
        // A destination that is not aligned, or too small for the covering span.
        let e = read_err(reader.read_batch(&mut [ReadRequest::new(10, 20, &mut buf[1..])]));
        assert!(
            e.contains("not 4096-byte aligned") && e.contains("offset 10"),
            "{e}"
        );
        let e = read_err(reader.read_batch(&mut [ReadRequest::new(4090, 20, &mut buf[..4096])]));
        assert!(e.contains("covering aligned span needs 8192"), "{e}");
        // One bad range fails the batch, and it is the one named.
        let (a, b) = buf.split_at_mut(8192);
        let e = read_err(reader.read_batch(&mut [
            ReadRequest::new(0, 100, a),
            ReadRequest::new(size as u64, 1, b),
        ]));
        assert!(e.contains(&format!("offset {size}")), "{e}");
        // The whole file, and the zero-length range, are fine.
        let mut reqs = [ReadRequest::new(0, size, &mut buf)];
        reader.read_batch(&mut reqs).expect("whole file");
        assert!(reqs[0].data() == &bytes[..]);
        reader
            .read_batch(&mut [ReadRequest::new(size as u64, 0, &mut buf)])
            .expect("empty range");
    }
}

#[test]
fn a_file_truncated_under_the_reader_is_refused_not_read_as_zeros() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("shrinks.bin");
    for opts in all_modes(4) {
        std::fs::write(&path, vec![7u8; 64 * 1024]).expect("write");
        let mut reader = DirectReader::with_options(&path, opts).expect("reader");
        // The reader knows the file it opened: a truncation is a changed file.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_len(10_000))
            .expect("truncate");
        let mut buf = AlignedBuf::zeroed(64 * 1024);
        match reader.read_batch(&mut [ReadRequest::new(8192, 20_000, &mut buf)]) {
            Err(e @ ReadError::Changed { .. }) => {
                let e = e.to_string();
                assert!(e.contains("size went from 65536 to 10000"), "{opts:?}: {e}");
            }
            Err(e) => panic!("{opts:?}: expected the file to be refused as changed, got {e}"),
            Ok(()) => panic!("{opts:?}: a truncated file was read"),
        }
    }
}

#[test]
fn a_queue_depth_out_of_range_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("x.bin");
    std::fs::write(&path, [0u8; 10]).expect("write");
    let e = DirectReader::with_options(
        &path,
        ReaderOptions {
            queue_depth: 0,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("x.bin") && e.contains("queue depth is 0"), "{e}");
    let deep = ReaderOptions {
        queue_depth: engine::experts::io::MAX_QUEUE_DEPTH + 1,
        ..Default::default()
    };
    assert!(DirectReader::with_options(&path, deep).is_err());
    let e = DirectReader::open(&dir.path().join("missing.bin"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.bin"), "{e}");
}

#[test]
fn a_recorded_profile_counts_every_route_of_prefill_and_decode() {
    let dir = tempfile::tempdir().expect("tempdir");
    for arch in [Arch::Qwen3Moe, Arch::Qwen35Moe] {
        let path = common::synth_tiny(dir.path(), arch, Preset::Q8_0, 3);
        let (_, cfg) = open(&path);
        let k = cfg.n_expert_used as u64;
        let input = ProfileInput::Random {
            tokens: 20,
            seed: 4,
        };
        let run = record_profile(&path, &input, 3).expect("record");
        let p = &run.profile;
        assert_eq!(run.prompt_tokens, 20);
        assert_eq!(run.generated.len(), 3);
        assert_eq!(p.tokens, 23);
        assert_eq!(p.arch, arch.name());
        for row in &p.counts {
            assert_eq!(row.iter().sum::<u64>(), 23 * k);
            // No expert is chosen twice for one token.
            assert!(row.iter().all(|&c| c <= 23));
        }
        p.validate(&cfg).expect("valid");
        // Deterministic.
        let again = record_profile(&path, &input, 3).expect("record");
        assert_eq!(again.profile, run.profile);

        // The decode path (one token per step) records what the prefill path records for
        // the same tokens: routing is the model's, whichever path computes it.
        let first = ProfileInput::Ids(vec![17]);
        let decoded = record_profile(&path, &first, 6).expect("decode");
        let mut all = vec![17];
        all.extend(&decoded.generated);
        let prefilled = record_profile(&path, &ProfileInput::Ids(all), 0).expect("prefill");
        assert_eq!(prefilled.profile.tokens, 7);
        assert_eq!(prefilled.profile.counts, decoded.profile.counts, "{arch}");

        // Text goes through the model's tokenizer; the file loads back.
        let text =
            record_profile(&path, &ProfileInput::Text("Hello, experts.".into()), 0).expect("text");
        assert!(text.prompt_tokens > 1);
        let saved = dir.path().join("routing.json");
        text.profile.save(&saved).expect("save");
        assert_eq!(
            RoutingProfile::load(&saved, &cfg).expect("load"),
            text.profile
        );

        let e = record_profile(&path, &ProfileInput::Ids(vec![cfg.n_vocab as u32]), 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("outside the vocabulary"), "{e}");
        std::fs::remove_file(&path).expect("rm");
    }
}
