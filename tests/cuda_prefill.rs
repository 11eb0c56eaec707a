//! The batched-prefill kernels against the CPU reference: many-row products (fp32 and bf16
//! tensor cores, plain and grouped by expert), batched routing and combination, and the GDN
//! conv + delta-rule scan over a chunk (causal attention of a chunk over a cache:
//! tests/cuda_attention_prefill.rs). Skips (and passes, saying so) when no GPU/driver is present.
//!
//! Bounds:
//! - fp32 kernels: as in tests/cuda_kernels.rs (summation order only): NMSE 1e-9, 1e-7 through a
//!   recurrence of up to 67 steps.
//! - bf16 tensor cores: each product x·w carries two bf16 roundings (relative error at most 2^-9
//!   each), so a sum of zero-mean terms has NMSE of a few 1e-6 (measured on the H200: 4e-6 to
//!   6e-6 over many rows, up to 1.5e-5 for a single row); we allow 1e-4. A wrong fragment, tile
//!   or group index gives NMSE of order 1.

mod common;
use common::gpu::*;
use common::*;
use lily::cpu::gdn::GdnDims;
use lily::cpu::norm::sigmoid;
use lily::cuda::{gdn_chunk_floats, GdnPrefill, GdnPrefillKernel, GdnStep, GemmKernel, GpuLinear, Precision};
use lily::linear::{FloatType, Linear};

const TOL: f64 = 1e-9;
const TOL_BF16: f64 = 1e-4;

fn tol(p: Precision) -> f64 {
    match p {
        Precision::F32 => TOL,
        Precision::Bf16 => TOL_BF16,
    }
}

/// The product kernels to check: fp32, the bf16 tiles, gemm_pipe and gemm_wg (sm_90a; also its
/// 256-row tiles and the warp-specialized gemm_ws) where they read the format, and the bf16 skinny kernel at each pass width (when it reads the format).
fn kernels(g: &lily::cuda::Gpu, gl: &GpuLinear) -> Vec<(Precision, GemmKernel)> {
    let mut v = vec![(Precision::F32, GemmKernel::Auto), (Precision::Bf16, GemmKernel::Tiles)];
    if gl.pipe_ok() {
        v.push((Precision::Bf16, GemmKernel::Pipe));
    }
    if gl.pipe_ok() && g.wg_available() {
        v.push((Precision::Bf16, GemmKernel::Wg));
    }
    if gl.skinny_ok() {
        v.extend([8, 16, 32].map(|tn| (Precision::Bf16, GemmKernel::Skinny(tn))));
        // small grids split K over blocks: the same products with each block over all of K
        v.extend([8, 32].map(|tn| (Precision::Bf16, GemmKernel::SkinnyUnsplit(tn))));
    }
    v
}

/// The gemm_wg forms beside Auto's (sm_90a, where gemm_wg takes the product: widths of whole
/// 128-column k-tiles; elsewhere they are errors, not fallbacks): 256-row tiles (plain products
/// only; the grouped test skips them) and gemm_wt, the TMA form, on gemm_wg's tiles and on 256
/// rows, and gemm_wsp, its persistent warp-specialized form (WtP, WtP256: plain products only),
/// for 4-bit, 8-bit and dense bf16 weights (the grouped test also runs gemm_wt's 128-row tiles;
/// its gathered gate/up is written out in tile order first). Their own tests, so that a kernel that traps does not
/// take the others' results with it (filter by test name).
fn new_kernels(g: &lily::cuda::Gpu, gl: &GpuLinear) -> Vec<(Precision, GemmKernel)> {
    let mut v = Vec::new();
    if g.wg_available() && gl.cols.is_multiple_of(128) {
        if gl.pipe_ok() {
            v.push((Precision::Bf16, GemmKernel::Wg256));
        }
        if gl.wt_ok() {
            v.extend(
                [GemmKernel::Wt, GemmKernel::Wt256, GemmKernel::WtP, GemmKernel::WtP256].map(|k| (Precision::Bf16, k)),
            );
        }
    }
    v
}

#[test]
fn gemm_matches_cpu_in_both_precisions() {
    gemm_cases(kernels);
}

#[test]
fn gemm_new_kernels_match_cpu() {
    gemm_cases(new_kernels);
}

