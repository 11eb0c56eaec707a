//! Tensor- and expert-parallel sharding arithmetic: which heads, experts and rows of a model
//! each of `ranks` GPUs owns (issue 17). Pure arithmetic on [`ModelConfig`], checked on the CPU;
//! the loaders and the NCCL step build on it.
//!
//! The split, per sublayer (the usual Megatron/vLLM plan, one all-reduce after each sublayer):
//! - **Attention**: query heads in contiguous equal ranges; each rank holds the KV heads its
//!   query heads read. With more ranks than KV heads, a KV head is replicated on
//!   `ranks / kv_heads` ranks. q/k/v (and the output gate) are split by output rows; the output
//!   projection by input columns (the rank's heads × head_dim), so its partial sums all-reduce.
//! - **Gated DeltaNet**: key heads in contiguous equal ranges, each with its value heads
//!   (`value_heads / key_heads` per key head); the fused input projection's q/k rows of the key
//!   heads, v/z/b/a rows of the value heads, their conv channels and recurrent states stay on the
//!   rank; the output projection is split by input columns.
//! - **Routed experts**: expert parallel, `experts / ranks` whole experts per rank (the router
//!   is replicated; a token's chosen experts run where they live and the weighted sum
//!   all-reduces). **Shared expert / dense MLP**: gate/up by rows of the intermediate size, down
//!   by the same columns.
//! - **lm_head**: vocabulary rows in contiguous ranges (the last may be shorter); the logits are
//!   gathered. The embedding is replicated.
//!
//! A split along input columns must keep whole quantization groups on each rank (the packed
//! MLX layout stores codes and scales per group of columns).

use crate::config::{FfnKind, ModelConfig};
use anyhow::{bail, Result};
use std::ops::Range;

/// What one rank of a tensor-parallel group owns. Ranges are in units of the named thing
/// (heads, experts, rows of the intermediate size, vocabulary rows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub ranks: usize,
    /// Attention query heads, and the KV heads they read (one replicated head when there are more
    /// ranks than KV heads).
    pub q_heads: Range<usize>,
    pub kv_heads: Range<usize>,
    /// Gated DeltaNet key heads and their value heads.
    pub gdn_k_heads: Range<usize>,
    pub gdn_v_heads: Range<usize>,
    /// Routed experts (empty for dense models).
    pub experts: Range<usize>,
    /// Rows of the shared expert's intermediate size (MoE) or of the MLP's (dense).
    pub ffn_rows: Range<usize>,
    /// Rows of the lm_head.
    pub vocab: Range<usize>,
}

impl Shard {
    /// Input columns of the attention output projection this rank multiplies.
    pub fn attn_out_cols(&self, cfg: &ModelConfig) -> Range<usize> {
        self.q_heads.start * cfg.head_dim..self.q_heads.end * cfg.head_dim
    }

    /// Input columns of the GDN output projection this rank multiplies.
    pub fn gdn_out_cols(&self, cfg: &ModelConfig) -> Range<usize> {
        let d = cfg.linear_value_head_dim;
        self.gdn_v_heads.start * d..self.gdn_v_heads.end * d
    }
}

/// `[r·n/ranks, (r+1)·n/ranks)` when `ranks` divides `n`, else an error naming `what`.
fn even(n: usize, ranks: usize, r: usize, what: &str) -> Result<Range<usize>> {
    if !n.is_multiple_of(ranks) {
        bail!("tensor-parallel {ranks}: {n} {what} do not split evenly over {ranks} ranks");
    }
    let per = n / ranks;
    Ok(r * per..(r + 1) * per)
}

/// Columns per rank of a split along input columns must be whole quantization groups.
fn check_groups(cols_per_rank: usize, group: usize, ranks: usize, what: &str) -> Result<()> {
    if group > 1 && !cols_per_rank.is_multiple_of(group) {
        bail!(
            "tensor-parallel {ranks}: the {what} would get {cols_per_rank} input columns per rank, \
             not a multiple of the quantization group ({group})"
        );
    }
    Ok(())
}

