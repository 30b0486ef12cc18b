//! [`ExpertStore`]: the one place that answers where a routed expert lives now (a VRAM
//! slot, the pinned RAM copy, or only the model file) and turns a step's routing into
//! the slot assignments and fetches an executor carries out.
//!
//! The store is host bookkeeping only: the executor owns the memory (VRAM slot buffers,
//! the pinned RAM copy, staging) and does the copies; the store says which expert goes
//! to which slot and where its bytes come from. Keeping this free of CUDA makes the
//! policy testable on any machine.
//!
//! # Slots
//!
//! Each layer has the [`Plan`]'s number of slots of one expert each. A step's distinct
//! experts of a layer are one *batch* when they fit the slots (a decode step always
//! does: every layer has at least `top_k` slots); otherwise they are split into batches
//! of at most half the slots, consecutive batches in disjoint slots, so the executor can
//! copy one batch in while the previous one computes. Each batch's experts all sit in
//! slots while the batch is computed. Within a step, experts already in a slot come
//! first, so a prompt uses what is cached before it evicts anything.
//!
//! # The prompt pool
//!
//! A tiered executor may keep a *pool*: VRAM for a few experts outside every layer's
//! slots. Before a long prompt chunk reaches a layer, [`ExpertStore::prefetch`] picks
//! experts of that layer that are in no slot but in the RAM copy (with that many
//! routes, nearly every expert is used) and the executor copies them into the pool
//! while the layer's mixer runs, when the copy engine would otherwise be idle. The
//! layer's step then computes the routed ones as a batch of their own
//! ([`Batch::pool`]) and the pool is free again. The pool is not a cache: what it
//! held is forgotten after the step, and nothing in it is ever a slot.
//!
//! # Replacement
//!
//! A miss takes a free slot, else evicts the slot with the lowest score among those not
//! holding an expert of the current batch. The score is recency plus frequency: the step
//! of last use plus [`FREQ_WEIGHT`] × a use count that halves every [`HALF_LIFE`] steps
//! of the layer. Routing reuse is mostly short-term (recency dominates), while an expert
//! a layer keeps returning to survives a burst of one-off misses.

use super::plan::Plan;
use super::ExpertIndex;

/// A chunk prefetches into the pool when it has at least this many routes per
/// expert of the layer: with uniform routing, the share of experts a chunk leaves
/// unused is then e^-4, under 2%.
pub const PREFETCH_ROUTES_PER_EXPERT: usize = 4;

/// Steps of recency one unit of (decayed) use count is worth when choosing a victim.
pub const FREQ_WEIGHT: f64 = 4.0;
/// Layer steps after which a slot's use count has halved.
pub const HALF_LIFE: u64 = 64;

/// Where an expert's bytes are now (the fastest copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Home {
    /// In VRAM slot `n` of its layer.
    Slot(u32),
    /// In the pinned RAM copy, at this byte offset of its layer's buffer
    /// ([`ExpertStore::ram_layout`]).
    Ram(usize),
    /// Only in the model file ([`ExpertStore::index`] says where).
    File,
}

/// One expert brought into a slot for a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fetch {
    pub expert: u32,
    pub slot: u32,
    /// Where its bytes come from: [`Home::Ram`] or [`Home::File`].
    pub from: Home,
}

/// Experts computed together: every one of them is in `slot_of` while the batch runs,
/// except those left to the CPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    /// (expert, slot) for each expert of the batch computed in a slot.
    pub slot_of: Vec<(u32, u32)>,
    /// The misses among them, to copy in before the batch is computed.
    pub fetch: Vec<Fetch>,
    /// Misses computed by the CPU from the RAM copy instead: (expert, offset in the
    /// layer's RAM buffer). They take no slot.
    pub cpu: Vec<(u32, usize)>,
    /// The batch computes in the prompt pool: `slot_of` names pool entries, filled
    /// by the layer's [`ExpertStore::prefetch`] (its `fetch` is empty).
    pub pool: bool,
    /// The batch of the same step (an index into the step's batches) that computes
    /// last, before this one, with a slot this batch's fetches overwrite: the
    /// fetches must wait for its products. `None`: no earlier batch of the step
    /// uses those slots.
    pub after: Option<usize>,
}

