//! Expert placement: how many VRAM slots each layer gets, which experts the pinned RAM
//! copy holds, what stays on disk. Pure computation over byte sizes, budgets and an
//! optional routing profile; the expert store allocates what the [`Plan`] says.
//!
//! # The rules
//!
//! **Slots.** Every layer first gets `top_k` slots (one token's experts must fit; fewer
//! is refused). The rest of the VRAM budget is handed out one slot at a time, each to
//! the layer whose slot count is lowest relative to its demand `d`, i.e. the smallest
//! `(slots + 1) / d` (ties: the lower layer), skipping layers whose next slot does not
//! fit the bytes left and layers that already have a slot per expert. So slot counts
//! end up proportional to demand, as far as the `top_k` floor and whole slots allow:
//! - with a routing profile, `d` is the number of experts the layer effectively uses,
//!   exp(entropy of its routing distribution) ([`RoutingProfile::effective_experts`]):
//!   a layer that spreads its routes over many experts needs more slots for the same
//!   hit rate than one that keeps returning to a few;
//! - without a profile, `d = 1` for every layer: equal slot counts (±1).
//!
//! A slot of layer `l` holds one expert of that layer, so it costs that layer's expert
//! bytes (layers may differ: Q4_K_M stores some `ffn_down` as Q6_K).
//!
//! **RAM.** The pinned copy takes experts in order of use, most used first: by the
//! profile's count (ties: lower layer, then lower expert); without a profile, round-robin
//! over layers (expert 0 of every layer, then expert 1, ...), so every layer is covered
//! alike. An expert that does not fit the bytes left is skipped and smaller ones (other
//! layers) may still fit. The RAM copy is a tier of its own, independent of the slots,
//! which are a cache in front of both RAM and disk.
//!
//! **Budgets** (docs/design.md invariant 5: nothing silently shrinks) are granted or refused,
//! never trimmed: too little VRAM for `top_k` slots per layer, or a RAM budget above
//! MemAvailable, is a [`PlanError`] with the numbers and the remedy. A budget larger
//! than the experts need is granted and the unused part shown in the account.

use super::profile::RoutingProfile;
use std::fmt;

const GIB: f64 = (1u64 << 30) as f64;

/// A size in GiB, or in MiB below 0.1 GiB (small models' budgets stay readable).
fn gib(b: u64) -> String {
    if (b as f64) < GIB / 10.0 {
        format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.2} GiB", b as f64 / GIB)
    }
}

/// What to place and within which budgets.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRequest {
    /// One expert's bytes (gate + up + down) for each trunk layer
    /// ([`ExpertIndex::trunk_expert_bytes`](super::ExpertIndex::trunk_expert_bytes)).
    pub expert_bytes: Vec<u64>,
    pub n_expert: usize,
    /// Experts per token (`n_expert_used`).
    pub top_k: usize,
    /// VRAM for expert slots.
    pub vram_budget: u64,
    /// RAM for the pinned copy.
    pub ram_budget: u64,
    /// MemAvailable; `None` when unknown (the RAM budget is then not checked).
    pub mem_available: Option<u64>,
}

impl PlanRequest {
    /// A request for the trunk layers of `index`, with MemAvailable from /proc/meminfo.
    pub fn for_index(
        index: &super::ExpertIndex,
        top_k: usize,
        vram_budget: u64,
        ram_budget: u64,
    ) -> PlanRequest {
        PlanRequest {
            expert_bytes: index.trunk_expert_bytes(),
            n_expert: index.n_expert(),
            top_k,
            vram_budget,
            ram_budget,
            mem_available: crate::memory::mem_available(),
        }
    }
}

/// A placement that cannot work; each names the numbers and the remedy.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "the VRAM budget for expert slots is {} but every one of the {n_layer} layers needs at least top-{top_k} slots ({} in all; the largest layer's {top_k} slots are {}): raise the VRAM budget to at least {}",
        gib(*budget), gib(*needed), gib(*largest_layer), gib(*needed)
    )]
    VramTooSmall {
        budget: u64,
        needed: u64,
        top_k: usize,
        n_layer: usize,
        largest_layer: u64,
    },
    #[error(
        "the RAM budget for the pinned expert copy is {} but only {} of RAM is available (MemAvailable): lower the RAM budget to at most {} or free memory",
        gib(*budget), gib(*available), gib(*available)
    )]
    RamTooLarge { budget: u64, available: u64 },
    #[error("expert plan: {0}")]
    Invalid(String),
}