/// gemm_wsp, the persistent kernel, where blocks take several tiles (more tiles than SMs): its
/// stages and their phases run on across tile boundaries (2 and 3 k-tiles per tile against 3-5
/// stages), 4,100 weight rows (the last tile clamped) and 1,300 input rows (a partial last tile).
#[test]
fn gemm_persistent_many_tiles_match_cpu() {
    let Some(g) = wg_gpu() else { return };
    let mut r = rng(29);
    let (rows, m) = (4100usize, 1300usize);
    for cols in [256usize, 384] {
        let cases = [
            ("q4 g64", quant(&mut r, rows, cols, 4, 64)),
            ("q4 g32", quant(&mut r, rows, cols, 4, 32)),
            ("q8 g128", quant(&mut r, rows, cols, 8, 128)),
            ("dense BF16", dense(&mut r, rows, cols, FloatType::BF16)),
        ];
        let x = uniform(&mut r, m * cols, 1.0);
        let xb = g.upload_f32(&x).unwrap();
        for (name, l) in &cases {
            let gl = GpuLinear::upload(&g, l).unwrap();
            let mut want = vec![0f32; m * rows];
            l.matmul(&x, &mut want);
            for kern in [GemmKernel::WtP, GemmKernel::WtP256] {
                let label = format!("{name} {rows}x{cols}");
                gemm_checked(&g, (Precision::Bf16, kern), &gl, xb.ptr, m, rows, &want, &label);
            }
        }
    }
}

fn gemm_cases(pick: fn(&lily::cuda::Gpu, &GpuLinear) -> Vec<(Precision, GemmKernel)>) {
    let Some(g) = gpu() else { return };
    let mut r = rng(11);
    let mut cases: Vec<(String, Linear)> = Vec::new();
    for (bits, group) in [(4u32, 32usize), (4, 64), (4, 128), (8, 64), (8, 32)] {
        cases.push((format!("q{bits} g{group} 133x{}", 3 * group), quant(&mut r, 133, 3 * group, bits, group)));
    }
    // Widths that the skinny kernel reads (multiples of 64): its blocks split K in 1, 2 or 4 parts
    // of 2 to 16 chunks; 300 rows span two 128-row block tiles.
    for (bits, group, rows, cols) in
        [(4u32, 32usize, 133usize, 256usize), (8, 32, 70, 128), (4, 64, 300, 1024), (4, 64, 77, 4096)]
    {
        cases.push((format!("q{bits} g{group} {rows}x{cols}"), quant(&mut r, rows, cols, bits, group)));
    }
    cases.push(("q4 g64 45x2048".into(), quant(&mut r, 45, 2048, 4, 64)));
    // 4-bit at 1100 rows (the 128-row pipelined kernel) with groups of 32 (two per k-tile)
    cases.push(("q4 g32 40x256".into(), quant(&mut r, 40, 256, 4, 32)));
    for ty in [FloatType::F32, FloatType::F16, FloatType::BF16] {
        cases.push((format!("dense {ty:?} 29x96"), dense(&mut r, 29, 96, ty)));
    }
    cases.push(("dense BF16 29x192".into(), dense(&mut r, 29, 192, FloatType::BF16)));
    // gemm_wt's 8-bit and dense bf16 forms (whole 128-column k-tiles)
    cases.push(("q8 g64 45x256".into(), quant(&mut r, 45, 256, 8, 64)));
    cases.push(("dense BF16 40x256".into(), dense(&mut r, 40, 256, FloatType::BF16)));
    for (name, l) in &cases {
        let gl = GpuLinear::upload(&g, l).unwrap();
        // 1100 rows take the 128-row-tile kernel (plain products of at least 1024 rows).
        let ms: &[usize] = if l.cols <= 2048 && l.rows < 64 { &[1, 13, 40, 130, 1100] } else { &[1, 13, 40, 130] };
        for &m in ms {
            let x = uniform(&mut r, m * l.cols, 1.0);
            let mut want = vec![0f32; m * l.rows];
            l.matmul(&x, &mut want);
            // Output rows of stride rows + 3: the 3 guard columns must stay NaN.
            let ldy = l.rows + 3;
            let xb = g.upload_f32(&x).unwrap();
            for pk in pick(&g, &gl) {
                gemm_checked(&g, pk, &gl, xb.ptr, m, ldy, &want, name);
            }
        }
    }
}

/// One product of `m` input rows (at `x`) into NaN-filled output rows of stride `ldy` against the
/// CPU's `want`, then accumulated onto itself against twice `want`; columns past the weight's
/// rows (guards) must stay NaN.
#[allow(clippy::too_many_arguments)]
fn gemm_checked(
    g: &std::sync::Arc<lily::cuda::Gpu>,
    (prec, kern): (Precision, GemmKernel),
    gl: &GpuLinear,
    x: u64,
    m: usize,
    ldy: usize,
    want: &[f32],
    name: &str,
) {
    let (rows, cols) = (gl.rows * gl.count, gl.cols);
    let yb = g.upload_f32(&vec![f32::NAN; m * ldy]).unwrap();
    for (acc, want) in [(false, want.to_vec()), (true, want.iter().map(|v| 2.0 * v).collect())] {
        g.gemm_with(kern, gl, prec, x, cols, yb.ptr, ldy, m, acc).unwrap();
        let y = yb.read_f32(0, m * ldy).unwrap();
        let got: Vec<f32> = y.chunks(ldy).flat_map(|row| row[..rows].to_vec()).collect();
        assert!(y.chunks(ldy).all(|row| row[rows..].iter().all(|v| v.is_nan())), "{name}: guard written");
        let what = if acc { " accumulate" } else { "" };
        check(&format!("gemm {prec:?} {kern:?}{what} {name} M={m}"), &got, &want, tol(prec));
    }
}

