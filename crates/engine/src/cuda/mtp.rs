//! MTP drafts on the GPU: the bookkeeping of `cpu/mtp.rs` over the device's passes
//! (`backend/mtp.rs`). After every trunk step the positions it made computable are
//! run through the MTP block from the step's hidden rows (`fill`), so the block's
//! cache is what training saw; a draft chains from the last trunk row, each token's
//! argmax written where the next pass embeds it, with one download for all of them.
//! Drafts never reach the output (a verify step keeps only what plain decoding
//! emits), so this state may lag: a restored sequence drafts nothing until its next
//! step starts the cache again.

use super::weights::cuda_err;
use super::CudaExecutor;
use model::{Backend, ExecError};

impl CudaExecutor {
    /// `Executor::enable_mtp`: passes keep their hidden rows from now on (graphs
    /// and tiered steps' segments captured without that copy are dropped).
    pub(super) fn start_mtp(&mut self) -> bool {
        if self.be.mtp.is_none() {
            return false;
        }
        self.be.set_keep_hidden(true);
        for g in &mut self.graphs {
            *g = [None, None];
        }
        for g in &mut self.segments {
            *g = [None, None];
        }
        self.row_graphs.clear();
        self.mtp_graphs.clear();
        self.verify_graphs.clear();
        true
    }

    /// Sequence `seq`'s MTP passes with their inputs written (`mtp_inputs`): with
    /// `k` 0 one pass over `n` rows (a fill: the hidden rows in `MtpBufs::input`),
    /// else `k` chained drafts from the one row there, each argmax written where the
    /// next pass embeds it and into `argmax_out[i]`. Kernels only (capturable);
    /// returns where the drafts are.
    fn launch_mtp(&mut self, seq: usize, n: usize, k: usize) -> Result<u64, ExecError> {
        let st = &self.states[seq];
        let (Some(bufs), Some(m)) = (&self.be.mtp, st.mtp.as_ref()) else {
            return Err(ExecError::new("MTP pass", "no MTP block in VRAM"));
        };
        let (h, pos, mpos) = (bufs.input.ptr(), bufs.pos.ptr(), bufs.mpos.ptr());
        let caches = (m.k.ptr(), m.v.ptr());
        let n_ctx = st.n_ctx;
        if k == 0 {
            self.be.mtp_pass(n, h, (pos, mpos), caches, n_ctx, false)?;
            return Ok(0);
        }
        let gpu = &self.be.gpu;
        let ids = self.be.token_ids();
        let row = (self.be.cfg.n_embd * 4) as u64;
        for i in 0..k as u64 {
            let at = (pos + 4 * i, mpos + 12 * i);
            let (out, lg) = self.be.mtp_pass(1, h, at, caches, n_ctx, true)?;
            let lg = lg.ok_or_else(|| ExecError::new("mtp_draft", "no logits"))?;
            // The draft: where the next pass embeds it, and its place in the answer.
            gpu.argmax_rows(
                lg.ptr,
                self.be.cfg.n_vocab,
                1,
                ids,
                self.argmax_scratch.ptr(),
            )
            .map_err(cuda_err("argmax"))?;
            gpu.copy_device(ids, self.argmax_out.ptr() + 4 * i, 4)
                .map_err(cuda_err("MTP draft"))?;
            gpu.copy_device(out.ptr, h, row)
                .map_err(cuda_err("MTP hidden rows"))?;
        }
        Ok(self.argmax_out.ptr())
    }

    /// [`Self::launch_mtp`] replayed from a graph (captured the first time) where the
    /// passes need nothing from the host (a few rows: their routing stays on the
    /// device); without graphs or VRAM for one, the same kernels one by one.
    fn run_mtp(&mut self, seq: usize, n: usize, k: usize) -> Result<u64, ExecError> {
        if !self.be.mtp_on_device(n) {
            return self.launch_mtp(seq, n, k);
        }
        self.replay(
            |ex| &mut ex.mtp_graphs,
            (seq, n, k),
            "an MTP pass",
            |ex| ex.launch_mtp(seq, n, k),
        )
    }

