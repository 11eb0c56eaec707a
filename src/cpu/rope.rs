//! Partial rotary position embedding, NeoX rotate-half layout.
//!
//! For one head vector `x[0..D]` at position p, with R = rotary dims (R ≤ D) and h = R/2:
//! for i < h, `θ_i = p · base^(−2i/R)`,
//! `x[i] ← x[i]·cos θ_i − x[i+h]·sin θ_i`, `x[i+h] ← x[i+h]·cos θ_i + x[i]·sin θ_i`;
//! dims `[R, D)` pass through.

pub struct Rope {
    pub rotary_dim: usize,
    inv_freq: Vec<f64>,
}

impl Rope {
    pub fn new(rotary_dim: usize, base: f64) -> Rope {
        let h = rotary_dim / 2;
        let inv_freq = (0..h).map(|i| base.powf(-(2.0 * i as f64) / rotary_dim as f64)).collect();
        Rope { rotary_dim, inv_freq }
    }

    /// Rotates every head of `x: [n_heads, head_dim]` for position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        let h = self.rotary_dim / 2;
        let cs: Vec<(f32, f32)> = self
            .inv_freq
            .iter()
            .map(|f| {
                let a = pos as f64 * f;
                (a.cos() as f32, a.sin() as f32)
            })
            .collect();
        for head in x.chunks_exact_mut(head_dim) {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = (head[i], head[i + h]);
                head[i] = a * c - b * s;
                head[i + h] = b * c + a * s;
            }
        }
    }
}