/// The device when it runs gemm_wg (sm_90a), else a loud skip.
fn wg_gpu() -> Option<std::sync::Arc<lily::cuda::Gpu>> {
    let g = gpu()?;
    if !g.wg_available() {
        eprintln!("SKIPPED: this device has no gemm_wg (sm_90a)");
        return None;
    }
    Some(g)
}

/// silu_mul_pairs_perm writes gemm_wg's input as x_bf16_perm writes it from silu_mul_pairs' f32
/// rows (the same f32 product, rounded once): the product from the workspace equals the product
/// through the f32 rows bit for bit, and both match the CPU within the bf16 bound. A product that
/// would not run on gemm_wg refuses the workspace as its input.
#[test]
fn silu_perm_feeds_gemm_wg_bit_identically() {
    let Some(g) = wg_gpu() else { return };
    let mut r = rng(23);
    // 70 gate/up pairs of width 256 (gate row k at [k, 0..256), up at [k, 256..512)) into a
    // 600-row down projection
    let (n, rows, out) = (256, 70, 600);
    let l = quant(&mut r, out, n, 4, 64);
    let gl = GpuLinear::upload(&g, &l).unwrap();
    let gu = uniform(&mut r, rows * 2 * n, 3.0);
    let h: Vec<f32> = (0..rows * n)
        .map(|i| {
            let (k, j) = (i / n, i % n);
            let (a, b) = (gu[k * 2 * n + j], gu[k * 2 * n + n + j]);
            a * sigmoid(a) * b
        })
        .collect();
    let mut want = vec![0f32; rows * out];
    l.matmul(&h, &mut want);
    let gub = g.upload_f32(&gu).unwrap();
    let hb = g.upload_f32(&vec![f32::NAN; rows * n]).unwrap();
    let ya = g.upload_f32(&vec![f32::NAN; rows * out]).unwrap();
    let yb = g.upload_f32(&vec![f32::NAN; rows * out]).unwrap();
    assert!(g.gemm_takes_wg(GemmKernel::Wg, &gl, Precision::Bf16, None, rows));
    g.silu_mul_pairs(gub.ptr, hb.ptr, n, rows).unwrap();
    g.gemm_with(GemmKernel::Wg, &gl, Precision::Bf16, hb.ptr, n, ya.ptr, out, rows, false).unwrap();
    g.silu_mul_pairs_perm(gub.ptr, n, rows).unwrap();
    g.gemm_with(GemmKernel::Wg, &gl, Precision::Bf16, g.wg_ws, n, yb.ptr, out, rows, false).unwrap();
    let (a, b) = (ya.read_f32(0, rows * out).unwrap(), yb.read_f32(0, rows * out).unwrap());
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "fused and f32-rows products differ");
    check("silu_mul_pairs_perm -> gemm_wg", &b, &want, TOL_BF16);
    let err = g.gemm_with(GemmKernel::Auto, &gl, Precision::F32, g.wg_ws, n, ya.ptr, out, rows, false).unwrap_err();
    assert!(format!("{err:#}").contains("workspace"), "{err:#}");
}

/// Routing of a chunk: batched top-k, grouping by expert (moe_align), the grouped products with
/// gathered inputs (gate/up pairs and down), and the weighted combination.
#[test]
fn grouped_experts_match_cpu() {
    grouped_cases(kernels);
}

#[test]
fn grouped_experts_new_kernels_match_cpu() {
    grouped_cases(new_kernels);
}

