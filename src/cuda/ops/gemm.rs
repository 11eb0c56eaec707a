//! The many-row weight products (kernels/gemm.cu, gemm_skinny.cu, gemm_pipe.cu, gemm_wg.cu):
//! plain and grouped by expert, the kernel each shape takes, and the skinny and wgmma kernels'
//! launch heuristics.

use super::super::params::{GemmParams, In, Out, TmaMap, XPermParams};
use super::super::Gpu;
use super::tma_map;
use super::{blocks, GpuLinear};
use anyhow::{bail, Result};

impl Gpu {
    /// `y[m, :] (+)= W x[m, :]` for m rows (matrix 0 of the stack); row strides ldx, ldy (f32
    /// elements).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        w: &GpuLinear,
        prec: Precision,
        x: u64,
        ldx: usize,
        y: u64,
        ldy: usize,
        m: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.gemm_with(GemmKernel::Auto, w, prec, x, ldx, y, ldy, m, accumulate)
    }

    /// [`Gpu::gemm`] with the bf16 kernel chosen by the caller (tests, benchmarks).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_with(
        &self,
        kern: GemmKernel,
        w: &GpuLinear,
        prec: Precision,
        x: u64,
        ldx: usize,
        y: u64,
        ldy: usize,
        m: usize,
        accumulate: bool,
    ) -> Result<()> {
        let tiles = m.div_ceil(prec.bm());
        let kern = kern.pick(w, m, m, 1);
        self.gemm_raw(w, prec, kern, w.rows, (x, ldx, 0, 1, m), (y, ldy), m, (0, tiles), accumulate)
    }

    /// Whether [`Gpu::gemm_with`] (`n` = None) or [`Gpu::gemm_grouped_with`] (`Some(n)`) over `rows`
    /// input rows runs on gemm_wg, so that its input may be written into [`Gpu::wg_ws`] in its
    /// layout beforehand (as [`Gpu::silu_mul_pairs_perm`] does) and passed as x (ldx = width).
    pub fn gemm_takes_wg(
        &self,
        kern: GemmKernel,
        w: &GpuLinear,
        prec: Precision,
        n: Option<usize>,
        rows: usize,
    ) -> bool {
        let kern = match n {
            None => kern.pick(w, rows, rows, 1),
            Some(n) => kern.pick(w, rows, 64, (w.rows * w.count / n.max(1)).max(1)),
        };
        self.wg_runs(prec, kern, w, rows)
    }

    /// Whether gemm_raw's gemm_wg arm takes a product of `xrows` input rows (kernel resolved).
    fn wg_runs(&self, prec: Precision, kern: GemmKernel, w: &GpuLinear, xrows: usize) -> bool {
        prec == Precision::Bf16 && kern.is_wg() && self.fits(kern, w, xrows)
    }

    /// `rows` input rows of width `k` (row r read at x row `gather[r] / gdiv`, or r without
    /// `gather`) as bf16 in wgmma's k order into gemm_wg's workspace (x_bf16_perm).
    fn x_bf16_perm(&self, (x, ldx, gather, gdiv): (u64, usize, u64, usize), rows: usize, k: usize) -> Result<()> {
        let p = XPermParams {
            x: In::new(x),
            ldx: ldx as i64,
            gather: In::new(gather),
            gdiv: gdiv.max(1) as i32,
            xb: Out::new(self.wg_ws),
            rows: rows as i32,
            k: k as i32,
        };
        self.launch_params("x_bf16_perm", ((rows * k / 8).div_ceil(256) as u32, 1, 1), 256, 0, &p)
    }

    /// Whether the gemm_wg kernel `kern` (gemm_wt's for the Wt kernels: more formats) takes the
    /// product.
    fn fits(&self, kern: GemmKernel, w: &GpuLinear, xrows: usize) -> bool {
        if kern.is_wt() {
            self.wg_available()
                && w.wt_ok()
                && w.cols.is_multiple_of(128)
                && xrows * w.cols * 2 <= crate::cuda::WG_WS_BYTES
        } else {
            self.wg_fits(w, xrows)
        }
    }

    /// [`Gpu::fits`] with 256-row tiles (their shared memory within the device's).
    fn wide_fits(&self, kern: GemmKernel, w: &GpuLinear, xrows: usize) -> bool {
        let smem = if kern.is_wt() { crate::cuda::gemm_wt_smem(256, wt_bits(w)) } else { crate::cuda::GEMM_WG_SMEM256 };
        self.fits(kern, w, xrows) && smem <= self.smem_optin_max
    }

    /// The routed-expert product: rows grouped by expert through `tiles` (from [`Gpu::moe_align`],
    /// built for `prec.bm()`, at most `max_tiles`) over `pairs` rows in all; row m reads x row
    /// `gather[m] / gdiv` (or m when gather is 0) and uses matrix e of the stack seen as matrices
    /// of `n` rows.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_grouped(
        &self,
        w: &GpuLinear,
        prec: Precision,
        n: usize,
        x: (u64, usize, u64, usize),
        y: (u64, usize),
        (tiles, max_tiles, pairs): (u64, usize, usize),
    ) -> Result<()> {
        self.gemm_grouped_with(GemmKernel::Auto, w, prec, n, x, y, (tiles, max_tiles, pairs))
    }

    /// [`Gpu::gemm_grouped`] with the bf16 kernel chosen by the caller.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_grouped_with(
        &self,
        kern: GemmKernel,
        w: &GpuLinear,
        prec: Precision,
        n: usize,
        x: (u64, usize, u64, usize),
        y: (u64, usize),
        (tiles, max_tiles, pairs): (u64, usize, usize),
    ) -> Result<()> {
        if !(w.rows * w.count).is_multiple_of(n) {
            bail!("gemm_grouped: {n} rows per matrix do not divide the stack");
        }
        let kern = kern.pick(w, pairs, 64, (w.rows * w.count / n).max(1));
        let (xp, ldx, gather, gdiv) = x;
        if gather != 0
            && matches!(kern, GemmKernel::Wt | GemmKernel::WtTall)
            && gather_expand_on()
            && self.wg_runs(prec, kern, w, pairs)
            && xp != self.wg_ws
        {
            // gemm_wt's copies do not gather: the gathered rows written out in tile order first
            let k = w.cols;
            self.x_bf16_perm((xp, ldx, gather, gdiv), pairs, k)?;
            let x = (self.wg_ws, k, 0, 1, pairs);
            return self.gemm_raw(w, prec, kern, n, x, y, 0, (tiles, max_tiles), false);
        }
        // rows of x the gathered rows reach (pair p reads row p / gdiv)
        let xrows = if gather != 0 { pairs.div_ceil(gdiv.max(1)) } else { pairs };
        self.gemm_raw(w, prec, kern, n, (xp, ldx, gather, gdiv, xrows), y, 0, (tiles, max_tiles), false)
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm_raw(
        &self,
        w: &GpuLinear,
        prec: Precision,
        kern: GemmKernel,
        n: usize,
        (x, ldx, gather, gdiv, xrows): (u64, usize, u64, usize, usize),
        (y, ldy): (u64, usize),
        m: usize,
        (tiles, ntiles): (u64, usize),
        accumulate: bool,
    ) -> Result<()> {
        if w.bits != 0 && !w.cols.is_multiple_of(32) {
            bail!("gemm: quantized width {} is not a multiple of 32", w.cols);
        }
        if prec == Precision::Bf16 && (!w.cols.is_multiple_of(32) || !ldx.is_multiple_of(4) || !x.is_multiple_of(16)) {
            bail!("gemm_bf16: width {} / row stride {ldx} not aligned for the tensor-core path", w.cols);
        }
        if ntiles == 0 {
            return Ok(());
        }
        let (wp, sp, bp, bits, group, ty) = w.weight_fields();
        let mut a = GemmParams {
            w: wp,
            sc: sp,
            bi: bp,
            bits,
            group,
            ty,
            x: In::new(x),
            ldx: ldx as i64,
            gather: In::new(gather),
            gdiv: gdiv.max(1) as i32,
            y: Out::new(y),
            ldy: ldy as i64,
            m: m as i32,
            n: n as i32,
            k: w.cols as i32,
            tiles: In::new(tiles),
            accumulate: accumulate as i32,
            kq: 1,
            ksplit: 1,
            part: Out::new(0),
            tickets: Out::new(0),
            xm: TmaMap::NONE,
            wm: TmaMap::NONE,
        };
        if x == self.wg_ws && x != 0 && !self.wg_runs(prec, kern, w, xrows) {
            bail!("gemm: inputs in gemm_wg's workspace, but this product ({kern:?}, {xrows} rows) does not run on gemm_wg");
        }
        match (prec, kern) {
            (Precision::F32, _) => self.launch_params("gemm_f32", (blocks(n, 8), ntiles as u32, 1), 256, 0, &a),
            (Precision::Bf16, GemmKernel::Skinny(tn) | GemmKernel::SkinnyUnsplit(tn)) => {
                if !w.skinny_ok() {
                    bail!("gemm_skinny: {}-bit weights of width {} (group {}) unsupported", w.bits, w.cols, w.group);
                }
                let tn = skinny_tn(tn, w.cols, self.smem_optin);
                let name = crate::cuda::skinny_kernel(tn, w.bits);
                let kq = skinny_kq_for(w.cols, if tiles == 0 { 0 } else { ntiles });
                let bn = 256 / kq;
                let grid = if tiles == 0 { blocks(n, bn) * m.div_ceil(tn) as u32 } else { blocks(n, bn) };
                let split = tiles == 0 && !matches!(kern, GemmKernel::SkinnyUnsplit(_));
                let ksplit =
                    if split { skinny_ksplit(grid as usize, self.sms as usize, w.cols / 64, kq, m * n) } else { 1 };
                a.kq = kq as i32;
                a.ksplit = ksplit as i32;
                a.part = Out::new(self.splitk_ws);
                a.tickets = Out::new(self.splitk_ws + crate::cuda::SPLITK_PART_BYTES as u64);
                let grid = if tiles == 0 { (grid, ksplit as u32, 1) } else { (grid, ntiles as u32, 1) };
                self.launch_params(name, grid, 256, skinny_smem(tn, w.cols) as u32, &a)
            }
            (Precision::Bf16, GemmKernel::Wg256 | GemmKernel::Wt256 | GemmKernel::WtP256)
                if tiles != 0 || !self.wide_fits(kern, w, xrows) =>
            {
                bail!(
                    "gemm {kern:?}: a grouped product, or {xrows} rows of width {} that 256-row tiles do not take",
                    w.cols
                )
            }
            (Precision::Bf16, GemmKernel::WtP) if tiles != 0 => {
                bail!("gemm {kern:?}: gemm_wsp takes plain products only, not a grouped one")
            }
            (Precision::Bf16, GemmKernel::WgTall | GemmKernel::WtTall | GemmKernel::WtP)
                if !self.fits(kern, w, xrows) =>
            {
                bail!(
                    "gemm {kern:?}: {} rows of width {} ({}-bit, group {}) do not fit gemm_wg",
                    xrows,
                    w.cols,
                    w.bits,
                    w.group
                )
            }
            // (gemm_wg gathers rows but reads 4-bit codes only: a gathered input of another
            // format that gemm_wt cannot take goes to the tiles kernel below)
            (Precision::Bf16, _) if self.wg_runs(prec, kern, w, xrows) && (gather == 0 || w.pipe_ok()) => {
                // the inputs as bf16 in wgmma's k order into the workspace (unless a kernel such
                // as silu_mul_pairs_perm wrote them there already), then the product
                let k = w.cols;
                if x != self.wg_ws {
                    self.x_bf16_perm((x, ldx, 0, 1), xrows, k)?;
                } else if gather != 0 || ldx != k {
                    bail!("gemm: inputs in gemm_wg's workspace are read as {xrows} plain rows of {k}");
                }
                a.x = In::new(self.wg_ws);
                a.ldx = k as i64;
                let wide = tiles == 0
                    && (matches!(kern, GemmKernel::Wg256 | GemmKernel::Wt256 | GemmKernel::WtP256)
                        || (wg256_from() > 0
                            && m >= wg256_from()
                            && self.wide_fits(kern, w, xrows)
                            && !(fill_sms() && 2 * (blocks(n, 128) as usize) * m.div_ceil(256) <= self.sms as usize)));
                let tall = matches!(kern, GemmKernel::WgTall | GemmKernel::WtTall | GemmKernel::WtP)
                    || (tiles == 0 && m >= wg128_from());
                // gemm_wt's TMA copies do not gather rows: gathered inputs stay on gemm_wg
                let tma = kern.is_wt() && gather == 0;
                let bt = if wide {
                    256
                } else if tall {
                    128
                } else {
                    64
                };
                let per_sm = if bt == 64 { 2 } else { 1 };
                let (name, smem) = match (tma, bt) {
                    (false, 256) => ("gemm_wg256", crate::cuda::GEMM_WG_SMEM256),
                    (false, 128) => ("gemm_wg128", crate::cuda::GEMM_WG_SMEM128),
                    (false, _) => ("gemm_wg64", crate::cuda::GEMM_WG_SMEM64),
                    (true, _) => {
                        let bits = wt_bits(w);
                        (crate::cuda::gemm_wt_kernel(bt, bits), crate::cuda::gemm_wt_smem(bt, bits))
                    }
                };
                if tma {
                    // inputs: bf16 [xrows][k], boxes of 64 columns x bt rows in the 128-byte
                    // swizzle; weights: bytes [stack rows][k·bits/8], boxes of that row's
                    // k-tile (128 columns) x 128 rows
                    let bits = wt_bits(w) as usize;
                    let row = k * bits / 8;
                    a.xm = tma_map(self.wg_ws, true, k, xrows, (64, bt as u32), true)?;
                    a.wm = tma_map(wp.0, false, row, w.rows * w.count, (16 * bits as u32, 128), false)?;
                }
                let (gx, gy) = (blocks(n, 128), if tiles == 0 { m.div_ceil(bt) } else { ntiles } as u32);
                let ks = if tiles == 0 {
                    wg_ksplit((gx * gy) as usize, (self.sms * per_sm) as usize, k / 128, m * n)
                } else {
                    1
                };
                let forced = matches!(kern, GemmKernel::WtP | GemmKernel::WtP256);
                let wsp_smem = crate::cuda::gemm_wsp_smem(bt, wt_bits(w), w.group.max(1) as usize);
                // (its scale warps load a row's groups of a k-tile as one vector: groups from 32,
                // scales and biases aligned to it)
                let vec = 256 / w.group.max(1) as u64;
                let room = wsp_smem + crate::cuda::GEMM_WSP_STATIC_SMEM <= self.smem_optin_max
                    && (w.bits == 0 || (w.group >= 32 && sp.0 % vec == 0 && bp.0 % vec == 0));
                // (Auto: only where blocks take more than one tile; with one tile each the
                // specialization alone measured 4% slower, the 8-bit router at 4K)
                let many = (gx * gy) as usize > self.sms as usize;
                if tma && tiles == 0 && bt >= 128 && (forced || (ks == 1 && many && persist_on() && room)) {
                    if !room {
                        bail!(
                            "gemm_wsp: group {} (from 32, scales aligned to 256 / group bytes), or {wsp_smem} bytes of shared memory beyond the device's",
                            w.group
                        );
                    }
                    // persistent: one block per SM over all the tiles, no split K
                    let grid = (gx * gy).min(self.sms);
                    let name = crate::cuda::gemm_wsp_kernel(bt, wt_bits(w));
                    return self.launch_params(name, (grid, 1, 1), 384, wsp_smem as u32, &a);
                }
                a.ksplit = ks as i32;
                a.part = Out::new(self.splitk_ws);
                a.tickets = Out::new(self.splitk_ws + crate::cuda::SPLITK_PART_BYTES as u64);
                self.launch_params(name, (gx, gy, ks as u32), 256, smem as u32, &a)
            }
            (Precision::Bf16, GemmKernel::Pipe | GemmKernel::Wg | GemmKernel::Wt)
                if kern == GemmKernel::Pipe || w.pipe_ok() =>
            {
                if !w.pipe_ok() {
                    bail!("gemm_pipe: {}-bit weights of width {} (group {}) unsupported", w.bits, w.cols, w.group);
                }
                if tiles == 0 && m >= 1024 {
                    let grid = (blocks(n, 128), m.div_ceil(128) as u32, 1);
                    self.launch_params("gemm_pipe128", grid, 256, crate::cuda::GEMM_PIPE_SMEM128 as u32, &a)
                } else {
                    let grid = (blocks(n, 128), ntiles as u32, 1);
                    self.launch_params("gemm_pipe64", grid, 256, crate::cuda::GEMM_PIPE_SMEM64 as u32, &a)
                }
            }
            (Precision::Bf16, _) if tiles == 0 && m >= 1024 => {
                self.launch_params("gemm_bf16_m128", (blocks(n, 128), m.div_ceil(128) as u32, 1), 256, 0, &a)
            }
            (Precision::Bf16, _) => self.launch_params("gemm_bf16", (blocks(n, 128), ntiles as u32, 1), 256, 0, &a),
        }
    }

    /// Whether this device runs gemm_wg (sm_90a, its workspace allocated).
    pub fn wg_available(&self) -> bool {
        self.wg_ws != 0
    }

    /// Whether gemm_wg takes this product: a format gemm_pipe reads, in groups of a power of
    /// two and whole 128-column k-tiles, with `xrows` input rows within the workspace.
    pub fn wg_fits(&self, w: &GpuLinear, xrows: usize) -> bool {
        self.wg_available()
            && w.pipe_ok()
            && (w.group as u32).is_power_of_two()
            && w.cols.is_multiple_of(128)
            && xrows * w.cols * 2 <= crate::cuda::WG_WS_BYTES
    }
}

