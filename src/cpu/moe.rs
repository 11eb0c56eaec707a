//! MoE routing: fp32 softmax over E router logits, top-K, renormalized over the K chosen.
//!
//! Equivalent to a softmax over the K largest logits. Ties pick the lower expert index.

/// Returns `(expert, weight)` pairs, largest weight first.
pub fn route(logits: &[f32], k: usize, renormalize: bool) -> Vec<(usize, f32)> {
    assert!(k >= 1 && k <= logits.len(), "route: top-k out of range");
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let probs: Vec<f32> = logits.iter().map(|l| (l - m).exp()).collect();
    let total: f32 = probs.iter().sum();
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
    idx.truncate(k);
    let denom = if renormalize { idx.iter().map(|&e| probs[e]).sum::<f32>() } else { total };
    idx.into_iter().map(|e| (e, probs[e] / denom)).collect()
}