fn grouped_cases(pick: fn(&lily::cuda::Gpu, &GpuLinear) -> Vec<(Precision, GemmKernel)>) {
    let Some(g) = gpu() else { return };
    let mut r = rng(12);
    // inter 128: both products' widths are whole k-tiles of gemm_wg (128 columns)
    let (e, k, t, h, inter) = (6usize, 3usize, 100usize, 128usize, 128usize);
    // Router logits biased so expert 1 gets every token (a segment longer than one 64-row tile,
    // one 128-row tile) and expert 4 none.
    let mut logits = uniform(&mut r, t * (e + 1), 1.0);
    for row in logits.chunks_mut(e + 1) {
        row[1] += 10.0;
        row[4] -= 10.0;
    }
    let gate_up: Vec<Linear> = (0..2 * e).map(|_| quant(&mut r, inter, h, 4, 64)).collect();
    let down: Vec<Linear> = (0..e).map(|_| quant(&mut r, h, inter, 4, 64)).collect();
    let gu = GpuLinear::stack(&g, &gate_up.iter().collect::<Vec<_>>()).unwrap();
    let dn = GpuLinear::stack(&g, &down.iter().collect::<Vec<_>>()).unwrap();
    let x = uniform(&mut r, t * h, 1.0);
    let x0 = uniform(&mut r, t * h, 1.0);
    let ys = uniform(&mut r, t * h, 1.0);

    // CPU: route each token, run its experts, combine with the shared-expert term.
    let mut want_ids = Vec::new();
    let mut want_w = Vec::new();
    let mut want_x = x0.clone();
    for tt in 0..t {
        let row = &logits[tt * (e + 1)..(tt + 1) * (e + 1)];
        let routes = lily::cpu::moe::route(&row[..e], k, true);
        let xt = &x[tt * h..(tt + 1) * h];
        let sg = sigmoid(row[e]);
        for j in 0..h {
            want_x[tt * h + j] += sg * ys[tt * h + j];
        }
        for &(ex, w) in &routes {
            want_ids.push(ex as i32);
            want_w.push(w);
            let (mut a, mut b) = (vec![0f32; inter], vec![0f32; inter]);
            gate_up[2 * ex].matvec(xt, &mut a);
            gate_up[2 * ex + 1].matvec(xt, &mut b);
            let hh: Vec<f32> = a.iter().zip(&b).map(|(p, q)| lily::cpu::norm::silu(*p) * q).collect();
            let mut y = vec![0f32; h];
            down[ex].matvec(&hh, &mut y);
            for j in 0..h {
                want_x[tt * h + j] += w * y[j];
            }
        }
    }

    let pairs = t * k;
    let lb = g.upload_f32(&logits).unwrap();
    let (idb, wb) = (g.zeros(4 * pairs).unwrap(), g.zeros(4 * pairs).unwrap());
    g.moe_topk_rows(lb.ptr, e + 1, t, e, k, true, idb.ptr, wb.ptr, 0, false).unwrap();
    assert_eq!(idb.read_i32(pairs).unwrap(), want_ids, "batched moe_topk ids");
    check("batched moe_topk weights", &wb.read_f32(0, pairs).unwrap(), &want_w, 1e-12);

    // Every kernel over the precision's tiles; the skinny kernel also over tiles as tall as its
    // pass (the routed experts of a short prompt: one pass per tile), gemm_wg also over 128-row
    // tiles (WgTall).
    let tilings = pick(&g, &gu)
        .into_iter()
        .filter(|&(_, k)| !matches!(k, GemmKernel::Wg256 | GemmKernel::Wt256 | GemmKernel::WtP | GemmKernel::WtP256))
        .flat_map(|(prec, kern)| {
            let own = match kern {
                GemmKernel::Skinny(tn) => Some((prec, kern, tn)),
                GemmKernel::Wg => Some((prec, GemmKernel::WgTall, 128)),
                GemmKernel::Wt => Some((prec, GemmKernel::WtTall, 128)),
                _ => None,
            };
            [(prec, kern, prec.bm())].into_iter().chain(own)
        });
    for (prec, kern, bm) in tilings {
        let max_tiles = pairs.div_ceil(bm) + e + 1;
        let (perm, inv, tiles) =
            (g.zeros(4 * pairs).unwrap(), g.zeros(4 * pairs).unwrap(), g.zeros(4 * (1 + 3 * max_tiles)).unwrap());
        g.moe_align(idb.ptr, pairs, e, bm, perm.ptr, inv.ptr, tiles.ptr).unwrap();
        let (pv, iv) = (perm.read_i32(pairs).unwrap(), inv.read_i32(pairs).unwrap());
        let tv = tiles.read_i32(1 + 3 * max_tiles).unwrap();
        // perm is a permutation grouping pairs by ascending expert; inv is its inverse.
        let mut seen = vec![false; pairs];
        for (p, &i) in pv.iter().enumerate() {
            assert!(!seen[i as usize], "perm repeats pair {i}");
            seen[i as usize] = true;
            assert_eq!(iv[i as usize], p as i32, "inv is not perm's inverse");
            if p > 0 {
                assert!(want_ids[pv[p - 1] as usize] <= want_ids[i as usize], "perm not grouped by expert");
            }
        }
        // Tiles cover every row once, within one expert, at most bm rows each.
        let nt = tv[0] as usize;
        assert!(nt <= max_tiles, "{nt} tiles > bound {max_tiles}");
        let mut covered = vec![0; pairs];
        for ti in 0..nt {
            let (ex, m0, m1) = (tv[1 + 3 * ti], tv[2 + 3 * ti] as usize, tv[3 + 3 * ti] as usize);
            assert!(m0 < m1 && m1 - m0 <= bm, "tile {ti} rows {m0}..{m1}");
            for m in m0..m1 {
                covered[m] += 1;
                assert_eq!(want_ids[pv[m] as usize], ex, "tile {ti} spans experts");
            }
        }
        assert!(covered.iter().all(|&c| c == 1), "tiles do not cover each row once");

        let xb = g.upload_f32(&x).unwrap();
        let egu = g.upload_f32(&vec![f32::NAN; pairs * 2 * inter]).unwrap();
        let eh = g.upload_f32(&vec![f32::NAN; pairs * inter]).unwrap();
        let ye = g.upload_f32(&vec![f32::NAN; pairs * h]).unwrap();
        let tl = (tiles.ptr, max_tiles, pairs);
        g.gemm_grouped_with(kern, &gu, prec, 2 * inter, (xb.ptr, h, perm.ptr, k), (egu.ptr, 2 * inter), tl).unwrap();
        // Row inv[i] of the gate/up output is pair i's [gate | up].
        let got = egu.read_f32(0, pairs * 2 * inter).unwrap();
        let mut want_gu = vec![0f32; pairs * 2 * inter];
        for i in 0..pairs {
            let (tt, ex) = (i / k, want_ids[i] as usize);
            let o = iv[i] as usize * 2 * inter;
            gate_up[2 * ex].matvec(&x[tt * h..(tt + 1) * h], &mut want_gu[o..o + inter]);
            gate_up[2 * ex + 1].matvec(&x[tt * h..(tt + 1) * h], &mut want_gu[o + inter..o + 2 * inter]);
        }
        check(&format!("grouped gate/up {prec:?} {kern:?} tiles of {bm}"), &got, &want_gu, tol(prec));
        g.silu_mul_pairs(egu.ptr, eh.ptr, inter, pairs).unwrap();
        g.gemm_grouped_with(kern, &dn, prec, h, (eh.ptr, inter, 0, 1), (ye.ptr, h), tl).unwrap();
        let xs = g.upload_f32(&x0).unwrap();
        let ysb = g.upload_f32(&ys).unwrap();
        g.moe_combine_rows(xs.ptr, ye.ptr, inv.ptr, wb.ptr, ysb.ptr, (lb.at(4 * e), e + 1), h, k, t).unwrap();
        check(
            &format!("grouped experts + combine {prec:?} {kern:?} tiles of {bm}"),
            &xs.read_f32(0, t * h).unwrap(),
            &want_x,
            tol(prec),
        );
    }
}

