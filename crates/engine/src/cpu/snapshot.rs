//! Snapshots of a CPU sequence's state (`Executor::snapshot` and friends): host
//! copies in the device-neutral `SeqSnapshot` layout, K transposed from the cache's
//! dim-major rows to position-major, and their loading back.
//!
//! A restored sequence computes the same bits as the one it was taken from: the
//! values are copied, never recomputed, and the cache layout (K's stride) does not
//! enter any arithmetic.

use super::CpuState;
use crate::exec::{LayerKv, RecurrentState, SeqSnapshot};
use model::ExecError;

/// A copy of `st` at position `pos`, with K/V of `0..pos` when `with_kv`.
pub(super) fn take(st: &CpuState, pos: usize, with_kv: bool) -> Result<SeqSnapshot, ExecError> {
    let op = if with_kv {
        "snapshot"
    } else {
        "snapshot_recurrent"
    };
    if pos > st.n_ctx {
        return Err(ExecError::new(
            op,
            format!("position {pos} is beyond the context of {}", st.n_ctx),
        ));
    }
    if let Some(c) = st.kv.iter().find(|c| c.len() < pos) {
        return Err(ExecError::new(
            op,
            format!(
                "the sequence has been fed {} positions since it was cleared, not {pos}",
                c.len()
            ),
        ));
    }
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
    let recurrent = st
        .dn
        .iter()
        .map(|d| RecurrentState {
            conv: d.conv.clone(),
            ssm: d.ssm.clone(),
        })
        .collect();
    Ok(SeqSnapshot {
        pos,
        kv_pos: if with_kv { pos } else { 0 },
        kv,
        recurrent,
    })
}

/// Checks that `snap`'s recurrent state fits `st`.
fn check_recurrent(op: &str, st: &CpuState, snap: &SeqSnapshot) -> Result<(), ExecError> {
    if snap.recurrent.len() != st.dn.len() {
        return Err(ExecError::new(
            op,
            format!(
                "the snapshot holds {} DeltaNet layer states, this model has {} \
                 (a snapshot of another model?)",
                snap.recurrent.len(),
                st.dn.len()
            ),
        ));
    }
    for (i, (r, d)) in snap.recurrent.iter().zip(&st.dn).enumerate() {
        if r.conv.len() != d.conv.len() || r.ssm.len() != d.ssm.len() {
            return Err(ExecError::new(
                op,
                format!(
                    "DeltaNet layer state {i} of the snapshot has another shape than this model's"
                ),
            ));
        }
    }
    Ok(())
}

/// Copies `snap`'s recurrent state (checked by `check_recurrent`) into `st`.
fn load_recurrent(st: &mut CpuState, snap: &SeqSnapshot) {
    for (r, d) in snap.recurrent.iter().zip(&mut st.dn) {
        d.conv.copy_from_slice(&r.conv);
        d.ssm.copy_from_slice(&r.ssm);
    }
}

/// Replaces `st` with positions `0..upto` of `snap`.
pub(super) fn restore(st: &mut CpuState, snap: &SeqSnapshot, upto: usize) -> Result<(), ExecError> {
    let op = "restore";
    if snap.kv.len() != st.kv.len() {
        return Err(ExecError::new(
            op,
            format!(
                "the snapshot holds {} attention layers, this model has {} \
                 (a snapshot of another model?)",
                snap.kv.len(),
                st.kv.len()
            ),
        ));
    }
    if upto > snap.kv_pos {
        return Err(ExecError::new(
            op,
            format!(
                "cannot restore {upto} positions from a snapshot holding K/V of {}",
                snap.kv_pos
            ),
        ));
    }
    if !st.dn.is_empty() && upto != snap.pos {
        return Err(ExecError::new(
            op,
            format!(
                "this model's DeltaNet state cannot be rewound: restore exactly the \
                 snapshot's {} positions, not {upto}",
                snap.pos
            ),
        ));
    }
    if upto > st.n_ctx {
        return Err(ExecError::new(
            op,
            format!("{upto} positions exceed the context of {}", st.n_ctx),
        ));
    }
    for (i, (l, c)) in snap.kv.iter().zip(&st.kv).enumerate() {
        let want = snap.kv_pos * c.width();
        if l.k.len() != want || l.v.len() != want {
            return Err(ExecError::new(
                op,
                format!("attention layer {i} of the snapshot has another shape than this model's"),
            ));
        }
    }
    check_recurrent(op, st, snap)?;
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
    let op = "restore_recurrent";
    if let Some(c) = st.kv.iter().find(|c| c.len() < snap.pos) {
        return Err(ExecError::new(
            op,
            format!(
                "the sequence holds K/V of {} positions, short of the snapshot's {}: \
                 restore the full snapshot instead",
                c.len(),
                snap.pos
            ),
        ));
    }
    check_recurrent(op, st, snap)?;
    load_recurrent(st, snap);
    Ok(())
}
