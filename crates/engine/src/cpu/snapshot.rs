//! Snapshots of a CPU sequence's state (`Executor::snapshot` and friends): host
//! copies in the device-neutral `SeqSnapshot` layout, K transposed from the cache's
//! dim-major rows to position-major, and their loading back.
//!
//! A restored sequence computes the same bits as the one it was taken from: the
//! values are copied, never recomputed, and the cache layout (K's stride) does not
//! enter any arithmetic.

use super::CpuState;
use crate::exec::{LayerKv, RecurrentState, SeqSnapshot, StateShape};
use model::ExecError;

/// A copy of `st` at position `pos`, with K/V of `0..pos` when `with_kv`, and the
/// recurrent state, or instead `mark`'s.
pub(super) fn take(
    st: &CpuState,
    pos: usize,
    with_kv: bool,
    mark: Option<&SeqSnapshot>,
) -> Result<SeqSnapshot, ExecError> {
    let op = match (with_kv, mark) {
        (_, Some(_)) => "snapshot_from_mark",
        (true, None) => "snapshot",
        (false, None) => "snapshot_recurrent",
    };
    shape(st).check_take(op, pos)?;
    let kv = if with_kv {
        st.kv
            .iter()
            .map(|c| {
                let (w, cap) = (c.width(), c.capacity());
                let mut k = vec![0.0f32; pos * w];
                // Cache row r (dim r of all kv heads) holds positions side by side.
                for (r, row) in c.k().chunks_exact(cap.max(1)).take(w).enumerate() {
                    for (p, &x) in row[..pos].iter().enumerate() {
                        k[p * w + r] = x;
                    }
                }
                LayerKv {
                    k,
                    v: c.v()[..pos * w].to_vec(),
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    let recurrent = match mark {
        Some(m) => m.recurrent.clone(),
        None => st
            .dn
            .iter()
            .map(|d| RecurrentState {
                conv: d.conv.clone(),
                ssm: d.ssm.clone(),
            })
            .collect(),
    };
    Ok(SeqSnapshot::taken(pos, with_kv, kv, recurrent))
}

/// The shape of `st`, which snapshots are checked against.
fn shape(st: &CpuState) -> StateShape {
    StateShape {
        n_ctx: st.n_ctx,
        kv_width: st.kv.iter().map(|c| c.width()).collect(),
        recurrent: st.dn.iter().map(|d| (d.conv.len(), d.ssm.len())).collect(),
        fed: st.kv.iter().map(|c| c.len()).min().unwrap_or(0),
    }
}

/// Copies `snap`'s recurrent state (checked by `StateShape::check_recurrent`) into `st`.
fn load_recurrent(st: &mut CpuState, snap: &SeqSnapshot) {
    for (r, d) in snap.recurrent.iter().zip(&mut st.dn) {
        d.conv.copy_from_slice(&r.conv);
        d.ssm.copy_from_slice(&r.ssm);
    }
}

/// Replaces `st` with positions `0..upto` of `snap`.
pub(super) fn restore(st: &mut CpuState, snap: &SeqSnapshot, upto: usize) -> Result<(), ExecError> {
    shape(st).check_restore(snap, upto)?;
    // Everything is checked: a refused restore has left `st` as it was.
    st.clear();
    load_recurrent(st, snap);
    st.reserve(upto)?;
    for (l, c) in snap.kv.iter().zip(&mut st.kv) {
        let (w, cap) = (c.width(), c.capacity());
        let (k, v) = c.k_v_mut();
        for (r, row) in k.chunks_exact_mut(cap.max(1)).take(w).enumerate() {
            for (p, x) in row[..upto].iter_mut().enumerate() {
                *x = l.k[p * w + r];
            }
        }
        v[..upto * w].copy_from_slice(&l.v[..upto * w]);
        c.wrote(upto);
    }
    Ok(())
}

/// Loads `snap`'s recurrent state into `st`, keeping its K/V.
pub(super) fn restore_recurrent(st: &mut CpuState, snap: &SeqSnapshot) -> Result<(), ExecError> {
    shape(st).check_restore_recurrent(snap)?;
    load_recurrent(st, snap);
    Ok(())
}
