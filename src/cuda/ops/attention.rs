//! The attention wrappers: q/k norm + RoPE into the KV cache (`attn_prep`), decode attention
//! (per-head or GQA-packed split-K, then `attn_combine`), causal prefill attention, and the KV
//! cache element type every one of them is launched for (kernels/attention*.cu).

use super::super::params::{
    AttnCombineParams, AttnDecFoldParams, AttnDecodeParams, AttnGqaParams, AttnPrefillParams, AttnPrepParams, In, Out,
    TmaMap,
};
use super::super::Gpu;
use super::{blocks, Precision};
use anyhow::{bail, Result};
use std::sync::OnceLock;

impl Gpu {
    /// Causal attention of t new tokens (queries `q: [t, H_q, D]`, K/V already in the caches at
    /// positions pos0.., pos0 read from the device) with the output gate read from `qg` rows of
    /// stride ldg; out `[t, H_q·D]`. fp32 SIMT, or bf16 tensor cores: the flash kernel
    /// ([`PrefillAttn::default_for`]). `kv_bytes`: the K (and V) cache's allocation (the TMA
    /// kernel's maps span it).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prefill(
        &self,
        prec: Precision,
        q: u64,
        kc: u64,
        vc: u64,
        qg: (u64, usize),
        out: u64,
        dims: (usize, usize, usize),
        t: usize,
        pos0: u64,
        gated: bool,
        (kv, kv_bytes): (KvDtype, usize),
    ) -> Result<()> {
        let k = PrefillAttn::default_for(prec, kv, dims.2, self.smem_optin_max, self.arch == "sm_90a");
        self.attn_prefill_with(k, q, kc, vc, qg, out, dims, t, pos0, gated, (kv, kv_bytes))
    }

    /// [`Gpu::attn_prefill`] on a chosen kernel (the kernel tests run each of them).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prefill_with(
        &self,
        k: PrefillAttn,
        q: u64,
        kc: u64,
        vc: u64,
        (qg, ldg): (u64, usize),
        out: u64,
        dims: (usize, usize, usize),
        t: usize,
        pos0: u64,
        gated: bool,
        (kv, kv_bytes): (KvDtype, usize),
    ) -> Result<()> {
        let (nh, hkv, hd) = dims;
        if !hd.is_multiple_of(32) || hd > 256 || !nh.is_multiple_of(hkv) {
            bail!("attn_prefill: head dim {hd} / heads {nh}:{hkv} unsupported");
        }
        let g = nh / hkv;
        let flash = matches!(k, PrefillAttn::Flash | PrefillAttn::FlashWg);
        let fp8 = kv == KvDtype::Fp8;
        if fp8 && k != PrefillAttn::Flash {
            bail!("attn_prefill: an fp8 KV cache is read by the flash kernel only (asked for {k:?})");
        }
        if flash
            && (kv == KvDtype::F32
                || ![64, 128, 256].contains(&hd)
                || super::super::fa_smem_kv(hd, kv) > self.smem_optin_max)
        {
            bail!(
                "attn_prefill: the flash kernels need a bf16 or fp8 cache and head dim 64/128/256 (got {kv:?}, {hd})"
            );
        }
        if k == PrefillAttn::FlashWg && self.arch != "sm_90a" {
            bail!("attn_prefill: the wgmma kernels need an sm_90a device (this one is {})", self.arch);
        }
        let (name, grid, block, shared) = match (k, kv) {
            _ if flash => {
                let (name, smem) = match k {
                    PrefillAttn::Flash => (super::super::fa_kernel(hd, fp8), super::super::fa_smem_kv(hd, kv)),
                    _ => (super::super::wg_attn_kernel(hd), super::super::wg_attn_smem(hd)),
                };
                (name, blocks(t * g, 128), 256, smem)
            }
            (_, KvDtype::Fp8) => unreachable!("checked above: fp8 takes the flash kernel"),
            (PrefillAttn::Simt, KvDtype::F32) => ("attn_prefill", blocks(t * g, 8), 256, 0),
            (PrefillAttn::Simt, KvDtype::Bf16) => ("attn_prefill_bf16", blocks(t * g, 8), 256, 0),
            (_, KvDtype::F32) => ("attn_prefill_tc", blocks(t * g, 64), 128, 0),
            (_, KvDtype::Bf16) => ("attn_prefill_tc_bf16", blocks(t * g, 64), 128, 0),
        };
        let mut a = AttnPrefillParams {
            q: In::new(q),
            kc: In::new(kc),
            vc: In::new(vc),
            qg: In::new(qg),
            ldg: ldg as i64,
            out: Out::new(out),
            nh: nh as i32,
            hkv: hkv as i32,
            hd: hd as i32,
            T: t as i32,
            pos_p: In::new(pos0),
            scale: 1.0 / (hd as f32).sqrt(),
            gated: gated as i32,
            km: TmaMap::NONE,
            vm: TmaMap::NONE,
        };
        if k == PrefillAttn::FlashWg {
            // the caches as bf16 [positions][H_kv·D], boxes of 64 columns x 64 keys, 128-byte swizzle
            let rows = kv_bytes / (hkv * hd * 2);
            a.km = super::tma_map(kc, true, hkv * hd, rows, (64, 64), true)?;
            a.vm = super::tma_map(vc, true, hkv * hd, rows, (64, 64), true)?;
        }
        self.launch_params(name, (grid, hkv as u32, 1), block, shared as u32, &a)
    }

    /// q/k RMSNorm + partial RoPE for `t` tokens at positions `pos`.. (inputs in rows of stride
    /// `ld`); writes the queries and the cache rows.
    pub fn attn_prep(&self, p: &AttnPrep, t: usize, ld: usize) -> Result<()> {
        self.attn_prep_rows(p, t, ld, 0)
    }

    /// [`Gpu::attn_prep`] for `t` rows of different sequences when `kvt` (a device table `[2t]`
    /// of the rows' K and V cache addresses) is not 0: row r at position `pos[r]` into its own
    /// cache (`p.kc`/`p.vc` unused).
    pub fn attn_prep_rows(&self, p: &AttnPrep, t: usize, ld: usize, kvt: u64) -> Result<()> {
        if !p.hd.is_multiple_of(32) || p.hd > 256 || p.rot > p.hd {
            bail!("attention: head dim {} unsupported (multiple of 32, at most 256)", p.hd);
        }
        let a = AttnPrepParams {
            qg: In::new(p.qg),
            kin: In::new(p.k),
            vin: In::new(p.v),
            qn: In::new(p.q_norm),
            kn: In::new(p.k_norm),
            q_out: Out::new(p.q_out),
            kc: Out::new(p.kc),
            vc: Out::new(p.vc),
            nh: p.nh as i32,
            hkv: p.hkv as i32,
            hd: p.hd as i32,
            gated: p.gated as i32,
            rot: p.rot as i32,
            pos_p: In::new(p.pos),
            theta: p.theta,
            eps: p.eps,
            ld: ld as i64,
            kvt: In::new(kvt),
            early: p.early as i32,
        };
        let name = match p.kv {
            KvDtype::F32 => "attn_prep",
            KvDtype::Bf16 => "attn_prep_bf16",
            KvDtype::Fp8 => "attn_prep_fp8",
        };
        self.launch_params(name, ((p.nh + p.hkv) as u32, t as u32, 1), p.hd as u32, 0, &a)
    }

    /// Attention of one query token over `pos + 1` cached positions (`pos`: device i32), split
    /// over `splits` blocks per head (per KV head for the packed kernel; partials in `part`:
    /// `[H_q, splits, D + 2]` f32), merged by `attn_combine`, which also applies the output gate.
    pub fn attn_decode(&self, a: &AttnDecode, kernel: AttnKernel) -> Result<()> {
        self.attn_decode_rows(a, kernel, &AttnRows { rows: 1, kvt: 0, ldqg: 0 })
    }

    /// [`Gpu::attn_decode`] for `r.rows` tokens of different sequences (see [`AttnRows`]); `a.q`,
    /// `a.qg`, `a.out`, `a.part` are the first row's, `a.pos` the rows' positions, `a.kc`/`a.vc`
    /// unused when `r.kvt` is not 0.
    pub fn attn_decode_rows(&self, a: &AttnDecode, kernel: AttnKernel, r: &AttnRows) -> Result<()> {
        let (nh, hkv, hd) = (a.nh, a.hkv, a.hd);
        if hkv == 0 || !nh.is_multiple_of(hkv) || !hd.is_multiple_of(32) || hd > 256 || !(1..=1024).contains(&a.splits)
        {
            bail!("attention decode: heads {nh}:{hkv}, head dim {hd}, {} splits unsupported", a.splits);
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let packed = match (kernel, nh / hkv) {
            (AttnKernel::Packed | AttnKernel::Tc, g @ (1 | 2 | 4 | 8)) => Some(g),
            (AttnKernel::Packed | AttnKernel::Tc, _) => {
                bail!("attention decode: packed kernel needs H_q/H_kv in 1,2,4,8")
            }
            _ => None,
        };
        // The per-head kernels take both head counts; the packed ones (one block per KV head) H_kv.
        let bf16 = a.kv == KvDtype::Bf16;
        let tc = kernel == AttnKernel::Tc && self.attn_tc_applies(nh, hkv, hd, a.kv);
        if a.kv == KvDtype::Fp8 && !tc {
            bail!("attention decode: an fp8 KV cache is read by the tensor-core kernel only ({kernel:?}, {nh}:{hkv} heads, dim {hd})");
        }
        let rows = r.rows.max(1) as u32;
        let (q, kc, vc, part) = (In::new(a.q), In::new(a.kc), In::new(a.vc), Out::new(a.part));
        let (pos_p, kvt) = (In::new(a.pos), In::new(r.kvt));
        let early = a.early as i32;
        let gqa = AttnGqaParams { q, kc, vc, part, hkv: hkv as i32, hd: hd as i32, pos_p, scale, kvt, early };
        match packed {
            Some(_) if tc => {
                let grid = (hkv as u32, a.splits as u32, rows);
                let fp8 = a.kv == KvDtype::Fp8;
                let name = super::super::attn_dec_kernel(hd, fp8);
                self.launch_params(name, grid, 128, super::super::attn_dec_smem(hd, fp8) as u32, &gqa)?;
            }
            Some(g) => {
                let names = if bf16 {
                    ["attn_decode_gqa1_bf16", "attn_decode_gqa2_bf16", "attn_decode_gqa4_bf16", "attn_decode_gqa8_bf16"]
                } else {
                    ["attn_decode_gqa1", "attn_decode_gqa2", "attn_decode_gqa4", "attn_decode_gqa8"]
                };
                let grid = (hkv as u32, a.splits as u32, rows);
                self.launch_params(names[g.trailing_zeros() as usize], grid, 256, 0, &gqa)?;
            }
            None => {
                let p = AttnDecodeParams {
                    q,
                    kc,
                    vc,
                    part,
                    nh: nh as i32,
                    hkv: hkv as i32,
                    hd: hd as i32,
                    pos_p,
                    scale,
                    kvt,
                };
                let name = if bf16 { "attn_decode_bf16" } else { "attn_decode" };
                self.launch_params(name, (nh as u32, a.splits as u32, rows), 256, 0, &p)?;
            }
        }
        self.attn_combine(a, r)
    }

    /// attn_combine over the decode kernels' partials in `a.part`.
    fn attn_combine(&self, a: &AttnDecode, r: &AttnRows) -> Result<()> {
        let rows = r.rows.max(1) as u32;
        let c = AttnCombineParams {
            part: In::new(a.part),
            qg: In::new(a.qg),
            out: Out::new(a.out),
            nh: a.nh as i32,
            hd: a.hd as i32,
            S: a.splits as i32,
            gated: a.gated as i32,
            ldqg: r.ldqg as i64,
        };
        // attn_combine_ds: each head's dims over hd / 32 blocks of 256 threads (the default since
        // session 41, where hd is a multiple of 32); `LILY_CUDA_COMBINE=block`: attn_combine, a
        // head per block of 1024 threads. The same arithmetic in other orders of the sums.
        static FORM: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let form = FORM.get_or_init(|| std::env::var("LILY_CUDA_COMBINE").unwrap_or_default());
        match form.as_str() {
            "block" => self.launch_params("attn_combine", (a.nh as u32, 1, rows), 1024, 0, &c),
            _ if a.hd.is_multiple_of(32) => {
                self.launch_params("attn_combine_ds", (a.nh as u32, (a.hd / 32) as u32, rows), 256, 0, &c)
            }
            _ => self.launch_params("attn_combine", (a.nh as u32, 1, rows), 1024, 0, &c),
        }
    }

    /// [`Gpu::attn_decode`] on [`AttnKernel::Tc`] over a bf16 cache with attn_combine's merge in
    /// the decode launch's tail (`attn_decode_tc{D}_fold`, `LILY_CUDA_COMBINE=fold`): the last
    /// blocks of each KV head to finish merge its splits into `a.out`, one launch fewer. `ctr`:
    /// `a.hkv` u64 counters, zeroed once, used by these launches alone (the kernels keep them
    /// consistent across launches of any split count). Needs [`Gpu::attn_fold_applies`].
    pub fn attn_decode_fold(&self, a: &AttnDecode, ctr: u64) -> Result<()> {
        if a.kv != KvDtype::Bf16 || !self.attn_fold_applies(a.nh, a.hkv, a.hd, a.splits) {
            bail!(
                "attention decode with the merge inside: needs a bf16 cache, 8 query heads per KV head of dim 64, 128 or 256 and at most one block an SM ({}:{} heads, dim {}, {} splits, {:?} cache)",
                a.nh, a.hkv, a.hd, a.splits, a.kv
            );
        }
        let p = AttnDecFoldParams {
            q: In::new(a.q),
            kc: In::new(a.kc),
            vc: In::new(a.vc),
            part: Out::new(a.part),
            hkv: a.hkv as i32,
            pos_p: In::new(a.pos),
            scale: 1.0 / (a.hd as f32).sqrt(),
            early: a.early as i32,
            qg: In::new(a.qg),
            out: Out::new(a.out),
            gated: a.gated as i32,
            ctr: Out::new(ctr),
        };
        let name = super::super::attn_dec_fold_kernel(a.hd);
        let smem = super::super::attn_dec_smem(a.hd, false) as u32;
        self.launch_params(name, (a.hkv as u32, a.splits as u32, 1), 128, smem, &p)
    }

    /// Whether [`Gpu::attn_decode_fold`] takes these heads and splits: where the tensor-core
    /// kernel applies to a bf16 cache, with every block resident at once (H_kv x splits at most
    /// the SMs: its mergers wait for the other blocks of their KV head).
    pub fn attn_fold_applies(&self, nh: usize, hkv: usize, hd: usize, splits: usize) -> bool {
        self.attn_tc_applies(nh, hkv, hd, KvDtype::Bf16)
            && (1..=1024).contains(&splits)
            && hkv * splits <= self.sms as usize
    }

    /// The decode attention kernels this device uses for these heads and cache: (kernel,
    /// splits) below and from a number of cached positions, and that number. The per-head
    /// kernel (32 splits per query head; many small blocks, quick at short context) up to a
    /// switch, then the GQA-packed kernel with about one block per SM (K/V read once instead of
    /// G times): on tensor cores where it applies ([`Gpu::attn_tc_applies`]; from 2,048
    /// positions), else the fp32-FMA one (from 8,192). `LILY_CUDA_ATTN=head|packed|tc` uses one
    /// kernel throughout, `LILY_CUDA_ATTN_TC=0` keeps the packed kernel off the tensor cores,
    /// `LILY_CUDA_ATTN_PACKED_FROM=N` moves the switch.
    pub fn attn_plan(&self, nh: usize, hkv: usize, hd: usize, kv: KvDtype) -> AttnPlan {
        let head = (AttnKernel::PerHead, 32);
        if hkv == 0 || !nh.is_multiple_of(hkv) || !matches!(nh / hkv, 1 | 2 | 4 | 8) {
            return (head, head, usize::MAX);
        }
        let splits = (self.sms as usize / hkv).clamp(1, 1024);
        if kv == KvDtype::Fp8 {
            // An fp8 cache has only the tensor-core kernel. It fits two blocks per SM
            // (kernel_names.rs, attn_dec_smem): one split per SM and KV head up to
            // `LILY_CUDA_FP8_LONG_FROM` positions (default 65,536), then
            // `LILY_CUDA_FP8_SPLITS_PER_SM` (default 2). Measured (perf log, session 26): one per
            // SM is 2% faster at 4K and 32K, two are 9% faster at 128K.
            let var = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
            let per_sm = var("LILY_CUDA_FP8_SPLITS_PER_SM", 2).clamp(1, 8);
            let long = (AttnKernel::Tc, (per_sm * self.sms as usize / hkv).clamp(1, 1024));
            return ((AttnKernel::Tc, splits), long, var("LILY_CUDA_FP8_LONG_FROM", 65536));
        }
        let packed = (AttnKernel::Packed, splits);
        // `LILY_CUDA_ATTN_TC_SPLITS`: the tensor-core kernel's splits per KV head (a measurement
        // knob: fewer, longer splits leave attn_combine fewer partials at short contexts).
        let tc_splits = std::env::var("LILY_CUDA_ATTN_TC_SPLITS").ok().and_then(|v| v.parse().ok()).unwrap_or(splits);
        let tc = (AttnKernel::Tc, tc_splits.clamp(1, 1024));
        let on = std::env::var("LILY_CUDA_ATTN_TC").map_or(true, |v| v != "0") && self.attn_tc_applies(nh, hkv, hd, kv);
        let (long, from) = if on { (tc, 2048) } else { (packed, 8192) };
        let from = std::env::var("LILY_CUDA_ATTN_PACKED_FROM").ok().and_then(|v| v.parse().ok()).unwrap_or(from);
        match std::env::var("LILY_CUDA_ATTN").as_deref() {
            Ok("head") => (head, head, usize::MAX),
            Ok("packed") => (packed, packed, 0),
            Ok("tc") => (tc, tc, 0),
            _ => (head, long, from),
        }
    }

    /// The decode attention of `rows` sequences in one launch, from one sequence's plan `plan`.
    /// The plan's splits fill the device with one sequence's heads, so with many rows they made
    /// tens of thousands of blocks over a few positions each (at 64 rows and 32 splits per head
    /// the per-head kernel ran 32,768 blocks of ~10 positions: 339 µs a layer). Here the kernel
    /// is the GQA-packed one ([`AttnKernel::Tc`]: K/V read once per KV head, on tensor cores
    /// where it applies) whenever the head grouping allows it, and the splits fall until the
    /// grid is about `LILY_CUDA_BATCH_ATTN_WAVES` (default 2) blocks per SM, never below 1 nor
    /// above one sequence's. `LILY_CUDA_BATCH_ATTN=head` keeps the per-head kernel, `=plan` the
    /// single sequence's kernel.
    pub fn attn_rows_plan(&self, plan: (AttnKernel, usize), nh: usize, hkv: usize, rows: usize) -> (AttnKernel, usize) {
        static V: std::sync::OnceLock<(Option<AttnKernel>, bool, usize)> = std::sync::OnceLock::new();
        let (forced, keep_plan, waves) = *V.get_or_init(|| {
            let mode = std::env::var("LILY_CUDA_BATCH_ATTN").ok();
            let forced = (mode.as_deref() == Some("head")).then_some(AttnKernel::PerHead);
            let w = std::env::var("LILY_CUDA_BATCH_ATTN_WAVES").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
            (forced, mode.as_deref() == Some("plan"), w)
        });
        rows_plan(plan, (forced, keep_plan, waves), self.sms as usize, nh, hkv, rows)
    }

    /// Whether [`AttnKernel::Tc`] runs on tensor cores for these heads and cache (else it is the
    /// packed fp32-FMA kernel): 8 query heads per KV head, head dim 64, 128 or 256, a bf16 or fp8
    /// cache (fp8: on sm_89 or later), and its shared memory within the device's opt-in limit.
    pub fn attn_tc_applies(&self, nh: usize, hkv: usize, hd: usize, kv: KvDtype) -> bool {
        let fp8 = kv == KvDtype::Fp8;
        (kv == KvDtype::Bf16 || (fp8 && self.has_fp8()))
            && hkv > 0
            && nh == 8 * hkv
            && matches!(hd, 64 | 128 | 256)
            && super::super::attn_dec_smem(hd, fp8) <= self.smem_optin_max
    }

    /// Whether the device converts fp8 e4m3 in hardware (sm_89 and later), which the fp8 KV
    /// cache's kernels need.
    pub fn has_fp8(&self) -> bool {
        !matches!(self.arch, "sm_80" | "sm_86")
    }

    /// Why an fp8 KV cache cannot serve a model of these heads on this device (its kernels: the
    /// tensor-core decode kernel and the flash prefill kernel), or `None` when it can.
    pub fn fp8_kv_unsupported(&self, nh: usize, hkv: usize, hd: usize) -> Option<String> {
        if !self.has_fp8() {
            return Some(format!("an fp8 KV cache needs an sm_89 or later GPU (this one is {})", self.arch));
        }
        if !self.attn_tc_applies(nh, hkv, hd, KvDtype::Fp8)
            || super::super::fa_smem_kv(hd, KvDtype::Fp8) > self.smem_optin_max
        {
            return Some(format!(
                "an fp8 KV cache needs 8 query heads per KV head and head dim 64, 128 or 256 (this model: {nh} query \
                 heads, {hkv} KV heads, head dim {hd})"
            ));
        }
        None
    }
}

