//! The CUDA executor: the whole model in one GPU's memory, our own kernels
//! (`crates/cuda`), and each batch-1 decode step replayed as a CUDA graph.
//!
//! Loading checks the VRAM the weights, the sequences' state and the scratch
//! arena need against the free memory before allocating anything, and refuses
//! with the numbers and the remedy (DESIGN.md invariant 5).

mod backend;
mod weights;

pub use backend::{CudaBackend, CudaState, DBuf};

use crate::exec::{Executor, SeqStep, StepOut, Want};
use crate::{Device, DeviceReport, EngineError};
use cuda::{Gpu, Graph};
use model::{ExecError, Logits, ModelConfig, ModelWeights};
use weights::cuda_err;

/// Tokens per step the scratch arena is sized for (a prompt is fed in chunks
/// of at most this many; the engine's chunk is 512).
const MAX_STEP_TOKENS: usize = 512;
/// Positions whose logits one step may return at once (Logits::All is split
/// into pieces of this many tokens).
const MAX_LOGIT_ROWS: usize = 64;
/// VRAM left free for the driver and the CUDA context's own needs.
const RESERVE: u64 = 512 << 20;

/// Where the executor's VRAM went, for the startup account.
#[derive(Debug, Clone, Copy)]
pub struct VramAccount {
    pub weights: u64,
    pub state: u64,
    pub scratch: u64,
    pub total: u64,
}

/// A captured decode step of one sequence: replaying it runs one token.
struct DecodeGraph {
    graph: Graph,
    /// Logits (n_vocab) or the greedy token id (one i32), on the device.
    out: u64,
}

pub struct CudaExecutor {
    be: CudaBackend,
    states: Vec<CudaState>,
    /// Per sequence: the captured step returning logits [0] or a token [1].
    graphs: Vec<[Option<DecodeGraph>; 2]>,
    argmax_out: cuda::DevBuf<i32>,
    use_graphs: bool,
    ordinal: usize,
    name: String,
    vram: VramAccount,
}

// SAFETY: the executor is used by one thread at a time (the engine owns it and
// `Executor` methods take `&mut self`); the `Cell`s in the backend are never
// shared between threads, and the CUDA context is made current by each call.
unsafe impl Send for CudaExecutor {}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

impl CudaExecutor {
    /// Opens GPU `ordinal`, checks the VRAM the model needs, uploads the weights
    /// and allocates `n_seq` sequences of `n_ctx` positions.
    pub fn open(
        ordinal: usize,
        cfg: &ModelConfig,
        weights: &ModelWeights,
        n_ctx: usize,
        n_seq: usize,
    ) -> Result<CudaExecutor, EngineError> {
        let dev = |e: cuda::CudaError| EngineError::Device(e.to_string());
        let gpu = Gpu::open(ordinal).map_err(dev)?;
        let name = gpu.name();
        let (free, total) = gpu.mem_info().map_err(dev)?;
        let w_bytes = weights::upload_bytes(weights);
        let state_one = crate::cpu::state_bytes(cfg, n_ctx) as u64;
        let state = state_one * n_seq as u64;
        // attn_core's key-split partials: the split count depends on the step's
        // token count, so take the largest any step may ask for.
        let attn_split = (1..=MAX_STEP_TOKENS)
            .map(|t| gpu.attn_scratch_bytes(t, cfg.n_head, cfg.n_head_kv, cfg.head_dim, n_ctx))
            .max()
            .unwrap_or(0) as usize;
        let arena = backend::scratch_bytes(cfg, MAX_STEP_TOKENS, MAX_LOGIT_ROWS, attn_split);
        let scratch = arena as u64 + (n_ctx * cfg.n_rot * 4) as u64;
        let need = w_bytes + state + scratch + RESERVE;
        if need > free {
            return Err(EngineError::Memory(format!(
                "cuda:{ordinal} ({name}) has {:.2} GiB free of {:.2} GiB, but this model needs {:.2} GiB: \
                 weights {:.2} GiB + KV/state {:.2} GiB for --max-context {n_ctx} + scratch {:.2} GiB + reserve {:.2} GiB. \
                 Lower --max-context, use a smaller quantization, or run on the CPU (--device cpu)",
                gib(free),
                gib(total),
                gib(need),
                gib(w_bytes),
                gib(state),
                gib(scratch),
                gib(RESERVE),
            )));
        }
        let bar = indicatif::ProgressBar::new(w_bytes);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "uploading weights to {msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_message(format!("cuda:{ordinal}"));
        let w = weights::upload(&gpu, cfg, weights, &|done| bar.set_position(done))?;
        bar.finish_and_clear();
        let be = CudaBackend::new(gpu, cfg.clone(), w, arena, n_ctx, MAX_STEP_TOKENS)?;
        let states = (0..n_seq)
            .map(|_| be.new_state_for(n_ctx))
            .collect::<Result<Vec<_>, _>>()?;
        let argmax_out = be
            .gpu
            .alloc::<i32>(1, "argmax")
            .map_err(cuda_err("allocate"))?;
        let use_graphs = std::env::var_os("SCORIA_NO_GRAPH").is_none();
        let vram = VramAccount {
            weights: w_bytes,
            state,
            scratch: be.arena_bytes() + be.rope_bytes(),
            total,
        };
        tracing::info!(
            "cuda:{ordinal} {name}: weights {:.2} GiB, KV/state {:.2} GiB, scratch {:.2} GiB, of {:.2} GiB",
            gib(vram.weights),
            gib(vram.state),
            gib(vram.scratch),
            gib(total)
        );
        Ok(CudaExecutor {
            be,
            graphs: (0..n_seq).map(|_| [None, None]).collect(),
            states,
            argmax_out,
            use_graphs,
            ordinal,
            name,
            vram,
        })
    }