/// gemm_wt's weight bits for a format it reads (dense bf16: 16).
fn wt_bits(w: &GpuLinear) -> u32 {
    if w.bits == 0 {
        16
    } else {
        w.bits as u32
    }
}

/// Which bf16 kernel runs a many-row product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmKernel {
    /// By shape: [`GemmKernel::Skinny`] for few rows per matrix, else [`GemmKernel::Tiles`].
    Auto,
    /// gemm_bf16: 64- or 128-row tiles of inputs against 128 weight rows.
    Tiles,
    /// gemm_skinny: weight rows on the MMA's M side, up to this many input rows (8, 16 or 32)
    /// per pass; each weight read once per pass.
    Skinny(usize),
    /// [`GemmKernel::Skinny`] with K never split over blocks (tests the one-block sums).
    SkinnyUnsplit(usize),
    /// gemm_pipe: the tiles kernel's product with the inputs in a cp.async pipeline and the 4-bit
    /// weights dequantized into the mma fragments (`LILY_CUDA_GEMM_PIPE=0`: [`GemmKernel::Tiles`]).
    Pipe,
    /// gemm_wg: the same products on Hopper's wgmma, inputs converted once to bf16 (sm_90a and
    /// inputs within [`crate::cuda::WG_WS_BYTES`]; else [`GemmKernel::Pipe`]).
    Wg,
    /// gemm_wg's 128-row kernel (gemm_wg128) on a grouped product's tiles, which `moe_align`
    /// must then build 128 rows tall: each expert's weights dequantized once per 128 rows instead
    /// of 64. An error, not a fallback, where gemm_wg does not take the product.
    WgTall,
    /// gemm_wg256 on a plain product: 256-row input tiles, each weight dequantized once per 256
    /// rows (an error where gemm_wg does not take the product or the device lacks its 216 KB of
    /// shared memory).
    Wg256,
    /// gemm_wt: gemm_wg's product with its tiles copied by the TMA and its wgmmas kept in flight
    /// across k-tiles (kernels/gemm_wt.cu), on the tiles [`GemmKernel::Wg`] would take, for
    /// 4-bit, 8-bit and dense bf16 weights (and like Wg [`GemmKernel::Pipe`], or the tiles
    /// kernel for the formats gemm_pipe does not read, where it does not take the product); a gathered input
    /// (the routed experts' gate/up) is first written out in tile order (`LILY_CUDA_GATHER_EXPAND`,
    /// where the workspace holds it) or else stays on gemm_wg, whose copies gather rows.
    /// Auto picks it where it would pick gemm_wg (`LILY_CUDA_GEMM_TMA=0`: gemm_wg).
    Wt,
    /// [`GemmKernel::Wt`] on a grouped product's 128-row tiles (as [`GemmKernel::WgTall`]).
    WtTall,
    /// [`GemmKernel::Wt`] on 256-row tiles of a plain product (as [`GemmKernel::Wg256`]).
    Wt256,
    /// gemm_wsp (kernels/gemm_wsp.cu): gemm_wt's product, persistent and warp-specialized, on
    /// 128-row tiles of a plain product (256 from `LILY_CUDA_WG256_FROM` rows, as Wt). Auto runs
    /// its plain gemm_wt products of 128- and 256-row tiles on it where there are more tiles than
    /// SMs and no split K (`LILY_CUDA_GEMM_PERSIST=0`: never).
    WtP,
    /// [`GemmKernel::WtP`] on 256-row tiles.
    WtP256,
}

