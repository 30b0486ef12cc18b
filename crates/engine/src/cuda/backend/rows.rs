//! Rows mode: one token of each of up to [`MAX_ROWS`] sequences in one pass. The
//! executor writes each row's token, position and a device table of its sequence's
//! K/V caches and DeltaNet states ([`CudaBackend::load_rows`]); each mixer then runs
//! its kernels once for all rows (`matvec_multi_rows` for the projections with each
//! row's DeltaNet conv, `dn_step_rows`, `attn_prep`/`attn_core` over the tables),
//! every row with the bits of its one-token step, and a captured pass replays for
//! whatever sequences the tables name.

use super::mixers::dn_step_shape;
use super::{n_delta_net, CudaBackend, CudaState, DBuf};
use crate::cuda::weights::{cuda_err, DevWeight, MixerDev};
use cuda::{ActQ8, DevBuf, Gpu};
use model::{ExecError, ModelConfig, SegmentRows};

/// The most sequences one batched decode pass takes (one token each, their states
/// named by the device tables; see [`CudaBackend::load_rows`]).
pub(crate) const MAX_ROWS: usize = 16;

/// Rows mode's state: the device tables of each row's state and which states they
/// name.
pub(crate) struct RowTables {
    /// Per attention layer the (K, V) caches of each row, per DeltaNet layer the conv
    /// states then the recurrent states, [`MAX_ROWS`] entries a table (written by
    /// [`CudaBackend::load_rows`]).
    tab: DevBuf<u64>,
    /// Which state each row's entries are (empty after one sequence's inputs).
    pub(super) ids: Vec<u64>,
}

impl RowTables {
    pub(super) fn new(gpu: &Gpu, cfg: &ModelConfig) -> Result<RowTables, ExecError> {
        let tables = 2 * (cfg.n_attention_layers() + n_delta_net(cfg));
        let tab = gpu
            .alloc::<u64>(tables.max(1) * MAX_ROWS, "state tables")
            .map_err(cuda_err("allocate step inputs"))?;
        Ok(RowTables {
            tab,
            ids: Vec::new(),
        })
    }
}

/// What names a sequence's state in the device tables: its first buffer's address.
fn state_id(st: &CudaState) -> u64 {
    st.kv
        .first()
        .map(|(k, _)| k.ptr())
        .or_else(|| st.conv.first().map(DevBuf::ptr))
        .unwrap_or(0)
}

impl CudaBackend {
    /// Writes a batched decode step's inputs: row r is one token (`tokens[r]`) of the
    /// sequence whose state is `states[r]`, at `positions[r]`; the state tables name
    /// each row's caches and recurrent state, so the mixers run every row in one
    /// launch (rows mode) and a captured pass replays for whatever sequences the
    /// tables name.
    pub(crate) fn load_rows(
        &mut self,
        tokens: &[u32],
        positions: &[usize],
        states: &[&CudaState],
    ) -> Result<(), ExecError> {
        let n = tokens.len();
        if n > MAX_ROWS || positions.len() != n || states.len() != n {
            return Err(ExecError::new(
                "step",
                format!(
                    "a batched pass of {n} rows ({} positions, {} states; at most {MAX_ROWS})",
                    positions.len(),
                    states.len()
                ),
            ));
        }
        self.upload_ids(tokens)?;
        let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        self.gpu
            .copy_to_device(&pos, self.pos.ptr())
            .map_err(cuda_err("upload positions"))?;
        let mut tab = vec![0u64; self.rows.tab.len()];
        for (r, st) in states.iter().enumerate() {
            for (a, (k, v)) in st.kv.iter().enumerate() {
                tab[a * 2 * MAX_ROWS + 2 * r] = k.ptr();
                tab[a * 2 * MAX_ROWS + 2 * r + 1] = v.ptr();
            }
            let base = 2 * self.cfg.n_attention_layers() * MAX_ROWS;
            for (d, (c, h)) in st.conv.iter().zip(&st.ssm).enumerate() {
                tab[base + 2 * d * MAX_ROWS + r] = c.ptr();
                tab[base + (2 * d + 1) * MAX_ROWS + r] = h.ptr();
            }
        }
        self.gpu
            .copy_to_device(&tab, self.rows.tab.ptr())
            .map_err(cuda_err("upload state tables"))?;
        self.pos_host = positions.to_vec();
        self.mpos_host.clear();
        self.rows.ids = states.iter().map(|s| state_id(s)).collect();
        Ok(())
    }

    /// The table of attention layer `slot`'s (K, V) per row.
    fn kv_tab(&self, slot: usize) -> u64 {
        self.rows.tab.ptr() + (8 * slot * 2 * MAX_ROWS) as u64
    }

    /// The tables of DeltaNet layer `slot`'s conv and recurrent states per row.
    fn dn_tabs(&self, slot: usize) -> (u64, u64) {
        let at = |i: usize| self.rows.tab.ptr() + (8 * i * MAX_ROWS) as u64;
        let base = 2 * self.cfg.n_attention_layers();
        (at(base + 2 * slot), at(base + 2 * slot + 1))
    }

    /// Whether the executor runs one token of several sequences as one pass: the
    /// fused kernels route and compute every row's experts on the device (tiered
    /// experts read the routing on the host, one sequence at a time).
    pub(crate) fn batches_rows(&self) -> bool {
        self.fused && self.tiered.is_none()
    }

