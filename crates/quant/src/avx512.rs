//! AVX-512 (F, BW, VL, VNNI) kernels.

use crate::isa::Avx512Proof;
use crate::{GgmlType, Kernel};

pub(crate) fn kernel(ty: GgmlType, _proof: Avx512Proof) -> Kernel {
    crate::scalar_kernel(ty)
}