/// Most rows of a plain product that go to the skinny kernel (`LILY_CUDA_SKINNY_MAX_M`).
fn skinny_max_m() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    super::env_usize(&V, "LILY_CUDA_SKINNY_MAX_M", 64)
}

/// Plain products with at most this many output rows go to the skinny kernel for up to 1,024
/// input rows (`LILY_CUDA_SKINNY_SMALL_N`, default 512; 0 turns it off): the 257-row router at
/// 256 tokens ran ~70 µs on the tiles kernel (a handful of blocks, each over all of K), while
/// the skinny kernel spreads it over row passes and K splits that read the 0.5 MB from L2.
fn skinny_small_n() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    super::env_usize(&V, "LILY_CUDA_SKINNY_SMALL_N", 512)
}

/// Most input rows per matrix, on average, for which grouped products go to the skinny kernel
/// (`LILY_CUDA_SKINNY_MAX_AVG`).
fn skinny_max_avg() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    super::env_usize(&V, "LILY_CUDA_SKINNY_MAX_AVG", 24)
}

impl GemmKernel {
    /// A gemm_wt kernel.
    fn is_wt(self) -> bool {
        matches!(self, GemmKernel::Wt | GemmKernel::WtTall | GemmKernel::Wt256 | GemmKernel::WtP | GemmKernel::WtP256)
    }