/// The shards of `cfg` over `ranks` ranks, or an error naming the dimension that does not split.
pub fn plan(cfg: &ModelConfig, ranks: usize) -> Result<Vec<Shard>> {
    if ranks == 0 {
        bail!("tensor-parallel 0: need at least one rank");
    }
    let (nq, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    if nkv == 0 || !nq.is_multiple_of(nkv) {
        bail!("{nq} attention heads are not a multiple of {nkv} KV heads");
    }
    if ranks > nkv && !ranks.is_multiple_of(nkv) {
        bail!("tensor-parallel {ranks}: {nkv} KV heads can be neither split nor replicated evenly over {ranks} ranks");
    }
    let (nk, nv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads);
    if nk == 0 || !nv.is_multiple_of(nk) {
        bail!("{nv} GDN value heads are not a multiple of {nk} key heads");
    }
    let group = cfg.quantization.as_ref().map_or(1, |q| q.group_size);
    let inter = match cfg.ffn {
        FfnKind::Moe => cfg.shared_expert_intermediate_size,
        FfnKind::Dense => cfg.intermediate_size,
    };
    let mut shards = Vec::with_capacity(ranks);
    for r in 0..ranks {
        let q_heads = even(nq, ranks, r, "attention heads")?;
        let kv_heads = if ranks <= nkv {
            even(nkv, ranks, r, "KV heads")?
        } else {
            let kv = r / (ranks / nkv);
            kv..kv + 1
        };
        let gdn_k_heads = even(nk, ranks, r, "GDN key heads")?;
        let vpk = nv / nk;
        let gdn_v_heads = gdn_k_heads.start * vpk..gdn_k_heads.end * vpk;
        let experts = match cfg.ffn {
            FfnKind::Moe => even(cfg.num_experts, ranks, r, "routed experts")?,
            FfnKind::Dense => 0..0,
        };
        let ffn_rows = even(inter, ranks, r, "rows of the MLP intermediate size")?;
        let per_vocab = cfg.vocab_size.div_ceil(ranks);
        let vocab = (r * per_vocab).min(cfg.vocab_size)..((r + 1) * per_vocab).min(cfg.vocab_size);
        shards.push(Shard { rank: r, ranks, q_heads, kv_heads, gdn_k_heads, gdn_v_heads, experts, ffn_rows, vocab });
    }
    let s = &shards[0];
    check_groups(s.q_heads.len() * cfg.head_dim, group, ranks, "attention output projection")?;
    check_groups(s.gdn_v_heads.len() * cfg.linear_value_head_dim, group, ranks, "GDN output projection")?;
    check_groups(s.ffn_rows.len(), group, ranks, "MLP down projection")?;
    Ok(shards)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn qwen36() -> ModelConfig {
        crate::synthetic::config("qwen3.6-35b-a3b", None, 248_320).unwrap()
    }

    fn dense(inter: usize, group: usize) -> ModelConfig {
        ModelConfig::from_json(&json!({
            "model_type": "qwen3_5",
            "text_config": {
                "vocab_size": 1001, "hidden_size": 256, "num_hidden_layers": 4, "full_attention_interval": 4,
                "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
                "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "intermediate_size": inter,
                "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "eos_token_id": 1,
                "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
            },
            "quantization": {"group_size": group, "bits": 4, "mode": "affine"}
        }))
        .unwrap()
    }

    /// The ranks' ranges, in rank order, tile [0, n) with no gap or overlap.
    fn tiles(parts: impl Iterator<Item = Range<usize>>, n: usize) -> bool {
        let mut at = 0;
        for p in parts {
            if p.start != at || p.end < p.start {
                return false;
            }
            at = p.end;
        }
        at == n
    }

    #[test]
    fn every_head_expert_and_row_has_exactly_one_owner() {
        let cfg = qwen36();
        for ranks in [1usize, 2, 4, 8] {
            let s = plan(&cfg, ranks).unwrap();
            assert_eq!(s.len(), ranks);
            assert!(tiles(s.iter().map(|x| x.q_heads.clone()), 16), "{ranks}: q heads");
            assert!(tiles(s.iter().map(|x| x.gdn_k_heads.clone()), 16), "{ranks}: GDN key heads");
            assert!(tiles(s.iter().map(|x| x.gdn_v_heads.clone()), 32), "{ranks}: GDN value heads");
            assert!(tiles(s.iter().map(|x| x.experts.clone()), 256), "{ranks}: experts");
            assert!(tiles(s.iter().map(|x| x.ffn_rows.clone()), 512), "{ranks}: shared expert rows");
            assert!(tiles(s.iter().map(|x| x.vocab.clone()), 248_320), "{ranks}: vocabulary");
            assert!(tiles(s.iter().map(|x| x.attn_out_cols(&cfg)), 16 * 256), "{ranks}: o_proj columns");
            assert!(tiles(s.iter().map(|x| x.gdn_out_cols(&cfg)), 32 * 128), "{ranks}: GDN out columns");
            for x in &s {
                // every query head's KV head (8 query heads per KV head) lives on its rank
                for q in x.q_heads.clone() {
                    assert!(x.kv_heads.contains(&(q / 8)), "{ranks}: rank {} q head {q}", x.rank);
                }
                // and every value head's key head (2 value heads per key head)
                for v in x.gdn_v_heads.clone() {
                    assert!(x.gdn_k_heads.contains(&(v / 2)), "{ranks}: rank {} v head {v}", x.rank);
                }
                assert_eq!(x.attn_out_cols(&cfg).len() % 64, 0);
                assert_eq!(x.ffn_rows.len() % 64, 0);
            }
        }
        // 2 KV heads over 2 ranks: one each; over 8: each replicated on 4 ranks
        assert_eq!(plan(&cfg, 2).unwrap()[1].kv_heads, 1..2);
        let s8 = plan(&cfg, 8).unwrap();
        assert_eq!(s8.iter().map(|x| x.kv_heads.start).collect::<Vec<_>>(), [0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(s8[5].experts, 160..192);
        assert_eq!(s8[7].vocab, 217_280..248_320);
    }

    #[test]
    fn uneven_splits_are_refused_by_name() {
        let cfg = qwen36();
        let err = |ranks| plan(&cfg, ranks).unwrap_err().to_string();
        assert!(err(0).contains("at least one rank"), "{}", err(0));
        assert!(err(3).contains("KV heads"), "{}", err(3));
        // 6 ranks could replicate the 2 KV heads 3 times, but not split 16 query heads
        assert!(err(6).contains("16 attention heads"), "{}", err(6));
        // 32 ranks: the 16 attention heads do not go around
        assert!(err(32).contains("16 attention heads"), "{}", err(32));
        // a dense model: 192 intermediate rows over 2 ranks is 96 down-projection columns each,
        // not whole groups of 64
        let d = dense(192, 64);
        let e = plan(&d, 2).unwrap_err().to_string();
        assert!(e.contains("MLP down projection") && e.contains("96"), "{e}");
        let s = plan(&dense(256, 64), 2).unwrap();
        assert_eq!((s[1].ffn_rows.clone(), s[1].experts.clone()), (128..256, 0..0));
        // 8 ranks: the dense model's 4 GDN key heads do not go around
        let e = plan(&dense(512, 64), 8).unwrap_err().to_string();
        assert!(e.contains("4 GDN key heads"), "{e}");
        // the vocabulary need not divide: 1,001 rows over 4 ranks are 3 of 251 and a last of 248
        let s = plan(&dense(512, 64), 4).unwrap();
        assert_eq!(s.iter().map(|x| x.vocab.clone()).collect::<Vec<_>>(), [0..251, 251..502, 502..753, 753..1001]);
        // more ranks than KV heads: the 2 KV heads replicated on 2 ranks each
        assert_eq!(s.iter().map(|x| x.kv_heads.start).collect::<Vec<_>>(), [0, 0, 1, 1]);
    }
}
