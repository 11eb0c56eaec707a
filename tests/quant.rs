//! Dequantization and the products over packed weights, against values built independently:
//! the test packs integer codes itself (MLX layout: element j of a u32 word at bits `bits·j`).

mod common;
use common::*;
use lily::cpu::kernels;
use lily::linear::{FloatType, Linear};
use lily::safetensors::{bf16_to_f32, f32_to_bf16, Bytes};

struct Packed {
    lin: Linear,
    dense: Vec<f64>, // [rows, cols] dequantized in f64 from the codes
}

fn pack(rows: usize, cols: usize, bits: u32, group: usize, seed: u64) -> Packed {
    let mut r = rng(seed);
    let levels = (1u64 << bits) - 1;
    let codes: Vec<u32> = (0..rows * cols).map(|_| (r.next_u64() % (levels + 1)) as u32).collect();
    let per_word = 32 / bits as usize;
    let mut words = Vec::new();
    for row in codes.chunks(cols) {
        for w in row.chunks(per_word) {
            let mut word = 0u32;
            for (j, &q) in w.iter().enumerate() {
                word |= q << (bits as usize * j);
            }
            words.extend(word.to_le_bytes());
        }
    }
    let ng = rows * cols / group;
    let s: Vec<u16> = uniform(&mut r, ng, 0.05).iter().map(|v| f32_to_bf16(v.abs() + 0.01)).collect();
    let b: Vec<u16> = uniform(&mut r, ng, 0.3).iter().map(|v| f32_to_bf16(*v)).collect();
    let dense = (0..rows * cols)
        .map(|i| {
            let g = i / group; // groups run along each row; cols is a multiple of group
            bf16_to_f32(s[g]) as f64 * codes[i] as f64 + bf16_to_f32(b[g]) as f64
        })
        .collect();
    let sb: Vec<u8> = s.iter().flat_map(|x| x.to_le_bytes()).collect();
    let bb: Vec<u8> = b.iter().flat_map(|x| x.to_le_bytes()).collect();
    let lin = Linear::quant(
        rows,
        cols,
        bits,
        group,
        Bytes::from_vec(words),
        Bytes::from_vec(sb),
        Bytes::from_vec(bb),
        FloatType::BF16,
    )
    .unwrap();
    Packed { lin, dense }
}

fn ref_matmul(dense: &[f64], rows: usize, cols: usize, x: &[f32], t: usize) -> Vec<f32> {
    let mut y = vec![0f32; t * rows];
    for tt in 0..t {
        for r in 0..rows {
            y[tt * rows + r] = (0..cols).map(|c| dense[r * cols + c] * x[tt * cols + c] as f64).sum::<f64>() as f32;
        }
    }
    y
}

#[test]
fn dequant_and_products_every_bits_and_group() {
    // fp32 accumulation over ≤ 384 products of O(1) terms: NMSE ~1e-13 typical; 1e-10 is safe.
    for bits in [4u32, 8] {
        for group in [32usize, 64, 128] {
            let (rows, cols) = (37, 3 * 128);
            let p = pack(rows, cols, bits, group, 100 + bits as u64 * 7 + group as u64);
            let mut row = vec![0f32; cols];
            for r in [0, 5, rows - 1] {
                p.lin.row_f32(r, &mut row);
                let want: Vec<f32> = p.dense[r * cols..(r + 1) * cols].iter().map(|v| *v as f32).collect();
                assert!(max_abs_diff(&row, &want) < 1e-6, "row_f32 bits={bits} group={group}");
            }
            let mut r = rng(9);
            for t in [1usize, 2, 3, 4, 5, 17] {
                let x = uniform(&mut r, t * cols, 1.0);
                let mut y = vec![0f32; t * rows];
                p.lin.matmul(&x, &mut y);
                let want = ref_matmul(&p.dense, rows, cols, &x, t);
                assert!(nmse(&y, &want) < 1e-10, "matmul bits={bits} group={group} t={t}: {}", nmse(&y, &want));
            }
        }
    }
}