impl Batch {
    pub fn slot(&self, expert: u32) -> Option<u32> {
        self.slot_of
            .iter()
            .find(|&&(e, _)| e == expert)
            .map(|&(_, s)| s)
    }

    /// Each route's slot in this batch (`routes`: one expert per route), -1 for a
    /// route whose expert the batch does not compute in a slot.
    pub fn slots_of(&self, routes: &[u32]) -> Vec<i32> {
        // A table by expert: a prompt chunk has tens of thousands of routes and a
        // batch a hundred experts, too many for a search per route.
        let n = self.slot_of.iter().map(|&(e, _)| e as usize + 1).max();
        let mut table = vec![-1i32; n.unwrap_or(0)];
        for &(e, s) in &self.slot_of {
            table[e as usize] = s as i32;
        }
        routes
            .iter()
            .map(|&e| table.get(e as usize).copied().unwrap_or(-1))
            .collect()
    }
}

/// Counters of where the experts of computed routes came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierStats {
    /// Expert uses served by a VRAM slot already holding the expert.
    pub hits: u64,
    /// Misses copied from the pinned RAM copy, and their bytes.
    pub ram_misses: u64,
    pub ram_bytes: u64,
    /// Misses read from the model file, and their bytes.
    pub disk_misses: u64,
    pub disk_bytes: u64,
    /// Misses computed by the CPU from the RAM copy (no copy to VRAM), and their bytes.
    pub cpu_misses: u64,
    pub cpu_bytes: u64,
    /// Nanoseconds the host spent reading misses from the file.
    pub disk_ns: u64,
    /// Nanoseconds the host spent in tiered expert steps (`step_ns`), and of those,
    /// waiting for the device to finish the work before the routing was known
    /// (`wait_ns`: the layer's mixer, norm and router, and whatever of the previous
    /// layer was still running) and from the start of the CPU's expert products to
    /// their end (`cpu_ns`; the host issues the device's copies and kernels beside
    /// them). The rest is the host planning the step and reading the CPU's input.
    pub step_ns: u64,
    pub wait_ns: u64,
    pub cpu_ns: u64,
    /// Experts copied ahead of their step — into the prompt pool for a prompt chunk,
    /// into slots on a guess of a decode token's routing ([`ExpertStore::ahead`]) —
    /// (each routed one is also a RAM miss, and its bytes are in `ram_bytes`), and of
    /// those, the ones the step did not route to (copied for nothing; their bytes
    /// are in `ram_bytes` too).
    pub prefetched: u64,
    pub prefetch_unused: u64,
}

