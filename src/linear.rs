//! Weight matrices in their checkpoint form and the products the CPU computes with them.
//!
//! A [`Linear`] is `rows × cols` (PyTorch `[out, in]`): `y[t, r] = Σ_c W[r, c] · x[t, c]`.
//! Storage stays packed as loaded (no dequantized copy of the model):
//! - dense bf16 / f16 / f32, row-major;
//! - MLX affine quantization: `packed: u32 [rows, cols·bits/32]` (element j of a word is
//!   `(w >> bits·j) & mask`, little-endian along the row), `scales`, `biases: [rows, cols/group]`
//!   (bf16, f16 or f32), `W[r, c] = scale[r, c/g] · q[r, c] + bias[r, c/g]`.
//!
//! Matrix-vector products use the affine identity per group: `Σ(s·q + b)x = s·Σqx + b·Σx`.
//! Matrix-matrix products dequantize one block of rows into a small per-thread f32 tile and reuse it
//! across all tokens.

use crate::cpu::kernels;
use crate::safetensors::{bf16_to_f32, f32_to_bf16, Bytes, Dtype};
use anyhow::{bail, Result};
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatType {
    F32,
    F16,
    BF16,
}

impl FloatType {
    pub fn from_dtype(d: Dtype) -> Option<FloatType> {
        match d {
            Dtype::F32 => Some(FloatType::F32),
            Dtype::F16 => Some(FloatType::F16),
            Dtype::BF16 => Some(FloatType::BF16),
            _ => None,
        }
    }
    pub fn size(self) -> usize {
        match self {
            FloatType::F32 => 4,
            _ => 2,
        }
    }
}

#[derive(Clone)]
pub enum Weight {
    Dense { ty: FloatType, data: Bytes },
    Quant { bits: u32, group: usize, packed: Bytes, scales: Bytes, biases: Bytes, sty: FloatType },
}

impl Weight {
    /// (bits, group, element type of the weights or of the scales); bits 0 for dense weights.
    pub fn format(&self) -> (u32, usize, FloatType) {
        match self {
            Weight::Dense { ty, .. } => (0, 0, *ty),
            Weight::Quant { bits, group, sty, .. } => (*bits, *group, *sty),
        }
    }
}

#[derive(Clone)]
pub struct Linear {
    pub rows: usize,
    pub cols: usize,
    pub w: Weight,
}