/// [`Gpu::attn_rows_plan`]'s choice as a function of the settings `(forced kernel, keep the
/// plan's kernel, blocks per SM)` and the device's `sms`.
fn rows_plan(
    plan: (AttnKernel, usize),
    (forced, keep_plan, waves): (Option<AttnKernel>, bool, usize),
    sms: usize,
    nh: usize,
    hkv: usize,
    rows: usize,
) -> (AttnKernel, usize) {
    let packed_ok = hkv > 0 && nh.is_multiple_of(hkv) && matches!(nh / hkv, 1 | 2 | 4 | 8);
    let kernel = match forced {
        Some(k) => k,
        None if keep_plan => plan.0,
        None if packed_ok => AttnKernel::Tc,
        None => AttnKernel::PerHead,
    };
    let grid_x = if kernel == AttnKernel::PerHead { nh } else { hkv }.max(1);
    let max = if kernel == plan.0 { plan.1 } else { (sms / grid_x).clamp(1, 1024) };
    let target = waves.max(1) * sms;
    (kernel, target.div_ceil(grid_x * rows.max(1)).clamp(1, max.max(1)))
}

#[cfg(test)]
mod tests {
    use super::{rows_plan, AttnKernel, KvDtype};

    /// Cache sizes per position as the kernels address them (kernels/attention.cu: fp8 rows are
    /// H_kv·D bytes, then the heads' f32 scales padded to 16 bytes), and the names the flag takes.
    #[test]
    fn kv_dtypes_size_positions_as_the_kernels_address_them() {
        assert_eq!(KvDtype::F32.pos_bytes(2, 256), 2048);
        assert_eq!(KvDtype::Bf16.pos_bytes(2, 256), 1024);
        assert_eq!(KvDtype::Fp8.pos_bytes(2, 256), 512 + 16);
        assert_eq!(KvDtype::Fp8.pos_bytes(5, 64), 320 + 32);
        // 10 attention layers of the 35B model, K and V: 20 KiB (bf16) and 10.3 KiB (fp8) a token
        let f32_bytes = 10 * 2 * 4 * 2 * 256;
        assert_eq!(KvDtype::Bf16.from_f32_bytes(f32_bytes, 2, 256), 20 * 1024);
        assert_eq!(KvDtype::Fp8.from_f32_bytes(f32_bytes, 2, 256), 10 * 2 * 528);
        for (s, k) in [("bf16", KvDtype::Bf16), ("fp8", KvDtype::Fp8), ("f32", KvDtype::F32)] {
            assert_eq!(KvDtype::parse(s).unwrap(), k);
        }
        let e = KvDtype::parse("fp4").unwrap_err().to_string();
        assert!(e.contains("fp4") && e.contains("fp8"), "{e}");
    }

