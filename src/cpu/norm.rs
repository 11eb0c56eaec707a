//! RMSNorm variants (fp32). Legend: D = normalized width.
//!
//! - `rms_norm`: `y = x · rsqrt(mean(x²) + eps) · w`, with `w` already holding the final multiplier
//!   (HF's zero-centred `1 + w` is folded in at load).
//! - `gated_rms_norm` (GDN output): `y = w ⊙ x · rsqrt(mean(x²) + eps) ⊙ silu(z)`.
//! - `l2_norm`: `x / sqrt(Σx² + eps)` (GDN q and k; no learned weight).

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Numerically stable softplus: `x` for large x.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// In place over every row of width `w.len()`.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    assert!(!w.is_empty() && x.len().is_multiple_of(w.len()), "rms_norm: width mismatch");
    for row in x.chunks_exact_mut(w.len()) {
        let r = inv_rms(row, eps);
        for (v, g) in row.iter_mut().zip(w) {
            *v *= r * g;
        }
    }
}

/// `out = rms_norm(x)` into a separate buffer.
pub fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    out.copy_from_slice(x);
    rms_norm(out, w, eps);
}

/// In place over every row of width `w.len()`; `z` has the same shape as `x`.
pub fn gated_rms_norm(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    assert!(x.len() == z.len() && x.len().is_multiple_of(w.len()), "gated_rms_norm: shape mismatch");
    for (row, zr) in x.chunks_exact_mut(w.len()).zip(z.chunks_exact(w.len())) {
        let r = inv_rms(row, eps);
        for ((v, g), zz) in row.iter_mut().zip(w).zip(zr) {
            *v = *v * r * g * silu(*zz);
        }
    }
}

/// In place over rows of width `d`, then multiplied by `scale`.
pub fn l2_norm(x: &mut [f32], d: usize, eps: f32, scale: f32) {
    for row in x.chunks_exact_mut(d) {
        let ss: f32 = row.iter().map(|v| v * v).sum();
        let r = scale / (ss + eps).sqrt();
        row.iter_mut().for_each(|v| *v *= r);
    }
}
