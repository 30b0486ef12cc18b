//! Synthetic GGUF models: any supported arch and geometry, seeded random weights, laid
//! out exactly as llama.cpp's converter followed by `llama-quantize` would write them.
//!
//! `scoria synth` and the tests use [`synthesize`]; tests that need a model with random
//! weights use [`synthetic_demo_path`]. `scoria serve` without `--model` serves the trained
//! demo model instead, found by [`demo_model_path`] (`demo.rs`). The real geometries are tens of gigabytes, so data is generated
//! tensor by tensor in parallel chunks (see [`gen`]) while a writer thread streams the
//! previous batch to disk: the file is written at disk speed and never held in memory.

pub mod accounting;
pub mod demo;
pub mod gen;
pub mod plan;

use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use gguf::{GgmlType, GgufWriter, Value, ValueType, WriteError};
use rayon::prelude::*;

use crate::geometry::{Arch, Geometry};
use crate::vocab::{self, VocabError};
pub use demo::{demo_model_path, DemoError, DEMO_MODEL_FILE, DEMO_MODEL_SHA256};
pub use plan::TensorSpec;

/// Version of the bytes `synthesize` produces for a given (geometry, preset, seed). Bump
/// it whenever the layout or the generators change, so cached demo models are remade.
pub const SYNTH_VERSION: u32 = 1;

/// Seed of the synthetic demo model ([`synthetic_demo`]).
pub const DEMO_SEED: u64 = 0x5C0_21A;

/// Quantization presets: the file types llama.cpp would produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Preset {
    /// `llama-quantize Q4_K_M`: experts Q4_K with Q6_K `ffn_down` on the `use_more_bits`
    /// layers, `attn_v`/`attn_qkv` likewise, `output` Q6_K, the rest Q4_K.
    Q4KM,
    /// `llama-quantize Q8_0`: every quantizable tensor Q8_0.
    Q8_0,
    /// Converter `--outtype f32`.
    F32,
    /// Converter `--outtype f16` (routers, norms, conv and 1-D tensors stay F32).
    F16,
    /// Converter `--outtype bf16`.
    Bf16,
    /// Every quantizable tensor in one quantized type (`--quant iq2_xxs`, ...): a tensor
    /// whose rows are not whole blocks of it falls back to Q8_0.
    Uniform(GgmlType),
    /// A mix as people download them: each tensor role's type from the published files
    /// (see [`Mix`]).
    Mix(Mix),
}

/// The per-role mixes of the downloaded low-bit files (`plan::mix_type` gives each
/// role's type and where the assignment comes from).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mix {
    /// Unsloth's UD-Q2_K_XL.
    UdQ2KXL,
    /// Unsloth's UD-Q3_K_XL.
    UdQ3KXL,
    /// Unsloth's UD-IQ2_XXS.
    UdIq2Xxs,
    /// `llama-quantize MXFP4_MOE`: routed experts MXFP4, the rest Q8_0.
    Mxfp4Moe,
    /// NVFP4 as llama.cpp's converter writes it from NVIDIA's FP4 checkpoints: every
    /// matrix NVFP4 with its second-level scale beside it (`<stem>.scale`, one per
    /// expert for a stack), the embedding and the LM head BF16 (the checkpoints leave
    /// them unquantized).
    Nvfp4Scaled,
}

/// The quantized types `--quant` takes by name, with the `general.file_type`
/// (llama_ftype) a file of mostly that type carries.
const UNIFORM: [(GgmlType, &str, u32); 22] = [
    (GgmlType::Q4_0, "q4_0", 2),
    (GgmlType::Q4_1, "q4_1", 3),
    (GgmlType::Q5_0, "q5_0", 8),
    (GgmlType::Q5_1, "q5_1", 9),
    (GgmlType::Q2_K, "q2_k", 10),
    (GgmlType::Q3_K, "q3_k", 11),
    (GgmlType::Q4_K, "q4_k", 14),
    (GgmlType::Q5_K, "q5_k", 16),
    (GgmlType::Q6_K, "q6_k", 18),
    (GgmlType::IQ2_XXS, "iq2_xxs", 19),
    (GgmlType::IQ2_XS, "iq2_xs", 20),
    (GgmlType::IQ3_XXS, "iq3_xxs", 23),
    (GgmlType::IQ1_S, "iq1_s", 24),
    (GgmlType::IQ4_NL, "iq4_nl", 25),
    (GgmlType::IQ3_S, "iq3_s", 26),
    (GgmlType::IQ2_S, "iq2_s", 28),
    (GgmlType::IQ4_XS, "iq4_xs", 30),
    (GgmlType::IQ1_M, "iq1_m", 31),
    (GgmlType::TQ1_0, "tq1_0", 36),
    (GgmlType::TQ2_0, "tq2_0", 37),
    (GgmlType::MXFP4, "mxfp4", 38),
    (GgmlType::NVFP4, "nvfp4", 39),
];

