//! The paged KV memory on the GPU (`lily::cuda::PagedBuf`): pages map in place, are zeroed,
//! go back to the pool and respect its limit; and a session whose cache grows by a page in the
//! middle of its decode gives the CPU's logits. Its own test binary: the pool and its limit are
//! per process, so no other test's pages move the counts. Skips (and passes, saying so) when no
//! GPU/driver is present.

mod common;
use common::*;
use lily::cuda::{CudaSession, KvDtype, PagedBuf};
use lily::generate::{CpuSession, Session};
use std::sync::Arc;

#[test]
fn cuda_kv_pages_map_in_place_and_go_back_to_the_pool() {
    let Some(gpu) = common::gpu::gpu() else { return };
    let (page, used0, _) = gpu.kv_pages().unwrap();
    assert!(page >= 4096, "page size {page}");
    let mut b = PagedBuf::new(&gpu, 4 * page + 100).unwrap();
    assert_eq!(b.pages(), 0);
    let ptr = b.ptr;

    // 1.5 pages of a pattern: two pages mapped, read back exactly.
    let data: Vec<u8> = (0..page + page / 2).map(|i| (i * 31 % 251) as u8 + 1).collect();
    b.write(&data).unwrap();
    assert_eq!(b.pages(), 2);
    assert_eq!(gpu.kv_pages().unwrap().1, used0 + 2);
    assert_eq!(b.read(data.len()).unwrap(), data);

    // Growing keeps the address and the content; everything not written reads zero.
    b.ensure(3 * page + 1).unwrap();
    assert_eq!((b.ptr, b.pages()), (ptr, 4));
    let all = b.read(4 * page).unwrap();
    assert_eq!(&all[..data.len()], &data[..]);
    assert!(all[data.len()..].iter().all(|&x| x == 0), "fresh pages are not zero");
    let e = b.ensure(5 * page + 1).unwrap_err();
    assert!(format!("{e:#}").contains("exceeds its reserved"), "{e:#}");

    // Released pages go back and are handed out again, zeroed.
    b.release().unwrap();
    assert_eq!(b.pages(), 0);
    assert_eq!(gpu.kv_pages().unwrap().1, used0);
    let mut c = PagedBuf::new(&gpu, 2 * page).unwrap();
    c.ensure(2 * page).unwrap();
    assert!(c.read(2 * page).unwrap().iter().all(|&x| x == 0), "a reused page is not zeroed");

    // The limit: an error naming it, and the buffer stays usable with the pages it has.
    gpu.set_kv_page_limit(Some(used0 + 3));
    b.ensure(page).unwrap();
    let e = b.ensure(3 * page).unwrap_err();
    gpu.set_kv_page_limit(None);
    assert!(format!("{e:#}").contains("out of pages"), "{e:#}");
    assert_eq!(b.pages(), 1);
    b.write(&data[..100]).unwrap();
    assert_eq!(b.read(100).unwrap(), &data[..100]);
    drop(b);
    drop(c);
    assert_eq!(gpu.kv_pages().unwrap().1, used0, "dropped buffers keep pages");

    // Absurd sizes are errors, not crashes.
    assert!(PagedBuf::new(&gpu, 1 << 62).is_err());
}

/// A session (fp32 cache: 4,096 positions of synthetic:tiny per 2 MiB page) prefilled to 4,000
/// positions, then decoding one token at a time past 4,096 (the cache maps its second page
/// between two steps, with the step graph already captured): its logits against the CPU's after
/// the same 4,160 tokens, then 16 greedy tokens of the device loop (position 4,176) against the
/// CPU's. Bound as in tests/cuda_model.rs (3e-5 of the row's range, fp32 both sides).
#[test]
fn cuda_decode_across_a_kv_page_boundary_matches_cpu() {
    let Some(gpu) = common::gpu::gpu() else { return };
    let model = Arc::new(lily::synthetic::build("tiny", None, 1024).unwrap());
    let gm = lily::cuda::upload_cached(&model).unwrap();
    let row = model.cfg.kv_dim() * 4;
    let per_page = gpu.kv_pages().unwrap().0 / row;
    let n = per_page + 64;
    let split = per_page - 96;
    let prompt: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 13) % 1024).collect();

    let mut s = CudaSession::new(gm);
    s.set_kv_dtype(KvDtype::F32).unwrap();
    s.prefill = Some(lily::cuda::Precision::F32);
    s.forward_last(&prompt[..split]).unwrap();
    let mut got = Vec::new();
    for &t in &prompt[split..] {
        got = s.forward_last(&[t]).unwrap();
    }
    let mut cpu = CpuSession::new(model.clone());
    let want = cpu.forward_last(&prompt).unwrap();
    let worst = compare_rows("decode across a KV page vs cpu", &got, &want, 1024);
    eprintln!(
        "synthetic:tiny, {split} prefilled + {} decoded (page of {per_page}): worst |Δ|/range vs cpu {worst:.2e}",
        n - split
    );
    assert!(worst <= 3e-5, "worst |Δ|/range {worst}");
    let first = lily::sampling::argmax(&want);
    let g = s.greedy_steps(first, 16).unwrap();
    let c = cpu.greedy_steps(first, 16).unwrap();
    assert_eq!(g, c, "greedy tokens after the page boundary differ");
}
