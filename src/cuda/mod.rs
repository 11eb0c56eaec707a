//! The CUDA backend: our own kernels (`kernels/*.cu`), compiled at run time with NVRTC for the
//! device's architecture and launched through the CUDA driver API (`cudarc`, dynamically loaded).
//!
//! Nothing here needs CUDA at build time, and nothing panics when it is absent: [`probe`] dlopens
//! `libcuda` and `libnvrtc` first (cudarc itself panics when a library is missing), so
//! `--device cuda` on a machine without a GPU is a clear error and `--device auto` falls back to
//! the CPU.
//!
//! Layout: [`Gpu`] (context, compiled module, launch helper, device buffers); `ops` (one typed
//! wrapper per kernel); `model` (weights uploaded once, [`CudaSession`] running the forward pass).
//! Activations are fp32 on the device; weights stay in their checkpoint format.

mod kernel_names;
pub mod kv_fp8;
mod model;
mod ops;
mod paged;
pub mod params;
pub mod profile;
pub mod timeline;

pub use model::{upload_cached, uploaded, CudaBatch, CudaModel, CudaSession};
pub use ops::{
    gdn_chunk_floats, gdn_prefill_kernel, gemv_default, sampling_params_bytes, AttnDecode, AttnKernel, AttnPlan,
    AttnPrep, GdnPrefill, GdnPrefillKernel, GdnRows, GdnStep, GemmKernel, GemvKernel, GpuLinear, KvDtype, MoeForm,
    Precision, PrefillAttn, RouteSums, RouterTail, TailTopk, SAMPLE_WS_BYTES,
};
pub use paged::PagedBuf;

/// A captured CUDA graph, ready to replay on [`Gpu::stream`].
pub struct Graph(sys::CUgraphExec);

// SAFETY: a graph exec handle may be launched from any thread with the context current.
unsafe impl Send for Graph {}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: the handle came from instantiate and is destroyed once.
        let _ = unsafe { drv::graph::exec_destroy(self.0) };
    }
}

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{result as drv, sys, CudaContext};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

pub use kernel_names::*;

fn try_dlopen(names: &[String]) -> bool {
    names.iter().any(|n| {
        // SAFETY: loading the CUDA driver / NVRTC runs only their library initialisers.
        unsafe { libloading::Library::new(n.as_str()) }.is_ok()
    })
}

/// Whether libnvrtc (the CUDA 13 runtime compiler) can be loaded.
pub fn nvrtc_available() -> bool {
    try_dlopen(&cudarc::get_lib_name_candidates("nvrtc"))
}

/// Checks that the CUDA driver and NVRTC libraries exist, without touching cudarc (which panics
/// when they are missing). Err carries a message for the user.
pub fn probe() -> Result<()> {
    if !try_dlopen(&cudarc::get_lib_name_candidates("cuda")) {
        bail!("no CUDA GPU/driver found (libcuda.so.1 could not be loaded); use --device cpu");
    }
    if !nvrtc_available() {
        bail!(
            "CUDA driver found but NVRTC (libnvrtc.so.13) could not be loaded; install the CUDA 13 \
             runtime compiler or put its lib folder on LD_LIBRARY_PATH"
        );
    }
    Ok(())
}

/// NVRTC architecture name for a compute capability (`a` variants where they exist).
pub fn arch_name(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (9, 0) => "sm_90a",
        (10, 0) => "sm_100a",
        (12, 0) => "sm_120a",
        (8, 9) => "sm_89",
        (8, 6) => "sm_86",
        (8, 0) => "sm_80",
        (8, _) => "sm_80",
        _ => "sm_90",
    }
}

/// Folders passed to NVRTC with `-I` (only those that exist; our kernels include no headers, so
/// this is for future ones): `$LILY_CUDA_INCLUDE`, `/usr/local/cuda/include`.
fn include_paths() -> Vec<String> {
    let mut v: Vec<String> = std::env::var("LILY_CUDA_INCLUDE").ok().into_iter().collect();
    v.push("/usr/local/cuda/include".into());
    v.into_iter().filter(|p| std::path::Path::new(p).is_dir()).collect()
}