const fn uniform_entry(ty: GgmlType) -> (&'static str, u32) {
    let mut i = 0;
    while i < UNIFORM.len() {
        if UNIFORM[i].0 as u32 == ty as u32 {
            return (UNIFORM[i].1, UNIFORM[i].2);
        }
        i += 1;
    }
    ("?", 0)
}

impl Preset {
    pub const ALL: [Preset; 32] = {
        let mut all = [Preset::Q4KM; 32];
        let head = [
            Preset::Q4KM,
            Preset::Q8_0,
            Preset::F32,
            Preset::F16,
            Preset::Bf16,
            Preset::Mix(Mix::UdQ2KXL),
            Preset::Mix(Mix::UdQ3KXL),
            Preset::Mix(Mix::UdIq2Xxs),
            Preset::Mix(Mix::Mxfp4Moe),
            Preset::Mix(Mix::Nvfp4Scaled),
        ];
        let mut i = 0;
        while i < head.len() {
            all[i] = head[i];
            i += 1;
        }
        let mut j = 0;
        while j < UNIFORM.len() {
            all[head.len() + j] = Preset::Uniform(UNIFORM[j].0);
            j += 1;
        }
        all
    };

    /// The name `--quant` takes.
    pub const fn name(self) -> &'static str {
        match self {
            Preset::Q4KM => "q4_k_m",
            Preset::Q8_0 => "q8_0",
            Preset::F32 => "f32",
            Preset::F16 => "f16",
            Preset::Bf16 => "bf16",
            Preset::Uniform(ty) => uniform_entry(ty).0,
            Preset::Mix(Mix::UdQ2KXL) => "ud_q2_k_xl",
            Preset::Mix(Mix::UdQ3KXL) => "ud_q3_k_xl",
            Preset::Mix(Mix::UdIq2Xxs) => "ud_iq2_xxs",
            Preset::Mix(Mix::Mxfp4Moe) => "mxfp4_moe",
            Preset::Mix(Mix::Nvfp4Scaled) => "nvfp4_scaled",
        }
    }

    /// `general.file_type` (llama_ftype).
    pub const fn file_type(self) -> u32 {
        match self {
            Preset::F32 => 0,
            Preset::F16 => 1,
            Preset::Q8_0 => 7,
            Preset::Q4KM => 15,
            Preset::Bf16 => 32,
            Preset::Uniform(ty) => uniform_entry(ty).1,
            // Q2_K, Q3_K_M, IQ2_XXS, MXFP4_MOE: the file types the mixes are made from.
            Preset::Mix(Mix::UdQ2KXL) => 10,
            Preset::Mix(Mix::UdQ3KXL) => 12,
            Preset::Mix(Mix::UdIq2Xxs) => 19,
            Preset::Mix(Mix::Mxfp4Moe) => 38,
            Preset::Mix(Mix::Nvfp4Scaled) => 39,
        }
    }

    pub const fn is_quantized(self) -> bool {
        !matches!(self, Preset::F32 | Preset::F16 | Preset::Bf16)
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> Result<Preset, String> {
        let lower = s.to_ascii_lowercase().replace('-', "_");
        Preset::ALL
            .into_iter()
            .find(|p| p.name() == lower)
            .ok_or_else(|| {
                let names: Vec<&str> = Preset::ALL.iter().map(|p| p.name()).collect();
                format!(
                    "unknown quantization preset `{s}` (one of {})",
                    names.join(", ")
                )
            })
    }
}

/// How to synthesize.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub preset: Preset,
    pub seed: u64,
    /// fsync the file before renaming it into place (so the reported time includes the
    /// flush to disk).
    pub sync: bool,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            preset: Preset::Q4KM,
            seed: 1,
            sync: true,
        }
    }
}