/// How slots were divided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotRule {
    /// No profile: equal slot counts.
    Even,
    /// Proportional to each layer's measured demand (a profile of `tokens` tokens).
    Profile { tokens: u64 },
}

/// One layer's share.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerPlan {
    pub slots: usize,
    /// One expert's bytes (= one slot's).
    pub expert_bytes: u64,
    /// The demand slots were divided by (1.0 without a profile).
    pub demand: f64,
    /// With a profile: the share of the layer's measured routes that its `slots` most
    /// used experts take (the hit rate of slots holding exactly those).
    pub coverage: Option<f64>,
    /// `resident[e]`: expert `e` is in the pinned RAM copy.
    pub resident: Vec<bool>,
}

impl LayerPlan {
    pub fn slot_bytes(&self) -> u64 {
        self.slots as u64 * self.expert_bytes
    }
    pub fn n_resident(&self) -> usize {
        self.resident.iter().filter(|&&r| r).count()
    }
}

/// Where every byte of the routed experts goes (its `Display` is the account printed at
/// startup; [`Plan::layer_table`] has the per-layer detail).
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub layers: Vec<LayerPlan>,
    pub n_expert: usize,
    pub top_k: usize,
    pub rule: SlotRule,
    pub vram_budget: u64,
    pub vram_used: u64,
    pub ram_budget: u64,
    pub ram_used: u64,
    pub mem_available: Option<u64>,
    /// The RAM copy's experts `(layer, expert)` in the order they were chosen (most
    /// used first): the order to load them in.
    pub resident_order: Vec<(u32, u32)>,
}

impl Plan {
    /// Bytes of all routed experts of the planned layers.
    pub fn total_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| l.expert_bytes * self.n_expert as u64)
            .sum()
    }
    pub fn n_slots(&self) -> usize {
        self.layers.iter().map(|l| l.slots).sum()
    }
    pub fn n_resident(&self) -> usize {
        self.resident_order.len()
    }
    /// Bytes only on disk (not in the RAM copy).
    pub fn disk_bytes(&self) -> u64 {
        self.total_bytes() - self.ram_used
    }
    pub fn is_resident(&self, layer: usize, expert: usize) -> bool {
        self.layers
            .get(layer)
            .and_then(|l| l.resident.get(expert))
            .copied()
            .unwrap_or(false)
    }

    /// One line per layer: slots, their bytes, demand, coverage, resident experts.
    pub fn layer_table(&self) -> String {
        let mut s = String::from("layer  slots   slot GiB  demand  coverage  in RAM\n");
        for (i, l) in self.layers.iter().enumerate() {
            s.push_str(&format!(
                "{i:>5}  {:>5}  {:>9.3}  {:>6.1}  {:>8}  {:>6}\n",
                l.slots,
                l.slot_bytes() as f64 / GIB,
                l.demand,
                l.coverage
                    .map_or("-".to_string(), |c| format!("{:.1}%", 100.0 * c)),
                l.n_resident()
            ));
        }
        s
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n_layer = self.layers.len();
        let total_experts = n_layer * self.n_expert;
        writeln!(
            f,
            "routed experts: {n_layer} layers × {} experts (top-{}), {}; slots divided {}",
            self.n_expert,
            self.top_k,
            gib(self.total_bytes()),
            match self.rule {
                SlotRule::Even => "evenly (no routing profile)".to_string(),
                SlotRule::Profile { tokens } =>
                    format!("by measured demand (routing profile of {tokens} tokens)"),
            }
        )?;
        let min = self.layers.iter().enumerate().min_by_key(|(_, l)| l.slots);
        let max = self.layers.iter().enumerate().max_by_key(|(_, l)| l.slots);
        writeln!(
            f,
            "  VRAM slots:   budget {}: {} slots, {} used, {} unused",
            gib(self.vram_budget),
            self.n_slots(),
            gib(self.vram_used),
            gib(self.vram_budget - self.vram_used)
        )?;
        if let (Some((lo_i, lo)), Some((hi_i, hi))) = (min, max) {
            write!(
                f,
                "                per layer {} (layer {lo_i}) to {} (layer {hi_i}), mean {:.1}",
                lo.slots,
                hi.slots,
                self.n_slots() as f64 / n_layer as f64
            )?;
            let cov: Vec<(usize, f64)> = self
                .layers
                .iter()
                .enumerate()
                .filter_map(|(i, l)| l.coverage.map(|c| (i, c)))
                .collect();
            if let Some(&(worst_i, worst)) = cov.iter().min_by(|a, b| a.1.total_cmp(&b.1)) {
                let mean = cov.iter().map(|c| c.1).sum::<f64>() / cov.len() as f64;
                write!(
                    f,
                    "; hit rate on the profile with the most used experts in the slots: mean {:.1}%, lowest {:.1}% (layer {worst_i})",
                    100.0 * mean,
                    100.0 * worst
                )?;
            }
            writeln!(f)?;
        }
        writeln!(
            f,
            "  RAM (pinned): budget {}: {} of {total_experts} experts, {} used, {} unused{}",
            gib(self.ram_budget),
            self.n_resident(),
            gib(self.ram_used),
            gib(self.ram_budget - self.ram_used),
            match self.mem_available {
                Some(a) => format!(" (MemAvailable {})", gib(a)),
                None => " (MemAvailable unknown: not checked)".to_string(),
            }
        )?;
        write!(
            f,
            "  disk only:    {} experts, {}, read with O_DIRECT on a miss",
            total_experts - self.n_resident(),
            gib(self.disk_bytes())
        )
    }
}

