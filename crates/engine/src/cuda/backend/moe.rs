//! The MoE block: the router, the routed experts and the shared expert, combined in
//! rank order. With every expert resident, one token (or each row of a batched
//! decode step) takes the fused kernels, routed on the device; a prompt downloads
//! its routing once per layer and groups its tokens by expert into tiles. A tiered
//! layer (`tiered/layer.rs`) runs the same launches over slots.

use super::{is_float, CudaBackend, DBuf, Tiered, MAX_ROWS};
use crate::cuda::weights::{cuda_err, DevWeight, MoeDev};
use cuda::{ActQ8, DevBuf, Gpu, MoeRoute, Tile, TileShape, TILE_GROUP, TILE_TOKENS};
use model::ExecError;

/// The resident MoE's state on the device: the fused kernels' counts of finished
/// blocks, zero between launches.
pub(crate) struct MoeCounts {
    /// Finished-block counts of the fused gate/up kernel's planes (see
    /// `Gpu::moe_gate_up`).
    plane_done: DevBuf<i32>,
    /// The router's finished blocks per row, for the rows it routes
    /// (`Gpu::router_routed`).
    route_done: DevBuf<i32>,
}

impl MoeCounts {
    pub(super) fn new(gpu: &Gpu) -> Result<MoeCounts, ExecError> {
        let plane_done = gpu
            .alloc::<i32>(MAX_ROWS * (cuda::MAX_TOP_K + 1), "expert plane counts")
            .map_err(cuda_err("allocate step inputs"))?;
        let route_done = gpu
            .alloc::<i32>(cuda::ROUTER_MAX_TOKENS, "router counts")
            .map_err(cuda_err("allocate step inputs"))?;
        Ok(MoeCounts {
            plane_done,
            route_done,
        })
    }
}

/// The activations of a fused MoE block's gate/up launch, their quantized copy, and
/// where the shared gate's logit went (0 without a shared expert).
pub(super) struct FusedAct {
    pub act: DBuf,
    pub aq: ActQ8,
    pub logit: u64,
}

/// A tiered layer's routed experts: their down products and the shared expert's
/// output and gate logit, for `moe_combine`; or, from the fused kernels, the block's
/// output itself.
pub(super) enum Routed {
    Parts(DBuf, (u64, u64)),
    Combined(DBuf),
}

/// Whether one token's MoE block of `m` can take the fused kernels: gate and up of
/// one type and shape (routed and shared alike), the shared expert reading and
/// writing the routed width, widths of whole 32-value blocks (the activations'
/// quantized copy), a warp per rank in one block, and few enough experts for the
/// fused routing.
pub(super) fn fused_moe(m: &MoeDev, n_expert: usize, k: usize) -> bool {
    let pair = |g: &DevWeight, u: &DevWeight| {
        (g.ty, g.row_bytes, g.stride, g.n_rows, g.n_cols)
            == (u.ty, u.row_bytes, u.stride, u.n_rows, u.n_cols)
    };
    let shared_ok = m.shared.as_ref().is_none_or(|s| {
        pair(&s.gate, &s.up)
            && s.gate.n_cols == m.gate_exps.n_cols
            && s.down.n_rows == m.down_exps.n_rows
    });
    let widths_ok = m.gate_exps.n_rows.is_multiple_of(32)
        && m.shared
            .as_ref()
            .is_none_or(|s| s.gate.n_rows.is_multiple_of(32));
    pair(&m.gate_exps, &m.up_exps)
        && shared_ok
        && widths_ok
        && k + usize::from(m.shared.is_some()) <= 32
        && k <= cuda::MAX_TOP_K
        && n_expert <= cuda::FUSED_MAX_EXPERTS
}

impl CudaBackend {
    /// The tier holding layer `layer`'s routed experts; `None` where they are all in
    /// VRAM: every layer of a resident executor, and the MTP block's (`layer` =
    /// n_layer), which is uploaded whole beside tiered layers.
    pub(crate) fn tier(&self, layer: usize) -> Option<&Tiered> {
        self.tiered.as_ref().filter(|_| layer < self.cfg.n_layer)
    }

    /// Whether layer `layer`'s MoE block `m` over `n` rows takes the fused kernels
    /// (resident experts, at most [`MAX_ROWS`] rows, a shape they take), routed on
    /// the device.
    fn fuses(&self, m: &MoeDev, layer: usize, n: usize) -> bool {
        n <= MAX_ROWS
            && self.fused
            && self.tier(layer).is_none()
            && fused_moe(m, self.cfg.n_expert, self.cfg.n_expert_used)
    }

