//! The kernels' names and sources: what the NVRTC module holds (`SOURCES`, `KERNELS`), which of
//! them may be launched as programmatic dependents, and which entry point a shape picks
//! (gemm_skinny, flash-attention prefill, tensor-core decode attention) with its shared memory.

/// Every kernel source, in compile order (the prelude first). One NVRTC program, one module.
pub const SOURCES: [(&str, &str); 27] = [
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("norm.cu", include_str!("kernels/norm.cu")),
    ("linear.cu", include_str!("kernels/linear.cu")),
    ("gemm.cu", include_str!("kernels/gemm.cu")),
    ("gemm_skinny.cu", include_str!("kernels/gemm_skinny.cu")),
    ("gemm_pipe.cu", include_str!("kernels/gemm_pipe.cu")),
    ("gemm_wg.cu", include_str!("kernels/gemm_wg.cu")),
    ("gemm_wt.cu", include_str!("kernels/gemm_wt.cu")),
    ("gemm_wsp.cu", include_str!("kernels/gemm_wsp.cu")),
    ("gdn.cu", include_str!("kernels/gdn.cu")),
    ("gdn_prefill.cu", include_str!("kernels/gdn_prefill.cu")),
    ("gdn_chunk.cu", include_str!("kernels/gdn_chunk.cu")),
    ("gdn_chunk_tc.cu", include_str!("kernels/gdn_chunk_tc.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("attention_dec.cu", include_str!("kernels/attention_dec.cu")),
    ("attention_prefill.cu", include_str!("kernels/attention_prefill.cu")),
    ("attention_fa.cu", include_str!("kernels/attention_fa.cu")),
    ("attention_wg.cu", include_str!("kernels/attention_wg.cu")),
    ("moe.cu", include_str!("kernels/moe.cu")),
    ("gemv_i8.cu", include_str!("kernels/gemv_i8.cu")),
    ("gemv.cu", include_str!("kernels/gemv.cu")),
    ("gemv_route.cu", include_str!("kernels/gemv_route.cu")),
    ("moe_fused2.cu", include_str!("kernels/moe_fused2.cu")),
    ("gdn_step_cl.cu", include_str!("kernels/gdn_step_cl.cu")),
    ("sampling.cu", include_str!("kernels/sampling.cu")),
    ("pstep.cu", include_str!("kernels/pstep.cu")),
    ("pstep_run.cu", include_str!("kernels/pstep_run.cu")),
];

/// Kernel entry points loaded from the module that are launched plainly; with [`PDL_KERNELS`] and
/// [`SKINNY_KERNELS`] they are every entry point (see [`all_kernels`]), each listed once.
pub const KERNELS: [&str; 32] = [
    "gemv_q_loadonly",
    "gemm_f32",
    "gemm_bf16",
    "gemm_bf16_m128",
    "gemm_pipe64",
    "gemm_pipe128",
    "conv_prefill",
    "conv_state",
    "gdn_qk_prep",
    "gdn_scan",
    "gdn_chunk_prep",
    "gdn_chunk_scan",
    "gdn_chunk_scan_tc",
    "gdn_chunk_prep_tc",
    "gdn_out_norm",
    "attn_prefill",
    "attn_prefill_tc",
    "attn_prefill_bf16",
    "attn_prefill_tc_bf16",
    "attn_prefill_fa64",
    "attn_prefill_fa128",
    "attn_prefill_fa256",
    "attn_prefill_fa64_fp8",
    "attn_prefill_fa128_fp8",
    "attn_prefill_fa256_fp8",
    "attn_prefill_wg64",
    "attn_prefill_wg128",
    "attn_prefill_wg256",
    "moe_align",
    "moe_combine",
    "moe_combine_rows",
    "pstep",
];

/// Whether the streams' loads carry an L2 evict-first policy (kernels/common.cuh's
/// `LILY_L2_EVICT_FIRST`; the default, +1% decode on the H200 in session 32;
/// `LILY_CUDA_L2_HINT=none` builds the kernels without it, a separate entry of the kernel cache).
pub fn l2_hint_first() -> bool {
    static P: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *P.get_or_init(|| std::env::var("LILY_CUDA_L2_HINT").map_or(true, |v| v != "none"))
}

/// Whether the 4-bit decode products run on int8 parts of their input and dp4a
/// (kernels/gemv.cu's `LILY_GEMV_I8`; the default, +14% decode on the H200 in session 32;
/// `LILY_CUDA_GEMV_I8=0` builds the float form, a separate entry of the kernel cache).
pub fn gemv_i8() -> bool {
    static P: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *P.get_or_init(|| std::env::var("LILY_CUDA_GEMV_I8").map_or(true, |v| v != "0"))
}

/// Whether the decode GEMVs with a fused RMSNorm request the norm's weights into the L2 before
/// their PDL wait (kernels/common.cuh's `LILY_NORM_PF`; the default since session 45, +0.8% /
/// +1.4% decode at 4K / 256 on an H100; `LILY_CUDA_NORM_PF=0` builds the kernels without it, a
/// separate entry of the kernel cache).
pub fn norm_pf() -> bool {
    static P: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *P.get_or_init(|| std::env::var("LILY_CUDA_NORM_PF").map_or(true, |v| v != "0"))
}

/// The concatenated program text.
pub fn kernel_source() -> String {
    let mut s = if super::timeline::enabled() { "#define LILY_TIMELINE 1\n".to_string() } else { String::new() };
    if l2_hint_first() {
        s.push_str("#define LILY_L2_EVICT_FIRST 1\n");
    }
    if gemv_i8() {
        s.push_str("#define LILY_GEMV_I8 1\n");
    }
    if norm_pf() {
        s.push_str("#define LILY_NORM_PF 1\n");
    }
    s.push_str(&super::params::c_decls());
    for (name, src) in SOURCES {
        s.push_str(&format!("// ---- {name} ----\n"));
        s.push_str(src);
        s.push('\n');
    }
    s
}

/// gemm_skinny's entry points, one per (input rows per pass, weight format), then the 8-row
/// 4-bit one at three blocks per SM.
pub const SKINNY_KERNELS: [&str; 10] = [
    "gemm_skinny8_q4",
    "gemm_skinny16_q4",
    "gemm_skinny32_q4",
    "gemm_skinny8_q8",
    "gemm_skinny16_q8",
    "gemm_skinny32_q8",
    "gemm_skinny8_bf16",
    "gemm_skinny16_bf16",
    "gemm_skinny32_bf16",
    "gemm_skinny8_q4w",
];

/// Every kernel entry point loaded from the module.
pub fn all_kernels() -> impl Iterator<Item = &'static str> {
    KERNELS.into_iter().chain(PDL_KERNELS).chain(SKINNY_KERNELS)
}

/// Whether `name` may be launched as a programmatic dependent.
pub fn is_pdl(name: &str) -> bool {
    PDL_KERNELS.contains(&name) || SKINNY_KERNELS.contains(&name)
}

/// The gemm_skinny entry point for `tn` input rows per pass (8, 16 or 32) and `bits` (4, 8, or 0
/// for bf16 weights).
pub fn skinny_kernel(tn: usize, bits: i32) -> &'static str {
    let t = match tn {
        8 => 0,
        16 => 1,
        _ => 2,
    };
    let f = match bits {
        4 => 0,
        8 => 1,
        _ => 2,
    };
    if tn == 8 && bits == 4 && !skinny_occ2() {
        return SKINNY_KERNELS[9];
    }
    SKINNY_KERNELS[3 * f + t]
}