fn check(req: &PlanRequest, profile: Option<&RoutingProfile>) -> Result<(), PlanError> {
    let bad = |m: String| Err(PlanError::Invalid(m));
    if req.expert_bytes.is_empty() {
        return bad("the model has no layers with routed experts".into());
    }
    if req.top_k == 0 || req.top_k > req.n_expert {
        return bad(format!(
            "top-{} routing over {} experts is impossible",
            req.top_k, req.n_expert
        ));
    }
    if let Some(l) = req.expert_bytes.iter().position(|&b| b == 0) {
        return bad(format!("layer {l}'s experts have 0 bytes"));
    }
    if let Some(p) = profile {
        let fits = p.n_layer == req.expert_bytes.len()
            && p.n_expert == req.n_expert
            && p.top_k == req.top_k
            && p.counts.len() == p.n_layer
            && p.counts.iter().all(|r| r.len() == p.n_expert);
        if !fits {
            return bad(format!(
                "the routing profile is for {} layers × {} experts (top-{}), the model has {} × {} (top-{}): record a profile of this model",
                p.n_layer,
                p.n_expert,
                p.top_k,
                req.expert_bytes.len(),
                req.n_expert,
                req.top_k
            ));
        }
    }
    Ok(())
}

/// The experts a RAM copy of `budget` bytes holds (the module docs' RAM rule;
/// `expert_bytes` per trunk layer): `resident[layer][expert]`, the (layer, expert)
/// pairs in the order they were taken, and the bytes they take.
pub fn ram_copy(
    expert_bytes: &[u64],
    n_expert: usize,
    budget: u64,
    profile: Option<&RoutingProfile>,
) -> (Vec<Vec<bool>>, Vec<(u32, u32)>, u64) {
    let n_layer = expert_bytes.len();
    let mut order: Vec<(u32, u32)> = (0..n_layer as u32)
        .flat_map(|l| (0..n_expert as u32).map(move |e| (l, e)))
        .collect();
    match profile {
        Some(p) => order.sort_by(|a, b| {
            let ca = p.counts[a.0 as usize][a.1 as usize];
            let cb = p.counts[b.0 as usize][b.1 as usize];
            cb.cmp(&ca).then(a.cmp(b))
        }),
        None => order.sort_by_key(|&(l, e)| (e, l)),
    }
    let mut resident = vec![vec![false; n_expert]; n_layer];
    let mut taken = Vec::new();
    let mut left = budget;
    for (l, e) in order {
        let b = expert_bytes[l as usize];
        if b <= left {
            left -= b;
            resident[l as usize][e as usize] = true;
            taken.push((l, e));
        }
    }
    (resident, taken, budget - left)
}