impl Linear {
    pub fn dense(rows: usize, cols: usize, ty: FloatType, data: Bytes) -> Result<Linear> {
        if data.len() != rows * cols * ty.size() {
            bail!("dense weight of {} bytes does not match [{rows}, {cols}]", data.len());
        }
        Ok(Linear { rows, cols, w: Weight::Dense { ty, data } })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn quant(
        rows: usize,
        cols: usize,
        bits: u32,
        group: usize,
        packed: Bytes,
        scales: Bytes,
        biases: Bytes,
        sty: FloatType,
    ) -> Result<Linear> {
        if bits != 4 && bits != 8 {
            bail!("{bits}-bit weights are not supported (4 or 8)");
        }
        if ![32, 64, 128].contains(&group) || !cols.is_multiple_of(group) {
            bail!("input width {cols} is not a multiple of the quantization group {group}");
        }
        let want_p = rows * cols * bits as usize / 8;
        let want_s = rows * (cols / group) * sty.size();
        if packed.len() != want_p || scales.len() != want_s || biases.len() != want_s {
            bail!("quantized weight buffers do not match [{rows}, {cols}] at {bits} bits, group {group}");
        }
        Ok(Linear { rows, cols, w: Weight::Quant { bits, group, packed, scales, biases, sty } })
    }

    /// Rows `[r0, r0 + n)` as their own matrix (no copy).
    pub fn row_range(&self, r0: usize, n: usize) -> Linear {
        assert!(r0 + n <= self.rows);
        let w = match &self.w {
            Weight::Dense { ty, data } => {
                let rb = self.cols * ty.size();
                Weight::Dense { ty: *ty, data: data.slice(r0 * rb, n * rb) }
            }
            Weight::Quant { bits, group, packed, scales, biases, sty } => {
                let pb = self.cols * *bits as usize / 8;
                let sb = self.cols / group * sty.size();
                Weight::Quant {
                    bits: *bits,
                    group: *group,
                    packed: packed.slice(r0 * pb, n * pb),
                    scales: scales.slice(r0 * sb, n * sb),
                    biases: biases.slice(r0 * sb, n * sb),
                    sty: *sty,
                }
            }
        };
        Linear { rows: n, cols: self.cols, w }
    }

    /// Columns `[c0, c0 + n)` of every row as their own matrix (copied: the columns of a row are
    /// not contiguous across rows). A quantized matrix splits only at whole groups, so `c0` and
    /// `n` must be multiples of its group; anything else is refused by name.
    pub fn col_range(&self, c0: usize, n: usize) -> Result<Linear> {
        if c0 + n > self.cols || n == 0 {
            bail!("columns [{c0}, {}) are not a non-empty range of a {}-column matrix", c0 + n, self.cols);
        }
        let rows = self.rows;
        let copy = |data: &[u8], row_bytes: usize, off: usize, len: usize| -> Bytes {
            let mut v = Vec::with_capacity(rows * len);
            for r in 0..rows {
                v.extend_from_slice(&data[r * row_bytes + off..r * row_bytes + off + len]);
            }
            Bytes::from_vec(v)
        };
        let w = match &self.w {
            Weight::Dense { ty, data } => {
                let es = ty.size();
                Weight::Dense { ty: *ty, data: copy(data.as_slice(), self.cols * es, c0 * es, n * es) }
            }
            Weight::Quant { bits, group, packed, scales, biases, sty } => {
                if !c0.is_multiple_of(*group) || !n.is_multiple_of(*group) {
                    bail!("columns [{c0}, {}) do not fall on the quantization groups of {group}", c0 + n);
                }
                let (pb, es) = (*bits as usize, sty.size());
                let (ng, g0, gn) = (self.cols / group, c0 / group, n / group);
                Weight::Quant {
                    bits: *bits,
                    group: *group,
                    packed: copy(packed.as_slice(), self.cols * pb / 8, c0 * pb / 8, n * pb / 8),
                    scales: copy(scales.as_slice(), ng * es, g0 * es, gn * es),
                    biases: copy(biases.as_slice(), ng * es, g0 * es, gn * es),
                    sty: *sty,
                }
            }
        };
        Ok(Linear { rows, cols: n, w })
    }

    /// Bytes this matrix occupies (what one full pass over it streams from memory).
    pub fn nbytes(&self) -> usize {
        match &self.w {
            Weight::Dense { data, .. } => data.len(),
            Weight::Quant { packed, scales, biases, .. } => packed.len() + scales.len() + biases.len(),
        }
    }

    /// Row `r` dequantized to f32 into `out[..cols]`.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() >= self.cols);
        let out = &mut out[..self.cols];
        match &self.w {
            Weight::Dense { ty, data } => {
                let rb = self.cols * ty.size();
                kernels::to_f32(*ty, &data.as_slice()[r * rb..(r + 1) * rb], out);
            }
            Weight::Quant { bits, group, packed, scales, biases, sty } => {
                let pb = self.cols * *bits as usize / 8;
                let ng = self.cols / group;
                let sb = ng * sty.size();
                // Scales of one row fit on the stack for every real width (≤ 16384 columns).
                let mut stack = [0f32; 1024];
                let mut heap = Vec::new();
                let sbuf: &mut [f32] = if 2 * ng <= stack.len() {
                    &mut stack[..2 * ng]
                } else {
                    heap.resize(2 * ng, 0f32);
                    &mut heap
                };
                let (s, b) = sbuf.split_at_mut(ng);
                kernels::to_f32(*sty, &scales.as_slice()[r * sb..(r + 1) * sb], s);
                kernels::to_f32(*sty, &biases.as_slice()[r * sb..(r + 1) * sb], b);
                kernels::dequant_row(*bits, *group, &packed.as_slice()[r * pb..(r + 1) * pb], s, b, out);
            }
        }
    }