    #[test]
    fn batched_attention_lowers_the_splits_to_about_two_blocks_per_sm() {
        let short = (AttnKernel::PerHead, 32);
        let auto = (None, false, 2);
        // Qwen3.6 (16 query heads, 2 KV heads) on 132 SMs: the packed kernel, 264 blocks wanted.
        assert_eq!(rows_plan(short, auto, 132, 16, 2, 64), (AttnKernel::Tc, 3)); // 2 x 3 x 64 = 384
        assert_eq!(rows_plan(short, auto, 132, 16, 2, 16), (AttnKernel::Tc, 9));
        // One row: never more splits than one sequence's packed plan (132 / 2).
        assert_eq!(rows_plan(short, auto, 132, 16, 2, 1), (AttnKernel::Tc, 66));
        // Many rows: at least one split.
        assert_eq!(rows_plan(short, auto, 132, 16, 2, 1024), (AttnKernel::Tc, 1));
        // At long context the plan is already packed: its splits are the cap.
        assert_eq!(rows_plan((AttnKernel::Tc, 66), auto, 132, 16, 2, 4), (AttnKernel::Tc, 33));
        // Head groupings the packed kernels do not take stay per head, capped by the plan.
        assert_eq!(rows_plan(short, auto, 132, 12, 1, 2), (AttnKernel::PerHead, 11));
        assert_eq!(rows_plan(short, auto, 132, 3, 0, 1), (AttnKernel::PerHead, 32));
        // The settings: per head forced, the plan kept, more waves.
        assert_eq!(rows_plan(short, (Some(AttnKernel::PerHead), false, 2), 132, 16, 2, 8), (AttnKernel::PerHead, 3));
        assert_eq!(rows_plan(short, (None, true, 2), 132, 16, 2, 64), (AttnKernel::PerHead, 1));
        assert_eq!(rows_plan(short, (None, false, 4), 132, 16, 2, 16), (AttnKernel::Tc, 17));
    }
}