/// Places the experts of `req` (see the module docs for the rules).
pub fn plan(req: &PlanRequest, profile: Option<&RoutingProfile>) -> Result<Plan, PlanError> {
    check(req, profile)?;
    let (n, k) = (req.n_expert, req.top_k);
    let bytes = &req.expert_bytes;
    let n_layer = bytes.len();

    // Slots: the top-k floor, then one slot at a time by demand.
    let floor: u64 = bytes.iter().map(|&b| b * k as u64).sum();
    if req.vram_budget < floor {
        return Err(PlanError::VramTooSmall {
            budget: req.vram_budget,
            needed: floor,
            top_k: k,
            n_layer,
            largest_layer: bytes.iter().max().copied().unwrap_or(0) * k as u64,
        });
    }
    let demand: Vec<f64> = match profile {
        Some(p) => (0..n_layer).map(|l| p.effective_experts(l)).collect(),
        None => vec![1.0; n_layer],
    };
    let mut slots = vec![k; n_layer];
    let mut left = req.vram_budget - floor;
    let mut open: Vec<usize> = (0..n_layer).filter(|&l| slots[l] < n).collect();
    loop {
        open.retain(|&l| slots[l] < n && bytes[l] <= left);
        let pick = open.iter().copied().min_by(|&a, &b| {
            let ra = (slots[a] + 1) as f64 / demand[a];
            let rb = (slots[b] + 1) as f64 / demand[b];
            ra.total_cmp(&rb).then(a.cmp(&b))
        });
        let Some(l) = pick else { break };
        slots[l] += 1;
        left -= bytes[l];
    }
    let vram_used = req.vram_budget - left;

    // RAM: most used first.
    if let Some(avail) = req.mem_available {
        if req.ram_budget > avail {
            return Err(PlanError::RamTooLarge {
                budget: req.ram_budget,
                available: avail,
            });
        }
    }
    let (resident, resident_order, ram_used) = ram_copy(bytes, n, req.ram_budget, profile);
    let ram_left = req.ram_budget - ram_used;

    let layers = (0..n_layer)
        .zip(resident)
        .map(|(l, resident)| LayerPlan {
            slots: slots[l],
            expert_bytes: bytes[l],
            demand: demand[l],
            coverage: profile.map(|p| p.coverage(l, slots[l])),
            resident,
        })
        .collect();
    Ok(Plan {
        layers,
        n_expert: n,
        top_k: k,
        rule: match profile {
            Some(p) => SlotRule::Profile { tokens: p.tokens },
            None => SlotRule::Even,
        },
        vram_budget: req.vram_budget,
        vram_used,
        ram_budget: req.ram_budget,
        ram_used: req.ram_budget - ram_left,
        mem_available: req.mem_available,
        resident_order,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn req(bytes: &[u64], n: usize, k: usize, vram: u64, ram: u64) -> PlanRequest {
        PlanRequest {
            expert_bytes: bytes.to_vec(),
            n_expert: n,
            top_k: k,
            vram_budget: vram,
            ram_budget: ram,
            mem_available: Some(1 << 40),
        }
    }

    /// A profile whose layer `l` routes every token to the experts `used[l]` with the
    /// given counts (each row's total must be tokens × k).
    fn profile(counts: Vec<Vec<u64>>, k: usize) -> RoutingProfile {
        let tokens = counts[0].iter().sum::<u64>() / k as u64;
        RoutingProfile {
            model: "test".into(),
            arch: "qwen3moe".into(),
            n_layer: counts.len(),
            n_expert: counts[0].len(),
            top_k: k,
            tokens,
            counts,
        }
    }

    #[test]
    fn without_a_profile_slots_are_even() {
        // 4 layers, 10 slots beyond the top-4 floor, 50 bytes that fit no slot.
        let p = plan(&req(&[100; 4], 16, 4, (16 + 10) * 100 + 50, 0), None).unwrap();
        let slots: Vec<usize> = p.layers.iter().map(|l| l.slots).collect();
        assert_eq!(slots, [7, 7, 6, 6]);
        assert_eq!(p.vram_used, 26 * 100);
        assert_eq!(p.rule, SlotRule::Even);
        assert!(p.layers.iter().all(|l| l.coverage.is_none()));
    }

    #[test]
    fn too_little_vram_for_top_k_is_refused_with_the_numbers() {
        let e = plan(&req(&[100, 200], 16, 4, 4 * 300 - 1, 0), None).unwrap_err();
        assert_eq!(
            e,
            PlanError::VramTooSmall {
                budget: 1199,
                needed: 1200,
                top_k: 4,
                n_layer: 2,
                largest_layer: 800,
            }
        );
        let msg = e.to_string();
        assert!(
            msg.contains("top-4") && msg.contains("raise the VRAM budget"),
            "{msg}"
        );
        // Exactly the floor is granted.
        let p = plan(&req(&[100, 200], 16, 4, 1200, 0), None).unwrap();
        assert_eq!(p.n_slots(), 8);
        assert_eq!(p.vram_used, 1200);
    }

    #[test]
    fn a_ram_budget_above_mem_available_is_refused() {
        let mut r = req(&[100; 2], 8, 2, 400, 5000);
        r.mem_available = Some(4999);
        let e = plan(&r, None).unwrap_err();
        assert_eq!(
            e,
            PlanError::RamTooLarge {
                budget: 5000,
                available: 4999
            }
        );
        assert!(e.to_string().contains("MemAvailable"), "{e}");
        r.mem_available = Some(5000);
        assert!(plan(&r, None).is_ok());
        // Unknown: granted, and the account says it was not checked.
        r.mem_available = None;
        let p = plan(&r, None).unwrap();
        assert!(p.to_string().contains("MemAvailable unknown"), "{p}");
    }

    #[test]
    fn impossible_requests_are_refused() {
        assert!(matches!(
            plan(&req(&[], 8, 2, 1 << 20, 0), None),
            Err(PlanError::Invalid(_))
        ));
        assert!(matches!(
            plan(&req(&[100], 8, 9, 1 << 20, 0), None),
            Err(PlanError::Invalid(_))
        ));
        assert!(matches!(
            plan(&req(&[100, 0], 8, 2, 1 << 20, 0), None),
            Err(PlanError::Invalid(_))
        ));
        // A profile of another shape.
        let prof = profile(vec![vec![1; 8]; 3], 2);
        let e = plan(&req(&[100; 2], 8, 2, 1 << 20, 0), Some(&prof)).unwrap_err();
        assert!(e.to_string().contains("3 layers"), "{e}");
    }

    #[test]
    fn slots_follow_measured_demand() {
        // Layer 0 routes uniformly over 16 experts (demand 16); layer 1 always to the
        // same 4 (demand 4, the top-k floor). Layer 0 fills up before layer 1 gets more.
        let prof = profile(vec![vec![4; 16], [vec![16; 4], vec![0; 12]].concat()], 4);
        assert!((prof.effective_experts(0) - 16.0).abs() < 1e-9);
        assert!((prof.effective_experts(1) - 4.0).abs() < 1e-9);
        let floor = 8 * 100;
        let p = plan(&req(&[100; 2], 16, 4, floor + 12 * 100, 0), Some(&prof)).unwrap();
        assert_eq!((p.layers[0].slots, p.layers[1].slots), (16, 4));
        assert_eq!(p.layers[0].coverage, Some(1.0));
        assert_eq!(p.layers[1].coverage, Some(1.0));
        assert_eq!(p.rule, SlotRule::Profile { tokens: 16 });
        let p = plan(&req(&[100; 2], 16, 4, floor + 14 * 100, 0), Some(&prof)).unwrap();
        assert_eq!((p.layers[0].slots, p.layers[1].slots), (16, 6));
        // Half of layer 0's slots hit half of its uniform routes.
        let p = plan(&req(&[100; 2], 16, 4, floor + 4 * 100, 0), Some(&prof)).unwrap();
        assert_eq!((p.layers[0].slots, p.layers[1].slots), (8, 4));
        assert_eq!(p.layers[0].coverage, Some(0.5));
    }

    #[test]
    fn a_budget_beyond_the_need_is_granted_and_the_rest_shown_unused() {
        let p = plan(&req(&[100, 150], 8, 2, 1 << 30, 1 << 30), None).unwrap();
        assert!(p.layers.iter().all(|l| l.slots == 8));
        assert_eq!(p.vram_used, 8 * 250);
        assert_eq!(p.ram_used, 8 * 250);
        assert_eq!(p.disk_bytes(), 0);
        assert_eq!(p.n_resident(), 16);
        let text = p.to_string();
        assert!(text.contains("16 slots"), "{text}");
        assert!(text.contains("disk only:    0 experts"), "{text}");
    }

    #[test]
    fn ram_holds_the_most_used_experts_first() {
        // Layer 1's experts are bigger (150 bytes); budget 400.
        let counts = vec![vec![5, 1, 0, 2], vec![0, 3, 4, 1]];
        let prof = profile(counts, 2);
        let p = plan(&req(&[100, 150], 4, 2, 10_000, 400), Some(&prof)).unwrap();
        // By count: (0,0)=5 100, (1,2)=4 150, (1,1)=3 150 does not fit the 150 left?
        // 100 + 150 = 250, 150 left: (1,1) fits exactly → 400; nothing else fits.
        assert_eq!(p.resident_order, vec![(0, 0), (1, 2), (1, 1)]);
        assert_eq!(p.ram_used, 400);
        assert!(p.is_resident(1, 2) && !p.is_resident(0, 3));
        // A 90-byte gap after a too-big expert is filled by a smaller one later.
        let p = plan(&req(&[100, 150], 4, 2, 10_000, 340), Some(&prof)).unwrap();
        // (0,0) 100, (1,2) 150 → 90 left; nothing fits.
        assert_eq!(p.resident_order, vec![(0, 0), (1, 2)]);
        let p = plan(&req(&[100, 150], 4, 2, 10_000, 360), Some(&prof)).unwrap();
        // 110 left after (0,0),(1,2): (1,1) 150 skipped, (0,3) 100 taken.
        assert_eq!(p.resident_order, vec![(0, 0), (1, 2), (0, 3)]);
    }

    #[test]
    fn without_a_profile_ram_covers_layers_round_robin() {
        let p = plan(&req(&[100; 3], 4, 2, 10_000, 500), None).unwrap();
        assert_eq!(
            p.resident_order,
            vec![(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)]
        );
        assert_eq!(p.disk_bytes(), 12 * 100 - 500);
    }

    /// Random requests: what the rules promise, checked on the result.
    #[test]
    fn random_plans_keep_their_promises() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for _ in 0..300 {
            let n_layer = rng.random_range(1..8);
            let n = rng.random_range(2..40);
            let k = rng.random_range(1..=n);
            let bytes: Vec<u64> = (0..n_layer).map(|_| rng.random_range(50..200)).collect();
            let total: u64 = bytes.iter().map(|b| b * n as u64).sum();
            let floor: u64 = bytes.iter().map(|b| b * k as u64).sum();
            let vram = rng.random_range(floor..=total + 500);
            let ram = rng.random_range(0..=total + 500);
            let prof = rng.random_bool(0.5).then(|| {
                let tokens = rng.random_range(1..50u64);
                let counts = (0..n_layer)
                    .map(|_| {
                        let mut row = vec![0u64; n];
                        let hot = rng.random_range(k..=n);
                        for _ in 0..tokens {
                            let mut picked = Vec::new();
                            while picked.len() < k {
                                let e = rng.random_range(0..hot);
                                if !picked.contains(&e) {
                                    picked.push(e);
                                }
                            }
                            for e in picked {
                                row[e] += 1;
                            }
                        }
                        row
                    })
                    .collect();
                profile(counts, k)
            });
            let r = req(&bytes, n, k, vram, ram);
            let p = plan(&r, prof.as_ref()).unwrap();
            let left = vram - p.vram_used;
            let used: u64 = p.layers.iter().map(|l| l.slot_bytes()).sum();
            assert_eq!(used, p.vram_used);
            assert!(p.vram_used <= vram);
            for (a, la) in p.layers.iter().enumerate() {
                assert!(la.slots >= k && la.slots <= n);
                // Nothing that fits was left unplaced.
                assert!(la.slots == n || la.expert_bytes > left, "layer {a}: {p:?}");
                // Proportional: a layer that got extra slots is not ahead of any layer
                // that could still take one.
                for lb in &p.layers {
                    if la.slots > k && lb.slots < n && lb.expert_bytes <= left {
                        assert!(
                            la.slots as f64 / la.demand <= (lb.slots + 1) as f64 / lb.demand + 1e-9
                        );
                    }
                }
            }
            let resident: u64 = p
                .resident_order
                .iter()
                .map(|&(l, _)| bytes[l as usize])
                .sum();
            assert_eq!(resident, p.ram_used);
            assert!(p.ram_used <= ram);
            let ram_left = ram - p.ram_used;
            for (l, lp) in p.layers.iter().enumerate() {
                assert_eq!(
                    lp.n_resident(),
                    p.resident_order
                        .iter()
                        .filter(|r| r.0 as usize == l)
                        .count()
                );
                if lp.n_resident() < n {
                    assert!(bytes[l] > ram_left);
                }
            }
            assert_eq!(p.disk_bytes() + p.ram_used, total);
            let _ = p.to_string();
            let _ = p.layer_table();
        }
    }
}