impl TierStats {
    pub fn uses(&self) -> u64 {
        self.hits + self.ram_misses + self.disk_misses + self.cpu_misses
    }
    /// Share of expert uses that were already in VRAM.
    pub fn hit_rate(&self) -> f64 {
        match self.uses() {
            0 => 0.0,
            n => self.hits as f64 / n as f64,
        }
    }
    pub fn minus(&self, before: &TierStats) -> TierStats {
        TierStats {
            hits: self.hits - before.hits,
            ram_misses: self.ram_misses - before.ram_misses,
            ram_bytes: self.ram_bytes - before.ram_bytes,
            disk_misses: self.disk_misses - before.disk_misses,
            disk_bytes: self.disk_bytes - before.disk_bytes,
            cpu_misses: self.cpu_misses - before.cpu_misses,
            cpu_bytes: self.cpu_bytes - before.cpu_bytes,
            disk_ns: self.disk_ns - before.disk_ns,
            step_ns: self.step_ns - before.step_ns,
            wait_ns: self.wait_ns - before.wait_ns,
            cpu_ns: self.cpu_ns - before.cpu_ns,
            prefetched: self.prefetched - before.prefetched,
            prefetch_unused: self.prefetch_unused - before.prefetch_unused,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct SlotUse {
    /// The expert held, or `u32::MAX` when free.
    expert: u32,
    last: u64,
    count: f64,
    /// Layer step at which `count` was last decayed.
    at: u64,
}

const FREE: u32 = u32::MAX;

/// One layer's slots.
#[derive(Debug, Clone)]
struct LayerSlots {
    slots: Vec<SlotUse>,
    /// expert → slot, or -1.
    slot_of: Vec<i32>,
    /// expert → the layer step it was last routed to (0: never), slot or not.
    seen: Vec<u64>,
    step: u64,
}

impl LayerSlots {
    fn new(n_slots: usize, n_expert: usize) -> LayerSlots {
        LayerSlots {
            slots: vec![
                SlotUse {
                    expert: FREE,
                    last: 0,
                    count: 0.0,
                    at: 0,
                };
                n_slots
            ],
            slot_of: vec![-1; n_expert],
            seen: vec![0; n_expert],
            step: 0,
        }
    }

    fn decayed(&self, s: &SlotUse) -> f64 {
        let age = self.step.saturating_sub(s.at) as f64;
        s.count * (-(age / HALF_LIFE as f64) * std::f64::consts::LN_2).exp()
    }

    fn touch(&mut self, slot: usize) {
        let c = self.decayed(&self.slots[slot]);
        let s = &mut self.slots[slot];
        s.count = c + 1.0;
        s.at = self.step;
        s.last = self.step;
    }

    /// Puts `expert` into `slot` (its bytes still to be copied), evicting what the
    /// slot held: fresh, used at this step, no count yet.
    fn assign(&mut self, slot: usize, expert: u32) {
        let old = self.slots[slot].expert;
        if old != FREE {
            self.slot_of[old as usize] = -1;
        }
        self.slots[slot] = SlotUse {
            expert,
            last: self.step,
            count: 0.0,
            at: self.step,
        };
        self.slot_of[expert as usize] = slot as i32;
    }

    /// The slots to reuse for `misses` misses of one batch, in the order they are
    /// taken: free ones (lowest index first), then the lowest scores (recency plus
    /// decayed frequency; the lower index on a tie) among slots not in `busy` (the
    /// batch's hits, and the slots the batch before is still reading). Fewer when
    /// too few slots are left. The scores do not change while the batch is
    /// assigned (the layer's step is fixed, and every slot the batch touches is
    /// busy or chosen here), so picking all victims at once from one scoring gives
    /// the victims of picking the lowest afresh for each miss; only the misses'
    /// victims are ordered, not every slot.
    fn victims(&self, busy: &[bool], misses: usize) -> Vec<usize> {
        let mut out: Vec<usize> = (0..self.slots.len())
            .filter(|&i| self.slots[i].expert == FREE)
            .take(misses)
            .collect();
        let need = misses - out.len();
        if need == 0 {
            return out;
        }
        let mut scored: Vec<(f64, usize)> = (0..self.slots.len())
            .filter(|&i| self.slots[i].expert != FREE && !busy[i])
            .map(|i| {
                let s = &self.slots[i];
                (s.last as f64 + FREQ_WEIGHT * self.decayed(s), i)
            })
            .collect();
        let order = |a: &(f64, usize), b: &(f64, usize)| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1));
        if need < scored.len() {
            scored.select_nth_unstable_by(need, order);
            scored.truncate(need);
        }
        scored.sort_unstable_by(order);
        out.extend(scored.iter().map(|&(_, i)| i));
        out
    }
}

/// Residency of every routed expert of the trunk layers (see the module docs).
#[derive(Debug, Clone)]
pub struct ExpertStore {
    index: ExpertIndex,
    plan: Plan,
    /// Per layer: expert → offset in the layer's RAM buffer.
    ram_off: Vec<Vec<Option<usize>>>,
    ram_bytes: Vec<usize>,
    layers: Vec<LayerSlots>,
    stats: TierStats,
    /// Per layer: the experts the prompt pool has room for (0: no pool).
    pool_cap: Vec<usize>,
    /// What the pool holds: the layer, and the expert of each entry.
    pooled: Option<(usize, Vec<u32>)>,
    /// The experts put into slots ahead of a layer's next step on a guess
    /// ([`ExpertStore::ahead`]): the layer, and the experts.
    guessed: Option<(usize, Vec<u32>)>,
}

impl ExpertStore {
    /// A store with empty slots; the RAM copy holds what `plan` makes resident, each
    /// expert's gate, up and down bytes back to back, in expert order per layer.
    pub fn new(index: ExpertIndex, plan: Plan) -> ExpertStore {
        let mut ram_off = Vec::with_capacity(plan.layers.len());
        let mut ram_bytes = Vec::with_capacity(plan.layers.len());
        for (l, lp) in plan.layers.iter().enumerate() {
            let mut off = 0usize;
            let row: Vec<Option<usize>> = lp
                .resident
                .iter()
                .map(|&r| {
                    r.then(|| {
                        let o = off;
                        off += lp.expert_bytes as usize;
                        o
                    })
                })
                .collect();
            debug_assert_eq!(Some(lp.expert_bytes), index.expert_bytes(l));
            ram_off.push(row);
            ram_bytes.push(off);
        }
        let layers = plan
            .layers
            .iter()
            .map(|lp| LayerSlots::new(lp.slots, plan.n_expert))
            .collect();
        ExpertStore {
            index,
            plan,
            ram_off,
            ram_bytes,
            layers,
            stats: TierStats::default(),
            pool_cap: Vec::new(),
            pooled: None,
            guessed: None,
        }
    }

