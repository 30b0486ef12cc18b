//! The kernel registry: the fat binaries build.rs embedded, every kernel's name, and
//! the function handles loaded from them.

use crate::error::CudaError;
use cudarc::driver::result;
use cudarc::driver::sys::{self, CUresult};
use std::ffi::CString;

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

macro_rules! kernels {
    ($($id:ident = $name:literal),* $(,)?) => {
        /// A kernel, by its `extern "C"` name in kernels/*.cu.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[allow(clippy::enum_variant_names)] // MatvecQ4K: the K of K-quants
        pub(crate) enum K { $($id),* }
        impl K {
            pub(crate) const ALL: &'static [K] = &[$(K::$id),*];
            pub(crate) fn name(self) -> &'static str {
                match self { $(K::$id => $name),* }
            }
        }
    };
}

kernels! {
    QuantizeAct = "quantize_act",
    MatvecF32 = "matvec_f32",
    MatvecF32T1 = "matvec_f32_t1",
    MatvecF32T4 = "matvec_f32_t4",
    MatvecF16 = "matvec_f16",
    MatvecF16T1 = "matvec_f16_t1",
    MatvecF16T4 = "matvec_f16_t4",
    MatvecBf16 = "matvec_bf16",
    MatvecBf16T1 = "matvec_bf16_t1",
    MatvecBf16T4 = "matvec_bf16_t4",
    MatvecQ8_0 = "matvec_q8_0",
    MatvecQ8_0T1 = "matvec_q8_0_t1",
    MatvecQ8_0T4 = "matvec_q8_0_t4",
    MatvecQ4_0 = "matvec_q4_0",
    MatvecQ4_0T1 = "matvec_q4_0_t1",
    MatvecQ4_0T4 = "matvec_q4_0_t4",
    MatvecQ4K = "matvec_q4_k",
    MatvecQ4KT1 = "matvec_q4_k_t1",
    MatvecQ4KT4 = "matvec_q4_k_t4",
    MatvecQ5K = "matvec_q5_k",
    MatvecQ5KT1 = "matvec_q5_k_t1",
    MatvecQ5KT4 = "matvec_q5_k_t4",
    MatvecQ6K = "matvec_q6_k",
    MatvecQ6KT1 = "matvec_q6_k_t1",
    MatvecQ6KT4 = "matvec_q6_k_t4",
    MatvecIq4Xs = "matvec_iq4_xs",
    MatvecIq4XsT1 = "matvec_iq4_xs_t1",
    MatvecIq4XsT4 = "matvec_iq4_xs_t4",
    MatvecQ2K = "matvec_q2_k",
    MatvecQ2KT1 = "matvec_q2_k_t1",
    MatvecQ2KT4 = "matvec_q2_k_t4",
    MatvecQ3K = "matvec_q3_k",
    MatvecQ3KT1 = "matvec_q3_k_t1",
    MatvecQ3KT4 = "matvec_q3_k_t4",
    MatvecQ4_1 = "matvec_q4_1",
    MatvecQ4_1T1 = "matvec_q4_1_t1",
    MatvecQ4_1T4 = "matvec_q4_1_t4",
    MatvecQ5_0 = "matvec_q5_0",
    MatvecQ5_0T1 = "matvec_q5_0_t1",
    MatvecQ5_0T4 = "matvec_q5_0_t4",
    MatvecQ5_1 = "matvec_q5_1",
    MatvecQ5_1T1 = "matvec_q5_1_t1",
    MatvecQ5_1T4 = "matvec_q5_1_t4",
    MatvecIq4Nl = "matvec_iq4_nl",
    MatvecIq4NlT1 = "matvec_iq4_nl_t1",
    MatvecIq4NlT4 = "matvec_iq4_nl_t4",
    MatvecMxfp4 = "matvec_mxfp4",
    MatvecMxfp4T1 = "matvec_mxfp4_t1",
    MatvecMxfp4T4 = "matvec_mxfp4_t4",
    MatvecTq1_0 = "matvec_tq1_0",
    MatvecTq1_0T1 = "matvec_tq1_0_t1",
    MatvecTq1_0T4 = "matvec_tq1_0_t4",
    MatvecTq2_0 = "matvec_tq2_0",
    MatvecTq2_0T1 = "matvec_tq2_0_t1",
    MatvecTq2_0T4 = "matvec_tq2_0_t4",
    MatvecIq2Xxs = "matvec_iq2_xxs",
    MatvecIq2XxsT1 = "matvec_iq2_xxs_t1",
    MatvecIq2XxsT4 = "matvec_iq2_xxs_t4",
    MatvecIq2Xs = "matvec_iq2_xs",
    MatvecIq2XsT1 = "matvec_iq2_xs_t1",
    MatvecIq2XsT4 = "matvec_iq2_xs_t4",
    MatvecIq2S = "matvec_iq2_s",
    MatvecIq2ST1 = "matvec_iq2_s_t1",
    MatvecIq2ST4 = "matvec_iq2_s_t4",
    MatvecIq3Xxs = "matvec_iq3_xxs",
    MatvecIq3XxsT1 = "matvec_iq3_xxs_t1",
    MatvecIq3XxsT4 = "matvec_iq3_xxs_t4",
    MatvecIq3S = "matvec_iq3_s",
    MatvecIq3ST1 = "matvec_iq3_s_t1",
    MatvecIq3ST4 = "matvec_iq3_s_t4",
    MatvecIq1S = "matvec_iq1_s",
    MatvecIq1ST1 = "matvec_iq1_s_t1",
    MatvecIq1ST4 = "matvec_iq1_s_t4",
    MatvecIq1M = "matvec_iq1_m",
    MatvecIq1MT1 = "matvec_iq1_m_t1",
    MatvecIq1MT4 = "matvec_iq1_m_t4",
    MatvecNvfp4 = "matvec_nvfp4",
    MatvecNvfp4T1 = "matvec_nvfp4_t1",
    MatvecNvfp4T4 = "matvec_nvfp4_t4",
    MmF32 = "mm_f32",
    MmF16 = "mm_f16",
    MmBf16 = "mm_bf16",
    MmqQ8_0 = "mmq_q8_0",
    MmqQ4_0 = "mmq_q4_0",
    MmqQ4K = "mmq_q4_k",
    MmqQ5K = "mmq_q5_k",
    MmqQ6K = "mmq_q6_k",
    MmqIq4Xs = "mmq_iq4_xs",
    MmqQ2K = "mmq_q2_k",
    MmqQ3K = "mmq_q3_k",
    MmqQ4_1 = "mmq_q4_1",
    MmqQ5_0 = "mmq_q5_0",
    MmqQ5_1 = "mmq_q5_1",
    MmqIq4Nl = "mmq_iq4_nl",
    MmqMxfp4 = "mmq_mxfp4",
    MmqTq1_0 = "mmq_tq1_0",
    MmqTq2_0 = "mmq_tq2_0",
    MmqIq2Xxs = "mmq_iq2_xxs",
    MmqIq2Xs = "mmq_iq2_xs",
    MmqIq2S = "mmq_iq2_s",
    MmqIq3Xxs = "mmq_iq3_xxs",
    MmqIq3S = "mmq_iq3_s",
    MmqIq1S = "mmq_iq1_s",
    MmqIq1M = "mmq_iq1_m",
    MmqNvfp4 = "mmq_nvfp4",
    Embed = "embed",
    EmbedLb = "embed_lb",
    RmsNorm = "rms_norm",
    AddRmsNorm = "add_rms_norm",
    DotRows = "dot_rows",
    Add = "add",
    Scale = "scale",
    ScaleTileRows = "scale_tile_rows",
    Swiglu = "swiglu",
    Argmax = "argmax",
    SampleMax = "sample_max",
    SampleWeigh = "sample_weigh",
    SampleGather = "sample_gather",
    SampleDraw = "sample_draw",
    RouteTopk = "route_topk",
    RouterF32R = "router_f32_r",
    RouterF16R = "router_f16_r",
    RouterBf16R = "router_bf16_r",
    RouterF32 = "router_f32",
    RouterF16 = "router_f16",
    RouterBf16 = "router_bf16",
    MoeCombine = "moe_combine",
    PublishWords = "publish_words",
    MoeGateUp = "moe_gate_up",
    MoeGateUpRows = "moe_gate_up_rows",
    MoeDownCombine = "moe_down_combine",
    MoeDownCombineRows = "moe_down_combine_rows",
    MoeGateUpLb = "moe_gate_up_lb",
    MoeGateUpRowsLb = "moe_gate_up_rows_lb",
    MoeDownCombineLb = "moe_down_combine_lb",
    MoeDownCombineRowsLb = "moe_down_combine_rows_lb",
    MatvecMulti = "matvec_multi",
    MatvecMultiLb = "matvec_multi_lb",
    MatvecMultiRowsF32 = "matvec_multi_rows_f32",
    MatvecMultiRowsF16 = "matvec_multi_rows_f16",
    MatvecMultiRowsBf16 = "matvec_multi_rows_bf16",
    MatvecMultiRowsQ8_0 = "matvec_multi_rows_q8_0",
    MatvecMultiRowsQ4_0 = "matvec_multi_rows_q4_0",
    MatvecMultiRowsQ4K = "matvec_multi_rows_q4_k",
    MatvecMultiRowsQ5K = "matvec_multi_rows_q5_k",
    MatvecMultiRowsQ6K = "matvec_multi_rows_q6_k",
    MatvecMultiRowsIq4Xs = "matvec_multi_rows_iq4_xs",
    MatvecMultiRowsQ2K = "matvec_multi_rows_q2_k",
    MatvecMultiRowsQ3K = "matvec_multi_rows_q3_k",
    MatvecMultiRowsQ4_1 = "matvec_multi_rows_q4_1",
    MatvecMultiRowsQ5_0 = "matvec_multi_rows_q5_0",
    MatvecMultiRowsQ5_1 = "matvec_multi_rows_q5_1",
    MatvecMultiRowsIq4Nl = "matvec_multi_rows_iq4_nl",
    MatvecMultiRowsMxfp4 = "matvec_multi_rows_mxfp4",
    MatvecMultiRowsTq1_0 = "matvec_multi_rows_tq1_0",
    MatvecMultiRowsTq2_0 = "matvec_multi_rows_tq2_0",
    MatvecMultiRowsIq2Xxs = "matvec_multi_rows_iq2_xxs",
    MatvecMultiRowsIq2Xs = "matvec_multi_rows_iq2_xs",
    MatvecMultiRowsIq2S = "matvec_multi_rows_iq2_s",
    MatvecMultiRowsIq3Xxs = "matvec_multi_rows_iq3_xxs",
    MatvecMultiRowsIq3S = "matvec_multi_rows_iq3_s",
    MatvecMultiRowsIq1S = "matvec_multi_rows_iq1_s",
    MatvecMultiRowsIq1M = "matvec_multi_rows_iq1_m",
    MatvecMultiRowsNvfp4 = "matvec_multi_rows_nvfp4",
    DnStepDk32 = "dn_step_dk32",
    DnStepDk64 = "dn_step_dk64",
    DnStepDk128 = "dn_step_dk128",
    DnStepRowsDk32 = "dn_step_rows_dk32",
    DnStepRowsDk64 = "dn_step_rows_dk64",
    DnStepRowsDk128 = "dn_step_rows_dk128",
    AttnPrep = "attn_prep",
    AttnPrepRows = "attn_prep_rows",
    AttnCoreHd32 = "attn_core_hd32",
    AttnCoreHd64 = "attn_core_hd64",
    AttnCoreHd128 = "attn_core_hd128",
    AttnCoreHd256 = "attn_core_hd256",
    AttnCoreWideHd32 = "attn_core_wide_hd32",
    AttnCoreWideHd64 = "attn_core_wide_hd64",
    AttnCoreWideHd128 = "attn_core_wide_hd128",
    AttnCoreWideHd256 = "attn_core_wide_hd256",
    AttnCoreRowsHd32 = "attn_core_rows_hd32",
    AttnCoreRowsHd64 = "attn_core_rows_hd64",
    AttnCoreRowsHd128 = "attn_core_rows_hd128",
    AttnCoreRowsHd256 = "attn_core_rows_hd256",
    AttnCombine = "attn_combine",
    DnConv = "dn_conv",
    DnQkNorm = "dn_qk_norm",
    DnRecurrenceDk32 = "dn_recurrence_dk32",
    DnRecurrenceDk64 = "dn_recurrence_dk64",
    DnRecurrenceDk128 = "dn_recurrence_dk128",
    DnGatedNorm = "dn_gated_norm",
    VisLinear = "vis_linear",
    VisLinearLo = "vis_linear_lo",
    VisLayernorm = "vis_layernorm",
    VisPosAdd = "vis_pos_add",
    VisRope = "vis_rope",
    VisAttnHd16 = "vis_attn_hd16",
    VisAttnHd32 = "vis_attn_hd32",
    VisAttnHd64 = "vis_attn_hd64",
    VisAttnHd72 = "vis_attn_hd72",
    VisAttnHd80 = "vis_attn_hd80",
    MathProbe = "math_probe",
    FaultProbe = "fault_probe",
}

