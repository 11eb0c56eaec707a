//! The opt-in int8-activation products (`lily::cpu::kernels::q8`) against naive f64 sums.
//!
//! This file is its own test binary because the switch is process-wide: every test here that goes
//! through `Linear` or the model turns it on (and none turns it off), so the other test binaries
//! keep the default fp32 path.

mod common;
use common::*;
use lily::cpu::kernels::q8::{self, Q8Act};
use lily::generate::{CpuSession, Session};
use lily::linear::{FloatType, Linear, Weight};
use lily::safetensors::{bf16_to_f32, f32_to_bf16, Bytes};
use std::sync::Arc;

struct Packed {
    lin: Linear,
    codes: Vec<u32>, // [rows, cols]
    s: Vec<f64>,     // [rows, cols/group]
    b: Vec<f64>,     // [rows, cols/group]
}

/// Random codes packed in the MLX layout (element j of a little-endian u32 word at bits `bits·j`).
fn pack(rows: usize, cols: usize, bits: u32, group: usize, seed: u64) -> Packed {
    let mut r = rng(seed);
    let levels = 1u64 << bits;
    let codes: Vec<u32> = (0..rows * cols).map(|_| (r.next_u64() % levels) as u32).collect();
    let per_word = 32 / bits as usize;
    let mut words = Vec::new();
    for row in codes.chunks(cols) {
        for w in row.chunks(per_word) {
            let word = w.iter().enumerate().fold(0u32, |acc, (j, &q)| acc | q << (bits as usize * j));
            words.extend(word.to_le_bytes());
        }
    }
    let ng = rows * cols / group;
    let s: Vec<u16> = uniform(&mut r, ng, 0.05).iter().map(|v| f32_to_bf16(v.abs() + 0.01)).collect();
    let b: Vec<u16> = uniform(&mut r, ng, 0.3).iter().map(|v| f32_to_bf16(*v)).collect();
    let lin = Linear::quant(
        rows,
        cols,
        bits,
        group,
        Bytes::from_vec(words),
        Bytes::from_vec(s.iter().flat_map(|x| x.to_le_bytes()).collect()),
        Bytes::from_vec(b.iter().flat_map(|x| x.to_le_bytes()).collect()),
        FloatType::BF16,
    )
    .unwrap();
    let f = |v: &[u16]| v.iter().map(|h| bf16_to_f32(*h) as f64).collect();
    Packed { lin, codes, s: f(&s), b: f(&b) }
}

/// Activations with a spread of magnitudes across groups (and one all-zero group).
fn activations(r: &mut lily::sampling::Rng, t: usize, cols: usize) -> Vec<f32> {
    let mut x = uniform(r, t * cols, 1.0);
    for (i, v) in x.iter_mut().enumerate() {
        let c = i % cols;
        *v *= [0.01f32, 1.0, 7.0, 0.3][(c / 32) % 4];
        if c < 32 && i / cols == 0 {
            *v = 0.0;
        }
    }
    x
}

#[test]
fn quantized_activations_round_within_half_a_step() {
    // 11 tokens: one whole block of the blocked layout (4-bit, groups 64/128) and a short one.
    const T: usize = 11;
    for (bits, group, cols) in [(4u32, 32usize, 224usize), (4, 64, 384), (4, 128, 256), (8, 32, 96), (8, 128, 256)] {
        let mut r = rng(3 + cols as u64);
        let x = activations(&mut r, T, cols);
        let a = Q8Act::new(&x, cols, group, bits);
        let ng = cols / group;
        let mut seen = vec![false; T * cols];
        for t in 0..T {
            for c in 0..cols {
                let p = a.index(t, c);
                assert!(!seen[p], "index is not a permutation at token {t}, column {c}");
                seen[p] = true;
                let (g, xi) = (c / group, a.q[p]);
                let d = a.d[t * ng + g];
                assert!((-127..=127).contains(&xi));
                // Rounding to nearest: |x − d·xi| ≤ d/2 (plus f32 rounding of x/d).
                let e = (x[t * cols + c] - d * xi as f32).abs();
                assert!(e <= 0.5 * d * (1.0 + 1e-5) + 1e-30, "bits={bits} group={group} c={c}: {e} > {d}/2");
            }
            for g in 0..ng {
                let xs = &x[t * cols + g * group..t * cols + (g + 1) * group];
                let want: i32 = (g * group..(g + 1) * group).map(|c| a.q[a.index(t, c)] as i32).sum();
                assert_eq!(a.isum[t * ng + g], want);
                assert_eq!(a.sum[t * ng + g], a.d[t * ng + g] * want as f32);
                assert!(xs.len() == group);
            }
        }
        assert!(seen.iter().all(|v| *v));
    }
}