/// What was written.
#[derive(Debug, Clone)]
pub struct SynthReport {
    pub path: PathBuf,
    pub geometry: String,
    pub arch: Arch,
    pub preset: Preset,
    pub seed: u64,
    pub file_size: u64,
    /// Header, metadata and tensor infos (unpadded).
    pub header_bytes: u64,
    /// Absolute offset of the data section.
    pub data_start: u64,
    pub n_tensors: usize,
    /// (type, tensors, bytes without padding), by type.
    pub by_type: Vec<(GgmlType, usize, u64)>,
    pub seconds: f64,
}

impl SynthReport {
    pub fn bytes_per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.file_size as f64 / self.seconds
        } else {
            0.0
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    // The cause is in the message, not a `source`, so `{:#}` chains print it once.
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{path}: {err}")]
    Write { path: PathBuf, err: WriteError },
    #[error("cannot lay out the model: {0}")]
    Layout(WriteError),
    #[error(transparent)]
    Plan(#[from] plan::PlanError),
    #[error("tensor `{name}`: {err}")]
    Gen { name: String, err: gen::GenError },
    #[error(transparent)]
    Vocab(#[from] VocabError),
    #[error(
        "geometry {geometry} has {geometry_vocab} vocabulary rows but its {vocab:?} vocabulary has {vocab_size} tokens"
    )]
    VocabSize {
        geometry: String,
        geometry_vocab: u32,
        vocab: vocab::QwenVocab,
        vocab_size: usize,
    },
    #[error("no cache directory: set SCORIA_CACHE_DIR, XDG_CACHE_HOME or HOME")]
    NoCacheDir,
    #[error("{0}: not a file path")]
    BadPath(PathBuf),
    #[error("the writer thread panicked")]
    WriterPanicked,
}

fn arr_str(items: &[String]) -> Value {
    Value::Array(
        ValueType::String,
        items.iter().map(|s| Value::String(s.clone())).collect(),
    )
}

/// The metadata a synthetic file of `g` carries, in file order.
pub fn metadata(g: &Geometry, opts: &SynthOptions) -> Result<Vec<(String, Value)>, SynthError> {
    let a = g.arch.name();
    let mut kv: Vec<(String, Value)> = Vec::new();
    let mut put = |k: String, v: Value| kv.push((k, v));
    let s = |x: &str| Value::String(x.to_string());
    put("general.architecture".into(), s(a));
    put("general.type".into(), s("model"));
    put(
        "general.name".into(),
        Value::String(format!("scoria synthetic {}", g.name)),
    );
    put("scoria.synthetic".into(), Value::Bool(true));
    put("scoria.synthetic.geometry".into(), s(g.name));
    put("scoria.synthetic.seed".into(), Value::U64(opts.seed));
    put("scoria.synthetic.version".into(), Value::U32(SYNTH_VERSION));
    for (k, v) in g.hparams() {
        put(k, v);
    }
    put(
        "general.file_type".into(),
        Value::U32(opts.preset.file_type()),
    );
    put("general.quantization_version".into(), Value::U32(2));

    let which = g.vocab();
    let v = vocab::load(which)?;
    if v.tokens.len() != g.n_vocab as usize {
        return Err(SynthError::VocabSize {
            geometry: g.name.to_string(),
            geometry_vocab: g.n_vocab,
            vocab: which,
            vocab_size: v.tokens.len(),
        });
    }
    put("tokenizer.ggml.model".into(), s("gpt2"));
    put("tokenizer.ggml.pre".into(), s(v.pre));
    put("tokenizer.ggml.tokens".into(), arr_str(&v.tokens));
    put(
        "tokenizer.ggml.token_type".into(),
        Value::Array(
            ValueType::I32,
            v.token_types.iter().map(|&t| Value::I32(t)).collect(),
        ),
    );
    put("tokenizer.ggml.merges".into(), arr_str(&v.merges));
    if let Some(id) = v.eos_id {
        put("tokenizer.ggml.eos_token_id".into(), Value::U32(id));
    }
    if let Some(id) = v.pad_id {
        put("tokenizer.ggml.padding_token_id".into(), Value::U32(id));
    }
    if let Some(id) = v.bos_id {
        put("tokenizer.ggml.bos_token_id".into(), Value::U32(id));
    }
    put("tokenizer.ggml.add_bos_token".into(), Value::Bool(false));
    let template = match g.arch {
        Arch::Qwen35Moe => crate::chat::QWEN35_TEMPLATE,
        Arch::Qwen3Next | Arch::Qwen3Moe => crate::chat::QWEN3_TEMPLATE,
    };
    put("tokenizer.chat_template".into(), s(template));
    Ok(kv)
}