fn fnv1a(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.bytes().chain([0u8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

fn cache_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("LILY_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .ok()
        .or_else(|| std::env::var("HOME").ok().map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("lily").join("kernels"))
}

/// NVRTC's version as "major.minor" (part of the kernel cache key).
fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints; the library was found by `nvrtc_available`.
    let ok = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if ok == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        format!("{major}.{minor}")
    } else {
        "unknown".into()
    }
}

/// NVRTC's options for the kernels (besides the architecture).
const COMPILE_FLAGS: [&str; 1] = ["--std=c++17"];

/// The kernel cache's file name for `arch`, without extension: `lily-{arch}-{hash}` of the
/// source, the architecture, the flags and NVRTC's version (`.ptx`: [`compile`]'s output;
/// `.cubin`: the same PTX assembled by ptxas for `arch`, [`cached_cubin`]).
pub fn cache_stem(arch: &str) -> String {
    stem_of(&kernel_source(), arch)
}

fn stem_of(src: &str, arch: &str) -> String {
    let key = fnv1a(&[src, arch, &COMPILE_FLAGS.join(" "), &nvrtc_version()]);
    format!("lily-{arch}-{key:016x}")
}

/// The kernels assembled for `arch` (a cubin in the kernel cache, put there by scripts/gpu.sh's
/// bundle from tests/cuda_compile.rs's ptxas run), if present: loading it skips the driver's
/// PTX JIT (about a minute for every kernel on a fresh machine).
fn cached_cubin(arch: &str) -> Option<Vec<u8>> {
    if std::env::var("LILY_KERNEL_CUBIN").as_deref() == Ok("0") {
        return None;
    }
    std::fs::read(cache_dir()?.join(format!("{}.cubin", cache_stem(arch)))).ok()
}

/// Compiles every kernel for `arch` (PTX text), through an on-disk cache keyed by the source
/// hash, the architecture, the flags and NVRTC's version (not by the include paths: the kernels
/// include no CUDA headers, so a cache filled on another machine with the same NVRTC, such as
/// scripts/gpu.sh's bundle, is found). Returns (ptx, whether it came from the cache).
pub fn compile(arch: &'static str) -> Result<(String, bool)> {
    let src = kernel_source();
    let includes = include_paths();
    let flags = COMPILE_FLAGS.map(String::from);
    let path = cache_dir().map(|d| d.join(format!("{}.ptx", stem_of(&src, arch))));
    if let Some(p) = &path {
        if let Ok(ptx) = std::fs::read_to_string(p) {
            return Ok((ptx, true));
        }
    }
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        include_paths: includes,
        options: flags.to_vec(),
        name: Some("lily.cu".into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&src, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            anyhow!("NVRTC failed to compile the kernels for {arch}:\n{}", log.to_string_lossy())
        }
        other => anyhow!("NVRTC error: {other:?}"),
    })?;
    let text = ptx.to_src();
    if let Some(p) = &path {
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
            let tmp = p.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, &text).is_ok() {
                let _ = std::fs::rename(&tmp, p);
            }
        }
    }
    Ok((text, false))
}

/// One device with the compiled kernels. All work goes to the legacy default stream, in order;
/// copies to the host synchronize.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub name: String,
    pub arch: &'static str,
    pub total_mem: usize,
    /// Streaming multiprocessors (grid sizes of the persistent kernels).
    pub sms: u32,
    /// Dynamic shared memory a block may opt in to (bytes; set on the kernels that use more
    /// than 48 KB).
    pub smem_optin: usize,
    /// The device's own opt-in limit (bytes), set on the flash-attention prefill kernels, whose
    /// tiles need up to 192 KB ([`fa_smem`]).
    pub smem_optin_max: usize,
    /// Programmatic dependent launch for [`PDL_KERNELS`]: on devices that have it (compute
    /// capability 9.0+) unless `LILY_CUDA_PDL=0`.
    pub pdl: bool,
    /// `LILY_CUDA_TIMELINE=1`: the timeline build's record buffer ([`timeline`]).
    pub timeline: Option<timeline::Timeline>,
    funcs: HashMap<&'static str, sys::CUfunction>,
    /// The stream every kernel runs on: a blocking stream (it synchronizes with the legacy
    /// default stream, which the synchronous copies use) that CUDA graphs can capture.
    pub stream: sys::CUstream,
    /// gemm_skinny's split-K workspace: [`SPLITK_PART_BYTES`] of partial sums, then
    /// [`SPLITK_TICKETS`] u32 arrival tickets (zero between launches). Kernels on the one
    /// stream use it in turn.
    pub splitk_ws: u64,
    /// gemm_wg's input workspace ([`WG_WS_BYTES`]: the bf16, k-permuted copy of a product's
    /// inputs), 0 where the device has no wgmma (not sm_90a). Kernels on the one stream use it
    /// in turn.
    pub wg_ws: u64,
    /// The physical pages of the KV caches ([`paged`]).
    pages: std::sync::Mutex<paged::PagePool>,
}

