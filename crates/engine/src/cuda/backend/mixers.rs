//! One sequence's mixers: attention over its K/V cache and gated DeltaNet over its
//! conv and recurrent state, for a prompt's tokens (the separate kernels) or one
//! token (the fused kernels, with the separate ones' bits). Rows mode (`rows.rs`)
//! runs the same kernels' rows launches for several sequences at once.

use super::{is_float, CudaBackend, CudaState, DBuf};
use crate::cuda::weights::{cuda_err, AttnDev, DevWeight, DnDev, MixerDev};
use cuda::{ActQ8, Rotary};
use model::ExecError;

/// Whether a DeltaNet layer with input projections `ws` has the one-token kernels
/// (`matvec_multi` takes at most four matrices, `dn_step` three state widths).
pub(super) fn dn_step_shape(ws: &[&DevWeight], ssm: &model::SsmConfig) -> bool {
    ws.len() <= 4 && matches!(ssm.d_state, 32 | 64 | 128)
}

impl CudaBackend {
    /// One sequence's attention over its tokens, at positions `pos0..` (its first row's
    /// position on the device; see `check_pos`): `Backend::attention`. `mpos`: 0, or
    /// the rows' multimodal rotary positions on the device (`load_mpos`).
    pub(super) fn attention_seq(
        &self,
        layer: usize,
        slot: usize,
        x: &DBuf,
        pos0: usize,
        state: &mut CudaState,
        mpos: u64,
    ) -> Result<DBuf, ExecError> {
        let pos_dev = self.check_pos(pos0, "attention")?;
        let MixerDev::Attention(a) = &self.w.layers[layer].mixer else {
            return Err(ExecError::new(
                "attention",
                format!("layer {layer} has no attention weights"),
            ));
        };
        let t_n = x.rows;
        if pos0 + t_n > state.n_ctx {
            return Err(ExecError::new(
                "attention",
                format!(
                    "positions {pos0}..{} exceed the context of {}",
                    pos0 + t_n,
                    state.n_ctx
                ),
            ));
        }
        let (kc, vc) = &state.kv[slot];
        self.attend(a, x, pos_dev, mpos, (kc.ptr(), vc.ptr()), state.n_ctx)
    }

    /// Attention `a` over the rows of `x` (the projections, then `attention_core`):
    /// the rows at the positions `pos_dev` gives, their K/V written into `caches`.
    pub(super) fn attend(
        &self,
        a: &AttnDev,
        x: &DBuf,
        pos_dev: u64,
        mpos: u64,
        caches: (u64, u64),
        n_ctx: usize,
    ) -> Result<DBuf, ExecError> {
        let t_n = x.rows;
        let xq = self.prepare(&[&a.q, &a.k, &a.v], x)?;
        let (q_raw, k_raw, v_raw) = if t_n == 1 && self.fused {
            // One token: the three projections in one launch.
            let q_raw = self.arena.alloc(1, a.q.n_rows, "attention")?;
            let k_raw = self.arena.alloc(1, a.k.n_rows, "attention")?;
            let v_raw = self.arena.alloc(1, a.v.n_rows, "attention")?;
            self.gpu
                .matvec_multi(
                    &[&a.q.mat(), &a.k.mat(), &a.v.mat()],
                    &[q_raw.ptr, k_raw.ptr, v_raw.ptr],
                    x.ptr,
                    xq,
                    None,
                )
                .map_err(cuda_err("matvec_multi"))?;
            (q_raw, k_raw, v_raw)
        } else {
            (
                self.mm_q(&a.q, x, xq)?,
                self.mm_q(&a.k, x, xq)?,
                self.mm_q(&a.v, x, xq)?,
            )
        };
        let raw = (&q_raw, &k_raw, &v_raw);
        self.attention_core(a, raw, pos_dev, mpos, caches, 0, n_ctx)
    }