/// GDN test shapes: (H_k, H_v, D_k, D_v, prefill calls of T tokens each, state carried). They
/// cover T < 64, T = 64, T > 64 over several 64-token chunks with and without a partial tail,
/// H_v = 2·H_k, D_k of 32, 64, 96 (a half-used last key slice in gdn_chunk_scan) and 128, D_v of
/// 32 to 128, and D_k = 160 (the chunked path falls back to the scan).
/// `moe_align` with up to 1,024 experts (its block scan spans all 32 warps) against a CPU
/// reference: the tile list is exactly (expert ascending, 0..cnt in steps of bm), perm groups
/// the pairs by expert and inv is its inverse. Counts are skewed so some experts get none,
/// some exactly bm and some several tiles.
#[test]
fn moe_align_matches_cpu() {
    let Some(g) = gpu() else { return };
    let mut r = rng(31);
    for (e, p, bm) in [(257usize, 576usize, 8usize), (1024, 3000, 8), (300, 4096, 64), (33, 1, 8), (1, 70, 16)] {
        let ids: Vec<i32> = (0..p)
            .map(|i| {
                let u = r.next_u64();
                // A quarter of the pairs on experts 0..4, the rest anywhere but the last tenth.
                let span = if i % 4 == 0 { 4.min(e) } else { (e - e / 10).max(1) };
                (u % span as u64) as i32
            })
            .collect();
        let mut cnt = vec![0usize; e];
        for &x in &ids {
            cnt[x as usize] += 1;
        }
        let mut want_tiles = vec![];
        let mut off = vec![0usize; e];
        let mut o = 0;
        for x in 0..e {
            off[x] = o;
            let mut m0 = o;
            while m0 < o + cnt[x] {
                want_tiles.push([x as i32, m0 as i32, (o + cnt[x]).min(m0 + bm) as i32]);
                m0 += bm;
            }
            o += cnt[x];
        }
        let max_tiles = p.div_ceil(bm) + e;
        let idb = g.upload_bytes(&i32_bytes(&ids)).unwrap();
        let (perm, inv, tiles) =
            (g.zeros(4 * p).unwrap(), g.zeros(4 * p).unwrap(), g.zeros(4 * (1 + 3 * max_tiles)).unwrap());
        g.moe_align(idb.ptr, p, e, bm, perm.ptr, inv.ptr, tiles.ptr).unwrap();
        let tv = tiles.read_i32(1 + 3 * max_tiles).unwrap();
        assert_eq!(tv[0] as usize, want_tiles.len(), "E={e} P={p} bm={bm}: tile count");
        for (i, w) in want_tiles.iter().enumerate() {
            assert_eq!(&tv[1 + 3 * i..4 + 3 * i], w, "E={e} P={p} bm={bm}: tile {i}");
        }
        let (pv, iv) = (perm.read_i32(p).unwrap(), inv.read_i32(p).unwrap());
        let mut seen = vec![false; p];
        for (slot, &i) in pv.iter().enumerate() {
            assert!(!seen[i as usize], "E={e}: perm repeats pair {i}");
            seen[i as usize] = true;
            assert_eq!(iv[i as usize], slot as i32, "E={e}: inv is not perm's inverse");
            let x = ids[i as usize] as usize;
            assert!(slot >= off[x] && slot < off[x] + cnt[x], "E={e}: pair {i} of expert {x} at slot {slot}");
        }
        eprintln!("moe_align E={e} P={p} bm={bm}: {} tiles as the CPU's", want_tiles.len());
    }
}

