//! Quantized block formats: layouts, dequantization and CPU dot kernels.
//!
//! (interface placeholder: the quant helper replaces these bodies)
pub use gguf::GgmlType;

/// Activations quantized once per step into 32-value blocks (see the canonical
/// reduction order in DESIGN.md).
#[derive(Debug, Clone, Default)]
pub struct ActQ8 {
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub sums: Vec<i32>,
}

pub fn is_supported(_ty: GgmlType) -> bool {
    todo!("quant helper")
}

pub fn quantize_act(_x: &[f32]) -> ActQ8 {
    todo!("quant helper")
}

/// out[r] = row r of `w` (n_cols columns, `out.len()` rows, type `ty`) · x.
/// `xq` must be `quantize_act(x)` when `ty` is a quantized type; it is ignored for F32/F16/BF16.
pub fn matvec(_ty: GgmlType, _w: &[u8], _n_cols: usize, _x: &[f32], _xq: &ActQ8, _out: &mut [f32]) {
    todo!("quant helper")
}

pub fn dequantize_row(_ty: GgmlType, _src: &[u8], _dst: &mut [f32]) {
    todo!("quant helper")
}