/// Bytes of partial sums a split-K skinny product may write (ksplit · M · N floats).
pub const SPLITK_PART_BYTES: usize = 8 << 20;
/// Blocks (row tile, sub-tile) of a split-K skinny product: one ticket each.
pub const SPLITK_TICKETS: usize = 4096;
/// Bytes of gemm_wg's input workspace: the widest product input of an 8192-token prefill chunk
/// with the routed experts' gate/up rows written out in tile order for gemm_wt (9 x 8192 rows of
/// 2048 bf16, 302 MB); larger inputs take gemm_pipe (or, gathered, stay gathered on gemm_wg).
pub const WG_WS_BYTES: usize = 384 << 20;

impl Drop for Gpu {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            // SAFETY: allocated in Gpu::new, freed once; the context is still alive here.
            let _ = unsafe { drv::free_sync(self.splitk_ws) };
            if self.wg_ws != 0 {
                // SAFETY: as above.
                let _ = unsafe { drv::free_sync(self.wg_ws) };
            }
        }
    }
}

// SAFETY: CUfunction handles are immutable after load and valid in every thread that has the
// context current (every entry point binds it).
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

/// `LILY_CUDA_SKIP=k1,k2`: a timing experiment that launches nothing for the named kernels
/// (results are garbage; `lily bench` then shows what those kernels cost inside the replayed
/// step, overlap and launch gaps included).
fn skipped(name: &str) -> bool {
    static S: OnceLock<Vec<String>> = OnceLock::new();
    S.get_or_init(|| {
        std::env::var("LILY_CUDA_SKIP").map_or(Vec::new(), |v| v.split(',').map(|s| s.trim().to_string()).collect())
    })
    .iter()
    .any(|s| s == name)
}

pub use profile::{profiling, report as profile_report};

static GPU: OnceLock<std::result::Result<Arc<Gpu>, String>> = OnceLock::new();

/// The process-wide GPU (device 0), initialised on first use.
pub fn gpu() -> Result<Arc<Gpu>> {
    GPU.get_or_init(|| Gpu::init().map(Arc::new).map_err(|e| format!("{e:#}"))).clone().map_err(|e| anyhow!(e))
}