/// The 8-row 4-bit product runs as `gemm_skinny8_q4w`: three blocks per SM (80 registers) with
/// two chunks in flight per warp, +4-5% on the batched step at B=16 and 64 against two blocks
/// with three chunks (`LILY_CUDA_SKINNY_OCC=2`: `gemm_skinny8_q4`).
fn skinny_occ2() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_SKINNY_OCC").is_ok_and(|v| v == "2"))
}

/// Kernels that call `pdl_wait()` before touching activations (kernels/common.cuh) and so may be
/// launched as programmatic dependents: their launch and weight reads overlap the previous
/// kernel's tail. The gemm_skinny entry points are such kernels too (see [`is_pdl`]).
pub const PDL_KERNELS: [&str; 79] = [
    "gemm_wsp128",
    "gemm_wsp256",
    "gemm_wsp128_q8",
    "gemm_wsp256_q8",
    "gemm_wsp128_bf16",
    "gemm_wsp256_bf16",
    "gemm_wg64",
    "gemm_wg128",
    "gemm_wg256",
    "gemm_wt64",
    "gemm_wt128",
    "gemm_wt256",
    "gemm_wt64_q8",
    "gemm_wt128_q8",
    "gemm_wt256_q8",
    "gemm_wt64_bf16",
    "gemm_wt128_bf16",
    "gemm_wt256_bf16",
    "x_bf16_perm",
    "moe_fused_q",
    "moe_fused_q2",
    "moe_fused_q2s",
    "moe_fused_q2s_given",
    "moe_fused_q2s_acc",
    "moe_fused_q2s_accb",
    "gemv_q2_route",
    "gemv_q2_route_fx",
    "gemv_q2_route_acc",
    "gemv_q2_route16_fx",
    "gemv_q2_route16_acc",
    "gemv_q2_conv",
    "samp_max",
    "samp_radix",
    "samp_zsum",
    "samp_draw",
    "attn_prep",
    "attn_decode",
    "attn_combine",
    "attn_combine_ds",
    "attn_decode_gqa1",
    "attn_decode_gqa2",
    "attn_decode_gqa4",
    "attn_decode_gqa8",
    "attn_prep_bf16",
    "attn_decode_bf16",
    "attn_decode_gqa1_bf16",
    "attn_decode_gqa2_bf16",
    "attn_decode_gqa4_bf16",
    "attn_decode_gqa8_bf16",
    "attn_decode_tc64",
    "attn_decode_tc128",
    "attn_decode_tc256",
    "attn_prep_fp8",
    "attn_decode_tc64_fp8",
    "attn_decode_tc128_fp8",
    "attn_decode_tc256_fp8",
    "attn_decode_tc64_fold",
    "attn_decode_tc128_fold",
    "attn_decode_tc256_fold",
    "conv_step",
    "gdn_step",
    "gdn_step_par",
    "gdn_step_par_e",
    "gdn_step_c4",
    "gdn_step_par_rows",
    "moe_down",
    "moe_down_q",
    "embed_row",
    "moe_topk",
    "argmax",
    "argmax_io",
    "linear_gemv",
    "gemv_q2",
    "gemv_q2_routed",
    "rms_norm",
    "silu_mul",
    "silu_mul_pairs",
    "silu_mul_pairs_perm",
    "add_inplace",
];

