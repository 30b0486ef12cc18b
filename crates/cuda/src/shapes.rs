//! The model shapes the CUDA kernels are built for, checked at load so that a model
//! they cannot run is refused before any weight is uploaded, naming the GGUF key and
//! the remedy (the CPU executor takes every shape). Compiled with or without the
//! `cuda` feature, so the rules are tested everywhere.

/// Head dimensions the attention kernels are built for (`attention.key_length`).
pub const ATTN_HEAD_DIMS: [usize; 4] = [32, 64, 128, 256];
/// DeltaNet head dimensions the recurrence kernels are built for (`ssm.state_size`).
pub const DN_STATE_DIMS: [usize; 3] = [32, 64, 128];
/// The widest causal conv of the DeltaNet kernels (`ssm.conv_kernel`;
/// kernels/deltanet.cu SC_MAX_DCONV).
pub const MAX_D_CONV: usize = 8;
/// The most experts a routed MoE layer may have (`expert_count`; kernels/moe.cu
/// SC_MAX_EXPERT).
pub const MAX_EXPERTS: usize = 1024;
/// The most experts a token may be routed to (`expert_used_count`; kernels/moe.cu
/// SC_MAX_K).
pub const MAX_TOP_K: usize = 32;

/// What the kernels need to know of a model (its GGUF metadata, `{arch}.` omitted
/// from the keys named in messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    /// `attention.key_length`.
    pub head_dim: usize,
    /// `expert_count` (0: no routed experts).
    pub n_expert: usize,
    /// `expert_used_count`.
    pub top_k: usize,
    /// `ssm.state_size` and `ssm.conv_kernel` of a hybrid model's DeltaNet layers.
    pub deltanet: Option<(usize, usize)>,
}

/// `Err` with one sentence per shape the kernels do not take, each naming its key
/// and what the kernels take; `arch` prefixes the keys (`qwen35moe.ssm.state_size`).
pub fn check(arch: &str, s: &ModelShape) -> Result<(), String> {
    let mut bad = Vec::new();
    if !ATTN_HEAD_DIMS.contains(&s.head_dim) {
        bad.push(format!(
            "{arch}.attention.key_length is {}; the CUDA attention kernels take {}",
            s.head_dim,
            list(&ATTN_HEAD_DIMS)
        ));
    }
    if let Some((d_state, d_conv)) = s.deltanet {
        if !DN_STATE_DIMS.contains(&d_state) {
            bad.push(format!(
                "{arch}.ssm.state_size is {d_state}; the CUDA DeltaNet kernels take {}",
                list(&DN_STATE_DIMS)
            ));
        }
        if d_conv == 0 || d_conv > MAX_D_CONV {
            bad.push(format!(
                "{arch}.ssm.conv_kernel is {d_conv}; the CUDA DeltaNet kernels take 1 to \
                 {MAX_D_CONV}"
            ));
        }
    }
    if s.n_expert > MAX_EXPERTS {
        bad.push(format!(
            "{arch}.expert_count is {}; the CUDA MoE kernels take at most {MAX_EXPERTS}",
            s.n_expert
        ));
    }
    if s.n_expert > 0 && s.top_k > MAX_TOP_K {
        bad.push(format!(
            "{arch}.expert_used_count is {}; the CUDA MoE kernels route to at most \
             {MAX_TOP_K}",
            s.top_k
        ));
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{}: run this model on the CPU (--device cpu), which takes every shape",
            bad.join("; ")
        ))
    }
}

fn list(v: &[usize]) -> String {
    let s: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    match s.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => s.join(""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen35(head_dim: usize, deltanet: Option<(usize, usize)>) -> ModelShape {
        ModelShape {
            head_dim,
            n_expert: 256,
            top_k: 8,
            deltanet,
        }
    }

    #[test]
    fn the_released_shapes_pass() {
        // Qwen3.5/3.6 MoE and Qwen3-Next: head_dim 256, DeltaNet heads of 128, conv 4;
        // Qwen3-MoE: head_dim 128, no DeltaNet.
        assert_eq!(check("qwen35moe", &qwen35(256, Some((128, 4)))), Ok(()));
        assert_eq!(check("qwen3next", &qwen35(256, Some((128, 4)))), Ok(()));
        assert_eq!(check("qwen3moe", &qwen35(128, None)), Ok(()));
    }

    #[test]
    fn other_shapes_are_refused_naming_each_key_and_the_remedy() {
        let e = check("qwen35moe", &qwen35(40, Some((16, 4)))).unwrap_err();
        assert!(
            e.contains("qwen35moe.attention.key_length is 40")
                && e.contains("32, 64, 128 or 256")
                && e.contains("qwen35moe.ssm.state_size is 16")
                && e.contains("32, 64 or 128")
                && e.contains("--device cpu"),
            "{e}"
        );
        assert!(!e.contains("conv_kernel") && !e.contains("expert"), "{e}");
        let e = check("qwen3next", &qwen35(128, Some((64, 9)))).unwrap_err();
        assert!(e.contains("qwen3next.ssm.conv_kernel is 9"), "{e}");
        let wide = ModelShape {
            n_expert: 2048,
            top_k: 40,
            ..qwen35(128, None)
        };
        let e = check("qwen3moe", &wide).unwrap_err();
        assert!(
            e.contains("expert_count is 2048") && e.contains("expert_used_count is 40"),
            "{e}"
        );
    }
}
