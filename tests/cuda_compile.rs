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
    for k in lily::cuda::KERNELS {
        assert!(ptx.contains(&format!(".entry {k}(")), "kernel {k} missing from the PTX");
    }
    // Second call comes from the on-disk cache.
    let (again, cached) = lily::cuda::compile("sm_90a").unwrap();
    assert!(cached && again == ptx);
    let _ = std::fs::remove_dir_all(&dir);
}