    /// Gives the store a prompt pool of `bytes` bytes (see the module docs): room
    /// for as many whole experts of each layer as fit.
    pub fn with_pool(mut self, bytes: u64) -> ExpertStore {
        self.pool_cap = self
            .plan
            .layers
            .iter()
            .map(|l| bytes.checked_div(l.expert_bytes).unwrap_or(0) as usize)
            .collect();
        self
    }

    /// The experts layer `layer` can have in the prompt pool at once.
    pub fn pool_entries(&self, layer: usize) -> usize {
        self.pool_cap.get(layer).copied().unwrap_or(0)
    }

    /// Fills the prompt pool for layer `layer`'s next step, a chunk of `n_tokens`
    /// tokens, when the chunk is long enough
    /// ([`PREFETCH_ROUTES_PER_EXPERT`]): with experts that are in no slot and in
    /// the RAM copy, the most recently routed first (then in expert order). Returns
    /// the copies to make (`slot` is the pool entry), none when the chunk is short,
    /// the layer has no pool, or every such expert is in a slot. Whatever the pool
    /// held before is forgotten.
    pub fn prefetch(&mut self, layer: usize, n_tokens: usize) -> Vec<Fetch> {
        self.pooled = None;
        let cap = self.pool_entries(layer);
        let n_expert = self.plan.n_expert;
        if cap == 0 || n_tokens * self.plan.top_k < PREFETCH_ROUTES_PER_EXPERT * n_expert {
            return Vec::new();
        }
        let ls = &self.layers[layer];
        let mut pick: Vec<(u32, usize)> = (0..n_expert as u32)
            .filter(|&e| ls.slot_of[e as usize] < 0)
            .filter_map(|e| self.ram_off[layer][e as usize].map(|o| (e, o)))
            .collect();
        pick.sort_by_key(|&(e, _)| (std::cmp::Reverse(ls.seen[e as usize]), e));
        pick.truncate(cap);
        if pick.is_empty() {
            return Vec::new();
        }
        self.stats.prefetched += pick.len() as u64;
        self.stats.ram_bytes += pick.len() as u64 * self.plan.layers[layer].expert_bytes;
        self.pooled = Some((layer, pick.iter().map(|&(e, _)| e).collect()));
        pick.iter()
            .enumerate()
            .map(|(i, &(expert, o))| Fetch {
                expert,
                slot: i as u32,
                from: Home::Ram(o),
            })
            .collect()
    }