/// [`Gpu::attn_plan`]: (kernel, splits) below the switch, the same from it, the switch.
pub type AttnPlan = ((AttnKernel, usize), (AttnKernel, usize), usize);

/// Which decode attention kernel [`Gpu::attn_decode`] launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKernel {
    /// One block per (query head, split), then `attn_combine`.
    PerHead,
    /// One block per (KV head, split) for all the query heads that share it.
    Packed,
    /// [`AttnKernel::Packed`] on tensor cores (kernels/attention_dec.cu) where it applies: 8
    /// query heads per KV head, head dim 64/128/256, a bf16 cache; else the packed kernel.
    Tc,
}

/// Arguments of [`Gpu::attn_decode`] (device pointers; `pos` is an i32 on the device).
/// Several sequences' decode attention in one launch: `rows` tokens, row r over the cache at
/// `kvt[2r]` (K) and `kvt[2r + 1]` (V) (a device table; 0: the one cache of the arguments), its
/// gate at `qg + r·ldqg` (f32 elements).
pub struct AttnRows {
    pub rows: usize,
    pub kvt: u64,
    pub ldqg: usize,
}

pub struct AttnDecode {
    /// Queries after norm and RoPE `[H_q, D]`.
    pub q: u64,
    pub kc: u64,
    pub vc: u64,
    /// Projection holding the gate per head (`[q | gate]`, stride 2D) when `gated`.
    pub qg: u64,
    pub out: u64,
    pub nh: usize,
    pub hkv: usize,
    pub hd: usize,
    pub pos: u64,
    pub gated: bool,
    /// `[H_q, splits, D + 2]` f32 scratch.
    pub part: u64,
    pub splits: usize,
    /// Element type of `kc`/`vc`.
    pub kv: KvDtype,
    /// The tensor-core kernel over a bf16 cache, one sequence: its first tiles requested before
    /// it waits for the previous kernel (attn_prep), the newest row read after the wait
    /// (the decode default since session 41; `LILY_CUDA_ATTN_EARLY=0` turns it off).
    pub early: bool,
}

