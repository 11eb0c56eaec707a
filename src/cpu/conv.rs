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
    let one = |tt: usize, out: &mut [f32]| {
        out.fill(0.0);
        for j in 0..k {
            let src = row(tt + j);
            for ch in 0..c {
                out[ch] += w[ch * k + j] * src[ch];
            }
        }
        out.iter_mut().for_each(|v| *v = silu(*v));
    };
    if t > 1 {
        y.par_chunks_mut(c).enumerate().for_each(|(tt, out)| one(tt, out));
    } else {
        one(0, y);
    }
    // New state: last K-1 rows of X.
    let total = k - 1 + t;
    let new_state: Vec<f32> = (total - (k - 1)..total).flat_map(|i| row(i).to_vec()).collect();
    state.copy_from_slice(&new_state);
}