    /// Forgets what the pool holds (its copies failed, or will not be waited for).
    pub fn drop_pool(&mut self) {
        self.pooled = None;
    }

    /// Slots for layer `layer`'s guessed experts before its next step is routed
    /// (`guesses`: a decode token's likeliest experts first): each guess held in the
    /// RAM copy and in no slot takes the slot a miss would (free, else the lowest
    /// score), and the copies to make are returned. Their bytes count as RAM copies
    /// now; at the layer's step each one routed to counts as a RAM miss (its other
    /// uses as hits), each other one as [`TierStats::prefetch_unused`]. Guesses never
    /// change which experts compute, only where their bytes are.
    pub fn ahead(&mut self, layer: usize, guesses: &[u32]) -> Vec<Fetch> {
        let n_expert = self.plan.n_expert;
        let ls = &mut self.layers[layer];
        // The guesses to copy: held in RAM, in no slot, each once.
        let mut wanted: Vec<(u32, usize)> = Vec::new();
        for &e in guesses {
            let ei = e as usize;
            if ei >= n_expert || ls.slot_of[ei] >= 0 || wanted.iter().any(|w| w.0 == e) {
                continue;
            }
            if let Some(o) = self.ram_off[layer][ei] {
                wanted.push((e, o));
            }
        }
        let victims = ls.victims(&vec![false; ls.slots.len()], wanted.len());
        let mut out = Vec::with_capacity(victims.len());
        for ((e, o), s) in wanted.into_iter().zip(victims) {
            ls.assign(s, e);
            out.push(Fetch {
                expert: e,
                slot: s as u32,
                from: Home::Ram(o),
            });
        }
        self.stats.prefetched += out.len() as u64;
        self.stats.ram_bytes += out.len() as u64 * self.plan.layers[layer].expert_bytes;
        self.guessed = (!out.is_empty()).then(|| (layer, out.iter().map(|f| f.expert).collect()));
        out
    }

    /// Forgets the guessed experts' slots (their copies failed): see [`Self::forget`].
    pub fn drop_ahead(&mut self, layer: usize, fetch: &[Fetch]) {
        self.guessed = None;
        self.forget(layer, fetch);
    }

    pub fn index(&self) -> &ExpertIndex {
        &self.index
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn n_layer(&self) -> usize {
        self.layers.len()
    }

    pub fn n_slots(&self, layer: usize) -> usize {
        self.layers[layer].slots.len()
    }

    /// Bytes of layer `layer`'s RAM buffer.
    pub fn ram_bytes(&self, layer: usize) -> usize {
        self.ram_bytes[layer]
    }

    /// The experts of layer `layer` in its RAM buffer, with their offsets.
    pub fn ram_layout(&self, layer: usize) -> impl Iterator<Item = (u32, usize)> + '_ {
        self.ram_off[layer]
            .iter()
            .enumerate()
            .filter_map(|(e, o)| o.map(|o| (e as u32, o)))
    }

    /// Where expert `expert` of layer `layer` is now.
    pub fn home(&self, layer: usize, expert: u32) -> Home {
        let l = &self.layers[layer];
        match l.slot_of.get(expert as usize) {
            Some(&s) if s >= 0 => Home::Slot(s as u32),
            _ => match self.ram_off[layer].get(expert as usize) {
                Some(Some(o)) => Home::Ram(*o),
                _ => Home::File,
            },
        }
    }

    /// Which expert slot `slot` of `layer` holds.
    pub fn slot_expert(&self, layer: usize, slot: u32) -> Option<u32> {
        let e = self.layers[layer].slots.get(slot as usize)?.expert;
        (e != FREE).then_some(e)
    }

    pub fn stats(&self) -> TierStats {
        self.stats
    }

    /// Adds the time reading misses from the file took.
    pub fn add_disk_time(&mut self, ns: u64) {
        self.stats.disk_ns += ns;
    }

    /// Adds one tiered step's host times (see [`TierStats::step_ns`]).
    pub fn add_step_time(&mut self, step_ns: u64, wait_ns: u64) {
        self.stats.step_ns += step_ns;
        self.stats.wait_ns += wait_ns;
    }