fn gdn_shapes() -> Vec<(usize, usize, usize, usize, Vec<usize>)> {
    vec![
        (2, 4, 32, 32, vec![1, 5, 64, 130]),
        (16, 32, 128, 128, vec![67, 3, 200]),
        (3, 3, 64, 96, vec![9, 100]),
        (2, 4, 96, 64, vec![70, 128]),
        (1, 2, 160, 32, vec![20]),
    ]
}

/// One prefill call's random inputs: projections `[t, ldp]` = [qkv | z | b | a | 5 unused].
struct GdnCall {
    t: usize,
    proj: Vec<f32>,
}

/// Random weights, start states and calls of one shape; the same for a given seed.
struct GdnCase {
    d: GdnDims,
    kc: usize,
    conv_w: Vec<f32>,
    dt_bias: Vec<f32>,
    neg_a: Vec<f32>,
    normw: Vec<f32>,
    cstate: Vec<f32>,
    rec: Vec<f32>,
    calls: Vec<GdnCall>,
}

impl GdnCase {
    fn new(r: &mut lily::sampling::Rng, hk: usize, hv: usize, dk: usize, dv: usize, ts: &[usize]) -> GdnCase {
        let d = GdnDims { hk, hv, dk, dv };
        let cd = 2 * hk * dk + hv * dv;
        let ldp = cd + hv * dv + 2 * hv + 5;
        let kc = 4;
        let conv_w = uniform(r, cd * kc, 0.5);
        let dt_bias = uniform(r, hv, 1.0);
        let neg_a: Vec<f32> = uniform(r, hv, 1.0).iter().map(|v| -(v.abs() + 0.1)).collect();
        let normw = uniform(r, dv, 1.5);
        let cstate = uniform(r, (kc - 1) * cd, 1.0);
        let rec = uniform(r, hv * dk * dv, 0.3);
        let calls = ts.iter().map(|&t| GdnCall { t, proj: uniform(r, t * ldp, 2.0) }).collect();
        GdnCase { d, kc, conv_w, dt_bias, neg_a, normw, cstate, rec, calls }
    }

    fn cd(&self) -> usize {
        2 * self.d.hk * self.d.dk + self.d.hv * self.d.dv
    }

    fn ldp(&self) -> usize {
        self.cd() + self.d.hv * self.d.dv + 2 * self.d.hv + 5
    }

    /// The CPU reference over every call: per call (conv, out, conv state, recurrent state).
    #[allow(clippy::type_complexity)]
    fn cpu(&self, chunk: Option<usize>) -> Vec<(Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>)> {
        let (cd, vd, hv, ldp) = (self.cd(), self.d.hv * self.d.dv, self.d.hv, self.ldp());
        let w = GdnWeights {
            d: self.d,
            conv_w: &self.conv_w,
            taps: self.kc,
            neg_a: &self.neg_a,
            dt_bias: &self.dt_bias,
            norm: &self.normw,
        };
        let (mut cstate, mut rec) = (self.cstate.clone(), self.rec.clone());
        self.calls
            .iter()
            .map(|call| {
                let col = |o: usize, n: usize| -> Vec<f32> {
                    call.proj.chunks(ldp).flat_map(|row| row[o..o + n].to_vec()).collect()
                };
                let (qkv, z, b, a) = (col(0, cd), col(cd, vd), col(cd + vd, hv), col(cd + vd + hv, hv));
                let (conv, o) = cpu_gdn_with(&w, call.t, &qkv, &z, &b, &a, &mut cstate, &mut rec, chunk);
                (conv, o, cstate.clone(), rec.clone())
            })
            .collect()
    }
}

