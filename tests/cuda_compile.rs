//! Every kernel compiles with NVRTC for sm_90a (the H200), with no GPU needed.
//!
//! Skips (and passes, saying so) when libnvrtc cannot be loaded, unless `LILY_REQUIRE_NVRTC=1`
//! (set by `.ci/run`, which installs the CUDA 13 NVRTC wheel), so a kernel that does not compile
//! fails CI.

#[test]
fn every_kernel_compiles_for_sm_90a() {
    if !lily::cuda::nvrtc_available() {
        if std::env::var("LILY_REQUIRE_NVRTC").as_deref() == Ok("1") {
            panic!("LILY_REQUIRE_NVRTC=1 but libnvrtc.so.13 could not be loaded (check LD_LIBRARY_PATH)");
        }
        eprintln!("SKIPPED: NVRTC (libnvrtc.so.13) not found; set LD_LIBRARY_PATH to compile the kernels");
        return;
    }
    // A fresh cache folder so the compiler really runs.
    let dir = std::env::temp_dir().join(format!("lily-kernel-cache-test-{}", std::process::id()));
    std::env::set_var("LILY_KERNEL_CACHE", &dir);
    let t = std::time::Instant::now();
    let (ptx, cached) = lily::cuda::compile("sm_90a").unwrap_or_else(|e| panic!("{e:#}"));
    assert!(!cached);
    eprintln!("compiled {} bytes of PTX for sm_90a in {:.2} s", ptx.len(), t.elapsed().as_secs_f64());
    // LILY_PTX_EXPORT=<dir>: the cache file goes there too (scripts/gpu.sh ships it in the bundle,
    // so the GPU machine skips NVRTC)
    if let Ok(out) = std::env::var("LILY_PTX_EXPORT") {
        std::fs::create_dir_all(&out).unwrap();
        for f in std::fs::read_dir(&dir).unwrap().flatten() {
            if f.path().extension().is_some_and(|e| e == "ptx") {
                std::fs::copy(f.path(), std::path::Path::new(&out).join(f.file_name())).unwrap();
            }
        }
    }
    for k in lily::cuda::all_kernels() {
        assert!(ptx.contains(&format!(".entry {k}(")), "kernel {k} missing from the PTX");
    }
    // A kernel that takes a params struct (src/cuda/params.rs) declares one parameter of the
    // struct's size, or for a spread struct one parameter per field of the field's size: its C
    // copy and the Rust struct the launch passes agree.
    for pk in lily::cuda::params::kernels() {
        let k = pk.name;
        let entry = &ptx[ptx.find(&format!(".entry {k}(")).unwrap_or_else(|| panic!("{k} missing"))..];
        let decl = &entry[..entry.find(')').unwrap()];
        match pk.spread {
            None => {
                let size = pk.size;
                assert!(
                    decl.contains(&format!("{k}_param_0[{size}]")),
                    "{k}: params of {size} bytes expected:\n{decl}"
                );
                assert!(!decl.contains(&format!("{k}_param_1")), "{k}: more than the params struct:\n{decl}");
            }
            Some(sizes) => {
                let params: Vec<&str> = decl.lines().filter(|l| l.contains(".param")).collect();
                assert_eq!(params.len(), sizes.len(), "{k}: {} fields expected:\n{decl}", sizes.len());
                for (i, (l, &sz)) in params.iter().zip(sizes).enumerate() {
                    // a by-value struct parameter (TmaMap) is declared as bytes: `.b8 NAME[size]`
                    let bytes = l.split('[').nth(1).and_then(|t| t.split(']').next()).and_then(|n| n.parse().ok());
                    let width = if let Some(b) = bytes {
                        b
                    } else if l.contains(".u64") || l.contains(".b64") || l.contains(".s64") || l.contains(".f64") {
                        8
                    } else if l.contains(".u32") || l.contains(".b32") || l.contains(".s32") || l.contains(".f32") {
                        4
                    } else {
                        0
                    };
                    assert!(l.contains(&format!("{k}_param_{i}")), "{k}: parameter {i} out of order:\n{decl}");
                    assert_eq!(width, sz, "{k}: parameter {i} of {sz} bytes expected: {l}");
                }
            }
        }
    }
    if let Ok(ptxas) = std::env::var("LILY_PTXAS") {
        let cubin = ptxas_report(&ptxas, &ptx, &dir);
        // with LILY_PTX_EXPORT the cubin goes there too, named as the kernel cache finds it
        if let Ok(out) = std::env::var("LILY_PTX_EXPORT") {
            let name = format!("{}.cubin", lily::cuda::cache_stem("sm_90a"));
            std::fs::copy(&cubin, std::path::Path::new(&out).join(name)).unwrap();
        }
    }
    // Second call comes from the on-disk cache.
    let (again, cached) = lily::cuda::compile("sm_90a").unwrap();
    assert!(cached && again == ptx);
    let _ = std::fs::remove_dir_all(&dir);
}

/// With `LILY_PTXAS=/path/to/ptxas` (the `nvidia-cuda-nvcc` wheel has one): assembles the PTX for
/// sm_90a, prints each kernel's registers and spills, and fails if any kernel spills registers
/// to local memory (a spill in a streaming kernel costs more than the kernel itself; pstep may
/// spill up to 128 bytes of per-chunk loop state, see below). The cubin
/// is left at `target/lily-sm_90a.cubin` for `nvdisasm`/`cuobjdump --dump-sass`; returns its path.
fn ptxas_report(ptxas: &str, ptx: &str, dir: &std::path::Path) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let src = dir.join("lily.ptx");
    std::fs::write(&src, ptx).unwrap();
    let out = std::process::Command::new(ptxas)
        .args(["-arch=sm_90a", "-v", "-o"])
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/target/lily-sm_90a.cubin"))
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("running {ptxas}: {e}"));
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "ptxas failed:\n{log}");
    let mut kernel = String::new();
    let mut spills = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            kernel = rest.split('\'').next().unwrap_or("").to_string();
        }
        if line.contains("spill stores") && !line.contains(" 0 bytes spill stores") {
            let stored: usize = line
                .split(" bytes spill stores")
                .next()
                .and_then(|l| l.rsplit(' ').next())
                .unwrap_or("0")
                .parse()
                .unwrap_or(0);
            // pstep (17 warps: 5 on one scheduler, so ptxas caps it at 96 registers) spills its
            // per-chunk loop state (slot, parity, the staged input's rr: a few L1 words a chunk
            // of ~40 KB of weights, none in its inner loops; read from nvdisasm's SASS of
            // session 37's build). Anything larger is a real spill.
            if !(kernel == "pstep" && stored <= 128) {
                spills.push(format!("{kernel}: {}", line.trim()));
            }
        }
        if line.contains("warning") {
            eprintln!("{line}");
        }
        if line.contains("Used") {
            eprintln!("{kernel}: {}", line.trim().trim_start_matches("ptxas info    : "));
        }
    }
    // The timeline build (LILY_CUDA_TIMELINE=1, a measurement build whose per-block records
    // take registers) may spill a few bytes; the product's build may not.
    if std::env::var("LILY_CUDA_TIMELINE").is_ok_and(|v| v == "1") {
        for s in &spills {
            eprintln!("timeline build spills (allowed there): {s}");
        }
    } else {
        assert!(spills.is_empty(), "kernels spill registers:\n{}", spills.join("\n"));
    }
    std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/target/lily-sm_90a.cubin"))
}
