//! Paged KV-cache memory (the vAttention scheme, on CUDA's virtual memory management).
//!
//! Each attention layer's K or V cache of a session is one range of virtual addresses, reserved
//! once for the whole context, and backed page by page by physical pages taken from one pool
//! per GPU (`cuMemCreate`, `cuMemMap`). A buffer's list of pages is its block table: logical
//! page `j` (cache rows `j·P/row .. (j+1)·P/row`) lives on physical page `pages[j]`, and the
//! MMU does the lookup. So the attention kernels address each cache as one array, nothing is
//! copied when a sequence grows, and the addresses captured in CUDA graphs stay valid for the
//! session's life. A page is the driver's allocation granularity P (2 MiB on the H200: 2,048
//! positions of one layer's bf16 K of the Qwen3.6 models).
//!
//! Pages go back to the pool when a buffer is released (a served slot whose request ended, a
//! snapshot restored over a longer cache) or dropped, and the next sequence maps them; the pool hands them back to the driver only when the process ends. With a limit set
//! (`lily serve` derives it from its KV budget), taking a page past it is an error naming the
//! numbers, not an out-of-memory fault in the middle of a step.
//!
//! Behind the last mapped page of every buffer sits the pool's guard page (zeroed once, shared,
//! mapped read-write but never written by a correct kernel), so a kernel that reads a tile
//! past the cached length reads zeros there instead of faulting on an unmapped address.

use super::Gpu;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::sys;
use std::sync::Arc;

type Handle = sys::CUmemGenericAllocationHandle;

fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(anyhow!("{what}: {r:?}"))
    }
}