    /// A gemm_wg / gemm_wt kernel (bf16 inputs in wgmma's k order from gemm_wg's workspace).
    fn is_wg(self) -> bool {
        matches!(
            self,
            GemmKernel::Wg
                | GemmKernel::WgTall
                | GemmKernel::Wg256
                | GemmKernel::Wt
                | GemmKernel::WtTall
                | GemmKernel::Wt256
                | GemmKernel::WtP
                | GemmKernel::WtP256
        )
    }

    /// The kernel for `rows` input rows over `mats` matrices (at most `per_tile` in one tile).
    fn pick(self, w: &GpuLinear, rows: usize, per_tile: usize, mats: usize) -> GemmKernel {
        match self {
            GemmKernel::Auto => {
                let avg = rows.div_ceil(mats.max(1)).min(per_tile);
                let small = if mats > 1 {
                    avg <= skinny_max_avg()
                } else {
                    rows <= skinny_max_m() || (w.rows * w.count <= skinny_small_n() && rows <= 1024)
                };
                if small && w.skinny_ok() {
                    let tn = if avg <= 6 {
                        8
                    } else if avg <= 16 {
                        16
                    } else {
                        32
                    };
                    GemmKernel::Skinny(tn.min(skinny_tn_cap().max(8)))
                } else if w.pipe_ok() && wg_on() {
                    if tma_on() {
                        GemmKernel::Wt
                    } else {
                        GemmKernel::Wg
                    }
                } else if w.wt_ok() && wg_on() && tma_on() {
                    // 8-bit and dense bf16: gemm_wt where it takes the product, else the tiles
                    GemmKernel::Wt
                } else if w.pipe_ok() && pipe_on() {
                    GemmKernel::Pipe
                } else {
                    GemmKernel::Tiles
                }
            }
            k => k,
        }
    }
}