/// Dynamic shared memory of gemm_pipe64 / gemm_pipe128: 4 stages of [64 or 128 rows][64] fp32
/// inputs and [128][32 bytes] of 4-bit codes (kernels/gemm_pipe.cu).
pub const GEMM_PIPE_SMEM64: usize = 4 * (64 * 256 + 128 * 32);
pub const GEMM_PIPE_SMEM128: usize = 4 * (128 * 256 + 128 * 32);

/// Dynamic shared memory of gemm_wg64 / gemm_wg128: 3 stages of [64 or 128 rows][128] bf16
/// inputs and [128][64 bytes] of 4-bit codes (kernels/gemm_wg.cu).
pub const GEMM_WG_SMEM64: usize = 3 * (64 * 256 + 128 * 64);
pub const GEMM_WG_SMEM128: usize = 3 * (128 * 256 + 128 * 64);
/// gemm_wg256's: 256-row input tiles, 216 KB.
pub const GEMM_WG_SMEM256: usize = 3 * (256 * 256 + 128 * 64);
/// gemm_wt's kernels (kernels/gemm_wt.cu): (input rows per tile, weight bits: 4, 8 or 16 for
/// dense bf16) and the name.
pub const GEMM_WT_KERNELS: [((usize, u32), &str); 9] = [
    ((64, 4), "gemm_wt64"),
    ((128, 4), "gemm_wt128"),
    ((256, 4), "gemm_wt256"),
    ((64, 8), "gemm_wt64_q8"),
    ((128, 8), "gemm_wt128_q8"),
    ((256, 8), "gemm_wt256_q8"),
    ((64, 16), "gemm_wt64_bf16"),
    ((128, 16), "gemm_wt128_bf16"),
    ((256, 16), "gemm_wt256_bf16"),
];

