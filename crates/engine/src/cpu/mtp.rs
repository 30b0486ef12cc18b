//! MTP drafts on the CPU: the model's next-next-token block (GGUF `nextn`, as
//! Qwen3.5 trains it) proposes the tokens a verify step checks.
//!
//! MTP position p pairs token x_p with the trunk's post-norm hidden state at p − 1
//! and predicts x_{p+1}; its attention sees the MTP positions before it, whose K/V a
//! sequence keeps in its own cache (position p at index p − 1). After every trunk
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

/// A sequence's MTP state.
pub struct MtpState {
    kv: KvCache,
    /// MTP positions `base..end` are in the cache (position p at index p − base).
    /// A sequence that lost them (restored from a snapshot, or given a prefix this
    /// state does not hold) starts again where its trunk states resume: its drafts
    /// then see a shorter past until it is cleared.
    base: usize,
    end: usize,
    /// The trunk's post-norm hidden rows of the last step, positions `pos0..`.
    hidden: Act,
    pos0: usize,
}

impl MtpState {
    pub fn new(kvw: usize) -> MtpState {
        MtpState {
            kv: KvCache::new(kvw),
            base: 1,
            end: 1,
            hidden: Act::zeros(0, 0),
            pos0: 0,
        }
    }

    /// An empty sequence.
    pub fn clear(&mut self) {
        self.kv.free();
        self.base = 1;
        self.end = 1;
        self.hidden = Act::zeros(0, 0);
        self.pos0 = 0;
    }

    /// The sequence's state came from elsewhere (a snapshot): the MTP cache starts
    /// again after the next step.
    pub fn lose(&mut self) {
        self.clear();
        self.base = 0;
        self.end = 0;
    }

    /// The sequence was rolled back to `pos` positions.
    pub fn truncate(&mut self, pos: usize) {
        self.end = self.end.min(pos).max(self.base);
        self.kv.truncate(self.end - self.base);
        let keep = pos.saturating_sub(self.pos0).min(self.hidden.rows);
        self.hidden.rows = keep;
        self.hidden.data.truncate(keep * self.hidden.cols);
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
/// the MTP positions it made computable (each `p` with x_p fed and h_{p−1} known).
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
    // h_{pos0−1}: a row of the step before (a slot that kept only part of its
    // history goes back to it).
    let prev = (pos0 > 0 && st.pos0 < pos0 && pos0 <= st.pos0 + st.hidden.rows)
        .then(|| st.hidden.row(pos0 - 1 - st.pos0).to_vec());
    let first = if pos0 == 0 {
        st.clear();
        1
    } else if prev.is_some() && st.base <= pos0 && pos0 <= st.end {
        st.truncate(pos0);
        pos0
    } else {
        // Nothing before this step: start again after its first position.
        st.kv.free();
        st.base = pos0 + 1;
        st.end = pos0 + 1;
        pos0 + 1
    };
    let rows = (pos0 + n).saturating_sub(first);
    if rows > 0 {
        let mut hid = Act::zeros(rows, h.cols);
        for (i, p) in (first..pos0 + n).enumerate() {
            let src = match (p == pos0, &prev) {
                (true, Some(row)) => &row[..],
                _ => h.row(p - 1 - pos0),
            };
            hid.row_mut(i).copy_from_slice(src);
        }
        let at = first - st.base;
        pass(
            b,
            w,
            &tokens[first - pos0..],
            &hid,
            first,
            at,
            &mut st.kv,
            n_ctx,
            false,
        );
    }
    st.end = pos0 + n;
    st.hidden = h;
    st.pos0 = pos0;
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
    let t = st.pos0 + st.hidden.rows;
    if st.hidden.rows == 0 || st.end != t || st.base == 0 {
        return Vec::new();
    }
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
        let at = t + i - st.base;
        let (o, lg) = pass(b, w, &[tok], &hid, t + i, at, &mut st.kv, n_ctx, true);
        let lg = lg.expect("asked for logits");
        tok = argmax(lg.row(0));
        out.push(tok);
        hid = o;
    }
    st.kv.truncate(st.end - st.base);
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