/// Plain gemm_wg products of at least this many rows take 256-row tiles (gemm_wg256)
/// (`LILY_CUDA_WG256_FROM`, default 2048: +2.4% prefill at 4K and 16K, perf log session 25;
/// 0 never).
fn wg256_from() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    super::env_usize(&V, "LILY_CUDA_WG256_FROM", 2048)
}

/// Whether Auto's plain products keep 128-row tiles where 256-row ones would leave at least half
/// the SMs without a tile (narrow products such as the 257-row router at 4K: 48 tiles of 256 rows,
/// 1.62 → 1.07 ms over 40 layers, perf log session 29; where the 256-row tiles nearly fill the
/// GPU, 128 of them, the 128-row form measured slower, 1.41 → 1.61 ms). `LILY_CUDA_WG256_FILL=0`
/// takes 256 rows there too.
fn fill_sms() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_WG256_FILL").map_or(true, |v| v != "0"))
}

/// Whether Auto's plain gemm_wt products of 128- and 256-row tiles without split K and with more
/// tiles than SMs run on the persistent gemm_wsp (`LILY_CUDA_GEMM_PERSIST=0`: no; on by default:
/// its 4-bit 256-row products 1.7% and its dense bf16 ones 5% faster than gemm_wt's, perf log
/// session 29).
fn persist_on() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_GEMM_PERSIST").map_or(true, |v| v != "0"))
}

