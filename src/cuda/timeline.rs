//! `LILY_CUDA_TIMELINE=1` (a measurement build): the decode step's timeline, kernel by kernel,
//! inside the replayed graph.
//!
//! The kernels are compiled with `LILY_TIMELINE` defined (a separate entry of the kernel cache;
//! the GPU machine compiles it with NVRTC on first use), so each decode kernel opening with
//! `TL_SCOPE(name)` (kernels/common.cuh) appends one record per block when the block's thread 0
//! returns: entry and return times (the global timer, ns), the launch's `%gridid`, and the
//! kernel name's fnv1a32, SM and block index. [`Timeline::reset`] empties the buffer;
//! [`Timeline::print_last_step`] groups the records into launches (by grid id), splits them
//! into steps at `embed_row`, and prints the last whole step: per launch when its first block
//! entered, when its last block returned, and its cost in the step (its last return minus the
//! previous launch's), then the same costs summed per kernel.
//!
//! The host side notes the step's launches in the order it queues them, each under the op
//! label the decode step gives it ([`super::profile::op`]: "moe.experts", "gdn.state", ... with
//! the bytes the op must move), from [`begin_step`] (the start of the step's recording: its
//! graph capture, or each eager step) on. Matched in order with the recorded launches, they give
//! the per-op table: cost in the step against the time the op's bytes need at the HBM rate.
//!
//! The times are those of blocks, not of the work a block waits for: a launch's blocks enter
//! as SMs free up (programmatic dependent launch lets them in before the previous launch ends,
//! where registers and shared memory allow) and then wait in `griddepcontrol.wait`.

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{result as drv, sys};
use std::collections::HashMap;
use std::ffi::CString;
use std::sync::Mutex;

/// Whether `LILY_CUDA_TIMELINE=1` asks for the timeline build.
pub fn enabled() -> bool {
    static P: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *P.get_or_init(|| std::env::var("LILY_CUDA_TIMELINE").is_ok_and(|v| v == "1"))
}

/// Records the buffer holds (32 bytes each): ~20 steps of the 35B model's ~55,000 blocks.
const CAP: usize = 1 << 20;

/// The record buffer and the module's counter.
pub struct Timeline {
    buf: sys::CUdeviceptr,
    count: sys::CUdeviceptr,
}

/// The step's launches as the host queued them: (kernel name hash, index of its op in `ops`),
/// and the ops (label, bytes).
struct Seq {
    launches: Vec<(u32, Option<usize>)>,
    ops: Vec<(&'static str, usize)>,
    cur: Option<usize>,
}
static SEQ: Mutex<Seq> = Mutex::new(Seq { launches: Vec::new(), ops: Vec::new(), cur: None });

/// A decode step's recording begins: forget the launches noted before.
pub fn begin_step() {
    let mut s = SEQ.lock().unwrap();
    s.launches.clear();
    s.ops.clear();
    s.cur = None;
}

/// The launches that follow belong to op `label` (moving `bytes`); `None`: to no op.
pub fn note_op(label: Option<&'static str>, bytes: usize) {
    let mut s = SEQ.lock().unwrap();
    s.cur = label.map(|l| {
        s.ops.push((l, bytes));
        s.ops.len() - 1
    });
}

/// Kernel `name` was queued.
pub fn note_launch(name: &str) {
    let mut s = SEQ.lock().unwrap();
    let cur = s.cur;
    s.launches.push((tl_hash(name), cur));
}

/// fnv1a32, as `tl_hash` in kernels/common.cuh.
fn tl_hash(s: &str) -> u32 {
    s.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ b as u32).wrapping_mul(0x0100_0193))
}

fn global(module: sys::CUmodule, name: &str) -> Result<sys::CUdeviceptr> {
    // SAFETY: module is loaded; the name is NUL-free.
    let (p, _) = unsafe { drv::module::get_global(module, CString::new(name).unwrap()) }
        .map_err(|e| anyhow!("timeline build: module global {name}: {e:?}"))?;
    Ok(p)
}

