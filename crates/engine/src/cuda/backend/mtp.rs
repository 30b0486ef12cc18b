//! The MTP block's pass on the device (what `cpu/mtp.rs`'s `pass` computes): rows of
//! tokens, each with the trunk's post-norm hidden row before it, through the
//! embedding and hidden norms side by side, the projection back to the model's
//! width, one attention + MoE layer over the sequence's MTP cache, and the head norm;
//! the LM head's logits when asked. The executor (`cuda/mtp.rs`) decides which rows
//! and positions; this file holds the kernels' order and the buffers the pass reads
//! between steps (the trunk's hidden rows, kept by `Backend::keep_hidden`).

use super::{CudaBackend, DBuf, MAX_ROWS};
use crate::cuda::weights::{cuda_err, MixerDev, MtpDev};
use cuda::{ActQ8, DevBuf};
use model::ExecError;

/// What the MTP block keeps on the device beside its weights.
pub(crate) struct MtpBufs {
    pub w: MtpDev,
    /// The last trunk pass's post-norm hidden rows (`Backend::keep_hidden`), in the
    /// pass's row order.
    pub hid: DevBuf<f32>,
    /// A pass's input hidden rows (one more than a step's rows: the row before the
    /// step, kept from the step before).
    pub input: DevBuf<f32>,
    /// Each row's (or chained draft's) cache row, i32 [rows]: the MTP cache is
    /// indexed by position − its first position ...
    pub pos: DevBuf<i32>,
    /// ... and its rotary position, i32 [rows][3] (all three the same), the position
    /// itself.
    pub mpos: DevBuf<i32>,
}

impl MtpBufs {
    /// Rows a pass may take (a prompt piece, or a batched decode step's rows).
    pub fn rows(&self) -> usize {
        self.mpos.len() / 3
    }
}

impl CudaBackend {
    /// Puts the MTP block `w` in place with room for passes of a step's rows. Its
    /// routed experts are all in `w` (uploaded whole, also beside tiered layers), so
    /// its MoE block runs as a resident layer's does.
    pub(crate) fn set_mtp(&mut self, w: MtpDev) -> Result<u64, ExecError> {
        let rows = self.chunk_tokens.max(MAX_ROWS);
        let e = self.cfg.n_embd;
        let alloc = |n: usize, what: &str| {
            self.gpu
                .alloc::<f32>(n, what)
                .map_err(cuda_err("allocate MTP buffers"))
        };
        let hid = alloc(rows * e, "MTP hidden rows")?;
        let input = alloc((rows + 1) * e, "MTP input rows")?;
        let ints = |n: usize| {
            self.gpu
                .alloc::<i32>(n, "MTP positions")
                .map_err(cuda_err("allocate MTP buffers"))
        };
        let (pos, mpos) = (ints(rows)?, ints(3 * rows)?);
        let bytes = hid.bytes() + input.bytes() + pos.bytes() + mpos.bytes();
        self.mtp = Some(MtpBufs {
            w,
            hid,
            input,
            pos,
            mpos,
        });
        Ok(bytes)
    }

    /// Whether an MTP pass over `n` rows needs nothing from the host (so it can be
    /// captured): its MoE block does not (see [`Self::moe_on_device`]).
    pub(crate) fn mtp_on_device(&self, n: usize) -> bool {
        self.mtp
            .as_ref()
            .is_some_and(|m| self.moe_on_device(&m.w.layer.moe, self.cfg.n_layer, n))
    }

    /// Writes what MTP passes read from the device: `tokens` into the step's id
    /// buffer, and for row (or chained draft) i < `n` its cache row `at + i` into
    /// `pos` and its rotary position `p0 + i` into `mpos`. Not capturable (host
    /// copies): the executor writes them before a pass or a captured chain of them.
    pub(crate) fn mtp_inputs(
        &self,
        tokens: &[u32],
        n: usize,
        (p0, at): (usize, usize),
    ) -> Result<(), ExecError> {
        let Some(m) = &self.mtp else {
            return Err(ExecError::new("MTP pass", "no MTP block in VRAM"));
        };
        if n > m.rows() {
            return Err(ExecError::new(
                "MTP pass",
                format!("{n} rows (at most {})", m.rows()),
            ));
        }
        self.upload_ids(tokens)?;
        let pos: Vec<i32> = (at..at + n).map(|p| p as i32).collect();
        let mpos: Vec<i32> = (p0..p0 + n).flat_map(|p| [p as i32; 3]).collect();
        let g = &self.gpu;
        g.copy_to_device(&pos, m.pos.ptr())
            .map_err(cuda_err("upload MTP positions"))?;
        g.copy_to_device(&mpos, m.mpos.ptr())
            .map_err(cuda_err("upload MTP positions"))
    }