    /// `y[r] = Σ_c W[r,c] x[c]` for one vector, parallel over rows.
    pub fn matvec(&self, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), self.cols, "matvec input width");
        assert_eq!(y.len(), self.rows, "matvec output height");
        let chunk = (self.rows / (4 * rayon::current_num_threads()).max(1)).clamp(16, 1024);
        match &self.w {
            Weight::Dense { ty: FloatType::BF16, data } if kernels::bf16_activations() => {
                self.bf16_product(data.as_slice(), x, 1, y, true)
            }
            Weight::Dense { ty, data } => {
                let rb = self.cols * ty.size();
                let d = data.as_slice();
                y.par_chunks_mut(chunk).enumerate().for_each(|(ci, ys)| {
                    for (i, yr) in ys.iter_mut().enumerate() {
                        let r = ci * chunk + i;
                        *yr = kernels::dot_dense(*ty, &d[r * rb..(r + 1) * rb], x);
                    }
                });
            }
            Weight::Quant { .. } if kernels::q8::cpu_int8() => self.matmul_q8(x, y),
            Weight::Quant { bits, group, packed, scales, biases, sty } => {
                let gsum: Vec<f32> = x.chunks_exact(*group).map(|g| g.iter().sum()).collect();
                let pb = self.cols * *bits as usize / 8;
                let sb = self.cols / group * sty.size();
                let (p, s, b) = (packed.as_slice(), scales.as_slice(), biases.as_slice());
                y.par_chunks_mut(chunk).enumerate().for_each(|(ci, ys)| {
                    for (i, yr) in ys.iter_mut().enumerate() {
                        let r = ci * chunk + i;
                        *yr = kernels::dot_quant(
                            *bits,
                            *group,
                            *sty,
                            &p[r * pb..(r + 1) * pb],
                            &s[r * sb..(r + 1) * sb],
                            &b[r * sb..(r + 1) * sb],
                            x,
                            &gsum,
                        );
                    }
                });
            }
        }
    }

    /// A bf16 product in blocks of up to 8 tokens over blocks of 128 rows (which stay in L2),
    /// each row read once per token block, four rows at a time (each input loaded once for the
    /// four). fp32 (`bf16x` false, the batched decode step's `t ≤ 8`): each output
    /// bit-identical to [`Self::matvec`]'s. With `bf16x` ([`kernels::bf16_activations`]) the
    /// inputs are rounded to bf16 once and the rows use bf16 dot products (one token: one row
    /// at a time); on a CPU without them, the rounded inputs go through the fp32 kernels. Either
    /// way what a token gets does not depend on the others or on `t`: a sequence decoded in a
    /// batch, or prefilled in chunks next to others, gets what it gets alone.
    fn bf16_product(&self, d: &[u8], x: &[f32], t: usize, y: &mut [f32], bf16x: bool) {
        let (rb, cols) = (2 * self.cols, self.cols);
        let hw = kernels::has_avx512_bf16();
        let xb: Option<Vec<u16>> = (bf16x && hw).then(|| x.iter().map(|&v| f32_to_bf16(v)).collect());
        let rounded: Option<Vec<f32>> =
            (bf16x && !hw).then(|| x.iter().map(|&v| bf16_to_f32(f32_to_bf16(v))).collect());
        let x = rounded.as_deref().unwrap_or(x);
        let out = SyncPtr(y.as_mut_ptr());
        let chunk = (self.rows / (4 * rayon::current_num_threads()).max(1)).clamp(16, 1024).next_multiple_of(4);
        (0..self.rows.div_ceil(chunk)).into_par_iter().for_each(|ci| {
            let mut o = [[0f32; 8]; 4];
            for b0 in (ci * chunk..((ci + 1) * chunk).min(self.rows)).step_by(128) {
                let b1 = (b0 + 128).min(((ci + 1) * chunk).min(self.rows));
                for t0 in (0..t).step_by(8) {
                    let tn = (t - t0).min(8);
                    let (xs, xbs) =
                        (&x[t0 * cols..(t0 + tn) * cols], xb.as_ref().map(|v| &v[t0 * cols..(t0 + tn) * cols]));
                    let mut r = b0;
                    while r < b1 {
                        let n = match xbs {
                            // One token: one row at a time (one sequential weight stream per
                            // thread, the faster read at batch 1); more: four.
                            Some(xb) if tn > 1 && r + 4 <= b1 => {
                                kernels::dot_bf16x_rows4(&d[r * rb..(r + 4) * rb], rb, xb, cols, tn, &mut o);
                                4
                            }
                            Some(xb) => {
                                kernels::dot_bf16x_row(&d[r * rb..(r + 1) * rb], xb, cols, &mut o[0][..tn]);
                                1
                            }
                            None if r + 4 <= b1 => {
                                kernels::dot_bf16_rows4(&d[r * rb..(r + 4) * rb], rb, xs, cols, tn, &mut o);
                                4
                            }
                            None => {
                                kernels::dot_bf16_multi(&d[r * rb..(r + 1) * rb], xs, cols, &mut o[0][..tn]);
                                1
                            }
                        };
                        for (i, oi) in o[..n].iter().enumerate() {
                            for (tt, v) in oi[..tn].iter().enumerate() {
                                // SAFETY: row r + i of each token is written by this chunk only; y outlives the loop.
                                unsafe { *out.get().add((t0 + tt) * self.rows + r + i) = *v };
                            }
                        }
                        r += n;
                    }
                }
            }
        });
    }

    /// `y[t, r] = Σ_c W[r,c] x[t,c]` for `t` tokens (`x: [t, cols]`, `y: [t, rows]`).
    pub fn matmul(&self, x: &[f32], y: &mut [f32]) {
        let t = x.len() / self.cols;
        assert_eq!(x.len(), t * self.cols, "matmul input width");
        assert_eq!(y.len(), t * self.rows, "matmul output shape");
        if t == 1 {
            return self.matvec(x, y);
        }
        if matches!(self.w, Weight::Quant { .. }) && kernels::q8::cpu_int8() {
            return self.matmul_q8(x, y);
        }
        if let Weight::Dense { ty: FloatType::BF16, data } = &self.w {
            let bf16x = kernels::bf16_activations();
            if t <= 8 || bf16x {
                return self.bf16_product(data.as_slice(), x, t, y, bf16x);
            }
        }
        if t <= 4 {
            if let Weight::Quant { bits, group, packed, scales, biases, sty } = &self.w {
                // Few tokens (MoE experts in prefill): decode each weight once for all of them.
                let (bits, group, sty) = (*bits, *group, *sty);
                let ng = self.cols / group;
                let gsum: Vec<f32> = x.chunks_exact(group).map(|g| g.iter().sum()).collect(); // [t, ng]
                let pb = self.cols * bits as usize / 8;
                let sb = ng * sty.size();
                let (p, s, b) = (packed.as_slice(), scales.as_slice(), biases.as_slice());
                let out = SyncPtr(y.as_mut_ptr());
                let chunk = (self.rows / (4 * rayon::current_num_threads()).max(1)).clamp(16, 1024);
                (0..self.rows.div_ceil(chunk)).into_par_iter().for_each(|ci| {
                    let mut o = [0f32; 4];
                    for r in ci * chunk..((ci + 1) * chunk).min(self.rows) {
                        let (pr, sr, br) =
                            (&p[r * pb..(r + 1) * pb], &s[r * sb..(r + 1) * sb], &b[r * sb..(r + 1) * sb]);
                        kernels::dot_quant_multi(bits, group, sty, pr, sr, br, x, self.cols, &gsum, &mut o[..t]);
                        for (tt, v) in o[..t].iter().enumerate() {
                            // SAFETY: row r of each token is written by this chunk only; y outlives the loop.
                            unsafe { *out.get().add(tt * self.rows + r) = *v };
                        }
                    }
                });
                return;
            }
        }
        const RB: usize = 16;
        let nblocks = self.rows.div_ceil(RB);
        let out = SyncPtr(y.as_mut_ptr());
        if t >= 3 && kernels::has_avx2() && std::env::var_os("LILY_GEMM_OLD").is_none() {
            // 16 rows dequantized into a k-major tile, then a 6-token × 16-row register-blocked GEMM.
            (0..nblocks).into_par_iter().for_each(|bi| {
                let r0 = bi * RB;
                let nr = RB.min(self.rows - r0);
                TILE.with(|cell| {
                    // Dequantize the 16 rows once, then walk k in L1-sized chunks: each chunk is
                    // transposed to k-major and multiplied, accumulating into y.
                    const KC: usize = 256;
                    let mut buf = cell.borrow_mut();
                    buf.resize(RB * self.cols + RB * KC, 0.0);
                    let (rows_buf, km) = buf.split_at_mut(RB * self.cols);
                    for i in 0..RB {
                        let row = &mut rows_buf[i * self.cols..(i + 1) * self.cols];
                        if i < nr {
                            self.row_f32(r0 + i, row);
                        } else {
                            row.fill(0.0);
                        }
                    }
                    let mut k0 = 0;
                    while k0 < self.cols {
                        let kc = KC.min(self.cols - k0);
                        for i in 0..RB {
                            kernels::scatter_column(&rows_buf[i * self.cols + k0..i * self.cols + k0 + kc], km, RB, i);
                        }
                        // SAFETY: as below; the kernel writes only the first nr of the 16 columns.
                        unsafe {
                            kernels::gemm_kmajor16(
                                km,
                                kc,
                                &x[k0..],
                                self.cols,
                                t,
                                out.get().add(r0),
                                self.rows,
                                nr,
                                k0 > 0,
                            )
                        };
                        k0 += kc;
                    }
                });
            });
            return;
        }
        (0..nblocks).into_par_iter().for_each(|bi| {
            let r0 = bi * RB;
            let nr = RB.min(self.rows - r0);
            TILE.with(|cell| {
                let mut tile = cell.borrow_mut();
                tile.resize(RB * self.cols, 0.0);
                for i in 0..nr {
                    self.row_f32(r0 + i, &mut tile[i * self.cols..(i + 1) * self.cols]);
                }
                // SAFETY: block bi writes only columns [r0, r0 + nr) of each of the t rows of y,
                // disjoint from every other block; y outlives the parallel loop.
                unsafe { kernels::gemm_tile_strided(&tile, nr, self.cols, x, t, out.get().add(r0), self.rows) };
            });
        });
    }
}