/// Whether Auto's gemm_wg products run on gemm_wt (`LILY_CUDA_GEMM_TMA=0`: no; on by default,
/// +31% prefill at 4K, +28% at 16K, perf log session 28).
pub fn tma_on() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_GEMM_TMA").map_or(true, |v| v != "0"))
}

/// Whether a grouped product with gathered inputs (the routed experts' gate/up) on gemm_wt first
/// writes its rows out in tile order (x_bf16_perm with the row map: pairs rows instead of tokens)
/// so that gemm_wt's TMA copies read them, instead of running on gemm_wg
/// (`LILY_CUDA_GATHER_EXPAND=0`: no; on by default, +7.5% prefill at 4K, +6.7% at 16K, perf log
/// session 28).
fn gather_expand_on() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_GATHER_EXPAND").map_or(true, |v| v != "0"))
}

/// Grouped bf16 products whose experts average at least this many rows take
/// [`GemmKernel::WgTall`] (128-row tiles) where gemm_wg takes them (`LILY_CUDA_WG_TALL_AVG`;
/// 0, the default until measured, never).
pub fn wg_tall_avg() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    super::env_usize(&V, "LILY_CUDA_WG_TALL_AVG", 0)
}

/// Whether the prefill's down projections take their input from [`Gpu::silu_mul_pairs_perm`]
/// (bf16 in gemm_wg's layout, no f32 round trip and no conversion launch) where they run on
/// gemm_wg (`LILY_CUDA_SILU_PERM=0`: no; on by default, +1.9% prefill at 4K with
/// [`gdn_norm_perm_on`], session 26).
pub fn silu_perm_on() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_SILU_PERM").map_or(true, |v| v != "0"))
}

