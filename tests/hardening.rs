//! No config, header or value may crash lily: every case ends in a clean error or a successful
//! run. Three parts:
//!
//! - every numeric field of the tiny MLX checkpoint's config.json, set in turn to each extreme
//!   value (0, 1, 2^31, 2^63, 2^63+4, u64::MAX, -1, 1.5, a string, null), then the real loader
//!   and a forward pass: an error or logits, never a panic, abort or hang;
//! - the crafted configs of the stress run that found the overflow defects;
//! - proptest fuzz targets for the safetensors header parser and the config parser: a few
//!   thousand cases here; `LILY_FUZZ_SECS=1800 cargo test --release --test hardening -- --ignored`
//!   runs each for that long (figures in docs/fuzzing.md).

mod common;
use common::*;
use lily::config::ModelConfig;
use lily::generate::{CpuSession, Session};
use lily::safetensors::{Bytes, SafeFile};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;

fn base_config() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("tiny-mlx4/config.json")).unwrap()).unwrap()
}

/// Paths (object keys from the root) of every number in the config.
fn numeric_paths(v: &Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match v {
        Value::Number(_) => out.push(at.clone()),
        Value::Object(o) => {
            for (k, x) in o {
                at.push(k.clone());
                numeric_paths(x, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

fn set(v: &mut Value, path: &[String], x: Value) {
    let mut cur = v;
    for k in &path[..path.len() - 1] {
        cur = &mut cur[k.as_str()];
    }
    cur[path[path.len() - 1].as_str()] = x;
}

fn extremes() -> Vec<Value> {
    vec![
        json!(0),
        json!(1),
        json!(1u64 << 31),
        json!(1u64 << 63),
        json!((1u64 << 63) + 4),
        json!(u64::MAX),
        json!(-1),
        json!(1.5),
        json!("12"),
        Value::Null,
    ]
}

/// A checkpoint directory: the fixture's files with this config.
fn with_config(dir: &Path, cfg: &Value) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    for e in std::fs::read_dir(fixtures().join("tiny-mlx4")).unwrap() {
        let p = e.unwrap().path();
        if p.file_name().unwrap() != "config.json" {
            std::os::unix::fs::symlink(&p, dir.join(p.file_name().unwrap())).unwrap();
        }
    }
    std::fs::write(dir.join("config.json"), serde_json::to_vec(cfg).unwrap()).unwrap();
}

/// Loads and runs three tokens; Ok(true) = ran, Ok(false) = a clean error, Err = a panic.
fn load_and_run(dir: &Path) -> Result<bool, String> {
    std::panic::catch_unwind(|| match lily::weights::load_model(dir) {
        Err(_) => false,
        Ok(m) => {
            let mut s = CpuSession::new(Arc::new(m));
            match s.forward_last(&[1, 2, 3]) {
                Ok(l) => {
                    assert!(!l.is_empty());
                    true
                }
                Err(_) => false,
            }
        }
    })
    .map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

#[test]
fn every_numeric_field_at_every_extreme_ends_cleanly() {
    let base = base_config();
    let mut paths = Vec::new();
    numeric_paths(&base, &mut Vec::new(), &mut paths);
    assert!(paths.len() >= 20, "only {} numeric fields found", paths.len());
    let dir = std::env::temp_dir().join(format!("lily-hardening-{}", std::process::id()));
    let mut panics = Vec::new();
    let (mut ran, mut refused) = (0, 0);
    for p in &paths {
        for x in extremes() {
            let mut c = base.clone();
            set(&mut c, p, x.clone());
            with_config(&dir, &c);
            match load_and_run(&dir) {
                Ok(true) => ran += 1,
                Ok(false) => refused += 1,
                Err(msg) => panics.push(format!("{} = {x}: {msg}", p.join("."))),
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    eprintln!("{} fields x {} values: {ran} ran, {refused} refused cleanly", paths.len(), extremes().len());
    assert!(panics.is_empty(), "panics:\n{}", panics.join("\n"));
    assert!(ran > 0 && refused > 0);
}

#[test]
fn the_stress_runs_overflow_configs_are_errors_naming_the_field() {
    let cases = [
        (vec!["text_config", "num_attention_heads"], json!((1u64 << 63) + 4), "num_attention_heads"),
        (vec!["text_config", "linear_key_head_dim"], json!(32 + (1u64 << 63)), "linear_key_head_dim"),
        (vec!["text_config", "linear_key_head_dim"], json!(32 + (1u64 << 62)), "linear_key_head_dim"),
        (vec!["text_config", "num_attention_heads"], json!(1u64 << 63), "num_attention_heads"),
    ];
    for (path, x, field) in cases {
        let mut c = base_config();
        set(&mut c, &path.iter().map(|s| s.to_string()).collect::<Vec<_>>(), x.clone());
        let e = format!("{:#}", ModelConfig::from_json(&c).unwrap_err());
        assert!(e.contains(field) && e.contains(&x.to_string()), "{field} = {x}: {e}");
    }
    // A billion layers without layer_types: refused at once, before any per-layer allocation.
    let mut c = base_config();
    c["text_config"].as_object_mut().unwrap().remove("layer_types");
    c["text_config"]["num_hidden_layers"] = json!(1_000_000_000u64);
    let t = std::time::Instant::now();
    let e = format!("{:#}", ModelConfig::from_json(&c).unwrap_err());
    assert!(e.contains("num_hidden_layers") && e.contains("at most"), "{e}");
    assert!(t.elapsed().as_secs() < 5, "the check must come before the work");
}

// ---- fuzz targets --------------------------------------------------------------------------

fn fuzz_secs() -> Option<u64> {
    std::env::var("LILY_FUZZ_SECS").ok().and_then(|s| s.parse().ok())
}

/// Runs `strategy` through `check` until `secs` have passed (or `cases` cases when None);
/// returns the number of cases run. A failing case fails the test with proptest's minimal input.
fn drive<S: Strategy>(name: &str, strategy: S, secs: Option<u64>, cases: u32, check: impl Fn(S::Value) + Copy) -> u64
where
    S::Value: std::fmt::Debug,
{
    let start = std::time::Instant::now();
    let batch = if secs.is_some() { 20_000 } else { cases };
    let mut total = 0u64;
    for round in 0u64.. {
        // A fresh runner per batch (a runner counts its successes across runs). The brief run is
        // seeded, so `cargo test` checks the same cases every time; the long one draws new seeds.
        let rng_seed = if secs.is_some() { RngSeed::Random } else { RngSeed::Fixed(0x6c69_6c79 + round) };
        let mut runner =
            TestRunner::new(Config { cases: batch, failure_persistence: None, rng_seed, ..Config::default() });
        let r = runner.run(&strategy, |v| {
            check(v);
            Ok(())
        });
        if let Err(e) = r {
            panic!("{name}: {e}");
        }
        total += batch as u64;
        match secs {
            Some(s) if start.elapsed().as_secs() < s => continue,
            _ => break,
        }
    }
    eprintln!("{name}: {total} cases in {:.0} s, no failure", start.elapsed().as_secs_f64());
    total
}

/// A safetensors file: a header from random entries (names, dtypes, shapes and offsets drawn
/// to hit the edges: zero, huge, overlapping, out of range), a random data length, sometimes
/// random bytes anywhere.
fn safetensors_input() -> impl Strategy<Value = Vec<u8>> {
    let num = prop_oneof![0u64..100, Just(u64::MAX), Just(1u64 << 63), Just(u32::MAX as u64), any::<u64>(),];
    let dtype = prop_oneof![
        Just("F32".to_string()),
        Just("BF16".to_string()),
        Just("F16".to_string()),
        Just("U32".to_string()),
        Just("I64".to_string()),
        "[A-Z0-9]{0,5}",
    ];
    let entry = (dtype, prop::collection::vec(num.clone(), 0..4), num.clone(), num.clone(), any::<u8>());
    let header = prop::collection::vec(entry, 0..5).prop_map(|es| {
        let mut m = serde_json::Map::new();
        for (i, (dt, shape, a, b, kind)) in es.into_iter().enumerate() {
            let v = match kind % 8 {
                0 => json!({"dtype": dt, "shape": shape}),
                1 => json!({"dtype": dt, "shape": shape, "data_offsets": [a]}),
                2 => json!({"dtype": 5, "shape": "x", "data_offsets": "y"}),
                3 => json!([1, 2]),
                _ => json!({"dtype": dt, "shape": shape, "data_offsets": [a, b]}),
            };
            m.insert(format!("t{i}"), v);
        }
        m.insert("__metadata__".into(), json!({"format": "pt"}));
        serde_json::to_vec(&Value::Object(m)).unwrap()
    });
    (header, 0usize..300, prop::collection::vec((any::<usize>(), any::<u8>()), 0..4), any::<u8>(), any::<u64>())
        .prop_map(|(h, data, flips, mode, n)| {
            let len = match mode % 6 {
                0 => n,                  // any header length
                1 => h.len() as u64 + 1, // off by one
                _ => h.len() as u64,
            };
            let mut b = [len.to_le_bytes().to_vec(), h, vec![0xAB; data]].concat();
            for (at, x) in flips {
                let i = at % b.len();
                b[i] = x;
            }
            if mode % 13 == 0 {
                b.truncate(n as usize % (b.len() + 1));
            }
            b
        })
}

fn check_safetensors(bytes: Vec<u8>) {
    let len = bytes.len();
    let b = Bytes::from_vec(bytes);
    if let Ok(f) = SafeFile::parse(Path::new("fuzz.safetensors"), b) {
        // Whatever parses holds tensors whose bytes lie inside the file.
        for t in f.tensors.values() {
            assert!(t.bytes.as_slice().len() <= len);
        }
    }
}

/// A config: the real one with up to four fields replaced by extreme values, removed, or
/// retyped, sometimes as text with a few bytes changed.
/// (field index, kind of value, number) replacements, then (byte index, byte) changes to the text.
type ConfigEdits = (Vec<(usize, u8, i64)>, Vec<(usize, u8)>);

fn config_input() -> impl Strategy<Value = ConfigEdits> {
    (
        prop::collection::vec((any::<usize>(), any::<u8>(), any::<i64>()), 0..5),
        prop::collection::vec((any::<usize>(), any::<u8>()), 0..3),
    )
}

fn check_config(edits: ConfigEdits) {
    thread_local! {
        static BASE: (Value, Vec<Vec<String>>) = {
            let b = base_config();
            let mut p = Vec::new();
            numeric_paths(&b, &mut Vec::new(), &mut p);
            (b, p)
        };
    }
    BASE.with(|(base, paths)| {
        let mut c = base.clone();
        for &(i, kind, n) in &edits.0 {
            let p = &paths[i % paths.len()];
            let x = match kind % 10 {
                0 => json!(n),
                1 => json!(n as u64),
                2 => json!(u64::MAX),
                3 => json!(1u64 << 63),
                4 => json!(n as f64 / 7.0),
                5 => json!(n.to_string()),
                6 => json!([n]),
                7 => json!({"x": n}),
                8 => Value::Null,
                _ => json!(n % 3),
            };
            set(&mut c, p, x);
        }
        let mut text = serde_json::to_vec(&c).unwrap();
        for &(at, x) in &edits.1 {
            let i = at % text.len();
            text[i] = x;
        }
        if let Ok(s) = std::str::from_utf8(&text) {
            if let Ok(cfg) = ModelConfig::from_json_str(s) {
                // Whatever validates has sizes that can be computed without overflow.
                let _ = (cfg.gdn_conv_dim(), cfg.q_proj_dim(), cfg.kv_dim(), cfg.vocab_size * cfg.hidden_size);
            }
        }
    })
}

#[test]
fn fuzz_safetensors_header_briefly() {
    drive("safetensors header", safetensors_input(), None, 20_000, check_safetensors);
}

#[test]
fn fuzz_config_briefly() {
    drive("config", config_input(), None, 20_000, check_config);
}

#[test]
#[ignore]
fn fuzz_safetensors_header_long() {
    drive("safetensors header", safetensors_input(), Some(fuzz_secs().unwrap_or(60)), 0, check_safetensors);
}

#[test]
#[ignore]
fn fuzz_config_long() {
    drive("config", config_input(), Some(fuzz_secs().unwrap_or(60)), 0, check_config);
}