impl Gpu {
    fn init() -> Result<Gpu> {
        probe()?;
        let n = CudaContext::device_count().map_err(|e| anyhow!("no CUDA GPU/driver found: {e:?}"))?;
        if n < 1 {
            bail!("no CUDA GPU/driver found (the driver reports no devices)");
        }
        let ctx = CudaContext::new(0).map_err(|e| anyhow!("CUDA context on device 0: {e:?}"))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let (maj, min) = ctx.compute_capability().map_err(|e| anyhow!("{e:?}"))?;
        let arch = arch_name(maj, min);
        let total_mem = ctx.total_mem().unwrap_or(0);
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| anyhow!("{e:?}"))?
            .max(1) as u32;
        ctx.bind_to_thread().map_err(|e| anyhow!("{e:?}"))?;
        // SAFETY: a cubin image read whole from the cache; the module lives as long as the
        // process. A cubin the driver refuses falls back to the PTX.
        let cubin =
            cached_cubin(arch).and_then(|b| unsafe { drv::module::load_data(b.as_ptr() as *const c_void) }.ok());
        let module = match cubin {
            Some(m) => m,
            None => {
                let (ptx, _) = compile(arch)?;
                let c = CString::new(ptx).context("PTX contains a NUL")?;
                // SAFETY: c is a NUL-terminated PTX image; the module lives as long as the process.
                unsafe { drv::module::load_data(c.as_ptr() as *const c_void) }
                    .map_err(|e| anyhow!("loading the compiled kernels: {e:?}"))?
            }
        };
        let timeline = if timeline::enabled() { Some(timeline::Timeline::new(module)?) } else { None };
        let mut funcs = HashMap::new();
        for k in all_kernels() {
            // SAFETY: module is loaded and never unloaded.
            let f = unsafe { drv::module::get_function(module, CString::new(k).unwrap()) }
                .map_err(|e| anyhow!("kernel {k} missing from the module: {e:?}"))?;
            funcs.insert(k, f);
        }
        let optin = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .unwrap_or(48 * 1024)
            .max(48 * 1024) as usize;
        let smem_optin = optin.min(160 * 1024);
        let fa = [64, 128, 256].map(|d| (fa_kernel(d, false), fa_smem(d).min(optin)));
        let fa8 = [64, 128, 256].map(|d| (fa_kernel(d, true), fa_smem_fp8(d).min(optin)));
        let fa_wg = [64, 128, 256].map(|d| (wg_attn_kernel(d), wg_attn_smem(d).min(optin)));
        let pipe = [
            ("gemm_pipe64", GEMM_PIPE_SMEM64),
            ("gemm_pipe128", GEMM_PIPE_SMEM128),
            ("gemm_wg64", GEMM_WG_SMEM64),
            ("gemm_wg128", GEMM_WG_SMEM128),
            ("gemm_wg256", GEMM_WG_SMEM256.min(optin)),
        ];
        let wt = GEMM_WT_KERNELS.map(|((bt, bits), k)| (k, gemm_wt_smem(bt, bits).min(optin)));
        let wsp = GEMM_WSP_KERNELS.map(|(_, k)| (k, optin - GEMM_WSP_STATIC_SMEM));
        let dec = [(64, false), (128, false), (256, false), (64, true), (128, true), (256, true)]
            .map(|(d, f8)| (attn_dec_kernel(d, f8), attn_dec_smem(d, f8).min(optin)));
        let dec_fold = [64, 128, 256].map(|d| (attn_dec_fold_kernel(d), attn_dec_smem(d, false).min(optin)));
        let skinny = SKINNY_KERNELS.map(|k| (k, smem_optin));
        let pstep = [("pstep", optin)];
        let gdn = [("gdn_chunk_scan_tc", GDN_TC_SMEM.min(optin)), ("gdn_chunk_prep_tc", GDN_PREP_TC_SMEM.min(optin))];
        for (k, bytes) in skinny
            .into_iter()
            .chain(fa)
            .chain(fa8)
            .chain(fa_wg)
            .chain(pipe)
            .chain(wt)
            .chain(wsp)
            .chain(dec)
            .chain(dec_fold)
            .chain(pstep)
            .chain(gdn)
        {
            // SAFETY: a valid function handle and attribute; the value is within the device limit.
            unsafe {
                sys::cuFuncSetAttribute(
                    funcs[k],
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
            }
            .result()
            .map_err(|e| anyhow!("shared memory opt-in for {k}: {e:?}"))?;
        }
        let stream = drv::stream::create(drv::stream::StreamKind::Default).map_err(|e| anyhow!("{e:?}"))?;
        let pdl = maj >= 9 && std::env::var("LILY_CUDA_PDL").map_or(true, |v| v != "0");
        // SAFETY: a plain device allocation, zeroed (the tickets start at 0), freed in Drop.
        let splitk_ws = unsafe { drv::malloc_sync(SPLITK_PART_BYTES + SPLITK_TICKETS * 4) }
            .map_err(|e| anyhow!("split-K workspace: {e:?}"))?;
        unsafe { drv::memset_d8_sync(splitk_ws, 0, SPLITK_PART_BYTES + SPLITK_TICKETS * 4) }
            .map_err(|e| anyhow!("{e:?}"))?;
        let wg_ws = if arch == "sm_90a" {
            // SAFETY: a plain device allocation, freed in Drop.
            unsafe { drv::malloc_sync(WG_WS_BYTES) }.map_err(|e| anyhow!("gemm_wg workspace: {e:?}"))?
        } else {
            0
        };
        Ok(Gpu {
            ctx,
            name,
            arch,
            total_mem,
            sms,
            smem_optin,
            smem_optin_max: optin,
            pdl,
            timeline,
            funcs,
            stream,
            splitk_ws,
            wg_ws,
            pages: std::sync::Mutex::new(paged::PagePool::new()),
        })
    }

