/*
 * sampling.cu: greedy argmax over the logits on the device.
 *
 * argmax: x [n] -> out[0] = the index of the largest value (ties: lower index, NaN ignored),
 *   grid 1, block 1024: a strided scan per thread, then a shared-memory tree over the block.
 *   With grid R: row r = blockIdx.x of x [R, n] into out[r] (the batched decode's tokens).
 *
 * argmax_io (the device-resident greedy loop): the same argmax, then thread 0 feeds it back:
 *   io = [token, position, count] (the step's input slot, read by embed_row/attention): token <-
 *   argmax, position += 1, ring[count] = argmax, count += 1. A replayed step graph that ends with
 *   it runs the next token with no host involvement; the host reads the ring at the end.
 *
 * sample_io (the device-resident sampling loop): like argmax_io, but the token is drawn from
 *   the filtered distribution of lily's host sampler (src/sampling.rs): z = logits / T (NaN as
 *   -inf), m = max z; top-k keeps z >= the k-th largest z; p = e^{z - m} / Z_k with Z_k summed over
 *   the top-k set; min-p keeps e^{z - m} >= min_p; top-p keeps the largest p whose total reaches
 *   top_p; then one token is drawn in proportion to p among the kept ones. Parameters come from
 *   device memory, sp = [T, top_p, min_p (f32), top_k, seed_lo, seed_hi (u32)], so one captured
 *   graph serves every request. grid 1, block 1024, n < 2^31; scratch cz, ci, kz, ki [n].
 *   1. m by a strided max. 2. Candidates: the ids with z >= m - 22.2 (below that p < 2^-32, whose
 *      fixed-point mass below is 0, so they are never drawn), compacted in id order into
 *      (cz, ci): each warp owns a contiguous segment read 32 consecutive ids at a time (ballot +
 *      popc), warp offsets from a block scan; c of them. Later passes read only the candidates,
 *      and once top-k is known only the top-k set (compacted again into kz, ki).
 *   3. Each cut-off is a threshold on the order-preserving u32 key of z, found exactly by a
 *      3-pass radix select (11, 11, 10 bits; shared histograms of 2048 u64 bins, added to once
 *      per group of lanes with the same bin (match_any + reduce_add), bins picked by a
 *      block-wide suffix scan): over counts for top-k (when k < c; else all candidates are in
 *      the top-k set, and Z_k leaves out the rest, each < e^-22.2), over masses for top-p.
 *      Cost: the radix passes are ~100 instructions per candidate, so a flat distribution
 *      (every id a candidate) with top-p takes ~2 ms; a peaked one, or top-k, far less.
 *      Masses are fixed point (p * 2^32 as u64), so every sum and choice is exact and
 *      independent of thread timing. Ties at a cut-off are all kept (the host keeps lower ids).
 *   4. The draw walks the kept masses in id order over the per-warp segments (warp sums, a block
 *      scan, then the owning warp rescans its segment with a warp scan): u = r * total with
 *      r = splitmix64(seed ^ splitmix64(count + 1)) / 2^64 (count = io[2], the step within this
 *      loop), so a seed gives the same tokens on every run.
 */
