//! Batching is invisible (invariant 3 of docs/design.md) on the executor of the test
//! device (`SCORIA_TEST_DEVICE`: the CPU, or the GPU in `scripts/gpu-tests.sh`): a step
//! that runs several sequences in one pass gives every entry the logits (compared bit
//! for bit) and the state (checked through the later steps' logits) that it gets
//! stepped alone, on synthetic models of every arch; a batch that names a sequence
//! twice is refused and changes nothing.

mod common;

use engine::cpu::{CpuBackend, CpuExecutor};
use engine::exec::{Executor, SeqStep, StepOut, Want};
use engine::sampler::{Draw, Edit};
use gguf::GgufFile;
use model::synth::Preset;
use model::{Logits, ModelConfig, ModelWeights};
use std::sync::Arc;

const N_CTX: usize = 64;
const N_SEQ: usize = 4;

fn executor(file: &Arc<GgufFile>, cfg: &ModelConfig, n_seq: usize) -> Box<dyn Executor> {
    let weights = ModelWeights::load(file, cfg).expect("weights");
    match common::test_device() {
        engine::Device::Cpu => {
            let backend = CpuBackend {
                cfg: cfg.clone(),
                weights,
                precision: Default::default(),
                routing: None,
                tier: None,
                hidden: Default::default(),
            };
            Box::new(CpuExecutor::new(backend, N_CTX, n_seq).expect("executor"))
        }
        #[cfg(feature = "cuda")]
        engine::Device::Cuda(n) => Box::new(
            engine::cuda::CudaExecutor::open(n, cfg, &weights, N_CTX, n_seq, Default::default())
                .expect("CUDA executor"),
        ),
        #[cfg(not(feature = "cuda"))]
        d => panic!("{d:?}: this build has no CUDA executor"),
    }
}

/// One entry of a test step: sequence, token count, want. Positions follow
/// each sequence's history; tokens are drawn from a running counter.
type Entry = (usize, usize, Want);

struct Harness {
    n_vocab: usize,
    batched: Box<dyn Executor>,
    /// One executor per sequence, stepped with that sequence's entries alone.
    solo: Vec<Box<dyn Executor>>,
    pos: [usize; N_SEQ],
    next_token: usize,
}

impl Harness {
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| {
                self.next_token += 1;
                ((self.next_token * 7919 + 13) % self.n_vocab) as u32
            })
            .collect()
    }

    /// Runs `entries` as one batch and each alone; asserts identical outputs.
    fn step(&mut self, label: &str, entries: &[Entry]) {
        let toks: Vec<Vec<u32>> = entries.iter().map(|&(_, n, _)| self.tokens(n)).collect();
        // Sampled entries: a flat-ish draw with penalties, its bits from the position.
        let draws: Vec<Option<Draw>> = entries
            .iter()
            .map(|&(seq, n, want)| {
                (want == Want::Sample).then(|| Draw {
                    temperature: 1.5,
                    top_k: if seq % 2 == 0 { 0 } else { 40 },
                    top_p: 0.9,
                    min_w: 0,
                    bits: engine::sampler::draw_bits(seq as u64, (self.pos[seq] + n) as u64),
                    edits: vec![Edit {
                        id: 5,
                        add: 1.0,
                        repeat: 1.3,
                        sub: 0.5,
                    }],
                })
            })
            .collect();
        let batch: Vec<SeqStep> = entries
            .iter()
            .zip(&toks)
            .zip(&draws)
            .map(|((&(seq, _, want), t), d)| SeqStep {
                seq,
                tokens: t,
                pos0: self.pos[seq],
                want,
                media: Default::default(),
                draws: d.as_slice(),
            })
            .collect();
        let got = self.batched.step(&batch).expect("batched step");
        assert_eq!(got.len(), batch.len(), "{label}: one output per entry");
        for (k, s) in batch.iter().enumerate() {
            let alone = self.solo[s.seq]
                .step(&[SeqStep { seq: 0, ..*s }])
                .expect("solo step")
                .remove(0);
            match (&got[k], &alone) {
                (StepOut::Logits(a), StepOut::Logits(b)) => {
                    let rows = match s.want {
                        Want::Logits(Logits::All) => s.tokens.len(),
                        _ => 1,
                    };
                    assert_eq!(a.len(), rows * self.n_vocab, "{label}: entry {k} length");
                    assert!(a.iter().all(|x| x.is_finite()), "{label}: entry {k}");
                    let differ = a
                        .iter()
                        .zip(b)
                        .position(|(x, y)| x.to_bits() != y.to_bits());
                    assert_eq!(
                        differ, None,
                        "{label}: entry {k} (seq {}) logits differ from the solo run at index {differ:?}",
                        s.seq
                    );
                    assert_eq!(a.len(), b.len());
                }
                (StepOut::Token(a), StepOut::Token(b)) => {
                    assert_eq!(a, b, "{label}: entry {k} (seq {}) token", s.seq)
                }
                (StepOut::Tokens(a), StepOut::Tokens(b)) => {
                    assert_eq!(a.len(), s.tokens.len(), "{label}: entry {k} rows");
                    assert_eq!(a, b, "{label}: entry {k} (seq {}) tokens", s.seq)
                }
                (a, b) => panic!("{label}: entry {k}: output kinds differ: {a:?} vs {b:?}"),
            }
        }
        for s in &batch {
            self.pos[s.seq] += s.tokens.len();
        }
    }

    fn clear(&mut self, seq: usize) {
        self.batched.clear(seq).expect("clear");
        self.solo[seq].clear(0).expect("clear");
        self.pos[seq] = 0;
    }
}