/// The fp32 chunked form itself (the CPU port of the GPU kernel's math, chunk 64) against the
/// recurrent one on the GPU test's inputs: shows that [`GDN_OUT_TOL`] leaves room for the
/// reassociation the chunked form brings (runs without a GPU).
#[test]
fn gdn_chunked_form_within_the_gpu_bound_on_cpu() {
    let mut r = rng(13);
    for (hk, hv, dk, dv, ts) in gdn_shapes() {
        let case = GdnCase::new(&mut r, hk, hv, dk, dv, &ts);
        let (want, got) = (case.cpu(None), case.cpu(Some(64)));
        for (ci, (w, g)) in want.iter().zip(&got).enumerate() {
            let name = format!("cpu chunked H_k{hk} H_v{hv} D_k{dk} D_v{dv} call {ci} T={}", ts[ci]);
            check(&format!("{name} out"), &g.1, &w.1, GDN_OUT_TOL / 10.0);
            check(&format!("{name} state"), &g.3, &w.3, GDN_OUT_TOL / 10.0);
        }
    }
}

/// NMSE bound of the delta rule's output and state: fp32 with a different summation order, through
/// a recurrence of up to 200 steps and (chunked) a triangular solve of 64 rows; measured well
/// below (see the test above), while an indexing, masking or sync error gives ≳ 1e-3.
const GDN_OUT_TOL: f64 = 1e-7;

/// NMSE bound of the tensor-core scan (gdn_chunk_scan_tc): its products round their operands to
/// TF32 (10 mantissa bits, relative error up to 2^-11 per operand, ~1e-7 NMSE per product) through
/// up to 200 steps of the recurrence carried across calls; measured 5e-9 to 9.4e-8 on an H200
/// over these shapes, while an indexing, masking or sync error gives ≳ 1e-3.
const GDN_TC_TOL: f64 = 1e-6;

