//! Causal grouped-query attention over a KV cache, fp32 softmax.
//!
//! Legend: T new tokens at positions `p0..p0+T`, H query heads, H_kv KV heads (query head h reads
//! KV head h / (H/H_kv)), D head dim, L = p0 + T cached positions after appending.
//! `q: [T, H, D]`; cache `k, v: [L, H_kv, D]` (rows in pages, [`KvRows`]); `out: [T, H, D]`;
//! `out[t,h] = Σ_{j ≤ p0+t} softmax_j(scale · q[t,h]·k[j,h/g]) v[j,h/g]`.

use crate::cpu::kernels::dot_f32;
use crate::state::KvRows;
use rayon::prelude::*;

pub struct AttnDims {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

pub fn attention(d: &AttnDims, q: &[f32], t: usize, p0: usize, k: &KvRows, v: &KvRows, scale: f32, out: &mut [f32]) {
    let (h, hkv, hd) = (d.heads, d.kv_heads, d.head_dim);
    let l = p0 + t;
    assert_eq!(q.len(), t * h * hd, "attention: q must be [T, H, D]");
    assert_eq!(out.len(), t * h * hd, "attention: out must be [T, H, D]");
    assert!(k.len() >= l && v.len() >= l, "attention: cache shorter than p0+T");
    assert!(k.width() == hkv * hd && v.width() == hkv * hd, "attention: cache rows must be [H_kv, D]");
    let group = h / hkv;
    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (tt, head) = (idx / h, idx % h);
        let kvh = head / group;
        let qv = &q[idx * hd..(idx + 1) * hd];
        let n = p0 + tt + 1;
        let mut scores: Vec<f32> = (0..n).map(|j| scale * dot_f32(qv, &k.row(j)[kvh * hd..][..hd])).collect();
        let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - m).exp();
            sum += *s;
        }
        o.fill(0.0);
        for (j, s) in scores.iter().enumerate() {
            let w = s / sum;
            for (ov, vv) in o.iter_mut().zip(&v.row(j)[kvh * hd..][..hd]) {
                *ov += w * vv;
            }
        }
    });
}