/// Whether the decode step merges the attention splits inside the decode launch
/// ([`Gpu::attn_decode_fold`]) where that applies: the default since session 48 (+0.4% at 4K on
/// an H100); `LILY_CUDA_COMBINE=ds|block` keeps attn_combine's own launch.
pub fn attn_fold() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_COMBINE").map_or(true, |v| v == "fold"))
}

/// Element type of the KV cache: bf16 (the default: half the bytes per decode step, scores and
/// softmax still fp32), fp32 (the exact mode; `LILY_CUDA_KV=f32`, `--kv-cache-dtype f32`) or fp8
/// e4m3 with a power-of-two scale per position and KV head (`--kv-cache-dtype fp8`: about half
/// the bf16 cache's bytes; layout in kernels/attention.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    Bf16,
    Fp8,
}

impl KvDtype {
    /// Bytes of one position's row of one cache (K or V) with `hkv` heads of dimension `hd`:
    /// fp8 adds the heads' f32 scales, padded to 16 bytes.
    pub fn pos_bytes(self, hkv: usize, hd: usize) -> usize {
        match self {
            KvDtype::F32 => 4 * hkv * hd,
            KvDtype::Bf16 => 2 * hkv * hd,
            KvDtype::Fp8 => hkv * hd + 16 * hkv.div_ceil(4),
        }
    }