/// conv_prefill + gdn_prefill over several calls (state carried between calls, from a random
/// start) against the CPU conv and recurrent delta rule, for the fp32 chunked kernels (the exact
/// mode), the serial scan (`LILY_CUDA_GDN_PREFILL=scan`) and the tensor-core scan (the bf16
/// prefill). Scratch and outputs start as NaN, so a read of anything the kernels did not write
/// shows. With the tensor-core scan, where gemm_wg takes the out-projection (sm_90a, D_v a
/// multiple of 64, H_v·D_v of 128): gdn_prefill_to_wg from the same state writes the same state
/// and an out-projection input that gives the product of the f32 rows bit for bit.
#[test]
fn gdn_prefill_matches_cpu() {
    let Some(g) = gpu() else { return };
    let mut r = rng(13);
    for (hk, hv, dk, dv, ts) in gdn_shapes() {
        let case = GdnCase::new(&mut r, hk, hv, dk, dv, &ts);
        let want = case.cpu(None);
        let (kd, vd, cd, ldp, kc) = (hk * dk, hv * dv, case.cd(), case.ldp(), case.kc);
        let gb = |v: &[f32]| g.upload_f32(v).unwrap();
        let (cw, dtb, nab, nwb) = (gb(&case.conv_w), gb(&case.dt_bias), gb(&case.neg_a), gb(&case.normw));
        // a 160-row out-projection for the gdn_prefill_to_wg check (its own generator: the
        // cases' data stay as they were)
        let wo = (dv % 64 == 0 && vd % 128 == 0 && g.wg_available())
            .then(|| GpuLinear::upload(&g, &quant(&mut rng(31), 160, vd, 4, 64)).unwrap());
        let mut kernels = vec![GdnPrefillKernel::Chunked, GdnPrefillKernel::Scan];
        if g.gdn_tc_fits(dk) {
            kernels.push(GdnPrefillKernel::ChunkedTc);
        } else {
            eprintln!("gdn prefill D_k {dk}: no tensor-core scan on this device or shape (fp32 kernels only)");
        }
        for kernel in kernels {
            let tol = if kernel == GdnPrefillKernel::ChunkedTc { GDN_TC_TOL } else { GDN_OUT_TOL };
            let (gcs, grec) = (gb(&case.cstate), gb(&case.rec));
            for (ci, (call, (conv, o, cstate, rec))) in case.calls.iter().zip(&want).enumerate() {
                let t = call.t;
                let pb = gb(&call.proj);
                let (yb, ob) = (gb(&vec![f32::NAN; t * cd]), gb(&vec![f32::NAN; t * vd]));
                let (qn, kn, kq) = (gb(&vec![0f32; t * kd]), gb(&vec![0f32; t * kd]), gb(&vec![0f32; t * hk]));
                let chunk = gb(&vec![f32::NAN; gdn_chunk_floats(t, hv, dk, dv)]);
                g.conv_prefill(pb.ptr, ldp, gcs.ptr, cw.ptr, yb.ptr, cd, kc, t).unwrap();
                let p = GdnPrefill {
                    step: GdnStep {
                        y: yb.ptr,
                        b: pb.at(4 * (cd + vd)),
                        a: pb.at(4 * (cd + vd + hv)),
                        z: pb.at(4 * cd),
                        dt_bias: dtb.ptr,
                        neg_a: nab.ptr,
                        norm: nwb.ptr,
                        state: grec.ptr,
                        out: ob.ptr,
                        hk,
                        hv,
                        dk,
                        dv,
                        eps: 1e-6,
                    },
                    t,
                    ldy: cd,
                    ldp,
                    qn: qn.ptr,
                    kn: kn.ptr,
                    kq: kq.ptr,
                    chunk: chunk.ptr,
                };
                let name = format!("gdn prefill {kernel:?} H_k{hk} H_v{hv} D_k{dk} D_v{dv} call {ci} T={t}");
                let mut fused = None;
                if let (GdnPrefillKernel::ChunkedTc, Some(wo)) = (kernel, &wo) {
                    // from a copy of the state: the norm into gemm_wg's workspace, then the product from it
                    let rec2 = gb(&grec.read_f32(0, rec.len()).unwrap());
                    let ob2 = gb(&vec![f32::NAN; t * vd]);
                    let p2 = GdnPrefill { step: GdnStep { state: rec2.ptr, out: ob2.ptr, ..p.step }, ..p };
                    g.gdn_prefill_to_wg(&p2, Precision::Bf16).unwrap();
                    let y2 = gb(&vec![f32::NAN; t * 160]);
                    g.gemm_with(GemmKernel::Wg, wo, Precision::Bf16, g.wg_ws, vd, y2.ptr, 160, t, false).unwrap();
                    fused = Some((y2.read_f32(0, t * 160).unwrap(), rec2.read_f32(0, rec.len()).unwrap()));
                }
                g.gdn_prefill_with(&p, kernel).unwrap();
                if let (Some((yf, recf)), Some(wo)) = (fused, &wo) {
                    let y1 = gb(&vec![f32::NAN; t * 160]);
                    g.gemm_with(GemmKernel::Wg, wo, Precision::Bf16, ob.ptr, vd, y1.ptr, 160, t, false).unwrap();
                    let ya = y1.read_f32(0, t * 160).unwrap();
                    assert!(
                        ya.iter().zip(&yf).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{name}: to_wg product differs"
                    );
                    let reca = grec.read_f32(0, rec.len()).unwrap();
                    assert!(
                        reca.iter().zip(&recf).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{name}: to_wg state differs"
                    );
                }
                check(&format!("{name} conv"), &yb.read_f32(0, t * cd).unwrap(), conv, TOL);
                check(&format!("{name} conv state"), &gcs.read_f32(0, cstate.len()).unwrap(), cstate, 0.0);
                check(&format!("{name} out"), &ob.read_f32(0, t * vd).unwrap(), o, tol);
                check(&format!("{name} state"), &grec.read_f32(0, rec.len()).unwrap(), rec, tol);
            }
        }
    }
}

/// Batched embedding gather: rows read from a device id array.
#[test]
fn embed_rows_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut r = rng(15);
    let l = quant(&mut r, 50, 128, 4, 32);
    let gl = GpuLinear::upload(&g, &l).unwrap();
    let ids = [3i32, 49, 0, 3, 17];
    let idb = g.upload_bytes(&i32_bytes(&ids)).unwrap();
    let ob = g.upload_f32(&vec![f32::NAN; ids.len() * l.cols]).unwrap();
    g.embed(&gl, idb.ptr, ob.ptr, ids.len()).unwrap();
    let mut want = vec![0f32; ids.len() * l.cols];
    for (i, &id) in ids.iter().enumerate() {
        l.row_f32(id as usize, &mut want[i * l.cols..(i + 1) * l.cols]);
    }
    check("embed rows", &ob.read_f32(0, want.len()).unwrap(), &want, 1e-12);
}
