//! Per-sequence caches: KV for full-attention layers, conv + recurrent state for GDN layers.
//!
//! On the CPU a KV cache is a list of pages of [`KV_PAGE_ROWS`] positions (the block table:
//! logical page `j` holds rows `j·16 .. j·16 + 16`), the same 16 positions per page that the
//! server's scheduler budgets: a sequence takes memory a page at a time as it grows, never
//! copies what it holds, and gives whole pages back when it ends. (The CUDA backend pages its
//! caches in device memory instead, see `cuda::PagedBuf`.)

use crate::config::{LayerKind, ModelConfig};

/// Positions per CPU KV page (vLLM's default block size; the scheduler's CPU page).
pub const KV_PAGE_ROWS: usize = 16;

/// Rows of `width` floats (one position of one layer's K or V: `[H_kv, D]`) in pages.
#[derive(Clone, Debug, Default)]
pub struct KvRows {
    width: usize,
    len: usize,
    /// The block table: page `j` holds rows `j·KV_PAGE_ROWS ..`, each page full but the last.
    pages: Vec<Box<[f32]>>,
}

impl KvRows {
    pub fn new(width: usize) -> KvRows {
        KvRows { width, len: 0, pages: Vec::new() }
    }

    /// Rows `data: [n, width]` as a cache.
    pub fn from_rows(width: usize, data: &[f32]) -> KvRows {
        let mut r = KvRows::new(width);
        r.push(data);
        r
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn width(&self) -> usize {
        self.width
    }

    /// Pages held.
    pub fn pages(&self) -> usize {
        self.pages.len()
    }

    /// Appends rows `data: [n, width]`, taking new pages as the last one fills.
    pub fn push(&mut self, data: &[f32]) {
        assert_eq!(data.len() % self.width.max(1), 0, "KV rows of width {}", self.width);
        let mut rest = data;
        while !rest.is_empty() {
            let at = self.len % KV_PAGE_ROWS;
            if at == 0 {
                self.pages.push(vec![0f32; KV_PAGE_ROWS * self.width].into_boxed_slice());
            }
            let n = (KV_PAGE_ROWS - at).min(rest.len() / self.width);
            let page = self.pages.last_mut().expect("a page");
            page[at * self.width..(at + n) * self.width].copy_from_slice(&rest[..n * self.width]);
            rest = &rest[n * self.width..];
            self.len += n;
        }
    }

    /// Row `j` (`[width]`).
    #[inline]
    pub fn row(&self, j: usize) -> &[f32] {
        debug_assert!(j < self.len);
        let at = (j % KV_PAGE_ROWS) * self.width;
        &self.pages[j / KV_PAGE_ROWS][at..at + self.width]
    }

    /// All rows, contiguous (`[len, width]`).
    pub fn to_vec(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.len * self.width);
        for (i, p) in self.pages.iter().enumerate() {
            let n = (self.len - i * KV_PAGE_ROWS).min(KV_PAGE_ROWS);
            out.extend_from_slice(&p[..n * self.width]);
        }
        out
    }

    /// Bytes of the pages held.
    pub fn nbytes(&self) -> usize {
        4 * self.pages.len() * KV_PAGE_ROWS * self.width
    }
}

#[derive(Clone)]
pub enum LayerState {
    /// `conv: [K−1, C]` raw inputs; `rec: [H_v, D_k, D_v]` fp32.
    Gdn { conv: Vec<f32>, rec: Vec<f32> },
    /// `k, v: [L, H_kv, D]` (k after norm and RoPE), in pages.
    Attention { k: KvRows, v: KvRows },
}

#[derive(Clone)]
pub struct State {
    /// Tokens processed so far (the position of the next token).
    pub pos: usize,
    pub layers: Vec<LayerState>,
}

impl State {
    pub fn new(cfg: &ModelConfig) -> State {
        let layers = cfg
            .layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Gdn => LayerState::Gdn {
                    conv: vec![0.0; (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim()],
                    rec: vec![0.0; cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim],
                },
                LayerKind::Attention => {
                    LayerState::Attention { k: KvRows::new(cfg.kv_dim()), v: KvRows::new(cfg.kv_dim()) }
                }
            })
            .collect();
        State { pos: 0, layers }
    }

    /// Bytes held by this state.
    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Gdn { conv, rec } => 4 * (conv.len() + rec.len()),
                LayerState::Attention { k, v } => k.nbytes() + v.nbytes(),
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows pushed in uneven pieces across page boundaries read back in order, one page per 16.
    #[test]
    fn kv_rows_fill_pages_in_order() {
        let w = 3;
        let data: Vec<f32> = (0..(2 * KV_PAGE_ROWS + 5) * w).map(|i| i as f32).collect();
        let mut r = KvRows::new(w);
        let mut at = 0;
        for n in [1, 7, 15, 2, 12] {
            r.push(&data[at * w..(at + n) * w]);
            at += n;
            assert_eq!(r.len(), at);
            assert_eq!(r.pages(), at.div_ceil(KV_PAGE_ROWS));
        }
        assert_eq!(at, 37);
        for j in 0..at {
            assert_eq!(r.row(j), &data[j * w..(j + 1) * w], "row {j}");
        }
        assert_eq!(r.to_vec(), data[..at * w]);
        assert_eq!(r.nbytes(), 4 * 3 * KV_PAGE_ROWS * w);
        assert_eq!(KvRows::from_rows(w, &data[..at * w]).to_vec(), r.to_vec());
    }
}
