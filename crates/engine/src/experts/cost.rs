//! [`CostModel`]: how a decode step's misses held in RAM are split between the CPU
//! (computing them where they are) and PCIe (copying them into VRAM slots), from
//! throughputs the executor measures at load.

/// How long moving an expert's bytes takes each way, measured at load: over PCIe
/// from the pinned copy into a slot, or through the CPU kernels computing it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Host→device bytes per second from pinned memory.
    pub pcie_bps: f64,
    /// CPU: seconds for a call computing experts, and seconds per expert byte.
    pub cpu_fixed_s: f64,
    pub cpu_s_per_byte: f64,
}

impl CostModel {
    /// Of `m` misses of `bytes` each, how many the CPU should compute so that the
    /// CPU and the copies of the rest (which run at once) finish soonest.
    pub fn split(&self, m: usize, bytes: u64) -> usize {
        let b = bytes as f64;
        let cost = |c: usize| {
            let cpu = if c == 0 {
                0.0
            } else {
                self.cpu_fixed_s + c as f64 * b * self.cpu_s_per_byte
            };
            let pcie = (m - c) as f64 * b / self.pcie_bps;
            cpu.max(pcie)
        };
        (0..=m)
            .min_by(|&a, &c| cost(a).total_cmp(&cost(c)))
            .unwrap_or(0)
    }
}

/// Whether the CPU may compute its experts from the mapped model file instead of the
/// pinned copy (`ram` bytes): only where the memory the process may still take
/// (`avail`: MemAvailable, or a cgroup's headroom) keeps the page cache of those
/// experts beside the pinned copy and `headroom` more. Inside a tight limit the
/// mapped pages would be evicted and read from the disk again every time.
pub fn cpu_may_read_map(avail: Option<u64>, ram: u64, headroom: u64) -> bool {
    avail.is_some_and(|a| a >= ram.saturating_mul(2).saturating_add(headroom))
}

#[cfg(test)]
mod tests {
    use super::{cpu_may_read_map, CostModel};

    #[test]
    fn the_mapped_file_only_where_its_page_cache_fits_beside_the_pinned_copy() {
        let gib = 1u64 << 30;
        // The GPU machine: 125 GiB, every expert of N80 (43.6 GiB) pinned.
        assert!(cpu_may_read_map(Some(120 * gib), 44 * gib, 8 * gib));
        // A 16 GiB cgroup: 6.7 GiB pinned out of 14.7 GiB of headroom.
        assert!(!cpu_may_read_map(
            Some(14 * gib + gib * 7 / 10),
            6 * gib + gib * 7 / 10,
            8 * gib
        ));
        // Unknown memory: the pinned copy.
        assert!(!cpu_may_read_map(None, 0, 0));
    }

    #[test]
    fn the_split_balances_the_cpu_against_the_copies() {
        let mb = 1u64 << 20;
        // Equal speeds and no call overhead: half each.
        let even = CostModel {
            pcie_bps: 50e9,
            cpu_fixed_s: 0.0,
            cpu_s_per_byte: 1.0 / 50e9,
        };
        assert_eq!(even.split(8, 2 * mb), 4);
        assert_eq!(even.split(0, 2 * mb), 0);
        // A CPU call costing more than copying everything: nothing to the CPU.
        let slow_call = CostModel {
            cpu_fixed_s: 1.0,
            ..even
        };
        assert_eq!(slow_call.split(8, 2 * mb), 0);
        // A CPU twice as fast as PCIe takes two thirds.
        let fast = CostModel {
            cpu_s_per_byte: 1.0 / 100e9,
            ..even
        };
        assert_eq!(fast.split(9, 2 * mb), 6);
    }
}