/// A writer with every kv and tensor of the file declared, and the tensor plan.
pub fn declare(
    g: &Geometry,
    opts: &SynthOptions,
) -> Result<(GgufWriter, Vec<TensorSpec>), SynthError> {
    let specs = plan::plan(g, opts.preset)?;
    for s in &specs {
        gen::check(s.ty, &s.init).map_err(|err| SynthError::Gen {
            name: s.name.clone(),
            err,
        })?;
    }
    let mut w = GgufWriter::new();
    for (k, v) in metadata(g, opts)? {
        w.add_kv(k, v).map_err(SynthError::Layout)?;
    }
    for s in &specs {
        w.add_tensor(s.name.as_str(), &s.dims, s.ty)
            .map_err(SynthError::Layout)?;
    }
    Ok((w, specs))
}

/// Bytes the file for (`g`, `opts`) will have.
pub fn file_size(g: &Geometry, opts: &SynthOptions) -> Result<u64, SynthError> {
    let (w, _) = declare(g, opts)?;
    Ok(w.layout().map_err(SynthError::Layout)?.file_size)
}

/// Writes the synthetic model `g` to `path` (through a temporary file in the same
/// directory, renamed into place when complete). `progress(done, total)` is called on the
/// calling thread with bytes written so far.
pub fn synthesize(
    path: &Path,
    geometry: &Geometry,
    opts: &SynthOptions,
    progress: &dyn Fn(u64, u64),
) -> Result<SynthReport, SynthError> {
    let start = Instant::now();
    let file_name = path
        .file_name()
        .ok_or_else(|| SynthError::BadPath(path.to_path_buf()))?
        .to_string_lossy()
        .into_owned();
    let (writer, specs) = declare(geometry, opts)?;
    let layout = writer.layout().map_err(SynthError::Layout)?;
    let total = layout.file_size;
    let tmp = partial_path(path, &file_name);
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |err| SynthError::Io { path: p, err }
    };
    let file = File::create(&tmp).map_err(io(path))?;
    let result = write_all(writer, file, &specs, opts, total, progress);
    match result {
        Ok(()) => {}
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(match e {
                Failure::Write(err) => SynthError::Write {
                    path: path.to_path_buf(),
                    err,
                },
                Failure::Panicked => SynthError::WriterPanicked,
            });
        }
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(path)(e));
    }
    progress(total, total);
    let mut by_type: Vec<(GgmlType, usize, u64)> = Vec::new();
    for t in &layout.tensors {
        match by_type.iter_mut().find(|(ty, _, _)| *ty == t.ty) {
            Some(e) => {
                e.1 += 1;
                e.2 += t.size;
            }
            None => by_type.push((t.ty, 1, t.size)),
        }
    }
    by_type.sort_by_key(|t| std::cmp::Reverse(t.2));
    Ok(SynthReport {
        path: path.to_path_buf(),
        geometry: geometry.name.to_string(),
        arch: geometry.arch,
        preset: opts.preset,
        seed: opts.seed,
        file_size: total,
        header_bytes: layout.header_bytes,
        data_start: layout.data_start,
        n_tensors: layout.tensors.len(),
        by_type,
        seconds: start.elapsed().as_secs_f64(),
    })
}

enum Failure {
    Write(WriteError),
    Panicked,
}