    /// Adds the time of one step's CPU expert products (see [`TierStats::cpu_ns`]).
    pub fn add_cpu_time(&mut self, ns: u64) {
        self.stats.cpu_ns += ns;
    }

    /// One step of layer `layer` routed to `routes` (the experts of every token, in
    /// any order, repeats allowed): the batches to compute, in order, with their slot
    /// assignments and fetches. The store's slot table is updated as if the batches
    /// run in order. When there are several, consecutive batches use disjoint slots
    /// (each at most half of the layer's), so a batch's copies need only wait for the
    /// computation of the batch before the previous one; with one batch, its copies
    /// wait for everything before (one stream does both by itself). Each batch's
    /// [`Batch::after`] names the batch its copies wait for. When the pool holds
    /// this layer's prefetched experts, the routed ones are one more batch
    /// ([`Batch::pool`]), first or second, and the pool is empty afterwards. Experts
    /// outside the layer's range are an error (they would index past the slot
    /// table).
    ///
    /// `to_cpu(m)` is asked, when the step is one batch, how many of its `m` misses
    /// that are in the RAM copy the CPU should compute instead of copying them to
    /// slots (the executor's cost model); those are the ones routed to least
    /// recently, so an expert that returns is promoted to a slot on its next miss.
    pub fn step(
        &mut self,
        layer: usize,
        routes: &[u32],
        to_cpu: &dyn Fn(usize) -> usize,
    ) -> Result<Vec<Batch>, String> {
        let n_expert = self.plan.n_expert;
        if let Some(&bad) = routes.iter().find(|&&e| e as usize >= n_expert) {
            return Err(format!(
                "layer {layer} routed to expert {bad}, but the model has {n_expert}"
            ));
        }
        let mut uses = vec![0u32; n_expert];
        for &e in routes {
            uses[e as usize] += 1;
        }
        let bytes = self.plan.layers[layer].expert_bytes;
        // The pool's routed experts: a batch of their own, copied in already.
        let mut pool = Batch {
            pool: true,
            ..Batch::default()
        };
        if let Some((_, held)) = self.pooled.take().filter(|&(l, _)| l == layer) {
            for (i, &e) in held.iter().enumerate() {
                match uses[e as usize] {
                    0 => self.stats.prefetch_unused += 1,
                    n => {
                        self.stats.ram_misses += 1;
                        self.stats.hits += n as u64 - 1;
                        pool.slot_of.push((e, i as u32));
                        uses[e as usize] = 0;
                    }
                }
            }
        }
        // Guessed experts this step routes to were copied ahead: a RAM miss each
        // (the batch loop below counts their uses as hits).
        let mut guessed_used = 0u64;
        if let Some((_, held)) = self.guessed.take().filter(|&(l, _)| l == layer) {
            for e in held {
                let here = self.layers[layer].slot_of[e as usize] >= 0;
                match uses[e as usize] {
                    n if n > 0 && here => guessed_used += 1,
                    _ => self.stats.prefetch_unused += 1,
                }
            }
        }
        self.stats.ram_misses += guessed_used;
        let slots_now = &self.layers[layer].slot_of;
        let mut distinct: Vec<u32> = (0..n_expert as u32)
            .filter(|&e| uses[e as usize] > 0)
            .collect();
        // Cached experts first, then expert order.
        distinct.sort_by_key(|&e| (slots_now[e as usize] < 0, e));
        let n_slots = self.n_slots(layer).max(1);
        // Several batches are double-buffered: each takes at most half the slots and
        // none of the previous batch's, so that a batch's copies can run while the
        // previous batch computes.
        let double = distinct.len() > n_slots && n_slots >= 2;
        let cap = if double { n_slots / 2 } else { n_slots };
        let mut out = Vec::new();
        // One batch: the CPU may take some of the misses held in RAM.
        let mut cpu = Vec::new();
        if distinct.len() <= n_slots && pool.slot_of.is_empty() {
            let ls = &self.layers[layer];
            let mut ram_misses: Vec<u32> = distinct
                .iter()
                .copied()
                .filter(|&e| {
                    ls.slot_of[e as usize] < 0 && self.ram_off[layer][e as usize].is_some()
                })
                .collect();
            let n = to_cpu(ram_misses.len()).min(ram_misses.len());
            ram_misses.sort_by_key(|&e| (ls.seen[e as usize], e));
            cpu = ram_misses[..n].to_vec();
        }
        distinct.retain(|e| !cpu.contains(e));
        let ls = &mut self.layers[layer];
        ls.step += 1;
        for &(e, _) in &pool.slot_of {
            ls.seen[e as usize] = ls.step;
        }
        let mut cpu_batch = Vec::with_capacity(cpu.len());
        for &e in &cpu {
            ls.seen[e as usize] = ls.step;
            self.stats.cpu_misses += 1;
            self.stats.cpu_bytes += bytes;
            self.stats.hits += uses[e as usize] as u64 - 1;
            if let Some(o) = self.ram_off[layer][e as usize] {
                cpu_batch.push((e, o));
            }
        }
        if distinct.is_empty() {
            if pool.slot_of.is_empty() {
                out.push(Batch {
                    cpu: cpu_batch,
                    ..Batch::default()
                });
            } else {
                out.push(pool);
            }
            return Ok(out);
        }
        // The previous batch's slots (double buffering).
        let mut prev = vec![false; self.layers[layer].slots.len()];
        for (ci, chunk) in distinct.chunks(cap).enumerate() {
            let ls = &mut self.layers[layer];
            if ci > 0 {
                ls.step += 1;
            }
            let mut busy = std::mem::replace(&mut prev, vec![false; ls.slots.len()]);
            let mut misses = 0;
            for &e in chunk {
                match usize::try_from(ls.slot_of[e as usize]) {
                    Ok(s) => busy[s] = true,
                    Err(_) => misses += 1,
                }
            }
            let mut victims = ls.victims(&busy, misses).into_iter();
            let mut batch = Batch::default();
            for &e in chunk {
                let n = uses[e as usize] as u64;
                let slot = match usize::try_from(ls.slot_of[e as usize]) {
                    Ok(s) => {
                        self.stats.hits += n;
                        s
                    }
                    Err(_) => {
                        let s = victims.next().ok_or_else(|| {
                            format!("layer {layer}: no slot free for a batch of {}", chunk.len())
                        })?;
                        ls.assign(s, e);
                        let from = match self.ram_off[layer][e as usize] {
                            Some(o) => Home::Ram(o),
                            None => Home::File,
                        };
                        // The first use fetches; the batch's other uses of it hit.
                        match from {
                            Home::Ram(_) => {
                                self.stats.ram_misses += 1;
                                self.stats.ram_bytes += bytes;
                            }
                            _ => {
                                self.stats.disk_misses += 1;
                                self.stats.disk_bytes += bytes;
                            }
                        }
                        self.stats.hits += n - 1;
                        batch.fetch.push(Fetch {
                            expert: e,
                            slot: s as u32,
                            from,
                        });
                        s
                    }
                };
                ls.touch(slot);
                ls.seen[e as usize] = ls.step;
                batch.slot_of.push((e, slot as u32));
                prev[slot] = double;
            }
            if ci == 0 {
                batch.cpu = std::mem::take(&mut cpu_batch);
            }
            out.push(batch);
        }
        self.stats.hits -= guessed_used;
        if !pool.slot_of.is_empty() {
            // First, so the slot batches' copies run while it computes; second when
            // the first slot batch copies nothing, so the copies into its slots
            // start earlier still.
            let at = usize::from(out.len() > 1 && out[0].fetch.is_empty());
            out.insert(at, pool);
        }
        // What each batch's copies wait for: the last earlier batch using a slot
        // they overwrite.
        let mut last = vec![None; self.layers[layer].slots.len()];
        for (j, b) in out.iter_mut().enumerate() {
            if b.pool {
                continue;
            }
            b.after = b.fetch.iter().filter_map(|f| last[f.slot as usize]).max();
            for &(_, s) in &b.slot_of {
                last[s as usize] = Some(j);
            }
        }
        Ok(out)
    }