    /// Makes the context current on this thread (sessions may move between threads).
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| anyhow!("binding the CUDA context: {e:?}"))
    }

    /// Free and total device memory in bytes (`cuMemGetInfo`).
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        drv::mem_get_info().map_err(|e| anyhow!("querying device memory: {e:?}"))
    }

    /// Launches `name` on the params struct `p` ([`params`]: declared to the kernel from the
    /// same definition; its one argument, or for a spread struct its fields in order), with
    /// `shared` bytes of dynamic shared memory.
    pub fn launch_params<P: params::KernelParams>(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        p: &P,
    ) -> Result<()> {
        let mut copy = *p;
        let base = &mut copy as *mut P as *mut u8;
        if P::SPREAD {
            // SAFETY: each offset is a field's offset inside `copy`, which outlives the launch call.
            let mut ptrs: Vec<*mut c_void> =
                P::OFFSETS.iter().map(|&o| unsafe { base.add(o) } as *mut c_void).collect();
            self.launch_raw(name, grid, block, shared, &mut ptrs)
        } else {
            let mut ptrs = [base as *mut c_void];
            self.launch_raw(name, grid, block, shared, &mut ptrs)
        }
    }

    /// The launch itself: `ptrs` point at the kernel's arguments in order (the driver copies
    /// them before returning).
    fn launch_raw(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        ptrs: &mut [*mut c_void],
    ) -> Result<()> {
        let f = *self.funcs.get(name).ok_or_else(|| anyhow!("unknown kernel {name}"))?;
        if skipped(name) {
            return Ok(());
        }
        let prof = profiling();
        let t0 = if prof { Some(self.event_now()?) } else { None };
        if self.pdl && is_pdl(name) {
            // SAFETY: a plain C struct for which all-zero bytes are a valid value.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let cfg = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: shared,
                hStream: self.stream,
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: as for launch_kernel below; cfg and attr outlive the call.
            unsafe { sys::cuLaunchKernelEx(&cfg, f, ptrs.as_mut_ptr(), std::ptr::null_mut()) }
                .result()
                .map_err(|e| anyhow!("launching {name}: {e:?}"))?;
        } else {
            // SAFETY: the argument list matches the kernel's signature (its params struct,
            // declared to the kernel from the same definition: src/cuda/params.rs); every
            // pointer is a live device allocation of the size the kernel reads.
            unsafe { drv::launch_kernel(f, grid, (block, 1, 1), shared, self.stream, ptrs) }
                .map_err(|e| anyhow!("launching {name}: {e:?}"))?;
        }
        if let Some(t0) = t0 {
            let t1 = self.event_now()?;
            profile::record(name, profile::Ev(t0), profile::Ev(t1))?;
        }
        if self.timeline.is_some() {
            timeline::note_launch(name);
        }
        Ok(())
    }

    /// Milliseconds of device time the launches `f` queues take (events around them).
    pub fn time_ms(&self, f: impl FnOnce() -> Result<()>) -> Result<f64> {
        let t0 = self.event_now()?;
        f()?;
        let t1 = self.event_now()?;
        // SAFETY: both events were recorded on this stream and are destroyed once.
        unsafe {
            drv::event::synchronize(t1).map_err(|e| anyhow!("{e:?}"))?;
            let ms = drv::event::elapsed(t0, t1).map_err(|e| anyhow!("{e:?}"))?;
            let _ = drv::event::destroy(t0);
            let _ = drv::event::destroy(t1);
            Ok(ms as f64)
        }
    }

    fn event_now(&self) -> Result<sys::CUevent> {
        let e = drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| anyhow!("{e:?}"))?;
        // SAFETY: e is a fresh event, recorded on the default stream.
        unsafe { drv::event::record(e, self.stream) }.map_err(|e| anyhow!("{e:?}"))?;
        Ok(e)
    }

    /// The driver's CUDA version, e.g. "13.0".
    pub fn driver_version(&self) -> String {
        let mut v: std::ffi::c_int = 0;
        // SAFETY: a plain query writing one int.
        match unsafe { sys::cuDriverGetVersion(&mut v) }.result() {
            Ok(()) => format!("{}.{}", v / 1000, (v % 1000) / 10),
            Err(_) => "unknown".into(),
        }
    }

    /// Measured device-memory bandwidth in GB/s: the best of 5 device-to-device copies of
    /// 1 GiB (bytes read plus bytes written over the time between two events).
    pub fn measure_bandwidth(self: &Arc<Self>) -> Result<f64> {
        let n = 1usize << 30;
        let (a, b) = (self.zeros(n)?, self.zeros(n)?);
        let mut best = 0f64;
        for _ in 0..5 {
            let ms = self.time_ms(|| {
                // SAFETY: both buffers are live allocations of n bytes on this context.
                unsafe { drv::memcpy_dtod_async(b.ptr, a.ptr, n, self.stream) }.map_err(|e| anyhow!("{e:?}"))
            })?;
            best = best.max(2.0 * n as f64 / (ms / 1e3) / 1e9);
        }
        profile::note_bandwidth(best);
        Ok(best)
    }

    /// Dense bf16 tensor-core peak in TFLOP/s from the published specification, where known
    /// (H100/H200 SXM: 989), for the roofline share of prefill.
    pub fn bf16_peak_tflops(&self) -> Option<f64> {
        (self.name.contains("H100") || self.name.contains("H200")).then_some(989.0)
    }

    /// The NVRTC options the kernels were compiled with.
    pub fn kernel_flags(&self) -> String {
        let pdl = if self.pdl { ", programmatic dependent launch" } else { "" };
        format!("nvrtc --gpu-architecture={} --std=c++17{pdl}", self.arch)
    }

    /// Records the launches `f` makes on the stream into a graph (nothing runs yet).
    pub fn capture(&self, f: impl FnOnce() -> Result<()>) -> Result<Graph> {
        self.bind()?;
        // SAFETY: the stream is ours; capture ends below on every path.
        unsafe {
            drv::stream::begin_capture(self.stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(|e| anyhow!("begin capture: {e:?}"))?;
            let r = f();
            let g = drv::stream::end_capture(self.stream).map_err(|e| anyhow!("end capture: {e:?}"));
            r?;
            let g = g?;
            let exec = drv::graph::instantiate(g, sys::CUgraphInstantiate_flags(0));
            let _ = drv::graph::destroy(g);
            Ok(Graph(exec.map_err(|e| anyhow!("instantiate graph: {e:?}"))?))
        }
    }

    /// Replays a captured graph on the stream.
    pub fn replay(&self, g: &Graph) -> Result<()> {
        // SAFETY: g is a live graph exec of this context.
        unsafe { drv::graph::launch(g.0, self.stream) }.map_err(|e| anyhow!("graph launch: {e:?}"))
    }

    /// Waits for all queued work and reports any asynchronous kernel error.
    pub fn sync(&self) -> Result<()> {
        drv::ctx::synchronize().map_err(|e| anyhow!("CUDA error while running kernels: {e:?}"))
    }

    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DevBuf> {
        self.bind()?;
        let n = bytes.max(4);
        // SAFETY: a plain device allocation, freed in Drop.
        let ptr = unsafe { drv::malloc_sync(n) }
            .map_err(|e| anyhow!("cudaMalloc of {:.1} MB failed: {e:?}", n as f64 / 1e6))?;
        Ok(DevBuf { ptr, bytes, gpu: self.clone() })
    }

    pub fn zeros(self: &Arc<Self>, bytes: usize) -> Result<DevBuf> {
        let b = self.alloc(bytes)?;
        // SAFETY: b is a live allocation of at least `bytes` bytes.
        unsafe { drv::memset_d8_sync(b.ptr, 0, bytes.max(4)) }.map_err(|e| anyhow!("{e:?}"))?;
        Ok(b)
    }

    pub fn upload_bytes(self: &Arc<Self>, data: &[u8]) -> Result<DevBuf> {
        let b = self.alloc(data.len())?;
        b.write_bytes(0, data)?;
        Ok(b)
    }

    pub fn upload_f32(self: &Arc<Self>, data: &[f32]) -> Result<DevBuf> {
        self.upload_bytes(f32_bytes(data))
    }
}