    /// Whether layer `layer`'s MoE block `m` over `n` rows of one pass needs nothing
    /// from the host (so the pass can be captured): resident experts, and one row
    /// (routed into tiles on the device) or a few through the fused kernels. A
    /// prompt's many rows download their routing to group them by expert.
    pub(crate) fn moe_on_device(&self, m: &MoeDev, layer: usize, n: usize) -> bool {
        self.tier(layer).is_none() && (n == 1 || self.fuses(m, layer, n))
    }

    /// Whether a trunk pass over `n` rows of one sequence needs nothing from the
    /// host: every layer's MoE block does not (see [`Self::moe_on_device`]).
    pub(crate) fn pass_on_device(&self, n: usize) -> bool {
        (self.w.layers.iter().enumerate()).all(|(i, l)| self.moe_on_device(&l.moe, i, n))
    }

    /// Layer `layer`'s MoE block over the rows of `x` (`Backend::moe`): the router,
    /// the routed experts (resident: fused for a token or a batched decode step's
    /// rows, by tiles for a prompt; tiered: `routed_tiered`) and the shared expert,
    /// combined in rank order.
    pub(super) fn moe_block(&self, layer: usize, x: &DBuf) -> Result<DBuf, ExecError> {
        self.moe_of(&self.w.layers[layer].moe, layer, x)
    }

    /// [`Self::moe_block`] of the block `m` (layer `layer`'s, or the MTP block's at
    /// `layer` = n_layer, which is never tiered: [`Self::tier`]).
    pub(super) fn moe_of(&self, m: &MoeDev, layer: usize, x: &DBuf) -> Result<DBuf, ExecError> {
        let cfg = &self.cfg;
        let (t_n, e, k) = (x.rows, cfg.n_embd, cfg.n_expert_used);
        // One quantized copy of x for the router and every expert that reads it.
        let mut ws: Vec<&DevWeight> = vec![&m.router, &m.gate_exps, &m.up_exps];
        if let Some(s) = &m.shared {
            ws.extend([&s.gate, &s.up]);
        }
        let xq = self.prepare(&ws, x)?;
        // A tiered decode token guesses the next layer's routing: the next router
        // applied to this layer's expert input, in the same launches as this layer's
        // routing (a second row of logits, weights and ids). The guess only decides
        // which experts are copied ahead (`Tiered::copy_ahead`).
        let tier = self.tier(layer);
        let guess = match tier {
            Some(t) if t_n == 1 && t.guesses > 0 => self
                .w
                .layers
                .get(layer + 1)
                .and_then(|next| m.router.joined(&next.moe.router)),
            _ => None,
        };
        let route_rows = t_n + usize::from(guess.is_some());
        let wts = self.arena.alloc(route_rows, k, "route")?;
        let ids = self.arena.alloc_bytes(route_rows * k * 4, "route")?;
        // A token or a batched decode step's rows: routed and computed on the device.
        if self.fuses(m, layer, t_n) {
            return self.moe_fused(m, x, xq, &wts, ids);
        }
        let logits = self.mm_q(guess.as_ref().unwrap_or(&m.router), x, xq)?;
        let guessed = guess.is_some();
        let (down, (shared, logit)) = match tier {
            Some(t) => match self.routed_tiered(t, layer, m, x, xq, &logits, &wts, ids, guessed)? {
                Routed::Combined(out) => return Ok(out),
                Routed::Parts(down, shared) => (down, shared),
            },
            None => {
                let down = self.routed_resident(m, x, xq, &logits, &wts, ids)?;
                (down, self.shared_expert(m, x, xq)?)
            }
        };
        let out = self.arena.alloc(t_n, e, "moe")?;
        self.gpu
            .moe_combine(down.ptr, wts.ptr, t_n, k, e, shared, logit, out.ptr)
            .map_err(cuda_err("moe_combine"))?;
        Ok(out)
    }