__device__ __forceinline__ int argmax_block(const float* x, int n) {
    __shared__ float bv[1024];
    __shared__ int bi[1024];
    float v = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float xv = x[i];
        if (xv > v || (xv == v && i < idx)) { v = xv; idx = i; }
    }
    bv[threadIdx.x] = v;
    bi[threadIdx.x] = idx;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = bv[threadIdx.x + s];
            int oi = bi[threadIdx.x + s];
            if (ov > bv[threadIdx.x] || (ov == bv[threadIdx.x] && oi < bi[threadIdx.x])) {
                bv[threadIdx.x] = ov;
                bi[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    return bi[0] == 0x7fffffff ? 0 : bi[0];
}

extern "C" __global__ void argmax(const float* x, int n, int* out) {
    pdl_begin();
    int t = argmax_block(x + (long long)blockIdx.x * n, n);
    if (threadIdx.x == 0) out[blockIdx.x] = t;
}

extern "C" __global__ void argmax_io(const float* x, int n, int* io, int* ring) {
    pdl_begin();
    int t = argmax_block(x, n);
    if (threadIdx.x == 0) {
        io[0] = t;
        io[1] += 1;
        ring[io[2]] = t;
        io[2] += 1;
    }
}

__device__ __forceinline__ u32 sort_key(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ float scaled_logit(const float* x, int i, float inv_t) {
    float v = x[i];
    return v != v ? -INFINITY : v * inv_t;
}
/* p * 2^32 in fixed point (the same expression everywhere, so sums agree between passes). */
__device__ __forceinline__ u64 fixed_mass(float z, float m, float inv_z) {
    return (u64)((double)expf(z - m) * (double)inv_z * 4294967296.0);
}
/* Survives top-k (key >= lo) and min-p (e^{z - m} >= min_p, as the host tests it). */
__device__ __forceinline__ bool kept(float z, u32 lo, float m, float min_p) {
    return sort_key(z) >= lo && (min_p <= 0.f || expf(z - m) >= min_p);
}

/* Exclusive prefix (in thread order) of one u64 per thread over the 1024-thread block; *total
   gets the sum. `sh` holds 33 u64. */
__device__ u64 block_scan_u64(u64 v, u64* sh, u64* total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        u64 t = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += t;
    }
    __syncthreads();
    if (lane == 31) sh[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        u64 w = sh[lane], wi = w;
        for (int o = 1; o < 32; o <<= 1) {
            u64 t = __shfl_up_sync(0xffffffffu, wi, o);
            if (lane >= o) wi += t;
        }
        sh[lane] = wi - w;
        if (lane == 31) sh[32] = wi;
    }
    __syncthreads();
    u64 ex = sh[warp] + inc - v;
    *total = sh[32];
    __syncthreads();
    return ex;
}

/* hist[bin] += w for the active lanes, one shared atomic per group of lanes with the same bin
   (w < 2^33: summed as 16-bit low and high parts). Called by all 32 lanes. */
__device__ __forceinline__ void hist_add(u64* hist, int bin, u64 w, bool active) {
    unsigned act = __ballot_sync(0xffffffffu, active);
    if (!active) return;
    unsigned grp = __match_any_sync(act, bin);
    u32 lo = __reduce_add_sync(grp, (u32)(w & 0xffffu));
    u32 hi = __reduce_add_sync(grp, (u32)(w >> 16));
    if ((threadIdx.x & 31) == __ffs(grp) - 1) atomicAdd(&hist[bin], ((u64)hi << 16) + lo);
}

/* Radix select over the candidates' keys: the largest threshold key t with W(key >= t) >= target,
   W summing over the candidates that pass kept(z, lo, m, min_p) a count of 1 (mass 0) or their
   fixed-point mass. Returns 0 when the total weight is below target. */
__device__ u32 radix_threshold(const float* cz, int c, float m, float inv_z, u32 lo, float min_p, u64 target,
                               int mass, u64* hist, u64* sh) {
    __shared__ u32 s_prefix;
    __shared__ u64 s_above;
    __shared__ int s_found;
    u32 prefix = 0, pmask = 0;
    u64 above = 0;
    for (int pass = 0; pass < 3; pass++) {
        const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0, nb = pass == 2 ? 1024 : 2048;
        for (int b = threadIdx.x; b < 2048; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        /* uniform trip count (warps stay converged for hist_add); 4 loads in flight */
        for (int base = 0; base < c; base += 4 * blockDim.x) {
            float zz[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                int i = base + u * blockDim.x + threadIdx.x;
                zz[u] = i < c ? cz[i] : -INFINITY;
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                int i = base + u * blockDim.x + threadIdx.x;
                u32 key = sort_key(zz[u]);
                bool act = i < c && (key & pmask) == prefix && kept(zz[u], lo, m, min_p);
                u64 w = act ? (mass ? fixed_mass(zz[u], m, inv_z) : 1ull) : 0ull;
                hist_add(hist, (key >> shift) & (nb - 1), w, w != 0);
            }
        }
        __syncthreads();
        /* Suffix sums over bins: thread t owns bins 2t, 2t+1; scan in reversed thread order. */
        int t = blockDim.x - 1 - threadIdx.x;
        u64 h0 = 2 * t < nb ? hist[2 * t] : 0, h1 = 2 * t + 1 < nb ? hist[2 * t + 1] : 0;
        u64 tot;
        u64 ex = block_scan_u64(h0 + h1, sh, &tot); /* weight in the bins above 2t + 1 */
        if (threadIdx.x == 0) s_found = 0;
        __syncthreads();
        u64 s1 = above + ex + h1, s0 = s1 + h0; /* W(bin >= 2t + 1), W(bin >= 2t) */
        if (2 * t + 1 < nb && s1 >= target && above + ex < target) {
            s_prefix = prefix | ((u32)(2 * t + 1) << shift);
            s_above = above + ex;
            s_found = 1;
        } else if (2 * t < nb && s0 >= target && s1 < target) {
            s_prefix = prefix | ((u32)(2 * t) << shift);
            s_above = s1;
            s_found = 1;
        }
        __syncthreads();
        if (!s_found) return 0;
        prefix = s_prefix;
        above = s_above;
        pmask |= (u32)(nb - 1) << shift;
        __syncthreads();
    }
    return prefix;
}

/* zz[u] = z of id i0 + 32u (from src_z when `cand`, else the scaled logits), -inf from w1 on:
   8 loads in flight per lane before their ballots (the loops are otherwise latency-bound). */
__device__ __forceinline__ void load8(const float* x, float inv_t, const float* src_z, bool cand, int i0, int w1,
                                      float (&zz)[8]) {
#pragma unroll
    for (int u = 0; u < 8; u++) {
        int i = i0 + 32 * u;
        zz[u] = i < w1 ? (cand ? src_z[i] : scaled_logit(x, i, inv_t)) : -INFINITY;
    }
}

/* Ordered compaction over per-warp contiguous segments (lanes read consecutive ids, so loads
   coalesce): copies the entries of (src_z, src_i) [c] (src_i null: ids are the positions, z
   from scaled logits) that satisfy z >= zmin and key >= kmin into (dz, di) in id order; returns
   their number. */
__device__ int compact_ordered(const float* x, float inv_t, const float* src_z, const int* src_i, int c, float zmin,
                               u32 kmin, float* dz, int* di, u64* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int seg = ((c + nw - 1) / nw + 31) & ~31, w0 = min(c, warp * seg), w1 = min(c, w0 + seg);
    u64 cnt = 0;
    for (int b = w0; b < w1; b += 256) {
        float zz[8];
        load8(x, inv_t, src_z, src_i != 0, b + lane, w1, zz);
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int i = b + 32 * u + lane;
            cnt += __popc(__ballot_sync(0xffffffffu, i < w1 && zz[u] >= zmin && sort_key(zz[u]) >= kmin));
        }
    }
    u64 total;
    u64 off = block_scan_u64(lane == 0 ? cnt : 0, sh, &total);
    off = __shfl_sync(0xffffffffu, off, 0);
    for (int b = w0; b < w1; b += 256) {
        float zz[8];
        load8(x, inv_t, src_z, src_i != 0, b + lane, w1, zz);
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int i = b + 32 * u + lane;
            bool f = i < w1 && zz[u] >= zmin && sort_key(zz[u]) >= kmin;
            unsigned bal = __ballot_sync(0xffffffffu, f);
            if (f) {
                int at = (int)off + __popc(bal & ((1u << lane) - 1));
                dz[at] = zz[u];
                di[at] = src_i ? src_i[i] : i;
            }
            off += __popc(bal);
        }
    }
    __syncthreads();
    return (int)total;
}