/// Generates batches of chunks on the rayon pool while a writer thread streams the
/// previous batches to `file`.
fn write_all(
    mut writer: GgufWriter,
    file: File,
    specs: &[TensorSpec],
    opts: &SynthOptions,
    total: u64,
    progress: &dyn Fn(u64, u64),
) -> Result<(), Failure> {
    let written = AtomicU64::new(0);
    let batch_chunks = rayon::current_num_threads().max(1) as u64;
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::sync_channel::<Vec<Vec<u8>>>(2);
        let (recycle_tx, recycle_rx) = mpsc::channel::<Vec<u8>>();
        let written_ref = &written;
        let sync = opts.sync;
        let handle = scope.spawn(move || -> Result<(), WriteError> {
            let mut out = BufWriter::with_capacity(8 << 20, file);
            writer.write_header(&mut out)?;
            out.flush()?;
            written_ref.store(writer_pos(&writer), Ordering::Relaxed);
            for batch in rx {
                for buf in batch {
                    writer.write_tensor_chunk(&mut out, &buf)?;
                    written_ref.fetch_add(buf.len() as u64, Ordering::Relaxed);
                    let _ = recycle_tx.send(buf);
                }
            }
            writer.finish(&mut out)?;
            let file = out
                .into_inner()
                .map_err(|e| WriteError::Io(e.into_error()))?;
            if sync {
                file.sync_all()?;
            }
            Ok(())
        });
        'tensors: for spec in specs {
            let n_elements: u64 = spec.dims.iter().product();
            let n_blocks = n_elements / spec.ty.block_size() as u64;
            let per_chunk = gen::blocks_per_chunk(spec.ty);
            let n_chunks = n_blocks.div_ceil(per_chunk);
            let stream = gen::name_hash(&spec.name);
            let mut c0 = 0u64;
            while c0 < n_chunks {
                let c1 = n_chunks.min(c0 + batch_chunks);
                let bufs: Vec<Vec<u8>> = (c0..c1)
                    .map(|_| recycle_rx.try_recv().unwrap_or_default())
                    .collect();
                let bufs: Vec<Vec<u8>> = bufs
                    .into_par_iter()
                    .enumerate()
                    .map(|(i, mut buf)| {
                        let c = c0 + i as u64;
                        buf.clear();
                        let nb = per_chunk.min(n_blocks - c * per_chunk) as usize;
                        let mut rng = gen::Rng::new(opts.seed, stream, c);
                        gen::generate(spec.ty, &spec.init, nb, &mut rng, &mut buf);
                        buf
                    })
                    .collect();
                if tx.send(bufs).is_err() {
                    // The writer stopped; its error comes out of join below.
                    break 'tensors;
                }
                progress(written.load(Ordering::Relaxed), total);
                c0 = c1;
            }
        }
        drop(tx);
        match handle.join() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Failure::Write(e)),
            Err(_) => Err(Failure::Panicked),
        }
    })
}

/// Bytes of the header region once `write_header` has run.
fn writer_pos(w: &GgufWriter) -> u64 {
    w.layout().map_or(0, |l| l.data_start)
}

/// Where scoria caches what it makes: `$SCORIA_CACHE_DIR`, else `$XDG_CACHE_HOME/scoria`,
/// else `$HOME/.cache/scoria`.
pub fn cache_dir() -> Option<PathBuf> {
    let nonempty = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(d) = nonempty("SCORIA_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = nonempty("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("scoria"));
    }
    nonempty("HOME").map(|h| PathBuf::from(h).join(".cache").join("scoria"))
}

/// The synthetic demo model's geometry and options: `tiny-qwen35moe`, Q8_0, random
/// weights (what `scoria serve` served before the trained demo model; the same file as
/// `scoria synth --geometry tiny --arch qwen35moe --quant q8_0 --seed 6029850`).
pub fn synthetic_demo() -> (Geometry, SynthOptions) {
    let g = Geometry::all()
        .into_iter()
        .find(|g| g.name == "tiny-qwen35moe")
        .unwrap_or_else(|| unreachable!("tiny-qwen35moe is a built-in geometry"));
    let opts = SynthOptions {
        preset: Preset::Q8_0,
        seed: DEMO_SEED,
        sync: true,
    };
    (g, opts)
}

/// Where a file named `file_name` beside `path` is written before it is renamed into
/// place: unique per call, not only per process, since threads of one process may write
/// the same file at once (each renames its own complete copy into place).
pub(crate) fn partial_path(path: &Path, file_name: &str) -> PathBuf {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    path.with_file_name(format!(
        ".{file_name}.partial-{}-{call}",
        std::process::id()
    ))
}

/// The path of the synthetic demo model ([`synthetic_demo`]: random weights, for tests
/// whose point needs them), synthesized into the cache directory on first use and reused
/// while its content version and size match.
pub fn synthetic_demo_path() -> Result<PathBuf, SynthError> {
    let dir = cache_dir().ok_or(SynthError::NoCacheDir)?;
    std::fs::create_dir_all(&dir).map_err(|err| SynthError::Io {
        path: dir.clone(),
        err,
    })?;
    let (g, opts) = synthetic_demo();
    let path = dir.join(format!(
        "demo-{}-{}-seed{}-v{SYNTH_VERSION}.gguf",
        g.name, opts.preset, opts.seed
    ));
    let want = file_size(&g, &opts)?;
    if std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() == want) {
        return Ok(path);
    }
    synthesize(&path, &g, &opts, &|_, _| {})?;
    Ok(path)
}
