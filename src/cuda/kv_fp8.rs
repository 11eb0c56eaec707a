//! The fp8 KV cache's rows on the host (kernels/attention.cu's layout: a position's H_kv rows of
//! D e4m3 bytes, then their f32 scales, padded to 16 bytes): snapshots of a session
//! (model/state.rs) and the kernel tests' reference caches. Encoding matches attn_prep_fp8 (the
//! same power-of-two scale, round to nearest even, saturation at ±448), decoding is exact.

/// e4m3 (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities) as f32, exact.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let (e, m) = ((b >> 3) & 15, (b & 7) as f32);
    let v = if e == 0 { m * (-9f32).exp2() } else { (1.0 + m / 8.0) * (e as f32 - 7.0).exp2() };
    if b & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// x as e4m3, rounded to nearest even, saturated at ±448 (as `cvt.rn.satfinite`).
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs() as f64;
    let bits = if a.is_nan() {
        0x7f
    } else if a >= 448.0 {
        0x7e
    } else if a < (-6f64).exp2() {
        // subnormal: multiples of 2^-9 (8 of them is 2^-6, which encodes as 0x08)
        (a * 512.0).round_ties_even() as u8
    } else {
        let e = a.log2().floor() as i32;
        let e = if (e as f64).exp2() > a { e - 1 } else { e };
        let q = (a / (e as f64).exp2() * 8.0).round_ties_even() as u32; // 8..=16
        let (e, q) = if q == 16 { (e + 1, 8) } else { (e, q) };
        ((((e + 7) as u32) << 3) | (q - 8)).min(0x7e) as u8
    };
    sign | bits
}

/// The power-of-two scale of a row whose largest magnitude is `amax`: the least 2^k at or
/// above amax/448 (f32 division, as the kernel), 1 for an all-zero row.
pub fn row_scale(amax: f32) -> f32 {
    if amax.is_nan() || amax <= 0.0 {
        return 1.0;
    }
    let r = (amax / 448.0) as f64;
    let b = r.to_bits();
    let exp = ((b >> 52) & 0x7ff) as i32 - 1023;
    let k = if b & ((1u64 << 52) - 1) == 0 { exp } else { exp + 1 };
    (k as f64).exp2() as f32
}

/// One position's bytes for the rows `p` (hkv·hd values).
pub fn encode_pos(p: &[f32], hkv: usize, hd: usize) -> Vec<u8> {
    let mut out = vec![0u8; super::KvDtype::Fp8.pos_bytes(hkv, hd)];
    for (h, row) in p.chunks_exact(hd).enumerate() {
        let s = row_scale(row.iter().fold(0f32, |m, x| m.max(x.abs())));
        for (j, &x) in row.iter().enumerate() {
            out[h * hd + j] = f32_to_e4m3(x * (1.0 / s));
        }
        out[hkv * hd + 4 * h..hkv * hd + 4 * h + 4].copy_from_slice(&s.to_le_bytes());
    }
    out
}

/// One position's rows (hkv·hd values) from its bytes.
pub fn decode_pos(p: &[u8], hkv: usize, hd: usize) -> Vec<f32> {
    (0..hkv * hd)
        .map(|i| {
            let o = hkv * hd + 4 * (i / hd);
            e4m3_to_f32(p[i]) * f32::from_le_bytes([p[o], p[o + 1], p[o + 2], p[o + 3]])
        })
        .collect()
}

/// Whole positions: `data` [n][hkv·hd] f32 as the cache's bytes.
pub fn encode_rows(data: &[f32], hkv: usize, hd: usize) -> Vec<u8> {
    data.chunks_exact(hkv * hd).flat_map(|p| encode_pos(p, hkv, hd)).collect()
}

/// Whole positions: the cache's bytes as [n][hkv·hd] f32.
pub fn decode_rows(bytes: &[u8], hkv: usize, hd: usize) -> Vec<f32> {
    bytes.chunks_exact(super::KvDtype::Fp8.pos_bytes(hkv, hd)).flat_map(|p| decode_pos(p, hkv, hd)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The e4m3 values from the OCP 8-bit floating point specification (E4M3: bias 7, max
    /// 448 = S.1111.110, min normal 2^-6 = S.0001.000, min subnormal 2^-9 = S.0000.001).
    #[test]
    fn e4m3_encodes_and_decodes_the_specification_values() {
        for (x, b) in [(448.0, 0x7e), (1.0, 0x38), (-2.0, 0xc0), ((-6f32).exp2(), 0x08), ((-9f32).exp2(), 0x01)] {
            assert_eq!(f32_to_e4m3(x), b, "{x}");
            assert_eq!(e4m3_to_f32(b), x, "{b:#x}");
        }
        assert_eq!(f32_to_e4m3(1000.0), 0x7e, "saturates");
        assert_eq!(f32_to_e4m3(1.0625), 0x38, "a tie rounds to the even mantissa (1.0)");
        assert_eq!(f32_to_e4m3(1.1875), 0x3a, "a tie rounds to the even mantissa (1.25)");
        for b in 0..=255u8 {
            if b & 0x7f != 0x7f {
                assert_eq!(f32_to_e4m3(e4m3_to_f32(b)), if b == 0x80 { 0x80 } else { b }, "{b:#x}");
            }
        }
    }

    #[test]
    fn fp8_rows_round_trip_and_stay_within_e4m3_rounding() {
        let (hkv, hd) = (3, 32);
        let p: Vec<f32> = (0..hkv * hd).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.173 * (1 + i / hd) as f32).collect();
        let bytes = encode_pos(&p, hkv, hd);
        assert_eq!(bytes.len(), 3 * 32 + 16);
        let back = decode_pos(&bytes, hkv, hd);
        for (row, brow) in p.chunks(hd).zip(back.chunks(hd)) {
            let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (&x, &y) in row.iter().zip(brow) {
                // half an e4m3 step: 2^-4 relative in the normal range, 2^-10 of the scale below it
                assert!((x - y).abs() <= x.abs() / 16.0 + amax / 448.0 * 2f32.powi(-9), "{x} -> {y}");
            }
        }
        assert_eq!(encode_pos(&back, hkv, hd), bytes, "decoded rows encode to the same bytes");
    }
}
