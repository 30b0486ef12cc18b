//! The tiered expert store's flags, shared by `run` and `bench`.

use std::path::PathBuf;

/// Where routed experts may live when the model does not fit the GPU.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TierArgs {
    /// GPU: VRAM this process may use, e.g. 16G or 12.5GiB (default: the free VRAM
    /// minus 512 MiB). A model that does not fit keeps its dense weights in VRAM and
    /// its routed experts in VRAM slots, a pinned RAM copy and the model file.
    #[arg(long = "vram-budget", value_parser = engine::parse_size)]
    pub vram_budget: Option<u64>,
    /// GPU, tiered experts: pinned RAM for the experts' copy, e.g. 40G (default: what
    /// is available minus 8 GiB, at most every expert). The rest is read from the file.
    #[arg(long = "ram-budget", value_parser = engine::parse_size)]
    pub ram_budget: Option<u64>,
    /// GPU, tiered experts: a routing profile (`scoria profile -o FILE`) that divides the
    /// VRAM slots by measured demand and fills them before the first token.
    #[arg(long = "profile")]
    pub profile: Option<PathBuf>,
}

impl TierArgs {
    /// Copies the flags into an engine configuration.
    pub fn apply(&self, cfg: &mut engine::EngineConfig) {
        cfg.vram_budget = self.vram_budget;
        cfg.ram_budget = self.ram_budget;
        cfg.expert_profile = self.profile.clone();
    }
}