    /// Whether `parts` are the rows [`Self::load_rows`] wrote, in order: one token
    /// each, their states named by the tables, at the positions written.
    pub(super) fn rows_mode(&self, parts: &[SegmentRows<'_, CudaState>]) -> bool {
        let ids = &self.rows.ids;
        let pos = &self.pos_host;
        self.fused
            && parts.len() > 1
            && ids.len() == parts.len()
            && pos.len() == parts.len()
            && parts
                .iter()
                .zip(ids.iter().zip(pos.iter()))
                .all(|(p, (&id, &at))| p.rows == 1 && state_id(p.state) == id && p.pos0 == at)
    }

    /// The input projections of a mixer in rows mode: every row of `x` against each
    /// of `ws` (at most four) in one launch, into `outs`; with `conv` (state table,
    /// taps, d_conv) matrix 0's rows go through each row's DeltaNet conv.
    fn multi_rows(
        &self,
        ws: &[&DevWeight],
        x: &DBuf,
        xq: ActQ8,
        conv: Option<(u64, u64, usize)>,
    ) -> Result<Vec<DBuf>, ExecError> {
        let outs: Vec<DBuf> = ws
            .iter()
            .map(|w| self.arena.alloc(x.rows, w.n_rows, "matvec_multi_rows"))
            .collect::<Result<_, _>>()?;
        let mats: Vec<cuda::Mat> = ws.iter().map(|w| w.mat()).collect();
        let ptrs: Vec<u64> = outs.iter().map(|o| o.ptr).collect();
        self.gpu
            .matvec_multi_rows(
                &mats.iter().collect::<Vec<_>>(),
                &ptrs,
                x.ptr,
                xq,
                x.rows,
                conv,
            )
            .map_err(cuda_err("matvec_multi_rows"))?;
        Ok(outs)
    }

    /// Rows mode of a DeltaNet layer: the input projections once over every row with
    /// each row's conv on its own state, then each row's recurrence and gated norm on
    /// its own state in one launch (the one-token kernels' bits), and the output
    /// projection over every row.
    /// None when the layer's shape has no one-token kernel.
    pub(super) fn delta_net_rows(
        &self,
        layer: usize,
        slot: usize,
        x: &DBuf,
    ) -> Result<Option<DBuf>, ExecError> {
        let (MixerDev::DeltaNet(d), Some(ssm)) = (&self.w.layers[layer].mixer, &self.cfg.ssm)
        else {
            return Ok(None);
        };
        let mut ws: Vec<&DevWeight> = vec![&d.qkv, &d.gate];
        ws.extend(d.proj.iter());
        if !dn_step_shape(&ws, ssm) {
            return Ok(None);
        }
        let n = x.rows;
        let xq = self.prepare(&ws, x)?;
        let (conv_tab, ssm_tab) = self.dn_tabs(slot);
        let outs = self.multi_rows(&ws, x, xq, Some((conv_tab, d.conv.ptr(), ssm.d_conv)))?;
        let (conv, z, proj) = (&outs[0], &outs[1], &outs[2..]);
        let conv_dim = ssm.conv_dim();
        let (y, yq, step) = self.dn_step_args(d, ssm, proj, z, n)?;
        let rows = cuda::DnRows {
            n,
            state_tab: ssm_tab,
            conv_stride: conv_dim,
            beta_stride: d.beta.stride,
            alpha_stride: d.alpha.stride,
        };
        self.gpu
            .dn_step_rows(conv.ptr, &step, &rows, y.ptr, yq)
            .map_err(cuda_err("dn_step_rows"))?;
        Ok(Some(self.mm_q(&d.out, &y, yq)?))
    }

    /// Rows mode of an attention layer: the projections once over every row, then
    /// each row's q/k norm, rotary and cache write, and its attention over its own
    /// cache, in one launch each (the one-token launches' bits), and the output
    /// projection over every row. None when the shape has no rows mode.
    pub(super) fn attention_rows(
        &self,
        layer: usize,
        slot: usize,
        x: &DBuf,
        parts: &[SegmentRows<'_, CudaState>],
    ) -> Result<Option<DBuf>, ExecError> {
        let MixerDev::Attention(a) = &self.w.layers[layer].mixer else {
            return Ok(None);
        };
        let (nh, nkv) = (self.cfg.n_head, self.cfg.n_head_kv);
        let n_ctx = parts[0].state.n_ctx;
        if nkv == 0 || nh / nkv > 16 || parts.iter().any(|p| p.state.n_ctx != n_ctx) {
            return Ok(None);
        }
        if let Some(p) = parts.iter().find(|p| p.pos0 + 1 > n_ctx) {
            return Err(ExecError::new(
                "attention",
                format!("position {} exceeds the context of {n_ctx}", p.pos0),
            ));
        }
        let ws = [&a.q, &a.k, &a.v];
        let xq = self.prepare(&ws, x)?;
        let outs = self.multi_rows(&ws, x, xq, None)?;
        let raw = (&outs[0], &outs[1], &outs[2]);
        let tab = self.kv_tab(slot);
        self.attention_core(a, raw, self.pos.ptr(), 0, (0, 0), tab, n_ctx)
            .map(Some)
    }
}
