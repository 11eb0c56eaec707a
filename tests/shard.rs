//! The sharding plan (`lily::shard`) carried out on the CPU: each rank's slices of real weight
//! layouts (MLX 4/8-bit, dense bf16) run in its own thread, and the partial outputs summed in
//! rank order (an in-process all-reduce) must equal the unsplit product.
//!
//! Bound: the split only regroups an fp32 sum (the same products, added per rank and then across
//! ranks), so the difference is summation-order rounding: NMSE ≤ 1e-10 (measured 5e-15 to
//! 1e-13; a wrong row or column range gives order 1).

mod common;
use common::gpu::{dense, quant};
use common::{nmse, rng, uniform};
use lily::config::ModelConfig;
use lily::linear::{FloatType, Linear};
use lily::shard::plan;
use serde_json::json;

const TOL: f64 = 1e-10;

fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

fn dense_cfg(hidden: usize, inter: usize, group: usize) -> ModelConfig {
    ModelConfig::from_json(&json!({
        "model_type": "qwen3_5",
        "text_config": {
            "vocab_size": 1000, "hidden_size": hidden, "num_hidden_layers": 4, "full_attention_interval": 4,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
            "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
            "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "intermediate_size": inter,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "eos_token_id": 1,
            "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
        },
        "quantization": {"group_size": group, "bits": 4, "mode": "affine"}
    }))
    .unwrap()
}

fn matmul(l: &Linear, x: &[f32], t: usize) -> Vec<f32> {
    let mut y = vec![0f32; t * l.rows];
    l.matmul(x, &mut y);
    y
}

/// SwiGLU MLP `down · (silu(gate·x) ⊙ up·x)` for `t` tokens.
fn mlp(gate: &Linear, up: &Linear, down: &Linear, x: &[f32], t: usize) -> Vec<f32> {
    let (g, u) = (matmul(gate, x, t), matmul(up, x, t));
    let h: Vec<f32> = g.iter().zip(&u).map(|(a, b)| silu(*a) * b).collect();
    matmul(down, &h, t)
}

/// Each rank's partial output, computed on its own thread, added in rank order.
fn all_reduce(parts: Vec<Vec<f32>>) -> Vec<f32> {
    let mut sum = vec![0f32; parts[0].len()];
    for p in &parts {
        sum.iter_mut().zip(p).for_each(|(s, v)| *s += v);
    }
    sum
}

#[test]
fn a_tensor_parallel_mlp_sums_to_the_whole() {
    let (hid, inter, t) = (128usize, 256usize, 3usize);
    let mut r = rng(71);
    for (bits, group) in [(4u32, 64usize), (8, 64), (4, 32)] {
        let (gate, up, down) = (
            quant(&mut r, inter, hid, bits, group),
            quant(&mut r, inter, hid, bits, group),
            quant(&mut r, hid, inter, bits, group),
        );
        let x = uniform(&mut r, t * hid, 1.0);
        let want = mlp(&gate, &up, &down, &x, t);
        let cfg = dense_cfg(hid, inter, group);
        for ranks in [1usize, 2, 4] {
            let shards = plan(&cfg, ranks).unwrap();
            let parts: Vec<Vec<f32>> = std::thread::scope(|s| {
                let hs: Vec<_> = shards
                    .iter()
                    .map(|sh| {
                        let (gate, up, down, x) = (&gate, &up, &down, &x);
                        s.spawn(move || {
                            let rows = sh.ffn_rows.clone();
                            let g = gate.row_range(rows.start, rows.len());
                            let u = up.row_range(rows.start, rows.len());
                            let d = down.col_range(rows.start, rows.len()).unwrap();
                            mlp(&g, &u, &d, x, t)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let got = all_reduce(parts);
            let e = nmse(&got, &want);
            eprintln!("MLP q{bits} g{group} over {ranks} ranks: nmse {e:.2e}");
            assert!(e <= TOL, "MLP q{bits} g{group} over {ranks} ranks: nmse {e:.2e}");
        }
    }
}

/// The attention output projection split by the ranks' heads (input columns), dense bf16 and
/// 4-bit: the per-rank products of each rank's heads add up to the whole projection.
#[test]
fn a_head_split_output_projection_sums_to_the_whole() {
    let cfg = dense_cfg(128, 256, 64);
    let (cols, t) = (cfg.num_attention_heads * cfg.head_dim, 5usize);
    let mut r = rng(72);
    for o in [quant(&mut r, 128, cols, 4, 64), dense(&mut r, 128, cols, FloatType::BF16)] {
        let heads = uniform(&mut r, t * cols, 1.0);
        let want = matmul(&o, &heads, t);
        for ranks in [2usize, 4] {
            let parts: Vec<Vec<f32>> = plan(&cfg, ranks)
                .unwrap()
                .iter()
                .map(|sh| {
                    let c = sh.attn_out_cols(&cfg);
                    let oc = o.col_range(c.start, c.len()).unwrap();
                    let hc: Vec<f32> = heads.chunks(cols).flat_map(|row| row[c.clone()].to_vec()).collect();
                    matmul(&oc, &hc, t)
                })
                .collect();
            let e = nmse(&all_reduce(parts), &want);
            eprintln!("o_proj over {ranks} ranks: nmse {e:.2e}");
            assert!(e <= TOL, "o_proj over {ranks} ranks: nmse {e:.2e}");
        }
    }
}

#[test]
fn column_slices_refuse_split_groups() {
    let mut r = rng(73);
    let l = quant(&mut r, 4, 256, 4, 64);
    let e = l.col_range(32, 64).err().expect("a slice through a group").to_string();
    assert!(e.contains("quantization groups of 64"), "{e}");
    assert!(l.col_range(192, 128).is_err(), "past the last column");
    assert!(l.col_range(64, 0).is_err(), "empty");
    // a whole-group slice of the codes equals the same columns of the dequantized rows
    let s = l.col_range(64, 128).unwrap();
    let (mut full, mut part) = (vec![0f32; 256], vec![0f32; 128]);
    for row in 0..4 {
        l.row_f32(row, &mut full);
        s.row_f32(row, &mut part);
        assert_eq!(&full[64..192], &part[..], "row {row}");
    }
}
