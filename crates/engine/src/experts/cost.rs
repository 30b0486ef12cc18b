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

/// The CPU's (seconds per call, seconds per expert byte) from timed calls
/// (`(experts in the call, seconds)`, the fastest of several calls of each size) of
/// experts of `bytes` each: the least-squares line through them, its fixed cost
/// held between zero and the fastest call of the fewest experts. Calls that did not
/// get slower with more experts say nothing about a fixed cost: then every second
/// is counted per expert, at the best rate any call showed.
pub fn fit_cpu(points: &[(usize, f64)], bytes: u64) -> (f64, f64) {
    let n = points.len() as f64;
    let mean_c = points.iter().map(|p| p.0 as f64).sum::<f64>() / n;
    let mean_t = points.iter().map(|p| p.1).sum::<f64>() / n;
    let (mut cov, mut var) = (0.0, 0.0);
    for &(c, t) in points {
        cov += (c as f64 - mean_c) * (t - mean_t);
        var += (c as f64 - mean_c).powi(2);
    }
    let b = bytes.max(1) as f64;
    if var <= 0.0 || cov <= 0.0 {
        let per_expert = points
            .iter()
            .map(|&(c, t)| t / c.max(1) as f64)
            .fold(f64::MAX, f64::min);
        return (0.0, per_expert.max(1e-12) / b);
    }
    let slope = cov / var;
    let fewest = points.iter().min_by_key(|p| p.0).map_or(0.0, |p| p.1);
    ((mean_t - slope * mean_c).clamp(0.0, fewest), slope / b)
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
    use super::{cpu_may_read_map, fit_cpu, CostModel};

    #[test]
    fn the_cpu_fit_is_the_line_through_its_calls_within_what_they_showed() {
        let mb = 1u64 << 20;
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1e-6);
        // 20 µs a call and 2 MiB at 50 GB/s an expert, exactly.
        let per = 2.0 * mb as f64 / 50e9;
        let line: Vec<(usize, f64)> = [1, 2, 4, 8].map(|c| (c, 20e-6 + c as f64 * per)).to_vec();
        let (fixed, s_per_byte) = fit_cpu(&line, 2 * mb);
        assert!(close(fixed, 20e-6), "{fixed}");
        assert!(close(1.0 / s_per_byte, 50e9), "{}", 1.0 / s_per_byte);
        // Slow one-expert calls (a cold start): the fixed cost never exceeds the
        // fastest one-expert call, and the other sizes still set the slope.
        let mut cold = line.clone();
        cold[0].1 = 220e-6;
        let (fixed, s_per_byte) = fit_cpu(&cold, 2 * mb);
        assert!(fixed < 220e-6 && fixed > 20e-6, "{fixed}");
        assert!(1.0 / s_per_byte > 50e9, "{}", 1.0 / s_per_byte);
        // A line steeper than its first call allows: the fixed cost is zero.
        let steep = [(1, 10e-6), (2, 100e-6), (4, 200e-6), (8, 400e-6)];
        assert_eq!(fit_cpu(&steep, 2 * mb).0, 0.0);
        // Calls that get faster with more experts: no fixed cost, and each expert
        // costs what the best call showed (8 experts in 40 µs).
        let odd = [(1, 90e-6), (2, 60e-6), (4, 50e-6), (8, 40e-6)];
        let (fixed, s_per_byte) = fit_cpu(&odd, 2 * mb);
        assert_eq!(fixed, 0.0);
        assert!(close(s_per_byte * (2 * mb) as f64, 5e-6), "{s_per_byte}");
    }

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