/// Whether the prefill's GDN out-projections take their input from the gated norm written as
/// bf16 straight into gemm_wg's workspace ([`Gpu::gdn_prefill_to_wg`]) where they run on
/// gemm_wg (`LILY_CUDA_GDN_NORM_PERM=0`: no; on by default, session 26).
pub fn gdn_norm_perm_on() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_GDN_NORM_PERM").map_or(true, |v| v != "0"))
}

/// Whether Auto picks [`GemmKernel::Wg`] for what [`GemmKernel::Pipe`] reads
/// (`LILY_CUDA_GEMM_WG=0`: no).
fn wg_on() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_GEMM_WG").map_or(true, |v| v != "0"))
}

/// Plain gemm_wg products of at least this many rows take the 128-row tiles (gemm_wg128: each
/// weight dequantized once per 128 input rows, one block per SM) instead of 64
/// (`LILY_CUDA_WG128_FROM`, default 1024).
fn wg128_from() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    super::env_usize(&V, "LILY_CUDA_WG128_FROM", 1024)
}

/// Whether Auto picks [`GemmKernel::Pipe`] over the tiles kernel (`LILY_CUDA_GEMM_PIPE=0`: no).
fn pipe_on() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_GEMM_PIPE").map_or(true, |v| v != "0"))
}

/// Blocks over which a plain skinny product of `grid` blocks splits K (`chunks` of 64 columns,
/// `kq` parts per block, `mn` output values): enough to give every SM a block, at most 8, each
/// warp keeping at least one chunk, within the workspace; 1 from half the SMs up
/// (`LILY_CUDA_SKINNY_SPLITK=0` turns it off).
fn skinny_ksplit(grid: usize, sms: usize, chunks: usize, kq: usize, mn: usize) -> usize {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *OFF.get_or_init(|| std::env::var("LILY_CUDA_SKINNY_SPLITK").is_ok_and(|v| v == "0")) {
        return 1;
    }
    if 2 * grid >= sms || grid > crate::cuda::SPLITK_TICKETS {
        return 1;
    }
    let fit = crate::cuda::SPLITK_PART_BYTES / (4 * mn.max(1));
    sms.div_ceil(grid).min(8).min(chunks / kq).min(fit).max(1)
}

/// Blocks over which a plain gemm_wg product of `grid` blocks splits its `ktiles` k-tiles (`mn`
/// output values), where the grid fills at most half of the `slots` (blocks resident at once):
/// about one block per slot, at most 8, each with at least two k-tiles, within the workspace
/// (at 256 tokens the 2,048-row output projections are 64 blocks of 32 k-tiles on 264 slots).
/// `LILY_CUDA_WG_SPLITK=0` turns it off.
fn wg_ksplit(grid: usize, slots: usize, ktiles: usize, mn: usize) -> usize {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *OFF.get_or_init(|| std::env::var("LILY_CUDA_WG_SPLITK").is_ok_and(|v| v == "0")) {
        return 1;
    }
    if 2 * grid > slots || grid > crate::cuda::SPLITK_TICKETS {
        return 1;
    }
    let fit = crate::cuda::SPLITK_PART_BYTES / (4 * mn.max(1));
    (slots / grid).min(8).min(ktiles / 2).min(fit).max(1)
}