extern "C" __global__ void __launch_bounds__(1024, 1)
    sample_io(const float* x, int n, int* io, int* ring, const float* sp, float* cz, int* ci, float* kz, int* ki) {
    __shared__ u64 hist[2048];
    __shared__ u64 sh[33];
    __shared__ float shf[33];
    __shared__ int s_tok;
    pdl_begin();
    const float inv_t = 1.f / sp[0], top_p = sp[1], min_p = sp[2];
    const int top_k = ((const int*)sp)[3];
    const u64 seed = (u64)((const u32*)sp)[4] | ((u64)((const u32*)sp)[5] << 32);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    /* 1. max */
    float mx = -INFINITY, mx2 = -INFINITY;
    int i0 = threadIdx.x;
    for (; i0 + blockDim.x < n; i0 += 2 * blockDim.x) {
        mx = fmaxf(mx, scaled_logit(x, i0, inv_t));
        mx2 = fmaxf(mx2, scaled_logit(x, i0 + blockDim.x, inv_t));
    }
    if (i0 < n) mx = fmaxf(mx, scaled_logit(x, i0, inv_t));
    mx = warp_max(fmaxf(mx, mx2));
    if (lane == 0) shf[warp] = mx;
    __syncthreads();
    float m = -INFINITY;
    for (int w = 0; w < nw; w++) m = fmaxf(m, shf[w]);
    __syncthreads();
    int tok = 0;
    if (m != -INFINITY) {
        /* 2. candidates in id order */
        int c = compact_ordered(x, inv_t, 0, 0, n, m - 22.2f, 0, cz, ci, sh);
        /* 3. top-k (then only the top-k set is looked at), Z_k, top-p */
        if (top_k > 0 && top_k < c) {
            u32 kkey = radix_threshold(cz, c, m, 0.f, 0, 0.f, (u64)top_k, 0, hist, sh);
            c = compact_ordered(x, inv_t, cz, ci, c, -INFINITY, kkey, kz, ki, sh);
            cz = kz;
            ci = ki;
        }
        float zs = 0.f;
        for (int i = threadIdx.x; i < c; i += blockDim.x) zs += expf(cz[i] - m);
        const float inv_z = 1.f / block_sum(zs, shf);
        u32 lo = 0;
        if (top_p < 1.f) {
            u64 target = (u64)((double)top_p * 4294967296.0);
            lo = radix_threshold(cz, c, m, inv_z, 0, min_p, target, 1, hist, sh);
        }
        /* 4. the draw, in id order over per-warp segments */
        const int seg = ((c + nw - 1) / nw + 31) & ~31, w0 = min(c, warp * seg), w1 = min(c, w0 + seg);
        u64 mine = 0;
        for (int i = w0 + lane; i < w1; i += 32)
            if (kept(cz[i], lo, m, min_p)) mine += fixed_mass(cz[i], m, inv_z);
        for (int o = 16; o > 0; o >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, o);
        u64 total;
        u64 off = block_scan_u64(lane == 0 ? mine : 0, sh, &total);
        off = __shfl_sync(0xffffffffu, off, 0);
        if (threadIdx.x == 0) s_tok = -1;
        __syncthreads();
        u64 r = splitmix64(seed ^ splitmix64((u64)io[2] + 1));
        u64 u = (u64)((double)(r >> 11) * (1.0 / 9007199254740992.0) * (double)total);
        if (total && u >= total) u = total - 1;
        if (total && u >= off && u < off + mine) { /* this warp holds the draw */
            for (int b = w0; b < w1; b += 32) {
                int i = b + lane;
                u64 w = i < w1 && kept(cz[i], lo, m, min_p) ? fixed_mass(cz[i], m, inv_z) : 0;
                u64 inc = w;
                for (int o = 1; o < 32; o <<= 1) {
                    u64 t = __shfl_up_sync(0xffffffffu, inc, o);
                    if (lane >= o) inc += t;
                }
                unsigned hit = __ballot_sync(0xffffffffu, w != 0 && u < off + inc);
                if (hit) {
                    if (lane == __ffs(hit) - 1) s_tok = ci[i];
                    break;
                }
                off += __shfl_sync(0xffffffffu, inc, 31);
            }
        }
        __syncthreads();
        tok = s_tok;
        if (tok < 0) /* no mass survived rounding: the first candidate holding the max */
            for (int i = 0; i < c; i++)
                if (cz[i] == m) {
                    tok = ci[i];
                    break;
                }
    }
    if (threadIdx.x == 0) {
        io[0] = tok;
        io[1] += 1;
        ring[io[2]] = tok;
        io[2] += 1;
    }
}