impl Timeline {
    /// Allocates the buffer and points the module's `lily_tl_buf` / `lily_tl_cap` at it.
    pub fn new(module: sys::CUmodule) -> Result<Timeline> {
        // SAFETY: a plain device allocation, kept for the process's life.
        let buf = unsafe { drv::malloc_sync(32 * CAP) }.map_err(|e| anyhow!("timeline buffer: {e:?}"))?;
        let (pb, pc, pn) =
            (global(module, "lily_tl_buf")?, global(module, "lily_tl_cap")?, global(module, "lily_tl_n")?);
        // SAFETY: the globals are a pointer and two u32s in the loaded module.
        unsafe {
            drv::memcpy_htod_sync(pb, &[buf])?;
            drv::memcpy_htod_sync(pc, &[CAP as u32])?;
            drv::memcpy_htod_sync(pn, &[0u32])?;
        }
        Ok(Timeline { buf, count: pn })
    }

    /// Empties the buffer (synchronous: call between steps).
    pub fn reset(&self) -> Result<()> {
        // SAFETY: the counter is a u32 global of the loaded module.
        unsafe { drv::memcpy_htod_sync(self.count, &[0u32]) }.map_err(|e| anyhow!("{e:?}"))
    }

    fn records(&self) -> Result<(Vec<[u64; 4]>, bool)> {
        let mut n = [0u32];
        // SAFETY: as in reset; then the first min(n, CAP) records of the buffer.
        unsafe { drv::memcpy_dtoh_sync(&mut n, self.count) }.map_err(|e| anyhow!("{e:?}"))?;
        let k = (n[0] as usize).min(CAP);
        let mut v = vec![0u64; 4 * k];
        unsafe { drv::memcpy_dtoh_sync(&mut v, self.buf) }.map_err(|e| anyhow!("{e:?}"))?;
        Ok((v.chunks_exact(4).map(|r| [r[0], r[1], r[2], r[3]]).collect(), n[0] as usize > CAP))
    }

    /// Prints the last whole step in the buffer (see the module doc); `names` are the kernel
    /// names to recognise.
    pub fn print_last_step(&self, names: &[&str]) -> Result<()> {
        let (recs, overflowed) = self.records()?;
        let by_hash: HashMap<u32, &str> = names.iter().map(|n| (tl_hash(n), *n)).collect();
        let launches = group(&recs);
        let (a, b) = last_step(&launches, overflowed, tl_hash("embed_row"))?;
        print_step(&launches[a..b], &by_hash);
        let seq = SEQ.lock().unwrap();
        match op_of(&launches[a..b], &seq.launches) {
            Some(ops) => print_ops(&launches[a..b], &ops, &seq.ops),
            None => eprintln!("(the step's launches do not match the host's queue: no per-op table)"),
        }
        Ok(())
    }
}

/// The launches `[a, b)` of the last step the buffer holds whole: steps start at the launches
/// of `embed` (the step's first kernel); when the buffer overflowed, the last one is cut short.
fn last_step(launches: &[Launch], overflowed: bool, embed: u32) -> Result<(usize, usize)> {
    let starts: Vec<usize> = (0..launches.len()).filter(|&i| launches[i].tag == embed).collect();
    Ok(match (starts.len(), overflowed) {
        (0, _) => bail!("timeline: no embed_row launch among {} launches", launches.len()),
        (1, true) => bail!("timeline: the buffer filled within one step"),
        (n, true) => (starts[n - 2], starts[n - 1]),
        (n, false) => (starts[n - 1], launches.len()),
    })
}

/// One launch: its kernel's hash, blocks, SMs, first entry, last entry and last return (ns).
struct Launch {
    tag: u32,
    blocks: usize,
    sms: usize,
    first_in: u64,
    last_in: u64,
    last_out: u64,
    /// the median block's return
    mid_out: u64,
}

/// A gap between two blocks' entries (ns) that no launch has inside it but consecutive steps
/// do: records with one grid id split there, in case a replayed graph's kernel nodes keep their
/// grid ids from one replay to the next.
const STEP_GAP: u64 = 500_000;

fn group(recs: &[[u64; 4]]) -> Vec<Launch> {
    let mut by_grid: HashMap<u64, Vec<&[u64; 4]>> = HashMap::new();
    for r in recs {
        by_grid.entry(r[2]).or_default().push(r);
    }
    let mut out: Vec<Launch> = Vec::new();
    for mut rs in by_grid.into_values() {
        rs.sort_by_key(|r| r[0]);
        let mut start = 0;
        for i in 1..=rs.len() {
            if i == rs.len() || rs[i][0] - rs[i - 1][0] > STEP_GAP {
                out.push(launch(&rs[start..i]));
                start = i;
            }
        }
    }
    out.sort_by_key(|l| (l.first_in, l.last_out));
    out
}