    /// Routed expert products over `tiles` (device array of `n_tiles`; `grouped`:
    /// built by [`Self::prompt_tiles`] in groups of [`TILE_GROUP`] of one expert).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mm_tiles(
        &self,
        w: &DevWeight,
        x: &DBuf,
        xq: ActQ8,
        tiles: u64,
        n_tiles: usize,
        grouped: bool,
        out_rows: usize,
    ) -> Result<DBuf, ExecError> {
        let out = self.arena.alloc(out_rows, w.n_rows, "expert products")?;
        self.mm_tiles_into(w, x, xq, tiles, n_tiles, grouped, &out, 0)?;
        Ok(out)
    }

    /// [`Self::mm_tiles`] into `out` (rows: every route; the tiles write theirs).
    /// With second-level scales, each row the tiles wrote is scaled by its expert's
    /// (`w.scale`, by the tile's expert) or, when `per_route` is not 0, by
    /// `per_route[row]` (f32 on the device: tiered layers' tiles name slots).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mm_tiles_into(
        &self,
        w: &DevWeight,
        x: &DBuf,
        xq: ActQ8,
        tiles: u64,
        n_tiles: usize,
        grouped: bool,
        out: &DBuf,
        per_route: u64,
    ) -> Result<(), ExecError> {
        // The tiles partition the routes: as many tiles as routes means one token
        // each (always so in a decode step, whose tiles route_topk writes). Every
        // kernel gives the same bits; only the speed differs.
        let shape = if grouped {
            TileShape::Grouped
        } else if n_tiles == out.rows {
            TileShape::Single
        } else {
            TileShape::Any
        };
        self.gpu
            .matvec_tiles_as(
                shape,
                w.ty,
                w.ptr,
                w.stride,
                w.row_bytes,
                w.n_rows,
                w.n_cols,
                x.ptr,
                xq,
                tiles,
                n_tiles,
                out.ptr,
            )
            .map_err(cuda_err("matvec_tiles"))?;
        match &w.scale {
            Some(s) => self
                .gpu
                .scale_tile_rows(out.ptr, w.n_rows, tiles, n_tiles, s.dev.ptr(), per_route)
                .map_err(cuda_err("scale_tile_rows")),
            None => Ok(()),
        }
    }

    /// Uploads tiles to device address `dst` (stream-ordered: earlier launches
    /// reading `dst` have finished before the copy lands).
    pub(super) fn put_tiles(&self, tiles: &[Tile], dst: u64) -> Result<(), ExecError> {
        self.gpu
            .copy_to_device(tiles, dst)
            .map_err(cuda_err("upload tiles"))
    }

    /// The shared expert's output and gate logit (device addresses; 0, 0 without one).
    pub(super) fn shared_expert(
        &self,
        m: &MoeDev,
        x: &DBuf,
        xq: ActQ8,
    ) -> Result<(u64, u64), ExecError> {
        let Some(s) = &m.shared else {
            return Ok((0, 0));
        };
        let sg = self.mm_q(&s.gate, x, xq)?;
        let su = self.mm_q(&s.up, x, xq)?;
        let sa = self.swiglu(&sg, &su)?;
        let sd = self.mm(&s.down, &sa)?;
        let logit = self.arena.alloc(x.rows, 1, "shared gate")?;
        self.gpu
            .dot_rows(x.ptr, s.gate_inp.ptr(), x.rows, x.cols, logit.ptr)
            .map_err(cuda_err("dot_rows"))?;
        Ok((sd.ptr, logit.ptr))
    }

    /// The routed experts of every resident layer: all its experts are in VRAM.
    /// Returns the down projections, one row per route (token-major, rank order).
    fn routed_resident(
        &self,
        m: &MoeDev,
        x: &DBuf,
        xq: ActQ8,
        logits: &DBuf,
        wts: &DBuf,
        ids: u64,
    ) -> Result<DBuf, ExecError> {
        let cfg = &self.cfg;
        let (t_n, k) = (x.rows, cfg.n_expert_used);
        let tile_bytes = std::mem::size_of::<Tile>();
        // One token: route_topk writes the expert tiles on the device.
        let device_tiles = if t_n == 1 {
            Some((
                self.arena.alloc_bytes(k * tile_bytes, "route")?,
                self.arena.alloc_bytes(k * tile_bytes, "route")?,
            ))
        } else {
            None
        };
        let (a, b) = device_tiles.unwrap_or((0, 0));
        self.gpu
            .route_topk(logits.ptr, t_n, cfg.n_expert, k, wts.ptr, ids, a, b)
            .map_err(cuda_err("route_topk"))?;
        let (tiles_gu, tiles_down, n_tiles, grouped) = match device_tiles {
            Some((a, b)) => (a, b, k, false),
            None => {
                // A prompt: group its routes by expert on the host.
                let host: Vec<i32> = self
                    .gpu
                    .download(ids, t_n * k)
                    .map_err(cuda_err("download routes"))?;
                let (gu, down, grouped) = self.prompt_tiles(&host, k);
                let a = self.arena.alloc_bytes(gu.len() * tile_bytes, "route")?;
                let b = self.arena.alloc_bytes(down.len() * tile_bytes, "route")?;
                self.put_tiles(&gu, a)?;
                self.put_tiles(&down, b)?;
                (a, b, gu.len(), grouped)
            }
        };
        let rows = t_n * k;
        let g = self.mm_tiles(&m.gate_exps, x, xq, tiles_gu, n_tiles, grouped, rows)?;
        let u = self.mm_tiles(&m.up_exps, x, xq, tiles_gu, n_tiles, grouped, rows)?;
        let act = self.swiglu(&g, &u)?;
        let aq = self.prepare(&[&m.down_exps], &act)?;
        self.mm_tiles(&m.down_exps, &act, aq, tiles_down, n_tiles, grouped, rows)
    }

    /// The MoE block of a token (or of each of up to [`MAX_ROWS`] rows on its own)
    /// when every expert is in VRAM, in three launches: the router; the routing with
    /// every expert's gate/up/SwiGLU (the shared one and its gate logit included) and
    /// their quantized copy; the down products combined. Several rows are routed
    /// once, by the router's last block of each row (or by `route_topk` for more
    /// experts than it routes), rather than in every block of the gate/up launch,
    /// whose blocks multiply with the rows (4 rows decoded 15% slower that way on
    /// Q35, measured 2026-12-02; 8% after the routing's warp reductions, 2026-12-03).
    /// A float router takes `Gpu::router`. The bits of the
    /// unfused path ([`Self::routed_resident`], `shared_expert`, `moe_combine`),
    /// which longer prompts take.
    fn moe_fused(
        &self,
        m: &MoeDev,
        x: &DBuf,
        xq: ActQ8,
        wts: &DBuf,
        ids: u64,
    ) -> Result<DBuf, ExecError> {
        let (n, k) = (x.rows, self.cfg.n_expert_used);
        let logits = self.arena.alloc(n, m.router.n_rows, "matvec")?;
        // A float router of up to ROUTER_MAX_TOKENS rows: the router kernel, which also
        // routes several rows when the expert count allows (no route_topk launch).
        let float_router = is_float(m.router.ty) && n <= cuda::ROUTER_MAX_TOKENS;
        let routed = float_router && n > 1 && self.cfg.n_expert <= cuda::ROUTE_IN_ROUTER_MAX_EXPERT;
        if float_router {
            let route = routed.then_some(cuda::RouterRoute {
                k,
                weights_out: wts.ptr,
                ids_out: ids,
                counter: self.counts.route_done.ptr(),
            });
            self.gpu
                .router_routed(&m.router.mat(), x.ptr, n, logits.ptr, route)
                .map_err(cuda_err("router"))?;
        } else {
            self.mm_q_into(&m.router, x, xq, &logits)?;
        }
        let route = if n == 1 {
            MoeRoute::Logits {
                logits: logits.ptr,
                n_expert: self.cfg.n_expert,
                wts_out: wts.ptr,
                ids_out: ids,
            }
        } else {
            if !routed {
                self.gpu
                    .route_topk(logits.ptr, n, self.cfg.n_expert, k, wts.ptr, ids, 0, 0)
                    .map_err(cuda_err("route_topk"))?;
            }
            MoeRoute::Given { ids }
        };
        let a = self.fused_gate_up(m, x, xq, route)?;
        self.fused_down(m, &a, ids, wts.ptr, 0)
    }

    /// The first launch of a fused MoE block after the router: the routing (or the
    /// given one), every expert's gate/up/SwiGLU and the shared gate's logit, for each
    /// row of `x` on its own.
    pub(super) fn fused_gate_up(
        &self,
        m: &MoeDev,
        x: &DBuf,
        xq: ActQ8,
        route: MoeRoute,
    ) -> Result<FusedAct, ExecError> {
        let k = self.cfg.n_expert_used;
        let (fe, sh) = (
            m.gate_exps.n_rows,
            m.shared.as_ref().map_or(0, |s| s.gate.n_rows),
        );
        let n = x.rows;
        let act = self.arena.alloc(n, k * fe + sh, "expert products")?;
        // The down products' quantized input, written by the gate/up kernel.
        let quantized =
            !is_float(m.down_exps.ty) || m.shared.as_ref().is_some_and(|s| !is_float(s.down.ty));
        let aq = if quantized {
            self.arena.alloc_act_q8(n, act.cols)?
        } else {
            ActQ8::NONE
        };
        // Where the shared expert's gate logit goes.
        let logit = match &m.shared {
            Some(_) => self.arena.alloc(n, 1, "shared gate")?.ptr,
            None => 0,
        };
        let shared = m.shared.as_ref().map(|s| (s.gate.mat(), s.up.mat()));
        self.gpu
            .moe_gate_up(
                &m.gate_exps.mat(),
                &m.up_exps.mat(),
                shared.as_ref().map(|(g, u)| (g, u)),
                m.shared.as_ref().map_or(0, |s| s.gate_inp.ptr()),
                route,
                k,
                n,
                x.ptr,
                xq,
                logit,
                act.ptr,
                aq,
                self.counts.plane_done.ptr(),
            )
            .map_err(cuda_err("moe_gate_up"))?;
        Ok(FusedAct { act, aq, logit })
    }

    /// The second launch of a fused MoE block: the down products of the ranks' experts
    /// (`ids`, slots when tiered; a negative one's products are row r of `given`) and
    /// the shared expert, combined with the routing weights `wts`.
    pub(super) fn fused_down(
        &self,
        m: &MoeDev,
        a: &FusedAct,
        ids: u64,
        wts: u64,
        given: u64,
    ) -> Result<DBuf, ExecError> {
        let out = self.arena.alloc(a.act.rows, self.cfg.n_embd, "moe")?;
        let sdown = m.shared.as_ref().map(|s| s.down.mat());
        self.gpu
            .moe_down_combine(
                &m.down_exps.mat(),
                sdown.as_ref(),
                ids,
                wts,
                self.cfg.n_expert_used,
                a.act.rows,
                a.act.ptr,
                a.aq,
                a.logit,
                out.ptr,
                given,
            )
            .map_err(cuda_err("moe_down_combine"))?;
        Ok(out)
    }

    /// Groups a prompt's (token, rank) routes by expert into tiles of up to 8
    /// tokens: (gate/up tiles reading token rows, down tiles reading route rows,
    /// grouped). When the experts average at least a tile of tokens, each expert's
    /// tiles are padded with empty ones to whole groups of [`TILE_GROUP`], which the
    /// tensor-core GEMM reads as one unit (`grouped`); sparser prompts (and tiered
    /// decode steps) keep one tile per 8 routes for the matvec kernels.
    pub(super) fn prompt_tiles(&self, ids: &[i32], k: usize) -> (Vec<Tile>, Vec<Tile>, bool) {
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); self.cfg.n_expert];
        for (r, &e) in ids.iter().enumerate() {
            if let Some(v) = by_expert.get_mut(e as usize) {
                v.push(r);
            }
        }
        let active = by_expert.iter().filter(|v| !v.is_empty()).count();
        let routed: usize = by_expert.iter().map(Vec::len).sum();
        let grouped = active > 0 && routed >= TILE_TOKENS * active;
        let (mut gu, mut down) = (Vec::new(), Vec::new());
        for (e, routes) in by_expert.iter().enumerate() {
            let n_tiles = routes.len().div_ceil(TILE_TOKENS);
            let padded = if grouped {
                n_tiles.next_multiple_of(TILE_GROUP)
            } else {
                n_tiles
            };
            for i in 0..padded {
                // Past the expert's routes: an empty tile padding its group.
                let lo = (i * TILE_TOKENS).min(routes.len());
                let chunk = &routes[lo..(lo + TILE_TOKENS).min(routes.len())];
                let mut a = Tile {
                    expert: e as i32,
                    n: chunk.len() as i32,
                    in_row: [-1; 8],
                    out_row: [-1; 8],
                };
                let mut b = a;
                for (j, &r) in chunk.iter().enumerate() {
                    a.in_row[j] = (r / k) as i32;
                    a.out_row[j] = r as i32;
                    b.in_row[j] = r as i32;
                    b.out_row[j] = r as i32;
                }
                gu.push(a);
                down.push(b);
            }
        }
        (gu, down, grouped)
    }
}