/// The loaded function of every kernel, indexed by `K`.
pub(crate) struct Functions {
    f: Vec<sys::CUfunction>,
    /// The most dynamic shared memory a block may opt in to on this device.
    pub(crate) smem_optin: u32,
}

impl Functions {
    pub(crate) fn empty() -> Functions {
        Functions {
            f: Vec::new(),
            smem_optin: 0,
        }
    }

    /// Finds every kernel in the loaded modules; a missing one is a build defect.
    pub(crate) fn load(modules: &[sys::CUmodule], smem_optin: i32) -> Result<Functions, CudaError> {
        let mut f = Vec::with_capacity(K::ALL.len());
        for k in K::ALL {
            let mut found = None;
            for &m in modules {
                let name = CString::new(k.name()).expect("kernel names have no NUL");
                // SAFETY: `m` is a loaded module.
                match unsafe { result::module::get_function(m, name) } {
                    Ok(func) => {
                        found = Some(func);
                        break;
                    }
                    Err(e) if e.0 == CUresult::CUDA_ERROR_NOT_FOUND => continue,
                    Err(e) => {
                        return Err(CudaError::driver(
                            format!("cuModuleGetFunction({})", k.name()),
                            e,
                        ))
                    }
                }
            }
            let func = found.ok_or_else(|| CudaError::Driver {
                call: format!("cuModuleGetFunction({})", k.name()),
                code: "not found in any kernel module (a build defect)".into(),
            })?;
            f.push(func);
        }
        let fns = Functions {
            f,
            smem_optin: smem_optin.max(0) as u32,
        };
        // Kernels whose shared memory (static + dynamic) may exceed the default
        // 48 KiB opt in to the dynamic part they need (when the device has it;
        // otherwise their launch reports it).
        for (k, need) in crate::ops::dynamic_smem_needs() {
            if need <= fns.smem_optin {
                // SAFETY: a function of a loaded module.
                unsafe {
                    result::function::set_function_attribute(
                        fns.get(k),
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        need as i32,
                    )
                }
                .map_err(|e| CudaError::driver(format!("cuFuncSetAttribute({})", k.name()), e))?;
            }
        }
        Ok(fns)
    }

    pub(crate) fn get(&self, k: K) -> sys::CUfunction {
        self.f[k as usize]
    }
}