    /// The MTP block's pass over `n` rows (kernels only: capturable): the token ids in
    /// the step's id buffer (`mtp_inputs`, or a draft's argmax), hidden rows at
    /// `hidden` (n × n_embd, consecutive), row 0's cache row at `pos_dev` and the rows'
    /// rotary positions at `mpos_dev` (`MtpBufs::pos`, `mpos`: entry i for chained
    /// draft i), their K/V into `caches` (`n_ctx` rows). Returns the head norm's output
    /// rows and, with `logits`, the LM head's; both in the scratch arena (the next
    /// pass reuses it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mtp_pass(
        &self,
        n: usize,
        hidden: u64,
        (pos_dev, mpos_dev): (u64, u64),
        caches: (u64, u64),
        n_ctx: usize,
        logits: bool,
    ) -> Result<(DBuf, Option<DBuf>), ExecError> {
        let Some(m) = &self.mtp else {
            return Err(ExecError::new("MTP pass", "no MTP block in VRAM"));
        };
        let MixerDev::Attention(a) = &m.w.layer.mixer else {
            return Err(ExecError::new(
                "MTP pass",
                "the MTP block's mixer is not attention",
            ));
        };
        if n == 0 || n > m.rows() {
            return Err(ExecError::new(
                "MTP pass",
                format!("{n} rows (at most {})", m.rows()),
            ));
        }
        let g = &self.gpu;
        let (e, eps) = (self.cfg.n_embd, self.cfg.eps);
        let row = (e * 4) as u64;
        self.arena.reset();
        self.normed_q.set(None);
        // The residual stream stays; the projection's inputs go when it is done.
        let x = self.arena.alloc(n, e, "MTP pass")?;
        self.arena.keep();
        let t = &self.w.token_embd;
        let emb = self.arena.alloc(n, e, "MTP pass")?;
        g.embed(
            t.ty,
            t.ptr,
            t.row_bytes,
            t.n_cols,
            self.tok.ptr(),
            n,
            emb.ptr,
        )
        .map_err(cuda_err("embed"))?;
        // [enorm(embedding) | hnorm(hidden)] per row, then eh_proj.
        let (en, hn) = (
            self.arena.alloc(n, e, "MTP pass")?,
            self.arena.alloc(n, e, "MTP pass")?,
        );
        g.rms_norm(emb.ptr, n, e, m.w.enorm.ptr(), eps, en.ptr, ActQ8::NONE)
            .map_err(cuda_err("rms_norm"))?;
        g.rms_norm(hidden, n, e, m.w.hnorm.ptr(), eps, hn.ptr, ActQ8::NONE)
            .map_err(cuda_err("rms_norm"))?;
        let cat = self.arena.alloc(n, 2 * e, "MTP pass")?;
        g.copy_device_2d((en.ptr, row), (cat.ptr, 2 * row), row, n)
            .map_err(cuda_err("MTP concat"))?;
        g.copy_device_2d((hn.ptr, row), (cat.ptr + row, 2 * row), row, n)
            .map_err(cuda_err("MTP concat"))?;
        let cq = self.prepare(&[&m.w.eh_proj], &cat)?;
        self.mm_q_into(&m.w.eh_proj, &cat, cq, &x)?;
        self.arena.release();

        let l = &m.w.layer;
        let h = self.norm_into(&x, None, l.attn_norm.ptr())?;
        let o = self.attend(a, &h, pos_dev, mpos_dev, caches, n_ctx)?;
        let hf = self.norm_into(&x, Some(&o), l.ffn_norm.ptr())?;
        let f = self.moe_of(&l.moe, self.cfg.n_layer, &hf)?;
        let out = self.norm_into(&x, Some(&f), m.w.head_norm.ptr())?;
        let lg = if logits {
            Some(self.mm(self.w.lm_head(), &out)?)
        } else {
            None
        };
        Ok((out, lg))
    }

    /// x += y (when given), then the norm with weights `w` of x into a new buffer, with
    /// its quantized copy for the next product (`prepare`).
    fn norm_into(&self, x: &DBuf, y: Option<&DBuf>, w: u64) -> Result<DBuf, ExecError> {
        let out = self.arena.alloc(x.rows, x.cols, "MTP pass")?;
        let q = if x.cols.is_multiple_of(32) {
            self.arena.alloc_act_q8(x.rows, x.cols)?
        } else {
            ActQ8::NONE
        };
        let eps = self.cfg.eps;
        match y {
            Some(y) => self
                .gpu
                .add_rms_norm(x.ptr, y.ptr, x.rows, x.cols, w, eps, out.ptr, q)
                .map_err(cuda_err("add_rms_norm"))?,
            None => self
                .gpu
                .rms_norm(x.ptr, x.rows, x.cols, w, eps, out.ptr, q)
                .map_err(cuda_err("rms_norm"))?,
        }
        self.normed_q
            .set((q != ActQ8::NONE).then_some((out.ptr, out.rows, q)));
        Ok(out)
    }
}