    /// One sequence's DeltaNet over its tokens: `Backend::delta_net`.
    pub(super) fn delta_net_seq(
        &self,
        layer: usize,
        slot: usize,
        x: &DBuf,
        state: &mut CudaState,
    ) -> Result<DBuf, ExecError> {
        let MixerDev::DeltaNet(d) = &self.w.layers[layer].mixer else {
            return Err(ExecError::new(
                "delta_net",
                format!("layer {layer} has no DeltaNet weights"),
            ));
        };
        let ssm =
            self.cfg.ssm.as_ref().ok_or_else(|| {
                ExecError::new("delta_net", "DeltaNet layer in a config without ssm")
            })?;
        let t_n = x.rows;
        let mut ws: Vec<&DevWeight> = vec![&d.qkv, &d.gate];
        ws.extend(d.proj.iter());
        let xq = self.prepare(&ws, x)?;
        if t_n == 1 && self.fused && dn_step_shape(&ws, ssm) {
            return self.delta_net_step(d, ssm, x, xq, state, slot);
        }
        let qkv = self.mm_q(&d.qkv, x, xq)?;
        let z = self.mm_q(&d.gate, x, xq)?;
        let proj: Vec<DBuf> = d
            .proj
            .iter()
            .map(|w| self.mm_q(w, x, xq))
            .collect::<Result<_, _>>()?;
        let conv_dim = ssm.conv_dim();
        let conv = self.arena.alloc(t_n, conv_dim, "delta_net")?;
        // A verify step (the executor checked that it fits the trail; one token leaves
        // nothing to keep, and a captured decode step never names the trail).
        let (conv_trail, ssm_trail) = match &state.trail {
            t if t.armed && t_n > 1 && !t.ssm.is_empty() => (t.conv[slot].ptr(), t.ssm[slot].ptr()),
            _ => (0, 0),
        };
        self.gpu
            .dn_conv(
                qkv.ptr,
                state.conv[slot].ptr(),
                d.conv.ptr(),
                t_n,
                conv_dim,
                ssm.d_conv,
                conv.ptr,
                conv_trail,
            )
            .map_err(cuda_err("dn_conv"))?;
        let scale = 1.0 / (ssm.d_state as f32).sqrt();
        self.gpu
            .dn_qk_norm(conv.ptr, t_n, conv_dim, ssm.n_k_heads, ssm.d_state, scale)
            .map_err(cuda_err("dn_qk_norm"))?;
        let y = self.arena.alloc(t_n, ssm.value_dim(), "delta_net")?;
        self.gpu
            .dn_recurrence(
                conv.ptr,
                t_n,
                conv_dim,
                proj[d.beta.proj].ptr,
                d.beta.stride,
                d.beta.idx.ptr(),
                proj[d.alpha.proj].ptr,
                d.alpha.stride,
                d.alpha.idx.ptr(),
                d.a.ptr(),
                d.dt_bias.ptr(),
                d.k_head_of.ptr(),
                z.ptr,
                d.norm.ptr(),
                self.cfg.eps,
                state.ssm[slot].ptr(),
                ssm.n_k_heads,
                ssm.n_v_heads,
                ssm.d_state,
                y.ptr,
                ssm_trail,
            )
            .map_err(cuda_err("dn_recurrence"))?;
        self.mm(&d.out, &y)
    }

    /// One token of a DeltaNet layer in three launches: the input projections with
    /// the conv of qkv (`matvec_multi`), the q/k norm, recurrence and gated norm with
    /// the output's quantized copy (`dn_step`), and the output projection. The bits
    /// of the prompt path's separate kernels.
    fn delta_net_step(
        &self,
        d: &DnDev,
        ssm: &model::SsmConfig,
        x: &DBuf,
        xq: ActQ8,
        state: &mut CudaState,
        slot: usize,
    ) -> Result<DBuf, ExecError> {
        let conv = self.arena.alloc(1, ssm.conv_dim(), "delta_net")?;
        let z = self.arena.alloc(1, d.gate.n_rows, "delta_net")?;
        let proj: Vec<DBuf> = d
            .proj
            .iter()
            .map(|w| self.arena.alloc(1, w.n_rows, "delta_net"))
            .collect::<Result<_, _>>()?;
        let mut mats = vec![d.qkv.mat(), d.gate.mat()];
        mats.extend(d.proj.iter().map(DevWeight::mat));
        let mut outs = vec![conv.ptr, z.ptr];
        outs.extend(proj.iter().map(|p| p.ptr));
        self.gpu
            .matvec_multi(
                &mats.iter().collect::<Vec<_>>(),
                &outs,
                x.ptr,
                xq,
                Some((state.conv[slot].ptr(), d.conv.ptr(), ssm.d_conv)),
            )
            .map_err(cuda_err("matvec_multi"))?;
        let (y, yq, step) = self.dn_step_args(d, ssm, &proj, &z, 1)?;
        self.gpu
            .dn_step(conv.ptr, &step, state.ssm[slot].ptr(), y.ptr, yq)
            .map_err(cuda_err("dn_step"))?;
        self.mm_q(&d.out, &y, yq)
    }