pub fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern read back is only copied.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// A device allocation (freed on drop).
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
    gpu: Arc<Gpu>,
}

impl DevBuf {
    /// Sets every byte to zero (after the work queued before it).
    pub fn zero(&self) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: a live allocation of `bytes` bytes (at least 4 were allocated).
        unsafe { drv::memset_d8_sync(self.ptr, 0, self.bytes.max(4)) }.map_err(|e| anyhow!("{e:?}"))
    }

    /// Device address `off` bytes in.
    pub fn at(&self, off: usize) -> u64 {
        self.ptr + off as u64
    }

    pub fn write_bytes(&self, off: usize, data: &[u8]) -> Result<()> {
        assert!(off + data.len() <= self.bytes, "DevBuf write out of bounds");
        if data.is_empty() {
            return Ok(());
        }
        self.gpu.bind()?;
        // SAFETY: the destination range lies inside this allocation (asserted above).
        unsafe { drv::memcpy_htod_sync(self.ptr + off as u64, data) }.map_err(|e| anyhow!("upload: {e:?}"))
    }

    pub fn write_f32(&self, off_elems: usize, data: &[f32]) -> Result<()> {
        self.write_bytes(4 * off_elems, f32_bytes(data))
    }

    pub fn write_i32(&self, off_elems: usize, data: &[i32]) -> Result<()> {
        self.write_bytes(4 * off_elems, &data.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())
    }

    /// Copies `n` f32 values starting at element `off` back to the host (synchronizes).
    pub fn read_f32(&self, off: usize, n: usize) -> Result<Vec<f32>> {
        assert!(4 * (off + n) <= self.bytes, "DevBuf read out of bounds");
        let mut v = vec![0f32; n];
        if n == 0 {
            return Ok(v);
        }
        self.gpu.bind()?;
        // SAFETY: the source range lies inside this allocation (asserted above).
        unsafe { drv::memcpy_dtoh_sync(&mut v, self.ptr + 4 * off as u64) }
            .map_err(|e| anyhow!("CUDA error (reported at a copy back): {e:?}"))?;
        Ok(v)
    }

    pub fn read_i32(&self, n: usize) -> Result<Vec<i32>> {
        assert!(4 * n <= self.bytes);
        let mut v = vec![0i32; n];
        self.gpu.bind()?;
        // SAFETY: as in read_f32.
        unsafe { drv::memcpy_dtoh_sync(&mut v, self.ptr) }.map_err(|e| anyhow!("CUDA error: {e:?}"))?;
        Ok(v)
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: ptr came from malloc_sync and is freed once.
            let _ = unsafe { drv::free_sync(self.ptr) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every loaded kernel is launched through a params struct (src/cuda/params.rs), and every
    /// params struct names only loaded kernels.
    #[test]
    fn every_kernel_takes_a_params_struct() {
        let typed: std::collections::HashSet<&str> = params::kernels().into_iter().map(|k| k.name).collect();
        let untyped: Vec<&str> = all_kernels().filter(|k| !typed.contains(k)).collect();
        assert!(untyped.is_empty(), "kernels launched without a params struct: {untyped:?}");
        for k in &typed {
            assert!(all_kernels().any(|n| n == *k), "params for {k}, which is not loaded");
        }
    }

    /// Every gemm_skinny entry point is loaded, may take PDL (the kernel waits before reading
    /// activations), and gets the dynamic shared memory opt-in; the name picked for a pass width
    /// and weight format is that format's kernel.
    #[test]
    fn skinny_kernels_are_registered_and_picked_by_format() {
        for k in SKINNY_KERNELS {
            assert!(all_kernels().any(|n| n == k), "{k} is not loaded");
            assert!(is_pdl(k), "{k} is not a PDL kernel");
        }
        let want = [
            (16, 4, "gemm_skinny16_q4"),
            (32, 4, "gemm_skinny32_q4"),
            (8, 8, "gemm_skinny8_q8"),
            (16, 8, "gemm_skinny16_q8"),
            (32, 8, "gemm_skinny32_q8"),
            (8, 0, "gemm_skinny8_bf16"),
            (16, 0, "gemm_skinny16_bf16"),
            (32, 0, "gemm_skinny32_bf16"),
        ];
        for (tn, bits, name) in want {
            assert_eq!(skinny_kernel(tn, bits), name, "tn {tn} bits {bits}");
        }
        let eight = skinny_kernel(8, 4);
        assert!(eight == "gemm_skinny8_q4w" || eight == "gemm_skinny8_q4", "tn 8 bits 4: {eight}");
    }
}
