//! MTP drafts on the CPU: the model's next-next-token block (GGUF `nextn`, as
//! Qwen3.5 trains it) proposes the tokens a verify step checks.
//!
//! MTP position p pairs token x_p with the trunk's post-norm hidden state at p − 1
//! and predicts x_{p+1}; its attention sees the MTP positions before it, whose K/V a
//! sequence keeps in its own cache (`MtpSpan` says which). After every trunk
//! step the positions it made computable are filled from the trunk's own hidden
//! states (`fill`), so the cache is what training saw. A draft chains from the last
//! trunk state: the token about to be fed with h_{t−1} gives d_{t+1}, then d_{t+1}
//! with the MTP's own output gives d_{t+2}, and so on; its K/V are dropped after.
//! Drafts never reach the output: a verify step keeps only what plain decoding
//! emits (invariant 2), so this state may lag (a sequence restored from a snapshot
//! has no MTP cache: it drafts nothing until it is cleared).

use model::math::rms_norm;
use model::weights::{Mixer, MtpWeights};
use model::Backend;

use super::attention::{self, At};
use super::{moe, Act, CpuBackend, KvCache};
use crate::spec::MtpSpan;

/// A sequence's MTP state: its cache, the last step's hidden rows, and where they
/// stand (`MtpSpan`, the GPU executor's bookkeeping too).
pub struct MtpState {
    kv: KvCache,
    span: MtpSpan,
    /// The trunk's post-norm hidden rows of the last step, positions `span.pos0..`
    /// (`span.rows` of them).
    hidden: Act,
}

impl MtpState {
    pub fn new(kvw: usize) -> MtpState {
        MtpState {
            kv: KvCache::new(kvw),
            span: MtpSpan::EMPTY,
            hidden: Act::zeros(0, 0),
        }
    }

    /// An empty sequence.
    pub fn clear(&mut self) {
        self.kv.free();
        self.span = MtpSpan::EMPTY;
        self.hidden = Act::zeros(0, 0);
    }

    /// The sequence's state came from elsewhere (a snapshot): the MTP cache starts
    /// again after the next step.
    pub fn lose(&mut self) {
        self.clear();
        self.span = MtpSpan::LOST;
    }

    /// The sequence was rolled back to `pos` positions.
    pub fn truncate(&mut self, pos: usize) {
        self.span.truncate(pos);
        self.fit();
    }

    /// The cache and the hidden rows to what the span says.
    fn fit(&mut self) {
        match self.span.cached() {
            0 => self.kv.free(),
            n => self.kv.truncate(n),
        }
        self.hidden.rows = self.span.rows;
        self.hidden.data.truncate(self.span.rows * self.hidden.cols);
    }

    pub fn bytes(&self) -> usize {
        self.kv.bytes() + self.hidden.data.capacity() * 4
    }
}

/// Rows `tokens` at MTP positions `p0..` with the hidden rows `hidden` through the
/// MTP block (K/V written from cache index `at`); the post-norm output rows, and
/// their logits when `logits`.
#[allow(clippy::too_many_arguments)]
fn pass(
    b: &CpuBackend,
    w: &MtpWeights,
    tokens: &[u32],
    hidden: &Act,
    p0: usize,
    at: usize,
    kv: &mut KvCache,
    n_ctx: usize,
    logits: bool,
) -> (Act, Option<Act>) {
    let (d, eps, n) = (b.cfg.n_embd, b.cfg.eps, tokens.len());
    let e = b.embed(tokens).expect("the CPU embeds any vocabulary id");
    let mut cat = Act::zeros(n, 2 * d);
    for r in 0..n {
        let row = cat.row_mut(r);
        row[..d].copy_from_slice(e.row(r));
        rms_norm(&mut row[..d], &w.enorm, eps);
        row[d..].copy_from_slice(hidden.row(r));
        rms_norm(&mut row[d..], &w.hnorm, eps);
    }
    let mut x = b.mm_weight(&w.eh_proj, &cat);
    let Mixer::Attention(aw) = &w.layer.mixer else {
        unreachable!("an MTP block's mixer is attention (weights.rs)")
    };
    let h = b.norm_rows(&x, &w.layer.attn_norm);
    let proj = attention::project(b, aw, &h);
    let rope: Vec<[u32; 3]> = (0..n).map(|i| [(p0 + i) as u32; 3]).collect();
    let at = At {
        pos0: at,
        rope: Some(&rope),
    };
    let core = attention::core(b, aw, &proj, 0, n, at, kv, n_ctx);
    add(b, &mut x, &b.mm_weight(&aw.o, &core));
    let hf = b.norm_rows(&x, &w.layer.ffn_norm);
    add(b, &mut x, &moe::run_mapped(b, &w.layer.moe, &hf));
    let out = b.norm_rows(&x, &w.head_norm);
    let lg = logits.then(|| b.mm_weight(&b.weights.output, &out));
    (out, lg)
}

/// The residual add (the CPU's `add_assign` cannot fail).
fn add(b: &CpuBackend, x: &mut Act, y: &Act) {
    b.add_assign(x, y).expect("rows of one width");
}

/// After a trunk step fed `tokens` at `pos0` and gave the post-norm rows `h`: fills
/// the MTP positions it made computable (`MtpSpan::fill`).
pub(super) fn fill(
    b: &CpuBackend,
    w: &MtpWeights,
    st: &mut MtpState,
    tokens: &[u32],
    pos0: usize,
    h: Act,
    n_ctx: usize,
) {
    let n = tokens.len();
    let f = st.span.fill(pos0, n);
    // The kept rows still reach h_{pos0−1} when `f.prev` (truncated to pos0).
    st.fit();
    if f.rows > 0 {
        let mut hid = Act::zeros(f.rows, h.cols);
        for (i, p) in (f.first..pos0 + n).enumerate() {
            let src = if p == pos0 && f.prev {
                st.hidden.row(pos0 - 1 - st.span.pos0)
            } else {
                h.row(p - 1 - pos0)
            };
            hid.row_mut(i).copy_from_slice(src);
        }
        let at = f.first - st.span.base;
        pass(
            b,
            w,
            &tokens[f.first - pos0..],
            &hid,
            f.first,
            at,
            &mut st.kv,
            n_ctx,
            false,
        );
    }
    st.span.filled(pos0, n, n);
    st.hidden = h;
}

/// Up to `k` drafts after `token`, which the next step feeds at the sequence's end
/// (greedy over the MTP's logits, ties to the lower id); none when the state does
/// not reach the sequence's end. The drafts' K/V are dropped again.
pub(super) fn draft(
    b: &CpuBackend,
    w: &MtpWeights,
    st: &mut MtpState,
    token: u32,
    k: usize,
    n_ctx: usize,
) -> Vec<u32> {
    let Some(t) = st.span.draft_at() else {
        return Vec::new();
    };
    let mut hid = Act::zeros(1, st.hidden.cols);
    hid.row_mut(0)
        .copy_from_slice(st.hidden.row(st.hidden.rows - 1));
    let mut tok = token;
    let mut out = Vec::with_capacity(k);
    for i in 0..k {
        // The draft's own position t + i + 1 must fit the context too.
        if t + i + 1 >= n_ctx {
            break;
        }
        let at = t + i - st.span.base;
        let (o, lg) = pass(b, w, &[tok], &hid, t + i, at, &mut st.kv, n_ctx, true);
        let lg = lg.expect("asked for logits");
        tok = argmax(lg.row(0));
        out.push(tok);
        hid = o;
    }
    st.kv.truncate(st.span.cached());
    out
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}