    /// Frees the slots `fetch` was filling (a copy or read failed): their bytes never
    /// arrived, so they must not be taken for hits later.
    pub fn forget(&mut self, layer: usize, fetch: &[Fetch]) {
        let ls = &mut self.layers[layer];
        for f in fetch {
            let Some(s) = ls.slots.get_mut(f.slot as usize) else {
                continue;
            };
            if s.expert == f.expert {
                s.expert = FREE;
                s.count = 0.0;
                ls.slot_of[f.expert as usize] = -1;
            }
        }
    }

    /// Puts experts into empty slots before the first step (in `order`: a routing
    /// profile's most used first), returning the fetches to carry out; an expert whose
    /// layer has no free slot left is skipped. These count as neither hits nor misses.
    pub fn warm(&mut self, order: &[(u32, u32)]) -> Vec<(usize, Fetch)> {
        let mut out = Vec::new();
        for &(l, e) in order {
            let (l, ei) = (l as usize, e as usize);
            if l >= self.layers.len() || ei >= self.plan.n_expert {
                continue;
            }
            let ls = &mut self.layers[l];
            if ls.slot_of[ei] >= 0 {
                continue;
            }
            let Some(s) = ls.slots.iter().position(|s| s.expert == FREE) else {
                continue;
            };
            ls.slots[s].expert = e;
            ls.slot_of[ei] = s as i32;
            let from = match self.ram_off[l][ei] {
                Some(o) => Home::Ram(o),
                None => Home::File,
            };
            out.push((
                l,
                Fetch {
                    expert: e,
                    slot: s as u32,
                    from,
                },
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::{LayerSlots, SlotUse, FREQ_WEIGHT};

    /// A batch's victims picked at once from one scoring are the victims of scoring
    /// every slot afresh for each miss and taking the lowest.
    #[test]
    fn victims_from_the_batch_scores_are_those_of_fresh_scores() {
        let mut x: u64 = 7;
        let mut next = |m: u64| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) % m
        };
        for round in 0..400 {
            let n = 1 + next(40) as usize;
            let mut ls = LayerSlots::new(n, 64);
            ls.step = 100 + next(200);
            for (i, s) in ls.slots.iter_mut().enumerate() {
                // A few free slots in some rounds; ties in recency on purpose.
                let free = round % 3 == 0 && next(8) == 0;
                *s = SlotUse {
                    expert: if free { u32::MAX } else { i as u32 },
                    last: 90 + next(12),
                    count: next(5) as f64 * 0.75,
                    at: 80 + next(20),
                };
            }
            let mut busy: Vec<bool> = (0..n).map(|_| next(4) == 0).collect();
            let fresh = |ls: &LayerSlots, busy: &[bool]| {
                if let Some(i) = ls.slots.iter().position(|s| s.expert == u32::MAX) {
                    return Some(i);
                }
                let score =
                    |i: usize| ls.slots[i].last as f64 + FREQ_WEIGHT * ls.decayed(&ls.slots[i]);
                (0..n)
                    .filter(|&i| !busy[i])
                    .min_by(|&a, &b| score(a).total_cmp(&score(b)).then(a.cmp(&b)))
            };
            let misses = next(n as u64 + 3) as usize;
            let got = ls.victims(&busy, misses);
            // One miss at a time: the lowest fresh score, filled and busy before the
            // next pick.
            let mut want = Vec::new();
            while want.len() < misses {
                let Some(v) = fresh(&ls, &busy) else { break };
                ls.slots[v] = SlotUse {
                    expert: 1000 + v as u32,
                    last: ls.step,
                    count: 0.0,
                    at: ls.step,
                };
                ls.touch(v);
                busy[v] = true;
                want.push(v);
            }
            assert_eq!(got, want, "round {round}: {misses} misses of {n} slots");
        }
    }
}
