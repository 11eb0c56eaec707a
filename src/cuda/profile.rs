//! `LILY_CUDA_PROFILE=1`: every launch timed with a pair of device events around it (recorded in
//! the stream, read in batches, so launches still queue ahead of the GPU; graphs are off), and a
//! table printed when a session is dropped. Gaps between kernels are in no kernel's total, and a
//! kernel timed alone does not overlap its neighbour as it does under programmatic dependent
//! launch in the replayed graph, so the totals exceed the graph's step time.
//!
//! The decode step labels its ops ([`op`]: "moe.experts", "gdn.state", ...) with the bytes each
//! must move (weights read, recurrent state read and written, KV cache read); launches under a
//! label are reported per op against the time those bytes need at [`hbm_gbs`] (the measured bandwidth), the rest
//! (prefill, batched steps) per kernel.

use anyhow::{anyhow, Result};
use cudarc::driver::{result as drv, sys};
use std::cell::Cell;
use std::sync::{Mutex, OnceLock};

/// Read-only HBM bandwidth measured on the project's H200 (GB/s; ../shared/docs/performance.md,
/// "Ceilings"): what an op's bytes are priced at.
pub const HBM_READ_GBS: f64 = 4183.0;

static MEASURED_GBS: OnceLock<f64> = OnceLock::new();

/// The bandwidth the per-op tables price bytes at: this device's, as [`super::Gpu::measure_bandwidth`]
/// measured it (`lily bench` does, before any table), else [`HBM_READ_GBS`].
pub fn hbm_gbs() -> f64 {
    MEASURED_GBS.get().copied().unwrap_or(HBM_READ_GBS)
}

/// Records the measured bandwidth for [`hbm_gbs`] (the first measurement stays).
pub(super) fn note_bandwidth(gbs: f64) {
    let _ = MEASURED_GBS.set(gbs);
}

pub fn profiling() -> bool {
    static P: OnceLock<bool> = OnceLock::new();
    *P.get_or_init(|| std::env::var("LILY_CUDA_PROFILE").is_ok_and(|v| v == "1"))
}