    pub fn vram(&self) -> VramAccount {
        self.vram
    }

    /// Writes a step's token ids and first position where the kernels read them.
    fn load_inputs(&self, tokens: &[u32], pos0: usize) -> Result<(), ExecError> {
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        self.be
            .gpu
            .copy_to_device(&ids, self.be.tok.ptr())
            .map_err(cuda_err("upload tokens"))?;
        self.be
            .gpu
            .copy_to_device(&[pos0 as i32], self.be.pos.ptr())
            .map_err(cuda_err("upload position"))?;
        self.be.pos_host.set(pos0);
        Ok(())
    }

    /// Runs the forward pass (kernels only; capturable for one token) and, for
    /// `Greedy`, the argmax; returns the device address of the output.
    fn launch_step(
        &mut self,
        seq: usize,
        tokens: &[u32],
        pos0: usize,
        want: Want,
    ) -> Result<u64, ExecError> {
        let logits = model::forward(&self.be, tokens, pos0, &mut self.states[seq], want.logits())?;
        if want == Want::Greedy {
            self.be
                .gpu
                .argmax(logits.ptr, self.be.cfg.n_vocab, self.argmax_out.ptr())
                .map_err(cuda_err("argmax"))?;
            Ok(self.argmax_out.ptr())
        } else {
            Ok(logits.ptr)
        }
    }

    /// One decode token of sequence `seq` through its captured graph
    /// (capturing it the first time).
    fn decode_graph(&mut self, s: &SeqStep) -> Result<u64, ExecError> {
        let slot = usize::from(s.want == Want::Greedy);
        if self.graphs[s.seq][slot].is_none() {
            self.be
                .gpu
                .begin_capture()
                .map_err(cuda_err("begin capture"))?;
            let out = self.launch_step(s.seq, s.tokens, s.pos0, s.want);
            // End the capture whatever happened, so the stream is usable again.
            let graph = self.be.gpu.end_capture().map_err(cuda_err("end capture"));
            let out = out?;
            self.graphs[s.seq][slot] = Some(DecodeGraph { graph: graph?, out });
        }
        let g = self.graphs[s.seq][slot]
            .as_ref()
            .ok_or_else(|| ExecError::new("decode", "graph missing"))?;
        g.graph
            .launch(&self.be.gpu)
            .map_err(cuda_err("graph launch"))?;
        Ok(g.out)
    }

    fn read_out(&self, out: u64, want: Want, rows: usize) -> Result<StepOut, ExecError> {
        Ok(match want {
            Want::Greedy => {
                let t: Vec<i32> = self
                    .be
                    .gpu
                    .download(out, 1)
                    .map_err(cuda_err("download token"))?;
                StepOut::Token(t[0] as u32)
            }
            Want::Logits(_) => StepOut::Logits(
                self.be
                    .gpu
                    .download(out, rows * self.be.cfg.n_vocab)
                    .map_err(cuda_err("download logits"))?,
            ),
        })
    }
}

impl Executor for CudaExecutor {
    fn report(&self) -> DeviceReport {
        DeviceReport {
            device: Device::Cuda(self.ordinal),
            name: self.name.clone(),
            vram_used: Some(self.vram.weights + self.vram.state + self.vram.scratch),
            vram_total: Some(self.vram.total),
        }
    }

    fn clear(&mut self, seq: usize) -> Result<(), ExecError> {
        let st = self
            .states
            .get(seq)
            .ok_or_else(|| ExecError::new("clear", format!("no sequence {seq}")))?;
        self.be.clear_state(st)
    }

    fn step(&mut self, batch: &[SeqStep]) -> Result<Vec<StepOut>, ExecError> {
        let mut outs = Vec::with_capacity(batch.len());
        for s in batch {
            if s.seq >= self.states.len() {
                return Err(ExecError::new("step", format!("no sequence {}", s.seq)));
            }
            if s.tokens.is_empty() {
                return Err(ExecError::new("step", "no tokens"));
            }
            if s.tokens.len() == 1 && s.want != Want::Logits(Logits::All) {
                self.load_inputs(s.tokens, s.pos0)?;
                let out = if self.use_graphs {
                    self.decode_graph(s)?
                } else {
                    self.launch_step(s.seq, s.tokens, s.pos0, s.want)?
                };
                outs.push(self.read_out(out, s.want, 1)?);
                continue;
            }
            // Several tokens: pieces the arena holds (every position's logits
            // need more room, so those pieces are shorter).
            let piece = if s.want == Want::Logits(Logits::All) {
                MAX_LOGIT_ROWS
            } else {
                MAX_STEP_TOKENS
            };
            let out =
                crate::exec::in_pieces(s.tokens, s.pos0, s.want, piece, |chunk, pos0, want| {
                    self.load_inputs(chunk, pos0)?;
                    let out = self.launch_step(s.seq, chunk, pos0, want)?;
                    let rows = if want == Want::Logits(Logits::All) {
                        chunk.len()
                    } else {
                        1
                    };
                    self.read_out(out, want, rows)
                })?;
            outs.push(out);
        }
        Ok(outs)
    }
}