/// Every bits × group, odd row counts, 1..17 tokens, through `Linear::matmul` (the SIMD kernel
/// where the CPU has AVX2) and the portable kernel, against two f64 references:
///
/// 1. the exact product with the quantized activations `x̂_c = dx_g·xi_c` (what the kernel
///    computes, in exact integer arithmetic up to the per-group f32 scaling): only f32 rounding
///    differs, so |Δ| ≤ 1e-5·Σ|terms|;
/// 2. the product with the original x: then the only extra error is x's rounding,
///    `|x_c − x̂_c| ≤ dx_g/2`, so `|Δ| ≤ Σ_c |W_c|·dx_g/2` (+ the f32 slack of 1.).
#[test]
fn int8_products_match_f64_within_the_rounding_bound() {
    q8::set_cpu_int8(true);
    for bits in [4u32, 8] {
        for group in [32usize, 64, 128] {
            // One group; 7 groups of 32 (odd: a trailing 32-column chunk); whole 64-column chunks.
            for cols in [group, if group == 32 { 224 } else { 3 * group }] {
                check_products(bits, group, cols, 37);
            }
        }
    }
}

/// The AVX-512 VNNI kernel (`vpdpbusd`) forms the same integer sums in the same lanes as the
/// AVX2 one (`maddubs` + `madd`), so their products are bit-identical: groups 64 and 128, 1 to 17
/// tokens (every register-block width), widths with a partial last block of 8 groups.
#[test]
fn vnni_and_avx2_int8_products_are_bit_identical() {
    q8::set_cpu_int8(true);
    if !lily::cpu::kernels::has_vnni() {
        eprintln!("this CPU has no AVX-512 VNNI (or LILY_NO_VNNI is set): nothing to compare");
        return;
    }
    for (group, cols) in [(64usize, 128usize), (64, 2048), (128, 384), (64, 64 * 13)] {
        let p = pack(45, cols, 4, group, 900 + cols as u64);
        let mut r = rng(31);
        for t in [1usize, 2, 5, 8, 9, 17] {
            let x = activations(&mut r, t, cols);
            let (mut y_vnni, mut y_avx2) = (vec![0f32; t * 45], vec![0f32; t * 45]);
            lily::cpu::kernels::set_vnni(true);
            p.lin.matmul(&x, &mut y_vnni);
            lily::cpu::kernels::set_vnni(false);
            p.lin.matmul(&x, &mut y_avx2);
            lily::cpu::kernels::set_vnni(true);
            let same = y_vnni.iter().zip(&y_avx2).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "group {group} cols {cols} t {t}: VNNI and AVX2 products differ");
        }
    }
}