/// Several int8-activation products in one parallel loop (opt-in path, see `kernels::q8`): job
/// `i` computes `W_i · x_i` for the already quantized `x_i: [t_i, cols_i]` and returns
/// `[t_i, rows_i]`. One loop over all the rows of all the matrices gives the threads fewer, larger
/// tasks than one loop per matrix (decode runs ~30 small products per layer).
pub fn matmul_q8_batch(jobs: &[(&Linear, &kernels::q8::Q8Act)]) -> Vec<Vec<f32>> {
    let mut outs: Vec<Vec<f32>> = jobs.iter().map(|(w, xa)| vec![0f32; xa.t * w.rows]).collect();
    let total: usize = jobs.iter().map(|(w, xa)| w.rows * xa.t).sum();
    let chunk = (total / (8 * rayon::current_num_threads()).max(1)).clamp(16, 1024);
    let mut tasks = Vec::new(); // (job, first row, end row)
    for (j, (w, xa)) in jobs.iter().enumerate() {
        assert!(w.fits_q8(xa), "matmul_q8_batch: job {j}'s input is not laid out for its weight");
        let rc = (chunk / xa.t).max(4);
        tasks.extend((0..w.rows).step_by(rc).map(|r0| (j, r0, (r0 + rc).min(w.rows))));
    }
    let ptrs: Vec<SyncPtr> = outs.iter_mut().map(|o| SyncPtr(o.as_mut_ptr())).collect();
    tasks.par_iter().for_each(|&(j, r0, r1)| {
        let (w, xa) = jobs[j];
        // SAFETY: tasks of one job cover disjoint row ranges; outs outlives the loop.
        unsafe { w.rows_q8(xa, r0, r1, ptrs[j]) };
    });
    outs
}