    /// The output rows of a DeltaNet step (and their quantized copy when the output
    /// projection needs one) and the `dn_step` arguments over the layer's β/α sources
    /// `proj` and gate `z`.
    pub(super) fn dn_step_args(
        &self,
        d: &DnDev,
        ssm: &model::SsmConfig,
        proj: &[DBuf],
        z: &DBuf,
        rows: usize,
    ) -> Result<(DBuf, ActQ8, cuda::DnStep), ExecError> {
        let y = self.arena.alloc(rows, ssm.value_dim(), "delta_net")?;
        let yq = if is_float(d.out.ty) {
            ActQ8::NONE
        } else {
            self.arena.alloc_act_q8(rows, y.cols)?
        };
        let step = cuda::DnStep {
            beta_src: proj[d.beta.proj].ptr,
            beta_idx: d.beta.idx.ptr(),
            alpha_src: proj[d.alpha.proj].ptr,
            alpha_idx: d.alpha.idx.ptr(),
            a: d.a.ptr(),
            dt_bias: d.dt_bias.ptr(),
            k_head_of: d.k_head_of.ptr(),
            z: z.ptr,
            norm_w: d.norm.ptr(),
            eps: self.cfg.eps,
            scale: 1.0 / (ssm.d_state as f32).sqrt(),
            n_k_heads: ssm.n_k_heads,
            n_v_heads: ssm.n_v_heads,
            d_state: ssm.d_state,
        };
        Ok((y, yq, step))
    }

    /// An attention layer after its projections: the q/k norms, rotary and cache
    /// write (`attn_prep`), the attention over the cache (`attn_core`) and the output
    /// projection, for the rows of `q_raw`. `caches` are one sequence's (K, V), whose
    /// first position is at `pos_dev`; or, with `kv_tab`, ignored: each row is one
    /// token of its own sequence, its caches in the table and its position at
    /// `pos_dev` + 4·row (rows mode). `mpos`: 0, or each row's multimodal rotary
    /// position on the device (`cuda::Rotary::mpos`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_core(
        &self,
        a: &AttnDev,
        (q_raw, k_raw, v_raw): (&DBuf, &DBuf, &DBuf),
        pos_dev: u64,
        mpos: u64,
        caches: (u64, u64),
        kv_tab: u64,
        n_ctx: usize,
    ) -> Result<DBuf, ExecError> {
        let cfg = &self.cfg;
        let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
        let n = q_raw.rows;
        let q_stride = if cfg.attn_output_gate { 2 * hd } else { hd };
        let q = self.arena.alloc(n, nh * hd, "attention")?;
        let rope = Rotary {
            table: self.rope.ptr(),
            n_rot: cfg.n_rot,
            mpos,
            sections: cfg.rope_sections.map_or([0, 0], |s| [s[1], s[2]]),
        };
        self.gpu
            .attn_prep(
                q_raw.ptr,
                k_raw.ptr,
                v_raw.ptr,
                n,
                pos_dev,
                nh,
                nkv,
                hd,
                q_stride,
                a.q_norm.ptr(),
                a.k_norm.ptr(),
                cfg.eps,
                &rope,
                caches.0,
                caches.1,
                q.ptr,
                kv_tab,
            )
            .map_err(cuda_err("attn_prep"))?;
        let out = self.arena.alloc(n, nh * hd, "attention")?;
        // The output projection's quantized input, written by the attention kernels.
        let oq = if is_float(a.o.ty) {
            ActQ8::NONE
        } else {
            self.arena.alloc_act_q8(n, nh * hd)?
        };
        let split = if kv_tab == 0 {
            self.gpu.attn_scratch_bytes(n, nh, nkv, hd, n_ctx)
        } else {
            self.gpu.attn_rows_scratch_bytes(n, nh, nkv, hd, n_ctx)
        };
        let scratch = if split > 0 {
            self.arena.alloc_bytes(split as usize, "attention")?
        } else {
            0
        };
        // The kernel finds head h's gate at h·q_stride + head_dim of the raw q row.
        let gate = if cfg.attn_output_gate { q_raw.ptr } else { 0 };
        let quantized = self
            .gpu
            .attn_core(
                q.ptr, n, pos_dev, nh, nkv, hd, caches.0, caches.1, n_ctx, gate, q_stride, out.ptr,
                scratch, oq, kv_tab,
            )
            .map_err(cuda_err("attn_core"))?;
        if oq != ActQ8::NONE && !quantized {
            self.gpu
                .quantize_act(out.ptr, out.rows, out.cols, oq)
                .map_err(cuda_err("quantize_act"))?;
        }
        self.mm_q(&a.o, &out, oq)
    }
}