    /// The bytes of this cache type for `f32_bytes` of fp32 cache rows of `hkv` heads of
    /// dimension `hd` (whole positions).
    pub fn from_f32_bytes(self, f32_bytes: usize, hkv: usize, hd: usize) -> usize {
        f32_bytes / (4 * hkv * hd).max(1) * self.pos_bytes(hkv, hd)
    }

    /// `f32`, `bf16` or `fp8` (also what `--kv-cache-dtype` and `LILY_CUDA_KV` take).
    pub fn parse(s: &str) -> Result<KvDtype> {
        match s {
            "f32" | "fp32" | "float32" => Ok(KvDtype::F32),
            "bf16" | "bfloat16" => Ok(KvDtype::Bf16),
            "fp8" | "fp8_e4m3" | "e4m3" => Ok(KvDtype::Fp8),
            _ => bail!("KV cache dtype `{s}`: expected bf16, fp8 or f32"),
        }
    }

    /// The process default: `LILY_CUDA_KV`, else bf16.
    pub fn from_env() -> Result<KvDtype> {
        std::env::var("LILY_CUDA_KV").map_or(Ok(KvDtype::Bf16), |v| KvDtype::parse(&v))
    }
}

/// Arguments of [`Gpu::attn_prep`].
pub struct AttnPrep {
    pub qg: u64,
    pub k: u64,
    pub v: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    pub q_out: u64,
    pub kc: u64,
    pub vc: u64,
    pub nh: usize,
    pub hkv: usize,
    pub hd: usize,
    pub gated: bool,
    pub rot: usize,
    /// Device i32: the position of this token.
    pub pos: u64,
    pub theta: f64,
    pub eps: f32,
    /// Element type of `kc`/`vc`.
    pub kv: KvDtype,
    /// The RoPE angles (and norm weights) are taken before the kernel waits for the previous one: only where
    /// `pos` was written before the current decode step began (by the host or the previous
    /// step's sampler), as in the one-sequence decode step (the default there;
    /// `LILY_CUDA_PREP_EARLY=0` turns it off). The same bits either way.
    pub early: bool,
}