impl Linear {
    /// Quantizes `x: [t, cols]` for this (quantized) matrix's bits and group.
    pub fn quantize_input(&self, x: &[f32]) -> kernels::q8::Q8Act {
        let Weight::Quant { bits, group, .. } = &self.w else { panic!("quantize_input on a dense weight") };
        kernels::q8::Q8Act::new(x, self.cols, *group, *bits)
    }

    /// Whether `xa` is laid out for this matrix.
    pub fn fits_q8(&self, xa: &kernels::q8::Q8Act) -> bool {
        matches!(&self.w, Weight::Quant { bits, group, .. } if *bits == xa.bits && *group == xa.group && self.cols == xa.cols)
    }

    /// Rows `[r0, r1)` of `W · x` for every token of `xa`, into `out: [t, rows]`.
    ///
    /// # Safety
    /// `out` must be valid for writes at `tt·rows + r` for every token `tt` and `r` in `[r0, r1)`.
    unsafe fn rows_q8(&self, xa: &kernels::q8::Q8Act, r0: usize, r1: usize, out: SyncPtr) {
        let Weight::Quant { bits, group, packed, scales, biases, sty } = &self.w else { unreachable!() };
        let (bits, group, sty) = (*bits, *group, *sty);
        if kernels::q4tile::applies(bits, group, self.cols, sty == FloatType::BF16) {
            let (p, s, b) = (packed.as_slice(), scales.as_slice(), biases.as_slice());
            // SAFETY: `applies` holds, xa fits this matrix (checked by the callers); out per the contract.
            return unsafe { kernels::q4tile::rows4(group, p, s, b, xa, r0, r1, out.get(), self.rows) };
        }
        let pb = self.cols * bits as usize / 8;
        let sb = self.cols / group * sty.size();
        let (p, s, b) = (packed.as_slice(), scales.as_slice(), biases.as_slice());
        let mut o = [0f32; 4];
        for r in r0..r1 {
            let (pr, sr, br) = (&p[r * pb..(r + 1) * pb], &s[r * sb..(r + 1) * sb], &b[r * sb..(r + 1) * sb]);
            let mut t0 = 0;
            while t0 < xa.t {
                let nt = (xa.t - t0).min(4);
                kernels::q8::dot_q8(bits, group, sty, pr, sr, br, xa, t0, &mut o[..nt]);
                for (j, v) in o[..nt].iter().enumerate() {
                    // SAFETY: per the contract.
                    unsafe { *out.get().add((t0 + j) * self.rows + r) = *v };
                }
                t0 += nt;
            }
        }
    }

