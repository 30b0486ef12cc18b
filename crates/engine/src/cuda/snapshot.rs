//! Snapshots of a sequence's state: K/V and recurrent state downloaded and uploaded
//! as they lie (the device keeps K/V position-major too), through a 64 MiB pinned
//! buffer with one wait per buffer's worth and the host side copied on the thread
//! pool.

use super::backend::tiered;
use super::weights::cuda_err;
use super::{CudaExecutor, CudaState};
use crate::exec::{LayerKv, RecurrentState, SeqSnapshot, StateShape};
use cuda::{Gpu, Lane};
use model::ExecError;

/// Bytes of the pinned buffer snapshots pass through.
const SNAP_CHUNK: usize = 64 << 20;

impl CudaExecutor {
    /// K (and V) floats a position.
    pub(super) fn kv_width(&self) -> usize {
        self.be.cfg.n_head_kv * self.be.cfg.head_dim
    }

    /// Sequence `seq`'s state shape, for the snapshot checks.
    pub(super) fn shape(&self, op: &str, seq: usize) -> Result<StateShape, ExecError> {
        let st = self.state(op, seq)?;
        Ok(StateShape {
            n_ctx: st.n_ctx,
            kv_width: st.kv.iter().map(|_| self.kv_width()).collect(),
            recurrent: st
                .conv
                .iter()
                .zip(&st.ssm)
                .map(|(c, s)| (c.len(), s.len()))
                .collect(),
            fed: self.fed[seq],
        })
    }

    /// A host copy of sequence `seq` at `pos` (K/V of `0..pos` when `with_kv`; the
    /// recurrent state, or `mark`'s instead): the device keeps K and V
    /// position-major, as a snapshot does, so each is one range of its buffer.
    pub(super) fn take_snapshot(
        &mut self,
        op: &str,
        seq: usize,
        pos: usize,
        with_kv: bool,
        mark: Option<&SeqSnapshot>,
    ) -> Result<SeqSnapshot, ExecError> {
        self.shape(op, seq)?.check_take(op, pos)?;
        let t0 = std::time::Instant::now();
        let n = pos * self.kv_width();
        let st = &self.states[seq];
        let mut parts = Vec::new();
        if with_kv {
            for (k, v) in &st.kv {
                parts.extend([(k.ptr(), n), (v.ptr(), n)]);
            }
        }
        if mark.is_none() {
            for (c, s) in st.conv.iter().zip(&st.ssm) {
                parts.extend([(c.ptr(), c.len()), (s.ptr(), s.len())]);
            }
        }
        let mut got = download_f32s(&self.be.gpu, &mut self.snap_buf, &parts)?;
        tracing::debug!(
            "{op} of slot {seq} at position {pos}: {:.1} MiB in {:.2} ms",
            parts.iter().map(|p| p.1 * 4).sum::<usize>() as f64 / (1 << 20) as f64,
            t0.elapsed().as_secs_f64() * 1e3
        );
        let mut got = got.drain(..);
        let mut next = || got.next().unwrap_or_default();
        let kv = (0..if with_kv { st.kv.len() } else { 0 })
            .map(|_| LayerKv {
                k: next(),
                v: next(),
            })
            .collect();
        let recurrent = match mark {
            Some(m) => m.recurrent.clone(),
            None => (0..st.conv.len())
                .map(|_| RecurrentState {
                    conv: next(),
                    ssm: next(),
                })
                .collect(),
        };
        Ok(SeqSnapshot::taken(pos, with_kv, kv, recurrent))
    }
}

/// Where each of `snap`'s recurrent arrays goes in `st`: (floats, device address).
pub(super) fn recurrent_uploads<'a>(
    snap: &'a SeqSnapshot,
    st: &'a CudaState,
) -> impl Iterator<Item = (&'a [f32], u64)> + 'a {
    snap.recurrent
        .iter()
        .zip(st.conv.iter().zip(&st.ssm))
        .flat_map(|(r, (c, s))| [(&r.conv[..], c.ptr()), (&r.ssm[..], s.ptr())])
}

/// A transfer of parts of `lens` floats through a buffer of `chunk` bytes, in
/// rounds of one buffer's worth: each round's pieces of the parts, in the order they
/// fill the buffer, as (part, first float of the part, floats).
fn snap_rounds(lens: impl Iterator<Item = usize>, chunk: usize) -> Vec<Vec<(usize, usize, usize)>> {
    let mut rounds = vec![Vec::new()];
    let mut at = 0;
    for (i, n) in lens.enumerate() {
        let mut done = 0;
        while done < n {
            if at + 4 > chunk {
                rounds.push(Vec::new());
                at = 0;
            }
            let m = (n - done).min((chunk - at) / 4);
            rounds
                .last_mut()
                .expect("one round at least")
                .push((i, done, m));
            at += 4 * m;
            done += m;
        }
    }
    rounds
}

/// Splits `parts` (one slice per part) into the pieces `round` names (pieces of one
/// part come in increasing order and never overlap), each with its offset in the
/// buffer.
fn round_slices<'a, T>(
    parts: Vec<&'a mut [T]>,
    round: &[(usize, usize, usize)],
) -> Vec<(usize, &'a mut [T])> {
    let mut tails: Vec<(usize, &mut [T])> = parts.into_iter().map(|p| (0, p)).collect();
    let mut at = 0;
    let mut got = Vec::with_capacity(round.len());
    for &(i, first, n) in round {
        let (pos, tail) = &mut tails[i];
        let rest = std::mem::take(tail);
        let (_, rest) = rest.split_at_mut(first - *pos);
        let (piece, rest) = rest.split_at_mut(n);
        *tail = rest;
        *pos = first + n;
        got.push((at, piece));
        at += 4 * n;
    }
    got
}