    /// After a step fed `tokens` at `pos0` to sequence `seq`, whose post-norm hidden
    /// rows are rows `row0..` of the pass's (`MtpBufs::hid`): runs the MTP positions
    /// the step made computable (each p with x_p fed and h_{p−1} known) and keeps the
    /// step's last rows for drafts and rollbacks.
    pub(super) fn mtp_fill(
        &mut self,
        seq: usize,
        tokens: &[u32],
        pos0: usize,
        row0: usize,
    ) -> Result<(), ExecError> {
        let (Some(bufs), Some(st)) = (&self.be.mtp, self.states[seq].mtp.as_mut()) else {
            return Ok(());
        };
        if !self.be.wants_hidden() {
            return Ok(());
        }
        let gpu = &self.be.gpu;
        let e = self.be.cfg.n_embd;
        let row = (e * 4) as u64;
        let n = tokens.len();
        let hid = bufs.hid.ptr() + row0 as u64 * row;
        let last = st.span;
        let f = st.span.fill(pos0, n);
        if f.rows > 0 {
            // The pass's hidden rows: h_{p−1} for p in first..pos0+n.
            let mut at = bufs.input.ptr();
            if f.prev {
                // h_{pos0−1}: a row the step before kept (a rolled-back step's included).
                let src = st.hid.ptr() + (pos0 - 1 - last.pos0) as u64 * row;
                gpu.copy_device(src, at, row)
                    .map_err(cuda_err("MTP hidden rows"))?;
                at += row;
            }
            gpu.copy_device(hid, at, (n - 1) as u64 * row)
                .map_err(cuda_err("MTP hidden rows"))?;
            let at = f.first - st.span.base;
            self.be
                .mtp_inputs(&tokens[f.first - pos0..], f.rows, (f.first, at))?;
            self.run_mtp(seq, f.rows, 0)?;
        }
        let Some(st) = self.states[seq].mtp.as_mut() else {
            unreachable!("checked above")
        };
        let kept = n.min(st.keeps(e));
        st.span.filled(pos0, n, kept);
        self.be
            .gpu
            .copy_device(
                hid + (n - kept) as u64 * row,
                st.hid.ptr(),
                kept as u64 * row,
            )
            .map_err(cuda_err("MTP hidden rows"))?;
        Ok(())
    }

    /// `Executor::mtp_draft`: up to `k` greedy drafts after `token`, which the next
    /// step feeds at sequence `seq`'s end; none when the state does not reach it.
    pub(super) fn mtp_drafts(
        &mut self,
        seq: usize,
        token: u32,
        k: usize,
    ) -> Result<Vec<u32>, ExecError> {
        let n = self.states.len();
        let st = self.states.get(seq).ok_or_else(|| {
            ExecError::new("mtp_draft", format!("no sequence {seq} (there are {n})"))
        })?;
        let n_ctx = st.n_ctx;
        let (Some(bufs), Some(m)) = (&self.be.mtp, st.mtp.as_ref()) else {
            return Ok(Vec::new());
        };
        let Some(t) = m.span.draft_at().filter(|_| self.be.wants_hidden()) else {
            return Ok(Vec::new());
        };
        // The draft's own position t + i + 1 must fit the context too.
        let k = k
            .min(n_ctx.saturating_sub(t + 1))
            .min(self.argmax_out.len());
        if k == 0 {
            return Ok(Vec::new());
        }
        let row = (self.be.cfg.n_embd * 4) as u64;
        let last = m.hid.ptr() + (m.span.rows - 1) as u64 * row;
        self.be
            .gpu
            .copy_device(last, bufs.input.ptr(), row)
            .map_err(cuda_err("MTP hidden rows"))?;
        self.be.mtp_inputs(&[token], k, (t, t - m.span.base))?;
        let out = self.run_mtp(seq, 1, k)?;
        let gpu = &self.be.gpu;
        let d: Vec<i32> = gpu.download(out, k).map_err(cuda_err("download drafts"))?;
        Ok(d.into_iter().map(|t| t as u32).collect())
    }
}