/// gemm_wt's kernel for `bt`-row tiles (64, 128 or 256) of weights of `bits` (4, 8, 16).
pub fn gemm_wt_kernel(bt: usize, bits: u32) -> &'static str {
    tile_kernel(&GEMM_WT_KERNELS, bt, bits)
}

/// The name for (`bt`, `bits`) in a table of tile kernels (its first entry where none matches).
fn tile_kernel(table: &[((usize, u32), &'static str)], bt: usize, bits: u32) -> &'static str {
    table.iter().find(|(k, _)| *k == (bt, bits)).unwrap_or(&table[0]).1
}

/// gemm_wsp's kernels (kernels/gemm_wsp.cu, persistent and warp-specialized, plain products):
/// (input rows per tile, weight bits) and the name.
pub const GEMM_WSP_KERNELS: [((usize, u32), &str); 6] = [
    ((128, 4), "gemm_wsp128"),
    ((256, 4), "gemm_wsp256"),
    ((128, 8), "gemm_wsp128_q8"),
    ((256, 8), "gemm_wsp256_q8"),
    ((128, 16), "gemm_wsp128_bf16"),
    ((256, 16), "gemm_wsp256_bf16"),
];

/// Static shared memory of the gemm_wsp kernels (their mbarriers, 1,024-aligned by ptxas): the
/// dynamic part may use the device's opt-in less this.
pub const GEMM_WSP_STATIC_SMEM: usize = 1024;

/// gemm_wsp's kernel for `bt`-row tiles (128 or 256) of weights of `bits` (4, 8, 16).
pub fn gemm_wsp_kernel(bt: usize, bits: u32) -> &'static str {
    tile_kernel(&GEMM_WSP_KERNELS, bt, bits)
}

/// Dynamic shared memory of [`gemm_wsp_kernel`]`(bt, bits)` for groups of `group` columns:
/// gemm_wt's stages and, for codes, one slot per stage of 128 rows x (128 / group) u32
/// scale/bias pairs.
pub fn gemm_wsp_smem(bt: usize, bits: u32, group: usize) -> usize {
    let slot = if bits == 16 { 0 } else { 128 * (128 / group.max(1)) * 4 };
    gemm_wt_smem(bt, bits) + gemm_wt_stages(bt, bits) * slot
}

/// Dynamic shared memory of [`gemm_wt_kernel`]`(bt, bits)`: its stages (gemm_wt.cu's WT_STAGES
/// table) of [bt rows][128] bf16 inputs and [128 rows][16·bits bytes] of weights, plus 1 KB to
/// align the swizzled tiles.
pub fn gemm_wt_smem(bt: usize, bits: u32) -> usize {
    gemm_wt_stages(bt, bits) * (bt * 256 + 128 * 16 * bits as usize) + 1024
}

/// gemm_wt's (and gemm_wsp's) pipeline stages: gemm_wt.cu's WT_STAGES table.
fn gemm_wt_stages(bt: usize, bits: u32) -> usize {
    match (bt, bits) {
        (256, 4) => 3,
        (256, _) => 2,
        (128, 4) => 5,
        (128, 8) => 4,
        (128, _) => 3,
        (_, 4) => 4,
        (_, 8) => 3,
        _ => 2,
    }
}

/// Dynamic shared memory of gdn_chunk_scan_tc (kernels/gdn_chunk_tc.cu): fp32 tiles Wt and Qt
/// [128][72], Mt [64][72], keys [64][136], the state [128][40], V_new and V2 [64][40].
pub const GDN_TC_SMEM: usize = 4 * (2 * 128 * 72 + 64 * 72 + 64 * 136 + 128 * 40 + 2 * 64 * 40);

/// Dynamic shared memory of gdn_chunk_prep_tc (kernels/gdn_chunk_tc.cu) at D_k <= 128: keys and
/// queries [64][132], A [64][68], the diagonal blocks' inverses [4][16][20], gammas and betas.
pub const GDN_PREP_TC_SMEM: usize = 4 * (2 * 64 * 132 + 64 * 68 + 4 * 16 * 20 + 3 * 64);

/// The flash-attention prefill kernel for head dim `d` (64, 128 or 256; kernels/attention_fa.cu)
/// over a bf16 cache, or an fp8 one (`fp8`).
pub fn fa_kernel(d: usize, fp8: bool) -> &'static str {
    match (d, fp8) {
        (64, false) => "attn_prefill_fa64",
        (128, false) => "attn_prefill_fa128",
        (_, false) => "attn_prefill_fa256",
        (64, true) => "attn_prefill_fa64_fp8",
        (128, true) => "attn_prefill_fa128_fp8",
        (_, true) => "attn_prefill_fa256_fp8",
    }
}

/// The wgmma + TMA prefill attention kernel for head dim `d` (64, 128 or 256;
/// kernels/attention_wg.cu). Its shared memory is [`wg_attn_smem`]`(d)`.
pub fn wg_attn_kernel(d: usize) -> &'static str {
    match d {
        64 => "attn_prefill_wg64",
        128 => "attn_prefill_wg128",
        _ => "attn_prefill_wg256",
    }
}