fn launch(rs: &[&[u64; 4]]) -> Launch {
    let mut outs: Vec<u64> = rs.iter().map(|r| r[1]).collect();
    outs.sort_unstable();
    let mut sms: Vec<u64> = rs.iter().map(|r| (r[3] >> 24) & 0xff).collect();
    sms.sort_unstable();
    sms.dedup();
    Launch {
        tag: (rs[0][3] >> 32) as u32,
        blocks: rs.len(),
        sms: sms.len(),
        first_in: rs.iter().map(|r| r[0]).min().unwrap(),
        last_in: rs.iter().map(|r| r[0]).max().unwrap(),
        last_out: *outs.last().unwrap(),
        mid_out: outs[outs.len() / 2],
    }
}

/// Each recorded launch's op: the host's queue `seq` walked in order beside `ls` (the host's
/// launches of kernels without a `TL_SCOPE` are skipped). None if they do not line up.
fn op_of(ls: &[Launch], seq: &[(u32, Option<usize>)]) -> Option<Vec<Option<usize>>> {
    let mut out = Vec::with_capacity(ls.len());
    let mut q = seq.iter();
    for l in ls {
        let &(_, op) = q.find(|(h, _)| *h == l.tag)?;
        out.push(op);
    }
    Some(out)
}

/// Each launch's cost in the step (µs): its last return minus the latest return before it.
fn costs(ls: &[Launch]) -> Vec<f64> {
    let mut prev = ls.first().map_or(0, |l| l.first_in);
    ls.iter()
        .map(|l| {
            let c = l.last_out.saturating_sub(prev) as f64 / 1e3;
            prev = prev.max(l.last_out);
            c
        })
        .collect()
}