fn check(geometry: &str, preset: Preset) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::synth(dir.path(), geometry, preset, 11);
    let file = Arc::new(GgufFile::open(&path).expect("open"));
    let cfg = ModelConfig::from_gguf(&file).expect("config");
    let mut h = Harness {
        n_vocab: cfg.n_vocab,
        batched: executor(&file, &cfg, N_SEQ),
        solo: (0..N_SEQ).map(|_| executor(&file, &cfg, 1)).collect(),
        pos: [0; N_SEQ],
        next_token: 0,
    };
    let last = Want::Logits(Logits::Last);
    let all = Want::Logits(Logits::All);
    let label = |s: &str| format!("{geometry} {preset}: {s}");

    // Prompts of different lengths, one asking for every position's logits.
    h.step(
        &label("prompts"),
        &[(0, 5, Want::Greedy), (1, 3, all), (2, 1, last)],
    );
    // Decode entries at different positions beside a prompt piece of a new
    // sequence and a multi-token piece of a running one.
    h.step(
        &label("decode + prompt"),
        &[
            (0, 1, last),
            (1, 1, Want::Greedy),
            (2, 7, all),
            (3, 6, last),
        ],
    );
    // Only decode entries, in an order unlike the sequences'.
    h.step(
        &label("decode"),
        &[
            (3, 1, last),
            (0, 1, all),
            (2, 1, Want::Greedy),
            (1, 1, Want::Sample),
        ],
    );
    h.step(
        &label("decode again"),
        &[(1, 1, last), (3, 1, last), (0, 1, last), (2, 1, last)],
    );
    // The same sequences again (a device replays the pass it captured for them).
    for r in 0..3 {
        h.step(
            &label(&format!("decode again, {r}")),
            &[
                (1, 1, Want::Sample),
                (3, 1, Want::Greedy),
                (0, 1, Want::Sample),
                (2, 1, last),
            ],
        );
    }
    // A batch naming one sequence twice is refused, naming it, and runs nothing:
    // the following steps still match the solo runs.
    let t = [1u32, 2];
    let err = h
        .batched
        .step(&[
            SeqStep {
                seq: 2,
                tokens: &t[..1],
                pos0: h.pos[2],
                want: last,
                media: Default::default(),
                draws: &[],
            },
            SeqStep {
                seq: 0,
                tokens: &t[..1],
                pos0: h.pos[0],
                want: last,
                media: Default::default(),
                draws: &[],
            },
            SeqStep {
                seq: 2,
                tokens: &t[1..],
                pos0: h.pos[2] + 1,
                want: last,
                media: Default::default(),
                draws: &[],
            },
        ])
        .expect_err("a sequence named twice must be refused");
    assert!(
        err.to_string().contains("sequence 2 appears twice"),
        "error names the sequence: {err}"
    );
    let err = h
        .batched
        .step(&[SeqStep {
            seq: N_SEQ,
            tokens: &t,
            pos0: 0,
            want: last,
            media: Default::default(),
            draws: &[],
        }])
        .expect_err("an unknown sequence must be refused");
    assert!(
        err.to_string().contains(&format!("no sequence {N_SEQ}")),
        "{err}"
    );
    // Multi-token pieces of running sequences, all positions' logits.
    h.step(
        &label("pieces"),
        &[
            (1, 4, all),
            (0, 1, last),
            (3, 2, Want::GreedyRows),
            (2, 3, Want::Sample),
        ],
    );
    // A sequence cleared and started afresh in a batch beside running ones.
    h.clear(2);
    h.step(
        &label("after clear"),
        &[
            (0, 1, last),
            (2, 4, all),
            (1, 1, Want::GreedyRows),
            (3, 1, last),
        ],
    );
    h.step(
        &label("after clear, decode"),
        &[(2, 1, last), (0, 1, last), (3, 3, all), (1, 1, last)],
    );
    // One entry: the single-sequence pass.
    h.step(&label("one entry"), &[(2, 2, all)]);
}

#[test]
fn qwen35moe_batch_equals_solo() {
    check("tiny-qwen35moe", Preset::Q4KM);
}

#[test]
fn qwen3next_batch_equals_solo() {
    check("tiny-qwen3next", Preset::Q4KM);
}

#[test]
fn qwen3moe_batch_equals_solo() {
    check("tiny-qwen3moe", Preset::Q8_0);
}

#[test]
fn qwen35moe_f32_batch_equals_solo() {
    check("tiny-qwen35moe", Preset::F32);
}
