//! Kernel parameter structs, defined once for both sides of a launch.
//!
//! Each struct below is a `#[repr(C)]` Rust struct and, through [`c_decls`] (prepended to the
//! kernel source before NVRTC compiles it), the same C struct: field names and order come from
//! one definition and each field's C type from its Rust type ([`CField`]), so a launch and its
//! kernel cannot disagree about argument order, count or width. A kernel takes its struct by
//! value (`extern "C" __global__ void rms_norm(RmsNormParams p)`), or, for a struct declared
//! `spread`, its fields as its parameter list (`gemm_f32(GemmParams_fields)`);
//! [`super::Gpu::launch_params`] passes either form.
//!
//! Field types: `i32` (int), `u32` (unsigned), `i64` (long long), `f32` (float), and device
//! pointers [`In<T>`] (`const T*`) and [`Out<T>`] (`T*`) over those element types and
//! [`Void`]. Both languages lay such a struct out the same way (natural alignment, no
//! reordering).

use std::marker::PhantomData;

/// A Rust field type and the C type it is declared as in the kernels' copy of the struct.
pub trait CField {
    fn c_type() -> String;
    /// The type as a kernel parameter (spread structs' parameter lists): the field type, except
    /// where the kernel needs the parameter itself in memory ([`TmaMap`]).
    fn c_param_type() -> String {
        Self::c_type()
    }
}

/// Scalar field types and their C names.
macro_rules! scalar_fields {
    ($($t:ty => $c:literal),*) => {
        $(impl CField for $t {
            fn c_type() -> String {
                $c.into()
            }
        })*
    };
}
scalar_fields!(u16 => "unsigned short", i32 => "int", u32 => "unsigned", i64 => "long long", u64 => "unsigned long long", f32 => "float", f64 => "double");

/// The element type of an untyped device address (`void`): weights whose layout a kernel reads
/// from other fields (bits, group, scale type).
#[derive(Clone, Copy)]
pub struct Void;
impl CField for Void {
    fn c_type() -> String {
        "void".into()
    }
}

/// A TMA tensor map (the driver's `CUtensorMap`, 128 opaque bytes, encoded on the host by
/// `cuTensorMapEncodeTiled`) passed by value. As a parameter it is `const __grid_constant__`, so
/// the kernel can hand the parameter's own address to `cp.async.bulk.tensor` (kernels/gemm_wt.cu).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct TmaMap(pub [u64; 16]);
impl CField for TmaMap {
    fn c_type() -> String {
        "TmaMap".into()
    }
    fn c_param_type() -> String {
        "const __grid_constant__ TmaMap".into()
    }
}
impl TmaMap {
    /// The map a kernel that does not read it is given.
    pub const NONE: TmaMap = TmaMap([0; 16]);
}

/// Element types that are structs of the kernel source (declared there; `c_decls` forward-
/// declares them so a params struct may point at one).
macro_rules! opaque_types {
    ($($t:ident),*) => {
        $(
            #[derive(Clone, Copy)]
            pub struct $t;
            impl CField for $t {
                fn c_type() -> String {
                    stringify!($t).into()
                }
            }
        )*
        const OPAQUE: &[&str] = &[$(stringify!($t)),*];
    };
}
opaque_types!(SampWs, PsPhase);

/// A device address the kernel reads `T`s at (`const T*`; 0 is null).
#[repr(transparent)]
pub struct In<T>(pub u64, PhantomData<T>);
/// A device address the kernel writes (or reads and writes) `T`s at (`T*`; 0 is null).
#[repr(transparent)]
pub struct Out<T>(pub u64, PhantomData<T>);

impl<T> In<T> {
    pub fn new(ptr: u64) -> In<T> {
        In(ptr, PhantomData)
    }
}
impl<T> Out<T> {
    pub fn new(ptr: u64) -> Out<T> {
        Out(ptr, PhantomData)
    }
}
impl<T> Clone for In<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for In<T> {}
impl<T> Clone for Out<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Out<T> {}
impl<T: CField> CField for In<T> {
    fn c_type() -> String {
        format!("const {}*", T::c_type())
    }
}
impl<T: CField> CField for Out<T> {
    fn c_type() -> String {
        format!("{}*", T::c_type())
    }
}

