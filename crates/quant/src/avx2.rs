//! AVX2 (+FMA, F16C) kernels.

use crate::isa::Avx2Proof;
use crate::{GgmlType, Kernel};

pub(crate) fn kernel(ty: GgmlType, _proof: Avx2Proof) -> Kernel {
    crate::scalar_kernel(ty)
}