/// Copies each of `parts` ((host floats, device address)) to the device through the
/// pinned buffer, a buffer's worth at a time with one wait for each (the floats
/// go into the buffer on the thread pool).
pub(super) fn upload_f32s(
    gpu: &Gpu,
    buf: &mut Option<cuda::PinnedBuf>,
    parts: &[(&[f32], u64)],
) -> Result<(), ExecError> {
    use rayon::prelude::*;
    let pb = tiered::pinned_at_least(gpu, buf, SNAP_CHUNK, "pinned buffer for snapshots")?;
    let err = cuda_err("restore");
    for round in snap_rounds(parts.iter().map(|(h, _)| h.len()), SNAP_CHUNK) {
        let mut dst = pb.as_mut_slice();
        let mut pieces = Vec::with_capacity(round.len());
        for &(i, first, n) in &round {
            let (piece, rest) = std::mem::take(&mut dst).split_at_mut(4 * n);
            dst = rest;
            pieces.push((piece, &parts[i].0[first..first + n]));
        }
        pieces.into_par_iter().for_each(|(d, h)| {
            for (d, v) in d.chunks_exact_mut(4).zip(h) {
                d.copy_from_slice(&v.to_ne_bytes());
            }
        });
        let mut at = 0;
        for &(i, first, n) in &round {
            gpu.copy_pinned_to_device(Lane::Stream, pb, at, 4 * n, parts[i].1 + 4 * first as u64)
                .map_err(&err)?;
            at += 4 * n;
        }
        gpu.sync().map_err(&err)?;
    }
    Ok(())
}

/// The floats of each of `parts` ((device address, floats)), read through the
/// pinned buffer a buffer's worth at a time with one wait for each (and copied out
/// of it on the thread pool, into zeroed allocations whose pages the copies fault
/// in in parallel).
pub(super) fn download_f32s(
    gpu: &Gpu,
    buf: &mut Option<cuda::PinnedBuf>,
    parts: &[(u64, usize)],
) -> Result<Vec<Vec<f32>>, ExecError> {
    use rayon::prelude::*;
    let pb = tiered::pinned_at_least(gpu, buf, SNAP_CHUNK, "pinned buffer for snapshots")?;
    // Unwritten allocations, filled in parallel (zeroing them first would be one
    // more pass over the memory, on one thread).
    let mut outs: Vec<Vec<f32>> = parts.iter().map(|&(_, n)| Vec::with_capacity(n)).collect();
    for round in snap_rounds(parts.iter().map(|&(_, n)| n), SNAP_CHUNK) {
        let srcs: Vec<(u64, usize)> = round
            .iter()
            .map(|&(i, first, n)| (parts[i].0 + 4 * first as u64, 4 * n))
            .collect();
        gpu.download_pinned(&srcs, pb, None)
            .map_err(cuda_err("snapshot"))?;
        let bytes = pb.as_slice();
        let spare = outs.iter_mut().map(|v| v.spare_capacity_mut()).collect();
        round_slices(spare, &round)
            .into_par_iter()
            .for_each(|(at, piece)| {
                let src = &bytes[at..at + 4 * piece.len()];
                for (d, c) in piece.iter_mut().zip(src.chunks_exact(4)) {
                    d.write(f32::from_ne_bytes([c[0], c[1], c[2], c[3]]));
                }
            });
    }
    for (v, &(_, n)) in outs.iter_mut().zip(parts) {
        // SAFETY: the rounds of `snap_rounds` cover floats 0..n of every part
        // exactly once (its test checks it), and each round wrote its pieces above.
        unsafe { v.set_len(n) };
    }
    Ok(outs)
}

#[cfg(test)]
mod tests {
    use super::{round_slices, snap_rounds};

    /// Every float of every part goes through the buffer once, in order, no round
    /// holds more than the buffer, and the slices a round names are those floats
    /// (what lets `download_f32s` take its unwritten allocations as written).
    #[test]
    fn snapshot_rounds_cover_every_float_once() {
        for chunk in [4, 8, 12, 40, 1 << 10] {
            let lens = [0usize, 3, 1, 17, 0, 9, 2];
            let rounds = snap_rounds(lens.iter().copied(), chunk);
            let mut next = vec![0usize; lens.len()];
            for round in &rounds {
                assert!(round.iter().map(|p| 4 * p.2).sum::<usize>() <= chunk);
                for &(i, first, n) in round {
                    assert!(n > 0);
                    assert_eq!(first, next[i], "chunk {chunk}: part {i} out of order");
                    next[i] += n;
                }
            }
            assert_eq!(next, lens, "chunk {chunk}");
            let mut outs: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0.0; n]).collect();
            let mut stamp = 0.0;
            for round in &rounds {
                let mut at_want = 0;
                let parts = outs.iter_mut().map(|v| &mut v[..]).collect();
                for (at, piece) in round_slices(parts, round) {
                    assert_eq!(at, at_want);
                    at_want += 4 * piece.len();
                    for x in piece {
                        stamp += 1.0;
                        *x = stamp;
                    }
                }
            }
            let flat: Vec<f32> = outs.concat();
            let want: Vec<f32> = (1..=flat.len()).map(|x| x as f32).collect();
            assert_eq!(flat, want, "chunk {chunk}");
        }
    }
}