/// A struct whose fields a kernel takes: as its one argument (`NAME(const XParams p)`), or, for
/// a struct declared `spread`, as that many arguments in field order (`NAME(XParams_fields)`,
/// a C macro for the parameter list: the kernel sees scalar parameters, which keeps NVVM from
/// loading the whole struct into registers at entry as it does a by-value struct; the
/// 80-register `gemm_skinny8_q4w` spilled that way).
///
/// # Safety
/// The type must be `#[repr(C)]` with only [`CField`] fields, declared through `kernel_params!`
/// (which also declares it to the kernels).
pub unsafe trait KernelParams: Copy {
    /// Whether the kernels take the fields as separate arguments.
    const SPREAD: bool;
    /// Each field's byte offset, in order.
    const OFFSETS: &'static [usize];
    /// Each field's size in bytes, in order.
    const SIZES: &'static [usize];
}

/// A kernel that takes a params struct: its name, the struct's size, and for a spread struct
/// each field's size (the arguments its PTX entry declares).
pub struct ParamKernel {
    pub name: &'static str,
    pub size: usize,
    pub spread: Option<&'static [usize]>,
}

macro_rules! kernel_params {
    ($( $(#[$m:meta])* $name:ident $($spread:ident)? [$($k:literal),+ $(,)?] { $( $(#[$fm:meta])* $f:ident : $t:ty ),* $(,)? } )*) => {
        $(
            $(#[$m])*
            #[repr(C)]
            #[derive(Clone, Copy)]
            #[allow(non_snake_case)] // the kernels' own parameter names (E, K, H, ...)
            pub struct $name { $( $(#[$fm])* pub $f: $t ),* }
            // SAFETY: repr(C), CField fields only, declared to the kernels by c_decls.
            unsafe impl KernelParams for $name {
                const SPREAD: bool = false $( || stringify!($spread).len() > 0 )?;
                const OFFSETS: &'static [usize] = &[$( std::mem::offset_of!($name, $f) ),*];
                const SIZES: &'static [usize] = &[$( std::mem::size_of::<$t>() ),*];
            }
        )*
        /// The C declarations of every params struct (and its field list as a parameter list,
        /// `XParams_fields`, and its names as an argument list, `XParams_names`), for the kernel source.
        pub fn c_decls() -> String {
            let mut s = String::from("// ---- kernel params (src/cuda/params.rs) ----\n");
            s.push_str("struct alignas(64) TmaMap { unsigned long long v[16]; };\n");
            for t in OPAQUE {
                s.push_str(&format!("struct {t};\n"));
            }
            $(
                s.push_str(concat!("struct ", stringify!($name), " {"));
                $( s.push_str(&format!(" {} {};", <$t as CField>::c_type(), stringify!($f))); )*
                s.push_str(" };\n");
                let fields: Vec<String> = vec![$( format!("{} {}", <$t as CField>::c_param_type(), stringify!($f)) ),*];
                s.push_str(&format!(concat!("#define ", stringify!($name), "_fields {}\n"), fields.join(", ")));
                let names: Vec<&str> = vec![$( stringify!($f) ),*];
                s.push_str(&format!(concat!("#define ", stringify!($name), "_names {}\n"), names.join(", ")));
            )*
            s
        }
        /// Each kernel that takes a params struct (tests/cuda_compile.rs checks its PTX entry
        /// declares the struct, or the spread fields, at these sizes).
        pub fn kernels() -> Vec<ParamKernel> {
            let mut v = Vec::new();
            $( $(
                v.push(ParamKernel {
                    name: $k,
                    size: std::mem::size_of::<$name>(),
                    spread: if <$name as KernelParams>::SPREAD { Some(<$name as KernelParams>::SIZES) } else { None },
                });
            )+ )*
            v
        }
    };
}

kernel_params! {
    /// `rms_norm`: y[r, :] = x[r, :] · rsqrt(mean(x[r, :]²) + eps) · w, rows of `d` (y may be x).
    RmsNormParams ["rms_norm"] { x: In<f32>, w: In<f32>, y: Out<f32>, d: i32, eps: f32 }
    /// `silu_mul`: h[i] = silu(g[i]) · u[i] for i < n.
    SiluMulParams ["silu_mul"] { g: In<f32>, u: In<f32>, h: Out<f32>, n: i32 }
    /// `silu_mul_pairs`: h[k, i] = silu(gu[2k, i]) · gu[2k+1, i] for i < n, k < pairs.
    SiluMulPairsParams ["silu_mul_pairs"] { gu: In<f32>, h: Out<f32>, n: i32, pairs: i32 }
    /// `silu_mul_pairs_perm` (gemm_wg.cu): the same h as bf16 rows in wgmma's k order
    /// (`x_bf16_perm`'s layout, width n a multiple of 64), straight into gemm_wg's workspace `xb`.
    SiluMulPairsPermParams ["silu_mul_pairs_perm"] { gu: In<f32>, xb: Out<u16>, n: i32, pairs: i32 }
    /// `add_inplace`: x[i] += y[i] for i < n.
    AddParams ["add_inplace"] { x: Out<f32>, y: In<f32>, n: i32 }
    /// The many-row weight products (gemm.cu, gemm_pipe.cu, gemm_skinny.cu):
    /// `y[m, n] (+)= Σ_k x[xr(m), k] · W[e·n_rows + n, k]`, W from `w`/`sc`/`bi` (`bits` 0, 4 or
    /// 8, quantization `group`, scale type `ty`), xr(m) = `gather[m] / gdiv` (or m without
    /// `gather`), expert e and rows from the `tiles` list (see gemm.cu). `kq`, `ksplit`, `part`
    /// and `tickets` are the skinny kernels' K split (the others ignore them); `xm` and `wm` the
    /// TMA maps of the inputs and the codes (gemm_wt and gemm_wsp only). Spread: these are the kernels'
    /// parameters (`NAME(GemmParams_fields)`).
    GemmParams spread [
        "gemm_f32", "gemm_bf16", "gemm_bf16_m128", "gemm_pipe64", "gemm_pipe128", "gemm_wg64", "gemm_wg128",
        "gemm_wg256", "gemm_wt64", "gemm_wt128", "gemm_wt256", "gemm_wt64_q8", "gemm_wt128_q8",
        "gemm_wt256_q8", "gemm_wt64_bf16", "gemm_wt128_bf16", "gemm_wt256_bf16", "gemm_wsp128", "gemm_wsp256",
        "gemm_wsp128_q8", "gemm_wsp256_q8", "gemm_wsp128_bf16", "gemm_wsp256_bf16",
        "gemm_skinny8_q4", "gemm_skinny16_q4", "gemm_skinny32_q4", "gemm_skinny8_q8", "gemm_skinny16_q8",
        "gemm_skinny32_q8", "gemm_skinny8_q4w", "gemm_skinny8_bf16", "gemm_skinny16_bf16", "gemm_skinny32_bf16"
    ] {
        w: In<Void>, sc: In<Void>, bi: In<Void>, bits: i32, group: i32, ty: i32,
        x: In<f32>, ldx: i64, gather: In<i32>, gdiv: i32, y: Out<f32>, ldy: i64,
        m: i32, n: i32, k: i32, tiles: In<i32>, accumulate: i32,
        kq: i32, ksplit: i32, part: Out<f32>, tickets: Out<u32>, xm: TmaMap, wm: TmaMap
    }
    /// `x_bf16_perm` (gemm_wg.cu): `xb[r, :]` = x row xr(r) (stride `ldx`; xr(r) = `gather[r] /
    /// gdiv`, or r without `gather`) as bf16, each 64-column
    /// chunk in wgmma's k order, for r < rows (width k, a multiple of 64).
    XPermParams ["x_bf16_perm"] { x: In<f32>, ldx: i64, gather: In<i32>, gdiv: i32, xb: Out<u16>, rows: i32, k: i32 }
    /// The GEMVs (gemv.cu's streaming `gemv_q2`/`gemv_q_loadonly`, linear.cu's `linear_gemv`):
    /// slot z = grid.y: `y[z·rows + r] (+)= Σ_c W[e·rows + r, c] · xn[c]`, xn = x row `z / xdiv`
    /// (stride `xstride`), RMS-normalized by `normw` when set, expert e = `ids[z]` (or 0).
    /// Spread (`NAME(GemvParams_fields)`).
    GemvParams spread ["gemv_q2", "gemv_q_loadonly", "linear_gemv"] {
        w: In<Void>, sc: In<Void>, bi: In<Void>, bits: i32, group: i32, ty: i32,
        x: In<f32>, xstride: i64, y: Out<f32>, rows: i32, cols: i32, ids: In<i32>, accumulate: i32,
        normw: In<f32>, eps: f32, xdiv: i32
    }
    /// `gemv_q2_route` (kernels/gemv_route.cu): the out-projection `y += W x` (`rows` = H) and
    /// the router `Wr` (`R` rows) on `rms_norm(y) · nw` into `logits`, through per-block parts
    /// `part` `[H / 32, R + 1]` and the u64 arrival counter `ctr`; with `ids` set also the MoE's
    /// top-`K` (top-k form `mode`, the shared expert as slot K) into `ids`/`wts` `[K + 1]`.
    /// `gemv_q2_route_acc` leaves the fixed-point sums in `part` for `moe_fused_q2s_acc`.
    /// The `16` entry points: blocks of 16 rows (one a warp), grid H / 16.
    GemvRouteParams spread ["gemv_q2_route", "gemv_q2_route_fx", "gemv_q2_route_acc", "gemv_q2_route16_fx", "gemv_q2_route16_acc"] {
        w: In<Void>, sc: In<Void>, bi: In<Void>, bits: i32, group: i32, ty: i32, x: In<f32>, y: Out<f32>,
        rows: i32, cols: i32, wr: In<Void>, sr: In<Void>, br: In<Void>, bits_r: i32, group_r: i32,
        ty_r: i32, R: i32, nw: In<f32>, eps: f32, part: Out<f32>, logits: Out<f32>, ctr: Out<u64>,
        ids: Out<i32>, wts: Out<f32>, K: i32, renorm: i32, mode: i32
    }
    /// `gemv_q2_conv`: gemv_q2 for one slot, rows c < C then through the causal conv + SiLU (state `cstate`, taps `cw`) into `cy`.
    GemvConvParams spread ["gemv_q2_conv"] { w: In<Void>, sc: In<Void>, bi: In<Void>, bits: i32, group: i32, ty: i32, x: In<f32>, y: Out<f32>, rows: i32, cols: i32, normw: In<f32>, eps: f32, cstate: Out<f32>, cw: In<f32>, cy: Out<f32>, C: i32, K: i32 }
    /// `moe_down_q` (gemv.cu) and `moe_down` (linear.cu): x[r] += Σ_{k<S} wts[k] · (W[ids[k]·rows + r, :] · silu(gu[2k]) ⊙ gu[2k+1]).
    MoeDownParams spread ["moe_down_q", "moe_down"] { w: In<Void>, sc: In<Void>, bi: In<Void>, bits: i32, group: i32, ty: i32, gu: In<f32>, ids: In<i32>, wts: In<f32>, S: i32, x: Out<f32>, rows: i32, cols: i32 }
    /// `gemv_q2_routed`: the top-K of `E` router logits, then the gate/up GEMV of the chosen experts (slot z = grid.y); block (0, 0) writes `ids_out`/`wts_out`.
    GemvRoutedParams spread ["gemv_q2_routed"] { w: In<Void>, sc: In<Void>, bi: In<Void>, bits: i32, group: i32, ty: i32, x: In<f32>, y: Out<f32>, rows: i32, cols: i32, normw: In<f32>, eps: f32, logits: In<f32>, E: i32, K: i32, renorm: i32, ids_out: Out<i32>, wts_out: Out<f32>, rank: i32 }
    /// `moe_fused_q`: the decode MoE in one launch (routing, gate/up into `gu`, down + residual into `x`; blocks meet on `ctr`).
    /// (`wr` not null: the router's `R` rows are computed first, into `logits`.)
    MoeFusedParams spread ["moe_fused_q", "moe_fused_q2", "moe_fused_q2s", "moe_fused_q2s_given", "moe_fused_q2s_acc", "moe_fused_q2s_accb"] { wg: In<Void>, sg: In<Void>, bg: In<Void>, wd: In<Void>, sd: In<Void>, bd: In<Void>, bits: i32, group_g: i32, group_d: i32, ty: i32, x: Out<f32>, gu: Out<f32>, inter: i32, H: i32, normw: In<f32>, eps: f32, logits: Out<f32>, E: i32, K: i32, renorm: i32, ids_out: Out<i32>, wts_out: Out<f32>, ctr: Out<u64>, bps: i32, rank: i32, wr: In<Void>, sr: In<Void>, br: In<Void>, bits_r: i32, group_r: i32, ty_r: i32, R: i32, trace: Out<u64>, fixed: i32, acc: i32, rblocks: i32 }
    /// `moe_topk`: softmax + top-K of `E` logits per row (stride `lstride`) into `ids`/`wout` (and `ids2` gate/up rows); `shared`: slot K is the shared expert.
    MoeTopkParams spread ["moe_topk"] { logits: In<f32>, E: i32, K: i32, renorm: i32, ids: Out<i32>, wout: Out<f32>, ids2: Out<i32>, lstride: i64, shared: i32 }
    /// `moe_combine`: x += Σ_k w_k ye[k] + g·ys, g = sigmoid(sg) (1 without sg).
    MoeCombineParams spread ["moe_combine"] { x: Out<f32>, ye: In<f32>, w: In<f32>, ys: In<f32>, sg: In<f32>, H: i32, K: i32 }
    /// `moe_align`: `P` routed pairs grouped by expert: `perm`, `inv` and the tile list of tiles of at most `bm` rows.
    MoeAlignParams spread ["moe_align"] { ids: In<i32>, P: i32, E: i32, bm: i32, perm: Out<i32>, inv: Out<i32>, tiles: Out<i32> }
    /// `moe_combine_rows`: x[t] += Σ_k w[t,k] ye[inv[t·K+k]] + sigmoid(sg[t·sgs]) ys[t].
    MoeCombineRowsParams spread ["moe_combine_rows"] { x: Out<f32>, ye: In<f32>, inv: In<i32>, w: In<f32>, ys: In<f32>, sg: In<f32>, sgs: i64, H: i32, K: i32 }
    /// `conv_step`: one token of the causal conv1d + SiLU over `C` channels, `K` taps (row i of grid.y: input `x + i·ldx`, output `y + i·ldy`, state `states[i]` or `state`).
    ConvStepParams spread ["conv_step"] { x: In<f32>, state: Out<f32>, w: In<f32>, y: Out<f32>, C: i32, K: i32, states: In<u64>, ldx: i64, ldy: i64 }
    /// `gdn_step`: one gated-delta-rule step per value head (one thread per value column), rows on state tables as `conv_step`.
    GdnStepParams spread ["gdn_step"] { y: In<f32>, bproj: In<f32>, aproj: In<f32>, z: In<f32>, dt_bias: In<f32>, neg_a: In<f32>, normw: In<f32>, S: Out<f32>, out: Out<f32>, hk: i32, hv: i32, dk: i32, dv: i32, eps: f32, states: In<u64>, ldy: i64, ldp: i64, ldo: i64 }
    /// `gdn_step_par`: `gdn_step` for one sequence with the rows of a head's state split over the block.
    GdnStepParParams spread ["gdn_step_par", "gdn_step_par_e", "gdn_step_c4"] { y: In<f32>, bproj: In<f32>, aproj: In<f32>, z: In<f32>, dt_bias: In<f32>, neg_a: In<f32>, normw: In<f32>, S: Out<f32>, out: Out<f32>, hk: i32, hv: i32, dk: i32, dv: i32, eps: f32 }
    /// `gdn_step_par_rows`: `gdn_step_par` for several rows, states from `states`.
    GdnStepParRowsParams spread ["gdn_step_par_rows"] { y: In<f32>, bproj: In<f32>, aproj: In<f32>, z: In<f32>, dt_bias: In<f32>, neg_a: In<f32>, normw: In<f32>, out: Out<f32>, hk: i32, hv: i32, dk: i32, dv: i32, eps: f32, states: In<u64>, ldy: i64, ldp: i64, ldo: i64 }
    /// `conv_prefill`: the causal conv1d + SiLU over `T` tokens (input rows of stride `ldx`).
    ConvPrefillParams spread ["conv_prefill"] { x: In<f32>, ldx: i64, state: In<f32>, w: In<f32>, y: Out<f32>, C: i32, K: i32, T: i32 }
    /// `conv_state`: the conv state after `T` tokens.
    ConvStateParams spread ["conv_state"] { x: In<f32>, ldx: i64, state: Out<f32>, C: i32, K: i32, T: i32 }
    /// `gdn_qk_prep`: q/k L2 normalization per head and token (`qn`, `kn`, their dot products `kq`).
    GdnQkPrepParams spread ["gdn_qk_prep"] { y: In<f32>, ldy: i64, qn: Out<f32>, kn: Out<f32>, kq: Out<f32>, hk: i32, dk: i32 }
    /// `gdn_scan`: the serial gated delta rule over `T` tokens, state in registers.
    GdnScanParams spread ["gdn_scan"] { qn: In<f32>, kn: In<f32>, kq: In<f32>, y: In<f32>, ldy: i64, bproj: In<f32>, aproj: In<f32>, ldp: i64, dt_bias: In<f32>, neg_a: In<f32>, S: Out<f32>, o: Out<f32>, hk: i32, hv: i32, dk: i32, dv: i32, T: i32 }
    /// `gdn_out_norm`: the gated RMSNorm of the output, in place, or with `xb` set, as bf16 rows
    /// in gemm_wg's k order into `xb` (gemm_wg's workspace; o is then left as it was).
    GdnOutNormParams spread ["gdn_out_norm"] {
        o: Out<f32>, z: In<f32>, ldz: i64, w: In<f32>, hv: i32, dv: i32, eps: f32, xb: Out<u16>
    }
    /// `gdn_chunk_prep`: the chunked delta rule's per-chunk preparation (`Wt`, `Qt`, `U`, `Mt`, `G`).
    GdnChunkPrepParams spread ["gdn_chunk_prep", "gdn_chunk_prep_tc"] { qn: In<f32>, kn: In<f32>, y: In<f32>, ldy: i64, bproj: In<f32>, aproj: In<f32>, ldp: i64, dt_bias: In<f32>, neg_a: In<f32>, Wt: Out<f32>, Qt: Out<f32>, U: Out<f32>, Mt: Out<f32>, G: Out<f32>, hk: i32, hv: i32, dk: i32, dv: i32, T: i32 }
    /// `gdn_chunk_scan`: the scan over chunks (state `S`, output `o`).
    GdnChunkScanParams spread ["gdn_chunk_scan", "gdn_chunk_scan_tc"] { kn: In<f32>, Wt: In<f32>, Qt: In<f32>, U: In<f32>, Mt: In<f32>, G: In<f32>, S: Out<f32>, o: Out<f32>, hk: i32, hv: i32, dk: i32, dv: i32, T: i32 }
    /// `argmax`: the index of each row's largest of `n` values (row = block) into `out`.
    ArgmaxParams spread ["argmax"] { x: In<f32>, n: i32, out: Out<i32> }
    /// `argmax_io`: the greedy loop's pass: argmax into the step's input slot `io` and the token `ring`.
    ArgmaxIoParams spread ["argmax_io"] { x: In<f32>, n: i32, io: Out<i32>, ring: Out<i32>, ws: Out<SampWs> }
    /// `samp_max`, `samp_zsum`: the sampler's max and Z passes over `n` logits (parameters `sp`, workspace `ws`).
    SampPassParams spread ["samp_max", "samp_zsum"] { x: In<f32>, n: i32, sp: In<f32>, ws: Out<SampWs> }
    /// `samp_radix`: one radix-select pass (`sel` 0: top-k, 1: top-p; `pass` 0-2).
    SampRadixParams spread ["samp_radix"] { x: In<f32>, n: i32, sp: In<f32>, ws: Out<SampWs>, sel: i32, pass: i32 }
    /// `samp_draw`: the draw, into `io` and `ring` as `argmax_io`.
    SampDrawParams spread ["samp_draw"] { x: In<f32>, n: i32, io: Out<i32>, ring: Out<i32>, sp: In<f32>, ws: Out<SampWs> }
    /// `pstep`: the persistent decode step over `nphase` phases of the table at `phases`; `ctr`
    /// [phase counter, exit ticket, launches so far], `flags` [phase][block] done flags.
    PstepParams spread ["pstep"] { phases: In<PsPhase>, nphase: i32, ctr: Out<u64>, flags: Out<u32>, slot_bytes: i32, ns: i32, xmax: i32, trace: Out<u32>, dbg: i32 }
    /// `attn_prep`, `attn_prep_bf16`: q/k RMSNorm + partial RoPE (`rot` dims, `theta`) of rows at
    /// positions `pos_p`; queries to `q_out`, K/V to the cache `kc`/`vc` (f32 or bf16 by kernel), or
    /// each row's own cache from `kvt` when set; `early` (no `kvt`): the RoPE angles and norm
    /// weights taken before the wait for the previous kernel ([`super::ops::AttnPrep::early`]).
    AttnPrepParams spread ["attn_prep", "attn_prep_bf16", "attn_prep_fp8"] {
        qg: In<f32>, kin: In<f32>, vin: In<f32>, qn: In<f32>, kn: In<f32>, q_out: Out<f32>, kc: Out<Void>, vc: Out<Void>,
        nh: i32, hkv: i32, hd: i32, gated: i32, rot: i32, pos_p: In<i32>, theta: f64, eps: f32, ld: i64, kvt: In<u64>,
        early: i32
    }
    /// `attn_decode`, `attn_decode_bf16`: one query token per head over the cache, split over
    /// grid.y blocks (partials to `part`).
    AttnDecodeParams spread ["attn_decode", "attn_decode_bf16"] {
        q: In<f32>, kc: In<Void>, vc: In<Void>, part: Out<f32>, nh: i32, hkv: i32, hd: i32, pos_p: In<i32>, scale: f32,
        kvt: In<u64>
    }
    /// The GQA-packed decode attention (one block per KV head and split): `attn_decode_gqa{1,2,4,8}`
    /// (f32 and bf16 caches) and the tensor-core `attn_decode_tc{64,128,256}`; `early` (tc over a
    /// bf16 cache, one sequence): the first tiles requested before the wait for attn_prep
    /// ([`super::ops::attn_early`]).
    AttnGqaParams spread [
        "attn_decode_gqa1", "attn_decode_gqa2", "attn_decode_gqa4", "attn_decode_gqa8",
        "attn_decode_gqa1_bf16", "attn_decode_gqa2_bf16", "attn_decode_gqa4_bf16", "attn_decode_gqa8_bf16",
        "attn_decode_tc64", "attn_decode_tc128", "attn_decode_tc256", "attn_decode_tc64_fp8", "attn_decode_tc128_fp8",
        "attn_decode_tc256_fp8"
    ] {
        q: In<f32>, kc: In<Void>, vc: In<Void>, part: Out<f32>, hkv: i32, hd: i32, pos_p: In<i32>, scale: f32, kvt: In<u64>,
        early: i32
    }
    /// `attn_decode_tc{64,128,256}_fold`: the tensor-core decode kernel (one sequence, bf16 cache)
    /// with attn_combine's merge in its tail: the last blocks of each KV head to finish merge its
    /// splits into `out` (gated by `qg` when `gated`), meeting on the KV heads' u64 counters `ctr`.
    AttnDecFoldParams spread ["attn_decode_tc64_fold", "attn_decode_tc128_fold", "attn_decode_tc256_fold"] {
        q: In<f32>, kc: In<Void>, vc: In<Void>, part: Out<f32>, hkv: i32, pos_p: In<i32>, scale: f32, early: i32,
        qg: In<f32>, out: Out<f32>, gated: i32, ctr: Out<u64>
    }
    /// `attn_combine`: the decode splits' partials merged per head, times the output gate `qg` (rows of stride `ldqg`) when `gated`.
    AttnCombineParams spread ["attn_combine", "attn_combine_ds"] { part: In<f32>, qg: In<f32>, out: Out<f32>, nh: i32, hd: i32, S: i32, gated: i32, ldqg: i64 }
    /// Causal prefill attention of `T` tokens (SIMT, tensor-core and flash kernels, f32 or bf16
    /// caches by kernel), output gate from `qg` rows of stride `ldg` when `gated`; `km` / `vm` the
    /// caches' TMA maps (attn_prefill_wg* only).
    AttnPrefillParams spread [
        "attn_prefill", "attn_prefill_bf16", "attn_prefill_tc", "attn_prefill_tc_bf16",
        "attn_prefill_fa64", "attn_prefill_fa128", "attn_prefill_fa256", "attn_prefill_fa64_fp8",
        "attn_prefill_fa128_fp8", "attn_prefill_fa256_fp8", "attn_prefill_wg64",
        "attn_prefill_wg128", "attn_prefill_wg256"
    ] {
        q: In<f32>, kc: In<Void>, vc: In<Void>, qg: In<f32>, ldg: i64, out: Out<f32>, nh: i32, hkv: i32, hd: i32, T: i32,
        pos_p: In<i32>, scale: f32, gated: i32, km: TmaMap, vm: TmaMap
    }
    /// `embed_row`: out[t, c] = W[row[t], c] dequantized, for c < cols (grid.y = tokens).
    EmbedParams ["embed_row"] {
        w: In<Void>, sc: In<Void>, bi: In<Void>, bits: i32, group: i32, ty: i32,
        row: In<i32>, cols: i32, out: Out<f32>
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The C side sees the Rust fields in order with the C type of each Rust type.
    #[test]
    fn c_decls_declare_each_struct_in_field_order() {
        let d = c_decls();
        assert!(
            d.contains("struct RmsNormParams { const float* x; const float* w; float* y; int d; float eps; };"),
            "{d}"
        );
        assert!(d.contains("struct SiluMulPairsParams { const float* gu; float* h; int n; int pairs; };"), "{d}");
    }

    /// A spread struct's kernels take its fields: the C parameter list in field order, and the
    /// launch's argument pointers at the fields' offsets (C's layout: `ldx` after the padding
    /// that aligns it, and the pointer after `gdiv`).
    #[test]
    fn spread_structs_list_their_fields_as_parameters() {
        let d = c_decls();
        assert!(
            d.contains("#define GemmParams_fields const void* w, const void* sc, const void* bi, int bits, int group, int ty, const float* x, long long ldx,"),
            "{d}"
        );
        const { assert!(GemmParams::SPREAD && !RmsNormParams::SPREAD) };
        assert_eq!(GemmParams::OFFSETS.len(), 23);
        // the TMA maps: 128 bytes each on 64-byte boundaries, parameters the kernel may take the
        // address of
        assert_eq!(GemmParams::SIZES[21..], [128, 128]);
        assert!(GemmParams::OFFSETS[21..].iter().all(|o| o % 64 == 0));
        assert!(d.contains("const __grid_constant__ TmaMap xm, const __grid_constant__ TmaMap wm\n"), "{d}");
        assert!(d.contains("struct GemmParams {") && d.contains(" TmaMap xm; TmaMap wm; };"), "{d}");
        assert_eq!(&GemmParams::OFFSETS[..9], &[0, 8, 16, 24, 28, 32, 40, 48, 56]);
        assert_eq!(GemmParams::OFFSETS[9], 64); // gdiv
        assert_eq!(GemmParams::OFFSETS[10], 72); // y, aligned past gdiv
        assert_eq!(GemmParams::SIZES[..4], [8, 8, 8, 4]);
        let k: Vec<_> = kernels().into_iter().filter(|k| k.name == "gemm_skinny8_q4w").collect();
        assert_eq!(k.len(), 1);
        assert_eq!(k[0].spread.map(|s| s.len()), Some(23));
    }

    /// Rust lays the structs out as C does: pointers 8 bytes, then 4-byte fields.
    #[test]
    fn layouts_are_the_c_layouts() {
        assert_eq!(std::mem::size_of::<RmsNormParams>(), 8 * 3 + 4 + 4);
        assert_eq!(std::mem::offset_of!(RmsNormParams, d), 24);
        assert_eq!(std::mem::size_of::<SiluMulPairsParams>(), 8 * 2 + 4 + 4);
    }
}