/// Per op label: launches, summed cost in the step, the ops' bytes and the time they need at
/// [`super::profile::hbm_gbs`]; then the step's total against its bytes.
fn print_ops(ls: &[Launch], op: &[Option<usize>], ops: &[(&'static str, usize)]) {
    let mut rows: Vec<(&str, usize, f64, f64)> = Vec::new(); // label, launches, cost µs, bytes
    let mut seen = vec![false; ops.len()];
    for (&cost, o) in costs(ls).iter().zip(op) {
        let (label, bytes) = match o {
            Some(i) if !std::mem::replace(&mut seen[*i], true) => (ops[*i].0, ops[*i].1 as f64),
            Some(i) => (ops[*i].0, 0.0),
            None => ("(no op)", 0.0),
        };
        match rows.iter_mut().find(|r| r.0 == label) {
            Some(r) => {
                r.1 += 1;
                r.2 += cost;
                r.3 += bytes;
            }
            None => rows.push((label, 1, cost, bytes)),
        }
    }
    let gbs = super::profile::hbm_gbs();
    eprintln!("per op (cost in the replayed step; bytes at {gbs:.0} GB/s)");
    eprintln!("| op | launches | µs | MB | µs at HBM rate | GB/s reached |");
    eprintln!("|---|---:|---:|---:|---:|---:|");
    let (mut tc, mut tb) = (0.0, 0.0);
    for (label, n, cost, bytes) in &rows {
        tc += cost;
        tb += bytes;
        let need = bytes / (gbs * 1e3);
        eprintln!(
            "| {label} | {n} | {cost:.1} | {:.1} | {need:.1} | {:.0} |",
            bytes / 1e6,
            bytes / (cost * 1e3).max(1e-9)
        );
    }
    eprintln!(
        "| **step** | {} | {tc:.1} | {:.1} | {:.1} | {:.0} = {:.1}% of {gbs:.0} |",
        ls.len(),
        tb / 1e6,
        tb / (gbs * 1e3),
        tb / (tc * 1e3).max(1e-9),
        100.0 * tb / (tc * 1e3).max(1e-9) / gbs
    );
}

fn print_step(ls: &[Launch], by_hash: &HashMap<u32, &str>) {
    let name = |t: u32| by_hash.get(&t).copied().unwrap_or("?");
    let t0 = ls[0].first_in;
    let us = |t: u64| t.saturating_sub(t0) as f64 / 1e3;
    let end = ls.iter().map(|l| l.last_out).max().unwrap_or(t0);
    eprintln!(
        "decode step timeline ({} launches, {:.1} µs from the first block's entry to the last return)",
        ls.len(),
        us(end)
    );
    eprintln!("| # | kernel | blocks | SMs | first in | last in | median out | last out | cost in step |");
    eprintln!("|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut per: Vec<(&str, usize, f64, f64)> = Vec::new();
    for (i, (l, &cost)) in ls.iter().zip(&costs(ls)).enumerate() {
        let tail = l.last_out.saturating_sub(l.mid_out) as f64 / 1e3;
        eprintln!(
            "| {i} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            name(l.tag),
            l.blocks,
            l.sms,
            us(l.first_in),
            us(l.last_in),
            us(l.mid_out),
            us(l.last_out),
            cost
        );
        match per.iter_mut().find(|p| p.0 == name(l.tag)) {
            Some(p) => {
                p.1 += 1;
                p.2 += cost;
                p.3 += tail;
            }
            None => per.push((name(l.tag), 1, cost, tail)),
        }
    }
    eprintln!("per kernel: launches, summed cost in the step (µs), summed tail (last return minus the median block's)");
    eprintln!("| kernel | launches | cost µs | per launch | tail µs |");
    eprintln!("|---|---:|---:|---:|---:|");
    per.sort_by(|a, b| b.2.total_cmp(&a.2));
    for (n, c, cost, tail) in per {
        eprintln!("| {n} | {c} | {cost:.1} | {:.2} | {tail:.1} |", cost / c as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_fnv1a32() {
        // the published FNV-1a 32-bit test vectors
        assert_eq!(tl_hash(""), 0x811c_9dc5);
        assert_eq!(tl_hash("a"), 0xe40c_292c);
        assert_eq!(tl_hash("foobar"), 0xbf9c_f968);
    }

    /// The host's queue lined up with the recorded launches: unscoped kernels skipped, each
    /// launch given its op; a recorded launch the queue lacks gives none.
    #[test]
    fn launches_take_their_ops_in_queue_order() {
        let (e, k, n) = (tl_hash("embed_row"), tl_hash("gemv_q2"), tl_hash("rms_norm"));
        let l = |tag| Launch { tag, blocks: 1, sms: 1, first_in: 0, last_in: 0, last_out: 0, mid_out: 0 };
        let ls = [l(e), l(k), l(k)];
        let seq = [(e, Some(0)), (n, None), (k, Some(1)), (n, Some(2)), (k, Some(2))];
        assert_eq!(op_of(&ls, &seq), Some(vec![Some(0), Some(1), Some(2)]));
        assert_eq!(op_of(&ls, &seq[..3]), None);
    }

    /// Records of two steps (embed, a kernel of 2 blocks on 2 SMs, a kernel of 1 block), given
    /// out of order: grouped by grid id (and, where a grid id repeats, by the gap between
    /// steps) into launches in entry order, the last step found.
    #[test]
    fn groups_launches_and_finds_the_last_step() {
        let (e, k) = (tl_hash("embed_row"), tl_hash("gemv_q2"));
        let rec =
            |t0: u64, t1: u64, grid: u64, tag: u32, sm: u64, b: u64| [t0, t1, grid, (tag as u64) << 32 | sm << 24 | b];
        for reuse in [false, true] {
            let mut recs = vec![];
            // the second step 1 ms later, once with new grid ids and once reusing the first's
            for (s, base) in [(0u64, 1_000u64), (1, 1_001_000)] {
                let g = if reuse { 0 } else { 10 * s };
                recs.push(rec(base + 500, base + 900, g + 2, k, 1, 0));
                recs.push(rec(base, base + 100, g + 1, e, 0, 0));
                recs.push(rec(base + 200, base + 700, g + 2, k, 0, 1));
                recs.push(rec(base + 800, base + 1_200, g + 3, k, 3, 0));
            }
            let ls = group(&recs);
            assert_eq!(ls.len(), 6);
            let (a, b) = last_step(&ls, false, e).unwrap();
            assert_eq!((a, b), (3, 6));
            let l = &ls[4];
            assert_eq!((l.blocks, l.sms, l.first_in, l.last_in, l.last_out), (2, 2, 1_001_200, 1_001_500, 1_001_900));
            // overflowed: the last step may be cut, so the one before it
            assert_eq!(last_step(&ls, true, e).unwrap(), (0, 3));
            assert!(last_step(&ls[1..3], false, e).is_err());
        }
    }
}