    /// `y[t, r] = Σ_c W[r,c] x[t,c]` with int8 activations (opt-in, see `kernels::q8`): x is
    /// quantized once, then each packed row is decoded once per block of up to 4 tokens.
    fn matmul_q8(&self, x: &[f32], y: &mut [f32]) {
        let xa = self.quantize_input(x);
        let out = SyncPtr(y.as_mut_ptr());
        let rows = self.rows;
        let chunk = (rows / (4 * rayon::current_num_threads()).max(1)).clamp(16, 1024);
        (0..rows.div_ceil(chunk)).into_par_iter().for_each(|ci| {
            // SAFETY: chunks cover disjoint row ranges; y outlives the loop.
            unsafe { self.rows_q8(&xa, ci * chunk, ((ci + 1) * chunk).min(rows), out) };
        });
    }
}

thread_local! {
    /// Per-thread scratch for a block of dequantized rows (reused across calls).
    static TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A raw output pointer shared by parallel blocks that write disjoint elements.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: used only for disjoint writes (see `matmul`).
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safetensors::f32_to_bf16;

    /// A bf16 product of 2-8 tokens (each row read once for all) gives every token exactly what
    /// the one-token product gives it (the batched-vs-alone property of the CPU decode step),
    /// also with a column count that leaves a tail.
    #[test]
    fn bf16_few_token_product_equals_each_token_alone() {
        let (rows, cols) = (37, 1027);
        let w: Vec<u8> = (0..rows * cols)
            .flat_map(|i| f32_to_bf16(((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 0.1).to_le_bytes())
            .collect();
        let lin = Linear::dense(rows, cols, FloatType::BF16, Bytes::from_vec(w)).unwrap();
        for t in 2..=8 {
            let x: Vec<f32> = (0..t * cols).map(|i| ((i * 31 % 997) as f32 / 997.0 - 0.5) * 2.0).collect();
            let mut y = vec![0f32; t * rows];
            lin.matmul(&x, &mut y);
            for tt in 0..t {
                let mut one = vec![0f32; rows];
                lin.matvec(&x[tt * cols..(tt + 1) * cols], &mut one);
                assert_eq!(&y[tt * rows..(tt + 1) * rows], &one[..], "t={t}, token {tt}");
            }
        }
    }

    /// With bf16 activations (the CLI's fast path for bf16 weights): every token of a 1-8 or
    /// 19-token product gets exactly what it gets alone (rows in fours and the leftover row one at a
    /// time, a tail of columns past the 16-column blocks), and that is the product of the
    /// bf16-rounded input within fp32 rounding of the f64 sum.
    #[test]
    fn bf16_activation_product_equals_each_token_alone_and_the_rounded_input() {
        let (rows, cols) = (37, 1027);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 0.1).collect();
        let wb: Vec<u8> = w.iter().flat_map(|&v| f32_to_bf16(v).to_le_bytes()).collect();
        let lin = Linear::dense(rows, cols, FloatType::BF16, Bytes::from_vec(wb)).unwrap();
        let Weight::Dense { data, .. } = &lin.w else { unreachable!() };
        let d = data.as_slice();
        for t in (1..=8).chain([19]) {
            let x: Vec<f32> = (0..t * cols).map(|i| ((i * 31 % 997) as f32 / 997.0 - 0.5) * 2.0).collect();
            let mut y = vec![0f32; t * rows];
            lin.bf16_product(d, &x, t, &mut y, true);
            for tt in 0..t {
                let xt = &x[tt * cols..(tt + 1) * cols];
                let mut one = vec![0f32; rows];
                lin.bf16_product(d, xt, 1, &mut one, true);
                assert_eq!(&y[tt * rows..(tt + 1) * rows], &one[..], "t={t}, token {tt}");
                for r in 0..rows {
                    let (mut s, mut mag) = (0f64, 0f64);
                    for c in 0..cols {
                        let wv = bf16_to_f32(f32_to_bf16(w[r * cols + c])) as f64;
                        let xv = bf16_to_f32(f32_to_bf16(xt[c])) as f64;
                        s += wv * xv;
                        mag += (wv * xv).abs();
                    }
                    // fp32 accumulation of ~cols/8 terms per lane: well inside 1e-5 of Σ|w·x|.
                    let err = (one[r] as f64 - s).abs();
                    assert!(err <= 1e-5 * mag, "row {r}: {} vs {s} (|w·x| sum {mag})", one[r]);
                }
            }
        }
    }
}