/// The prefill attention kernels: fp32 SIMT (the exact mode), bf16 tensor cores one 32-key tile
/// at a time (`attn_prefill_tc*`, any cache), and the flash kernels (bf16 cache, head dim
/// 64/128/256, 128-row blocks): on mma.sync with ldmatrix and cp.async double buffering
/// (kernels/attention_fa.cu), and on Hopper's wgmma with TMA copies and the softmax under the
/// previous tile's P V (kernels/attention_wg.cu, sm_90a).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillAttn {
    Simt,
    Tc,
    Flash,
    FlashWg,
}

impl PrefillAttn {
    /// SIMT in the exact mode; in the bf16 mode on sm_90a the wgmma + TMA kernel over a bf16
    /// cache (519 against 300 TFLOP/s at 128K, perf log session 28), else the mma.sync flash
    /// kernel where it applies. `LILY_CUDA_ATTN_PREFILL` picks another for an A/B: `fa` (the
    /// mma.sync flash kernel) or `tc`.
    pub fn default_for(prec: Precision, kv: KvDtype, hd: usize, smem_max: usize, sm90a: bool) -> PrefillAttn {
        static PICK: OnceLock<String> = OnceLock::new();
        let pick = PICK.get_or_init(|| std::env::var("LILY_CUDA_ATTN_PREFILL").unwrap_or_default());
        let flash_fits =
            kv != KvDtype::F32 && [64, 128, 256].contains(&hd) && super::super::fa_smem_kv(hd, kv) <= smem_max;
        match prec {
            // an fp8 cache has only the flash kernel
            _ if kv == KvDtype::Fp8 => PrefillAttn::Flash,
            Precision::F32 => PrefillAttn::Simt,
            _ if !flash_fits || pick == "tc" => PrefillAttn::Tc,
            _ if sm90a && pick != "fa" && kv == KvDtype::Bf16 && super::super::wg_attn_smem(hd) <= smem_max => {
                PrefillAttn::FlashWg
            }
            _ => PrefillAttn::Flash,
        }
    }
}