#[test]
fn simd_and_portable_quant_dots_agree() {
    for bits in [4u32, 8] {
        let (rows, cols, group) = (4, 256, 64);
        let p = pack(rows, cols, bits, group, 77 + bits as u64);
        let lily::linear::Weight::Quant { packed, scales, biases, .. } = &p.lin.w else { unreachable!() };
        let mut r = rng(10);
        let x = uniform(&mut r, cols, 1.0);
        let gsum: Vec<f32> = x.chunks(group).map(|g| g.iter().sum()).collect();
        let pb = cols * bits as usize / 8;
        let sb = cols / group * 2;
        for row in 0..rows {
            let args = (
                &packed.as_slice()[row * pb..(row + 1) * pb],
                &scales.as_slice()[row * sb..(row + 1) * sb],
                &biases.as_slice()[row * sb..(row + 1) * sb],
            );
            let a = kernels::dot_quant(bits, group, FloatType::BF16, args.0, args.1, args.2, &x, &gsum);
            let b = kernels::dot_quant_portable(bits, group, FloatType::BF16, args.0, args.1, args.2, &x, &gsum);
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "bits={bits} row={row}: {a} vs {b}");
        }
    }
}

#[test]
fn dense_products_bf16_f16_f32() {
    let (rows, cols) = (9, 75); // odd width exercises the scalar tail
    let mut r = rng(11);
    let w = uniform(&mut r, rows * cols, 1.0);
    for ty in [FloatType::F32, FloatType::BF16, FloatType::F16] {
        let (bytes, wq): (Vec<u8>, Vec<f64>) = match ty {
            FloatType::F32 => (w.iter().flat_map(|v| v.to_le_bytes()).collect(), w.iter().map(|v| *v as f64).collect()),
            FloatType::BF16 => {
                let h: Vec<u16> = w.iter().map(|v| f32_to_bf16(*v)).collect();
                (h.iter().flat_map(|v| v.to_le_bytes()).collect(), h.iter().map(|v| bf16_to_f32(*v) as f64).collect())
            }
            FloatType::F16 => {
                // f16 of v: exact for these values after rounding through a reference encoder
                let h: Vec<u16> = w.iter().map(|v| f32_to_f16_ref(*v)).collect();
                (
                    h.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    h.iter().map(|v| lily::safetensors::f16_to_f32(*v) as f64).collect(),
                )
            }
        };
        let lin = Linear::dense(rows, cols, ty, Bytes::from_vec(bytes)).unwrap();
        for t in [1usize, 4] {
            let x = uniform(&mut r, t * cols, 1.0);
            let mut y = vec![0f32; t * rows];
            lin.matmul(&x, &mut y);
            let want = ref_matmul(&wq, rows, cols, &x, t);
            assert!(nmse(&y, &want) < 1e-10, "{ty:?} t={t}");
        }
    }
}

/// Truncating f32 → f16 for normal values in range (enough for uniform(-1, 1) test data).
fn f32_to_f16_ref(v: f32) -> u16 {
    let b = v.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    if exp <= 0 {
        return sign;
    }
    sign | ((exp as u16) << 10) | ((b >> 13) & 0x3ff) as u16
}

#[test]
fn f16_decoding_known_values() {
    use lily::safetensors::f16_to_f32;
    assert_eq!(f16_to_f32(0x3c00), 1.0);
    assert_eq!(f16_to_f32(0xc000), -2.0);
    assert_eq!(f16_to_f32(0x7bff), 65504.0);
    assert_eq!(f16_to_f32(0x0001), 5.960_464_5e-8); // smallest subnormal
    assert!(f16_to_f32(0x7c00).is_infinite());
    assert!(f16_to_f32(0x7e00).is_nan());
}

#[test]
fn quantized_shape_mismatch_is_an_error() {
    let e = Linear::quant(
        4,
        64,
        4,
        64,
        Bytes::from_vec(vec![0; 10]),
        Bytes::from_vec(vec![0; 8]),
        Bytes::from_vec(vec![0; 8]),
        FloatType::BF16,
    );
    assert!(e.is_err());
    let e = Linear::quant(
        4,
        96,
        4,
        64,
        Bytes::from_vec(vec![0; 192]),
        Bytes::from_vec(vec![0; 8]),
        Bytes::from_vec(vec![0; 8]),
        FloatType::BF16,
    );
    assert!(e.err().unwrap().to_string().contains("group"));
}
