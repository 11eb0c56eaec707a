//! Causal depthwise conv1d with carried state, then SiLU (GDN q/k/v channels).
//!
//! Legend: T tokens, C channels, K taps. `w: [C, K]` (tap K−1 multiplies the current token),
//! `state: [K−1, C]` holds the last K−1 raw (pre-conv) inputs, zeros at sequence start.
//! With X = [state; x] of shape [K−1+T, C]: `y[t, c] = silu(Σ_j w[c, j] · X[t + j, c])`;
//! afterwards `state` = the last K−1 rows of X.

use super::norm::silu;
use rayon::prelude::*;

pub fn causal_conv1d_silu(x: &[f32], t: usize, c: usize, w: &[f32], k: usize, state: &mut [f32], y: &mut [f32]) {
    assert_eq!(x.len(), t * c, "conv1d: x must be [T, C]");
    assert_eq!(y.len(), t * c, "conv1d: y must be [T, C]");
    assert_eq!(w.len(), c * k, "conv1d: w must be [C, K]");
    assert_eq!(state.len(), (k - 1) * c, "conv1d: state must be [K-1, C]");
    let row = |i: usize| -> &[f32] {
        if i < k - 1 {
            &state[i * c..(i + 1) * c]
        } else {
            &x[(i - (k - 1)) * c..(i - (k - 2)) * c]
        }
    };
    // Output channels [c0, c0 + out.len()) of token tt; taps summed in order j = 0..K.
    let one = |tt: usize, c0: usize, out: &mut [f32]| {
        let rows: Vec<&[f32]> = (0..k).map(|j| &row(tt + j)[c0..c0 + out.len()]).collect();
        for (i, o) in out.iter_mut().enumerate() {
            let wc = &w[(c0 + i) * k..][..k];
            let mut acc = 0f32;
            for (wj, r) in wc.iter().zip(&rows) {
                acc += wj * r[i];
            }
            *o = silu(acc);
        }
    };
    if t > 1 {
        y.par_chunks_mut(c).enumerate().for_each(|(tt, out)| one(tt, 0, out));
    } else {
        // Decode: one token, parallel over channel blocks.
        y.par_chunks_mut(1024).enumerate().for_each(|(b, out)| one(0, b * 1024, out));
    }
    // New state: last K-1 rows of X.
    let total = k - 1 + t;
    let mut new_state = vec![0f32; (k - 1) * c];
    for (j, dst) in new_state.chunks_exact_mut(c).enumerate() {
        dst.copy_from_slice(row(total - (k - 1) + j));
    }
    state.copy_from_slice(&new_state);
}