/// Dynamic shared memory of [`wg_attn_kernel`]`(d)`: [`fa_smem`]`(d)` and 1 KB to align the
/// swizzled tiles.
pub fn wg_attn_smem(d: usize) -> usize {
    fa_smem(d) + 1024
}

/// Dynamic shared memory of [`fa_kernel`]`(d, false)`: Q [128][d] and two K and V tiles [64][d],
/// bf16.
pub fn fa_smem(d: usize) -> usize {
    (128 + 4 * 64) * d * 2
}

/// [`fa_smem`] or [`fa_smem_fp8`] for a cache of type `kv`.
pub fn fa_smem_kv(d: usize, kv: super::KvDtype) -> usize {
    if kv == super::KvDtype::Fp8 {
        fa_smem_fp8(d)
    } else {
        fa_smem(d)
    }
}

/// Dynamic shared memory of [`fa_kernel`]`(d, true)`: Q [128][d] and one K and V tile [64][d],
/// fp16, then two raw stages (K and V [64][d] bytes, their 2 x 64 f32 scales), then the widened
/// tile's 2 x 64 scales.
pub fn fa_smem_fp8(d: usize) -> usize {
    (128 + 2 * 64) * d * 2 + 2 * (2 * 64 * d + 2 * 64 * 4) + 2 * 64 * 4
}

/// The tensor-core decode attention kernel for head dim `d` (64, 128 or 256; G = 8 query heads
/// per KV head; kernels/attention_dec.cu) over a bf16 cache, or an fp8 one (`fp8`).
pub fn attn_dec_kernel(d: usize, fp8: bool) -> &'static str {
    match (d, fp8) {
        (64, false) => "attn_decode_tc64",
        (128, false) => "attn_decode_tc128",
        (_, false) => "attn_decode_tc256",
        (64, true) => "attn_decode_tc64_fp8",
        (128, true) => "attn_decode_tc128_fp8",
        (_, true) => "attn_decode_tc256_fp8",
    }
}

/// The fold form of the bf16 tensor-core decode kernel at head dim `d` (attn_combine's merge in
/// its tail; the same dynamic shared memory as [`attn_dec_kernel`]`(d, false)`).
pub fn attn_dec_fold_kernel(d: usize) -> &'static str {
    match d {
        64 => "attn_decode_tc64_fold",
        128 => "attn_decode_tc128_fold",
        _ => "attn_decode_tc256_fold",
    }
}

/// Dynamic shared memory of [`attn_dec_kernel`]`(d, fp8)`, then each warp's P buffers
/// (2 x [8][24] u16): bf16, 4 warps' rings of 3 stages of a K and a V tile [16][d] bf16; fp8, 4
/// warps' one fp16 tile [16][d] and 2 raw stages (K and V [16][d] bytes, 2 x 16 f32 scales).
pub fn attn_dec_smem(d: usize, fp8: bool) -> usize {
    let warp = if fp8 { 16 * d * 2 + 2 * (2 * 16 * d + 128) } else { 3 * 2 * 16 * d * 2 };
    4 * warp + 4 * 2 * 8 * 24 * 2
}