fn prop() -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// Makes `[ptr, ptr + bytes)` readable and writable by the device.
fn allow(ptr: u64, bytes: usize) -> Result<()> {
    let desc = sys::CUmemAccessDesc {
        location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the range is mapped (by the caller) and desc lives across the call.
    check(unsafe { sys::cuMemSetAccess(ptr, bytes, &desc, 1) }, "cuMemSetAccess")
}

/// Maps `h` at `ptr` (one page) with device access.
fn map(ptr: u64, page: usize, h: Handle) -> Result<()> {
    // SAFETY: ptr lies in a range this module reserved and is not mapped; h is a live handle.
    check(unsafe { sys::cuMemMap(ptr, page, 0, h, 0) }, "cuMemMap")?;
    allow(ptr, page)
}

/// The physical pages of one GPU: free ones, how many exist and the limit on pages in use.
pub struct PagePool {
    page: usize,
    free: Vec<Handle>,
    in_use: usize,
    limit: Option<usize>,
    /// The shared zero page behind every buffer, and its own mapping (where it was zeroed).
    guard: Option<(Handle, u64)>,
}

impl PagePool {
    pub(super) fn new() -> PagePool {
        PagePool { page: 0, free: Vec::new(), in_use: 0, limit: None, guard: None }
    }

    /// The page size in bytes (queried once from the driver).
    fn page(&mut self) -> Result<usize> {
        if self.page == 0 {
            let mut g = 0usize;
            let p = prop();
            // SAFETY: g and p outlive the call.
            check(
                unsafe {
                    sys::cuMemGetAllocationGranularity(
                        &mut g,
                        &p,
                        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                    )
                },
                "cuMemGetAllocationGranularity",
            )?;
            if g == 0 {
                bail!("the driver reports a zero allocation granularity");
            }
            self.page = g;
        }
        Ok(self.page)
    }

    fn create(&mut self) -> Result<Handle> {
        let page = self.page()?;
        let mut h: Handle = 0;
        let p = prop();
        // SAFETY: h and p outlive the call.
        check(unsafe { sys::cuMemCreate(&mut h, page, &p, 0) }, "cuMemCreate (KV cache page)").map_err(|e| {
            anyhow!("out of GPU memory for the KV cache ({} pages of {} MiB in use): {e}", self.in_use, page >> 20)
        })?;
        Ok(h)
    }

    fn take(&mut self) -> Result<Handle> {
        if let Some(l) = self.limit {
            if self.in_use >= l {
                bail!(
                    "the KV cache is out of pages: all {l} pages of {} MiB of its budget are in use",
                    self.page >> 20
                );
            }
        }
        let h = match self.free.pop() {
            Some(h) => h,
            None => self.create()?,
        };
        self.in_use += 1;
        Ok(h)
    }

    fn give(&mut self, h: Handle) {
        self.in_use -= 1;
        self.free.push(h);
    }

    /// The guard page's handle, made (and zeroed) on first use.
    fn guard(&mut self) -> Result<Handle> {
        if let Some((h, _)) = self.guard {
            return Ok(h);
        }
        let page = self.page()?;
        let h = self.create()?;
        let mut va = 0u64;
        // SAFETY: a fresh reservation of one page; va outlives the call.
        check(unsafe { sys::cuMemAddressReserve(&mut va, page, page, 0, 0) }, "cuMemAddressReserve")?;
        map(va, page, h)?;
        // SAFETY: the page was just mapped read-write at va.
        check(unsafe { sys::cuMemsetD8_v2(va, 0, page) }, "zeroing the KV guard page")?;
        self.guard = Some((h, va));
        Ok(h)
    }

    /// Pages in use and the limit.
    pub fn usage(&self) -> (usize, Option<usize>) {
        (self.in_use, self.limit)
    }
}

impl Drop for PagePool {
    fn drop(&mut self) {
        // SAFETY: every handle here is live and no longer mapped anywhere but the guard's own VA.
        unsafe {
            if let Some((h, va)) = self.guard.take() {
                sys::cuMemUnmap(va, self.page);
                sys::cuMemAddressFree(va, self.page);
                sys::cuMemRelease(h);
            }
            for h in self.free.drain(..) {
                sys::cuMemRelease(h);
            }
        }
    }
}

impl Gpu {
    /// Page size, pages in use and their limit of the KV page pool.
    pub fn kv_pages(&self) -> Result<(usize, usize, Option<usize>)> {
        let mut p = self.pages.lock().unwrap();
        self.bind()?;
        let page = p.page()?;
        let (used, limit) = p.usage();
        Ok((page, used, limit))
    }

    /// Caps the pages in use (None: as many as the device gives).
    pub fn set_kv_page_limit(&self, limit: Option<usize>) {
        self.pages.lock().unwrap().limit = limit;
    }
}

/// One cache array of up to `capacity` bytes at a fixed device address, mapped page by page.
pub struct PagedBuf {
    /// The array's device address (stable for the buffer's life).
    pub ptr: u64,
    capacity: usize,
    /// The block table: physical page of each logical page, in order.
    pages: Vec<Handle>,
    page: usize,
    gpu: Arc<Gpu>,
}

impl PagedBuf {
    /// Reserves addresses for `capacity` bytes (plus the guard) and maps nothing but the guard.
    pub fn new(gpu: &Arc<Gpu>, capacity: usize) -> Result<PagedBuf> {
        gpu.bind()?;
        let mut pool = gpu.pages.lock().unwrap();
        let page = pool.page()?;
        let guard = pool.guard()?;
        let capacity = capacity.div_ceil(page).max(1) * page;
        let mut ptr = 0u64;
        // SAFETY: ptr outlives the call; the size is a multiple of the granularity.
        check(unsafe { sys::cuMemAddressReserve(&mut ptr, capacity + page, page, 0, 0) }, "cuMemAddressReserve")
            .map_err(|e| anyhow!("reserving {} MiB of addresses for a KV cache: {e}", capacity >> 20))?;
        let b = PagedBuf { ptr, capacity, pages: Vec::new(), page, gpu: gpu.clone() };
        map(ptr, page, guard)?;
        Ok(b)
    }

    /// Bytes backed by pages.
    pub fn mapped(&self) -> usize {
        self.pages.len() * self.page
    }

    /// Pages mapped (the block table's length).
    pub fn pages(&self) -> usize {
        self.pages.len()
    }

    /// Maps pages (zeroed) until at least `bytes` are backed; the guard moves behind them.
    /// Work queued before stays valid: mapped pages never move.
    pub fn ensure(&mut self, bytes: usize) -> Result<()> {
        if bytes <= self.mapped() {
            return Ok(());
        }
        if bytes > self.capacity {
            bail!("KV cache of {bytes} bytes exceeds its reserved {} bytes", self.capacity);
        }
        self.gpu.bind()?;
        // Queued work may read the guard where the new pages go: wait for it first.
        self.gpu.sync()?;
        let mut pool = self.gpu.pages.lock().unwrap();
        let end = self.ptr + self.mapped() as u64;
        // SAFETY: the guard is mapped at `end` (one page) and no work is queued (synced).
        check(unsafe { sys::cuMemUnmap(end, self.page) }, "cuMemUnmap (KV guard)")?;
        let need = bytes.div_ceil(self.page) - self.pages.len();
        let mut grown = Ok(());
        for _ in 0..need {
            let at = self.ptr + self.mapped() as u64;
            let h = match pool.take() {
                Ok(h) => h,
                Err(e) => {
                    grown = Err(e);
                    break;
                }
            };
            if let Err(e) = map(at, self.page, h) {
                pool.give(h);
                grown = Err(e);
                break;
            }
            self.pages.push(h);
            // SAFETY: the page was just mapped read-write at `at`.
            if let Err(e) = check(unsafe { sys::cuMemsetD8_v2(at, 0, self.page) }, "zeroing a KV page") {
                grown = Err(e);
                break;
            }
        }
        // The guard behind the last page, whether or not every page could be had.
        let guard = pool.guard()?;
        map(self.ptr + self.mapped() as u64, self.page, guard)?;
        grown
    }

    /// Unmaps every page (back to the pool); the guard returns to the start.
    pub fn release(&mut self) -> Result<()> {
        if self.pages.is_empty() {
            return Ok(());
        }
        self.gpu.bind()?;
        self.gpu.sync()?;
        let mut pool = self.gpu.pages.lock().unwrap();
        // SAFETY: pages and guard are mapped contiguously from ptr; no work is queued (synced).
        check(unsafe { sys::cuMemUnmap(self.ptr, self.mapped() + self.page) }, "cuMemUnmap (KV pages)")?;
        for h in self.pages.drain(..) {
            pool.give(h);
        }
        let guard = pool.guard()?;
        map(self.ptr, self.page, guard)
    }

    /// Writes `data` at the start, mapping the pages it needs (synchronous).
    pub fn write(&mut self, data: &[u8]) -> Result<()> {
        self.ensure(data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: [ptr, ptr + len) is mapped (ensured above).
        unsafe { cudarc::driver::result::memcpy_htod_sync(self.ptr, data) }.map_err(|e| anyhow!("KV upload: {e:?}"))
    }

    /// The first `n` bytes, copied back (synchronizes).
    pub fn read(&self, n: usize) -> Result<Vec<u8>> {
        if n > self.mapped() {
            bail!("reading {n} bytes of a KV cache that holds {}", self.mapped());
        }
        let mut v = vec![0u8; n];
        if n > 0 {
            self.gpu.bind()?;
            // SAFETY: [ptr, ptr + n) is mapped (checked above).
            unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut v, self.ptr) }
                .map_err(|e| anyhow!("CUDA error (reported at a KV copy back): {e:?}"))?;
        }
        Ok(v)
    }

    /// Sets every mapped byte to zero (after the queued work).
    pub fn zero(&self) -> Result<()> {
        if self.pages.is_empty() {
            return Ok(());
        }
        self.gpu.bind()?;
        // SAFETY: [ptr, ptr + mapped) is mapped read-write.
        check(unsafe { sys::cuMemsetD8_v2(self.ptr, 0, self.mapped()) }, "zeroing a KV cache")
    }
}

impl Drop for PagedBuf {
    fn drop(&mut self) {
        if self.gpu.bind().is_err() || self.gpu.sync().is_err() {
            return; // the context is gone: so are its mappings
        }
        let mut pool = self.gpu.pages.lock().unwrap();
        // SAFETY: pages and guard are mapped contiguously from ptr; the reservation is freed once.
        unsafe {
            sys::cuMemUnmap(self.ptr, self.mapped() + self.page);
            sys::cuMemAddressFree(self.ptr, self.capacity + self.page);
        }
        for h in self.pages.drain(..) {
            pool.give(h);
        }
    }
}