fn check_products(bits: u32, group: usize, cols: usize, rows: usize) {
    let ng = cols / group;
    let p = pack(rows, cols, bits, group, 500 + bits as u64 * 7 + group as u64 + cols as u64);
    let Weight::Quant { packed, scales, biases, .. } = &p.lin.w else { unreachable!() };
    let (pb, sb) = (cols * bits as usize / 8, ng * 2);
    let mut r = rng(21 + group as u64);
    for t in [1usize, 2, 3, 4, 5, 9, 17, 24] {
        let x = activations(&mut r, t, cols);
        let a = Q8Act::new(&x, cols, group, bits);
        let mut y = vec![0f32; t * rows];
        p.lin.matmul(&x, &mut y);
        for (tt, row) in (0..t).flat_map(|tt| (0..rows).map(move |row| (tt, row))) {
            let (mut exact_q, mut exact_x, mut mag, mut bound) = (0f64, 0f64, 0f64, 0f64);
            for c in 0..cols {
                let g = c / group;
                let (s, b, d) = (p.s[row * ng + g], p.b[row * ng + g], a.d[tt * ng + g] as f64);
                let w = s * p.codes[row * cols + c] as f64 + b;
                let xv = x[tt * cols + c] as f64;
                let xh = d * a.q[a.index(tt, c)] as f64;
                exact_q += w * xh;
                exact_x += w * xv;
                mag += (w * xh).abs();
                bound += w.abs() * d / 2.0;
            }
            let what = format!("bits={bits} group={group} cols={cols} t={t} row={row}");
            let got = y[tt * rows + row] as f64;
            let tol = 1e-5 * mag + 1e-6;
            assert!((got - exact_q).abs() <= tol, "{what}: {got} vs {exact_q} (tol {tol})");
            assert!((got - exact_x).abs() <= bound + tol, "{what}: {got} vs {exact_x} (bound {bound})");
            let port = q8::dot_q8_portable(
                bits,
                group,
                FloatType::BF16,
                &packed.as_slice()[row * pb..(row + 1) * pb],
                &scales.as_slice()[row * sb..(row + 1) * sb],
                &biases.as_slice()[row * sb..(row + 1) * sb],
                &a,
                tt,
            ) as f64;
            assert!((port - exact_q).abs() <= tol, "portable {what}: {port} vs {exact_q}");
        }
    }
}

/// The tiny MLX 4-bit and 8-bit/group-32 checkpoints with int8 activations against the mlx-lm
/// fp32 logits. Each product now carries the activation rounding (rms error `dx/√12`, i.e.
/// ~0.2-1% of the activations' rms per group, depending on how peaked the group is), compounded
/// over 8 layers; these random-weight models amplify input noise about 2x into the logits, and a
/// near-tie in the top-3 expert choice flips the routing, a discrete jump. Measured: median
/// |Δ|/range per position 1.4-1.9%, worst 10-17% (fp32 activations with 0.4% uniform relative
/// noise injected give 0.5% median, 6-7% worst: the same shape, smaller). Bounds: median ≤ 4%,
/// every position ≤ 30% of its logit range, and the argmax equal wherever the reference's top-1
/// margin exceeds twice the position's max |Δ|. A wrong layout or scale fails these by far
/// (logits then differ by the order of their whole range).
#[test]
fn tiny_models_in_int8_stay_close_to_fp32_reference() {
    q8::set_cpu_int8(true);
    for (dir, name) in [("tiny-mlx4", "tiny-mlx4"), ("tiny-mlx8-g32", "tiny-mlx8-g32")] {
        let model = Arc::new(lily::weights::load_model(&fixtures().join(dir)).unwrap());
        let r = reference(name);
        let vocab = model.cfg.vocab_size;
        let mut s = CpuSession::new(model.clone());
        let got = s.forward_all(&r.prompt).unwrap();
        let rel = loose_rows(dir, &got, &r.logits, vocab, 0.3);
        let (median, worst) = (rel[rel.len() / 2], rel[rel.len() - 1]);
        eprintln!("{dir} int8: |Δ|/range vs mlx-lm fp32: median {median:.2e}, worst {worst:.2e}");
        assert!(median <= 0.04, "{dir}: median |Δ|/range {median}");

        // Prefill then token-by-token decode (the decode MoE path) against the one-shot prefill,
        // both in int8: every token's activations are quantized the same way in both, so only
        // fp32 summation order differs (plus an occasional int8 rounding flip it causes).
        let split = 100;
        let inc = prefill_then_decode(&mut CpuSession::new(model.clone()), &r.prompt, split);
        let worst_inc = rows_worst(&inc[split * vocab..], &got[split * vocab..], vocab);
        eprintln!("{dir} int8: prefill-then-decode vs one-shot worst |Δ|/range {worst_inc:.2e}");
        assert!(worst_inc <= 0.01, "{dir}: int8 decode vs prefill {worst_inc}");
    }
}