/// Dynamic shared memory of gemm_skinny for `tn` rows per pass and width `k`.
fn skinny_smem(tn: usize, k: usize) -> usize {
    (tn * k * 2).max(256 * (tn + 1) * 4)
}

/// [`skinny_kq`] for a grouped product of `ntiles` expert tiles (0: a plain product). Every
/// block of a tile stages the tile's inputs, and a block covers 256/kq weight rows, so with
/// many tiles (a prefill chunk's routed experts: ~546 tiles at 256 tokens) kq = 1 stages them
/// a quarter as often and still fills the GPU: prefill at 256 tokens 8,489-8,509 → 8,854-8,872
/// tok/s (kq 2: 8,356-8,361). From 384 tiles (about 112 prompt tokens); the batched decode
/// step (330 tiles at 64 sequences) keeps [`skinny_kq`]. `LILY_CUDA_SKINNY_KQ` forces both.
fn skinny_kq_for(k: usize, ntiles: usize) -> usize {
    match skinny_kq_forced() {
        None if ntiles >= 384 => 1,
        _ => skinny_kq(k),
    }
}

fn skinny_kq_forced() -> Option<usize> {
    static V: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_SKINNY_KQ").ok().and_then(|v| v.parse().ok()))
}

/// How many parts of K the 8 warps of a gemm_skinny block split (1, 2 or 4; the block then
/// covers 256 / kq weight rows): about 8 chunks of 64 columns per warp
/// (`LILY_CUDA_SKINNY_KQ` overrides).
fn skinny_kq(k: usize) -> usize {
    match skinny_kq_forced() {
        Some(q @ (1 | 2 | 4)) => q,
        _ => match k / 64 {
            c if c >= 32 => 4,
            c if c >= 16 => 2,
            _ => 1,
        },
    }
}

/// Most input rows per pass that [`GemmKernel::Auto`] gives the skinny kernel
/// (`LILY_CUDA_SKINNY_TN`, default 8: the 8-row 4-bit pass runs three blocks per SM with two
/// chunks in flight per warp, the 16-row one two blocks with one chunk; in the batched step
/// 8 beat 16 by 6.5% at B=16 and tied at B=64 (3,041 vs 3,059 tok/s), and 16 had beaten two
/// 32-row passes at one block per SM by 4-5% at B=64).
fn skinny_tn_cap() -> usize {
    static CAP: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    super::env_usize(&CAP, "LILY_CUDA_SKINNY_TN", 8)
}

/// `tn` (8, 16 or 32) lowered until its shared memory fits `optin` bytes.
fn skinny_tn(tn: usize, k: usize, optin: usize) -> usize {
    let mut tn = tn.clamp(8, 32).next_power_of_two();
    while tn > 8 && skinny_smem(tn, k) > optin {
        tn /= 2;
    }
    tn
}

/// Which arithmetic the many-row products use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// fp32 FMAs (exact mode: tests against the fp32 references).
    F32,
    /// bf16 tensor cores with fp32 accumulation (the fast prefill).
    Bf16,
}

impl Precision {
    /// Rows per tile of the kernel (the `bm` that `moe_align` must use).
    pub fn bm(self) -> usize {
        match self {
            Precision::F32 => 8,
            Precision::Bf16 => 64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::wg_ksplit;

    #[test]
    fn wg_split_k_fills_idle_slots_within_its_bounds() {
        let slots = 264;
        for grid in [1usize, 16, 64, 100, 132, 133, 388, 5000] {
            for ktiles in [1usize, 4, 16, 32] {
                for mn in [1usize, 256 * 2048, 4096 * 4096] {
                    let ks = wg_ksplit(grid, slots, ktiles, mn);
                    assert!((1..=8).contains(&ks), "grid {grid}: ksplit {ks}");
                    if ks > 1 {
                        assert!(2 * grid <= slots, "grid {grid} already fills half the slots");
                        assert!(ktiles / ks >= 2, "{ktiles} k-tiles over {ks} parts");
                        assert!(ks * mn * 4 <= crate::cuda::SPLITK_PART_BYTES, "parts overflow the workspace");
                        assert!(grid * ks <= slots, "more blocks than slots");
                    }
                }
            }
        }
        // the 256-token output projection: 64 blocks of 32 k-tiles go to 4 parts of 8
        assert_eq!(wg_ksplit(64, slots, 32, 256 * 2048), 4);
    }
}