/// Per (op label, kernel): launches and milliseconds.
type Totals = Vec<((Option<&'static str>, String), (u64, f64))>;
static TOTALS: Mutex<Totals> = Mutex::new(Vec::new());
/// Per op label: calls and bytes.
static OP_BYTES: Mutex<Vec<(&'static str, (u64, f64))>> = Mutex::new(Vec::new());

thread_local! {
    /// The op the launches of this thread belong to (None: not a labelled decode op).
    static OP: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// Labels the launches that follow (on this thread) as op `label`, which moves `bytes` bytes;
/// `None` ends the labelling. Free when neither profiling nor recording the timeline.
pub fn op(label: Option<&'static str>, bytes: usize) {
    if super::timeline::enabled() {
        super::timeline::note_op(label, bytes);
    }
    if !profiling() {
        return;
    }
    OP.with(|c| c.set(label));
    if let Some(l) = label {
        let mut b = OP_BYTES.lock().unwrap();
        match b.iter_mut().find(|e| e.0 == l) {
            Some(e) => {
                e.1 .0 += 1;
                e.1 .1 += bytes as f64;
            }
            None => b.push((l, (1, bytes as f64))),
        }
    }
}

/// An event handle waiting in the profile queue.
pub(super) struct Ev(pub(super) sys::CUevent);
// SAFETY: event handles may be used from any thread with the context current.
unsafe impl Send for Ev {}

type Pending = Vec<(Option<&'static str>, String, Ev, Ev)>;
static PENDING: Mutex<Pending> = Mutex::new(Vec::new());

/// Queues one launch's events (`t0` before, `t1` after it) under the current op.
pub(super) fn record(name: &str, t0: Ev, t1: Ev) -> Result<()> {
    let mut pending = PENDING.lock().unwrap();
    pending.push((OP.with(|c| c.get()), name.to_string(), t0, t1));
    if pending.len() >= 4096 {
        flush(&mut pending)?;
    }
    Ok(())
}

/// Waits for the queued events and adds their times to the totals.
fn flush(pending: &mut Pending) -> Result<()> {
    let mut p = TOTALS.lock().unwrap();
    for (op, name, t0, t1) in pending.drain(..) {
        // SAFETY: both events were recorded on the stream and are destroyed once, here.
        let ms = unsafe {
            drv::event::synchronize(t1.0).map_err(|e| anyhow!("{e:?}"))?;
            let ms = drv::event::elapsed(t0.0, t1.0).map_err(|e| anyhow!("{e:?}"))?;
            let _ = drv::event::destroy(t0.0);
            let _ = drv::event::destroy(t1.0);
            ms
        };
        let key = (op, name);
        match p.iter_mut().find(|e| e.0 == key) {
            Some(e) => {
                e.1 .0 += 1;
                e.1 .1 += ms as f64;
            }
            None => p.push((key, (1, ms as f64))),
        }
    }
    Ok(())
}

/// Prints and clears the totals: the labelled decode ops first (per step: µs, MB, the µs those
/// bytes need at [`hbm_gbs`], the bandwidth reached), then the unlabelled kernels.
pub fn report() {
    if let Err(e) = flush(&mut PENDING.lock().unwrap()) {
        eprintln!("LILY_CUDA_PROFILE: {e:#}");
    }
    let mut p = TOTALS.lock().unwrap();
    let mut ob = OP_BYTES.lock().unwrap();
    if !ob.is_empty() {
        eprint!("{}", op_table(&p, &ob));
    }
    let mut rest: Vec<_> = p.iter().filter(|e| e.0 .0.is_none()).collect();
    if !rest.is_empty() {
        rest.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        let total: f64 = rest.iter().map(|e| e.1 .1).sum();
        eprintln!("| kernel | launches | total ms | share | µs per launch |");
        eprintln!("|---|---:|---:|---:|---:|");
        for ((_, name), (n, ms)) in rest {
            eprintln!("| {name} | {n} | {ms:.2} | {:.1}% | {:.2} |", 100.0 * ms / total, 1000.0 * ms / *n as f64);
        }
    }
    p.clear();
    ob.clear();
}

/// The per-op table of the labelled launches; steps = the calls of the first label.
fn op_table(p: &Totals, ob: &[(&'static str, (u64, f64))]) -> String {
    let steps = ob[0].1 .0.max(1) as f64;
    let mut s = format!(
        "decode step by op ({steps} steps; each kernel timed alone; bytes priced at {:.0} GB/s)\n\
         | op | kernels (µs/step) | launches/step | µs/step | MB/step | µs at HBM rate | GB/s reached | share of time |\n\
         |---|---|---:|---:|---:|---:|---:|---:|\n",
        hbm_gbs()
    );
    let rows: Vec<(&str, String, f64, f64, f64)> = ob
        .iter()
        .map(|(l, (_, bytes))| {
            let mine: Vec<_> = p.iter().filter(|e| e.0 .0 == Some(*l)).collect();
            // each kernel with its µs a step when the op has several
            let names: Vec<String> = mine
                .iter()
                .map(|e| match mine.len() {
                    1 => e.0 .1.clone(),
                    _ => format!("{} {:.1}", e.0 .1, 1000.0 * e.1 .1 / steps),
                })
                .collect();
            let launches = mine.iter().map(|e| e.1 .0).sum::<u64>() as f64 / steps;
            let us = 1000.0 * mine.iter().map(|e| e.1 .1).sum::<f64>() / steps;
            (*l, names.join(", "), launches, us, bytes / steps)
        })
        .collect();
    let total_us: f64 = rows.iter().map(|r| r.3).sum();
    let total_b: f64 = rows.iter().map(|r| r.4).sum();
    let total_l: f64 = rows.iter().map(|r| r.2).sum();
    let line = |l: &str, k: &str, n: f64, us: f64, b: f64| {
        let need = b / (hbm_gbs() * 1e3);
        let gbs = if us > 0.0 { b / (us * 1e3) } else { 0.0 };
        format!(
            "| {l} | {k} | {n:.0} | {us:.1} | {:.2} | {need:.1} | {gbs:.0} | {:.1}% |\n",
            b / 1e6,
            100.0 * us / total_us.max(1e-9)
        )
    };
    for (l, k, n, us, b) in &rows {
        s += &line(l, k, *n, *us, *b);
    }
    s += &line("**step (sum)**", "", total_l, total_us, total_b);
    s
}

/// `LILY_CUDA_MOE_TRACE=1` (a measurement switch): the decode step's moe_fused_q launches write
/// the global timer at fixed points per block, printed after a device decode loop.
pub fn moe_tracing() -> bool {
    static P: OnceLock<bool> = OnceLock::new();
    *P.get_or_init(|| std::env::var("LILY_CUDA_MOE_TRACE").is_ok_and(|v| v == "1"))
}

/// Stamps per block of one moe_fused_q launch (kernels/gemv.cu writes slots 0-6, 8, 9).
pub const MOE_TRACE_SLOTS: usize = 16;

/// Prints the last step's moe_fused_q stamps (`[layers, sms, MOE_TRACE_SLOTS]` u64): per point,
/// µs after the launch's first block started, mean and latest over the blocks, averaged over
/// the layers; and the time from one MoE launch's last block to the next launch's first.
pub fn print_moe_trace(buf: &super::DevBuf, sms: usize, layers: usize) -> Result<()> {
    let raw = buf.read_i32(2 * MOE_TRACE_SLOTS * sms * layers)?;
    let at = |l: usize, b: usize, j: usize| {
        let i = 2 * ((l * sms + b) * MOE_TRACE_SLOTS + j);
        (raw[i] as u32 as u64) | ((raw[i + 1] as u32 as u64) << 32)
    };
    let points = [
        (0, "entry"),
        (1, "previous kernel done (pdl wait)"),
        (2, "top-k done"),
        (8, "gate/up: body start"),
        (9, "gate/up: input staged"),
        (3, "gate/up done (before arrive)"),
        (4, "down: meeting passed"),
        (5, "down: input staged"),
        (6, "end"),
    ];
    let mut sums = vec![(0.0f64, 0.0f64, 0usize); points.len()];
    let (mut between, mut nb, mut prev_end) = (0.0, 0usize, None::<u64>);
    for l in 0..layers {
        let blocks: Vec<usize> = (0..sms).filter(|&b| at(l, b, 0) != 0).collect();
        let Some(t0) = blocks.iter().map(|&b| at(l, b, 0)).min() else { continue };
        for (k, &(j, _)) in points.iter().enumerate() {
            let v: Vec<f64> =
                blocks.iter().filter(|&&b| at(l, b, j) != 0).map(|&b| (at(l, b, j) - t0) as f64 / 1e3).collect();
            if v.is_empty() {
                continue;
            }
            sums[k].0 += v.iter().sum::<f64>() / v.len() as f64;
            sums[k].1 += v.iter().cloned().fold(f64::MIN, f64::max);
            sums[k].2 += 1;
        }
        if let Some(p) = prev_end {
            between += t0.saturating_sub(p) as f64 / 1e3;
            nb += 1;
        }
        prev_end = blocks.iter().map(|&b| at(l, b, 6)).max();
    }
    eprintln!("MoE launch trace (moe_fused_q or _q2), last step, µs after the launch's first block (means over the MoE layers)");
    eprintln!("| point | mean over blocks | latest block |");
    eprintln!("|---|---:|---:|");
    for (k, &(_, name)) in points.iter().enumerate() {
        let (m, x, n) = sums[k];
        if n > 0 {
            eprintln!("| {name} | {:.2} | {:.2} |", m / n as f64, x / n as f64);
        }
    }
    if nb > 0 {
        eprintln!(
            "| last block's end to the next launch's first block (the layer between) | {:.2} | |",
            between / nb as f64
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_table_prices_bytes_per_step() {
        // 2 steps: "embed" twice (one launch each, 0.004 ms), "moe" twice over two kernels.
        let p: Totals = vec![
            ((Some("embed"), "embed_row".into()), (2, 0.004)),
            ((Some("moe"), "a".into()), (2, 0.040)),
            ((Some("moe"), "b".into()), (2, 0.020)),
            ((None, "gemm".into()), (1, 5.0)),
        ];
        // moe: 2 x 41.83 MB -> 41.83 MB a step, 10 µs at 4,183 GB/s; 30 µs a step measured.
        let ob = [("embed", (2, 0.0)), ("moe", (2, 2.0 * 41.83e6))];
        let t = op_table(&p, &ob);
        assert!(t.contains("(2 steps;"), "{t}");
        assert!(t.contains("| moe | a 20.0, b 10.0 | 2 | 30.0 | 41.83 | 10.0 | 1394 | 93.8% |"), "{t}");
        assert!(t.contains("| embed | embed_row | 1 | 2.0 | 0.00 | 0.0 | 0 | 6.2% |"), "{t}");
        assert!(t.contains("| **step (sum)** |  | 3 | 32.0 | 41.83 | 10.0 | 1307 | 100.0% |"), "{t}");
        assert!(!t.contains("gemm"), "unlabelled kernels stay out of the op table: {t}");
    }
}
