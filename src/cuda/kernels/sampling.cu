/*
 * sampling.cu: choosing the next token on the device.
 *
 * argmax: x [R, n] -> out[r] = the index of the largest value of row r (ties: lower index, NaN
 *   ignored), grid R, block 1024: a strided scan per thread, then a shared-memory tree. The
 *   batched decode's greedy rows.
 *
 * The device-resident loops (one row, replayed at the end of the step graph) spread the row over
 * G = min(128, ceil(n / 2048)) blocks of SB = 512 threads, block b owning the contiguous slice
 * [b S, (b + 1) S), S = ceil(n / G), read 512 consecutive ids at a time (coalesced; 1 MB of
 * logits stays in L2 between the passes). A pass that needs the whole row ends with a ticket: each
 * block writes its partial into the workspace `ws` (struct SampWs, host size SAMPLE_WS_BYTES,
 * zeroed once at allocation), fences, and takes a ticket; the block that takes the last one
 * combines the partials in block order (so results do not depend on timing) and resets the
 * ticket. The next pass is the next kernel in the stream. io = [token, position, count] is the
 * step's input slot (read by embed_row/attention): token <- t, position += 1, ring[count] = t,
 * count += 1, so a replayed step graph runs the next token with no host involvement.
 *
 * argmax_io: the greedy loop, one pass (block maxima with their first index, then the io update).
 *
 * Sampling (samp_max, samp_radix x 3 for top-k, samp_zsum, samp_radix x 3 for top-p, samp_draw):
 *   the filtered distribution of lily's host sampler (src/sampling.rs): z = logits / T (NaN as
 *   -inf), m = max z; top-k keeps z >= the k-th largest z; p = e^{z - m} / Z_k with Z_k summed over
 *   the top-k set; min-p keeps e^{z - m} >= min_p; top-p keeps the largest p whose total reaches
 *   top_p; one token is drawn in proportion to p among the kept ones. Parameters come from device
 *   memory, sp = [T, top_p, min_p (f32), top_k, seed_lo, seed_hi (u32)], so one captured graph
 *   serves every request; passes whose filter is off return at once.
 *   - Candidates: ids with z >= m - 22.2 (below that p < 2^-32, whose fixed-point mass is 0, so
 *     they are never drawn). Top-k counts candidates only: with fewer than k all are kept, and
 *     Z_k leaves out the rest (each < e^-22.2).
 *   - Each cut-off is a threshold on the order-preserving u32 key of z, found exactly by a 3-pass
 *     radix select (11, 11, 10 bits): per block a shared histogram (2048 u64 bins, one shared
 *     atomic per group of lanes with the same bin: match_any + reduce_add), added into the global
 *     histogram with integer atomics (order-independent), and the last block picks the bin by a
 *     suffix scan and clears the histogram. Over counts for top-k, over masses for top-p. Masses
 *     are fixed point (p 2^32 as u64), so every sum and choice is exact. Ties at a cut-off are all
 *     kept (the host keeps lower ids).
 *   - The draw: per-block sums of the kept masses; the last block takes u = r * total with
 *     r = splitmix64(seed ^ splitmix64(count + 1)) / 2^64 (count = io[2], the step within this
 *     loop), finds the block whose range holds u, and rescans that slice in id order. A seed gives
 *     the same tokens on every run. No mass left after rounding: the first id holding the max.
 *   Cost: 9 launches over 1 MB in L2, ~5 us each whatever the distribution (the one-block version
 *   before this took 1.2 ms on a flat row).
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

extern "C" __global__ void argmax(ArgmaxParams_fields) {
    pdl_begin();
    int t = argmax_block(x + (long long)blockIdx.x * n, n);
    if (threadIdx.x == 0) out[blockIdx.x] = t;
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


#define SB 512
#define SMAXG 128
#define NBINS 2048

/* The workspace shared by the passes of one draw (SAMPLE_WS_BYTES on the host covers it). */
struct SampWs {
    float m;        /* max z */
    int argm;       /* first id holding it */
    u32 lo_k, lo_p; /* top-k and top-p key thresholds (0: none) */
    float inv_z;    /* 1 / Z_k */
    u32 prefix, pmask; /* the radix select in progress */
    u32 fail;       /* sel + 1 when select sel ended early */
    u64 above;      /* weight in the bins above the prefix */
    u32 ticket, pad;
    float pf[SMAXG];
    int pi[SMAXG];
    u64 pu[SMAXG];
    u64 hist[NBINS];
};

struct SampParams {
    float inv_t, top_p, min_p;
    int top_k;
    u64 seed;
};
__device__ __forceinline__ SampParams samp_params(const float* sp) {
    SampParams p;
    p.inv_t = 1.f / sp[0];
    p.top_p = sp[1];
    p.min_p = sp[2];
    p.top_k = ((const int*)sp)[3];
    p.seed = (u64)((const u32*)sp)[4] | ((u64)((const u32*)sp)[5] << 32);
    return p;
}

/* The slice [*s0, *s1) of block b of G over n ids. */
__device__ __forceinline__ void samp_slice(int n, int* s0, int* s1) {
    int S = (n + gridDim.x - 1) / gridDim.x;
    *s0 = min(n, (int)blockIdx.x * S);
    *s1 = min(n, *s0 + S);
}

/* After this block's partials are written: true in the block that took the last ticket (which
   then sees every block's partials). Called by all threads. */
__device__ bool samp_last(SampWs* ws) {
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 t = atomicAdd(&ws->ticket, 1u);
        s_last = t == gridDim.x - 1;
        if (s_last) atomicExch(&ws->ticket, 0u);
    }
    __syncthreads();
    if (s_last) __threadfence();
    return s_last;
}

/* Exclusive prefix (in thread order) of one u64 per thread over the block (up to 32 warps);
   *total gets the sum. `sh` holds 33 u64. */
__device__ u64 block_scan_u64(u64 v, u64* sh, u64* total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u64 inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        u64 t = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += t;
    }
    __syncthreads();
    if (lane == 31) sh[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        u64 w = lane < nw ? sh[lane] : 0, wi = w;
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

/* This block's (max, first index) over its slice, by raw values (argmax_block's rule) or by
   scaled logits (NaN as -inf); thread 0 gets the block's result. */
__device__ void slice_max(const float* x, int s0, int s1, float inv_t, bool scaled, float* v_out, int* i_out) {
    __shared__ float bv[SB / 32];
    __shared__ int bi[SB / 32];
    float v = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = s0 + threadIdx.x; i < s1; i += SB) {
        float xv = scaled ? scaled_logit(x, i, inv_t) : x[i];
        if (xv > v || (xv == v && i < idx)) { v = xv; idx = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { bv[warp] = v; bi[warp] = idx; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < SB / 32; w++)
            if (bv[w] > v || (bv[w] == v && bi[w] < idx)) { v = bv[w]; idx = bi[w]; }
        *v_out = v;
        *i_out = idx;
    }
}

/* The last block's combination of the per-block (max, index) partials in block order. */
__device__ __forceinline__ void max_of_parts(SampWs* ws, float* v, int* idx) {
    *v = -INFINITY;
    *idx = 0x7fffffff;
    for (int b = 0; b < (int)gridDim.x; b++) {
        float ov = __ldcg(&ws->pf[b]);
        int oi = __ldcg(&ws->pi[b]);
        if (ov > *v || (ov == *v && oi < *idx)) { *v = ov; *idx = oi; }
    }
}

__device__ __forceinline__ void io_advance(int* io, int* ring, int t) {
    io[0] = t;
    io[1] += 1;
    ring[io[2]] = t;
    io[2] += 1;
}

/* Greedy: token = argmax x (argmax_block's rule; all NaN: 0). grid G, block SB. */
extern "C" __global__ void __launch_bounds__(SB) argmax_io(ArgmaxIoParams_fields) {
    TL_SCOPE("argmax_io");
    pdl_begin();
    int s0, s1;
    samp_slice(n, &s0, &s1);
    float v;
    int idx;
    slice_max(x, s0, s1, 1.f, false, &v, &idx);
    if (threadIdx.x == 0) {
        ws->pf[blockIdx.x] = v;
        ws->pi[blockIdx.x] = idx;
    }
    if (samp_last(ws) && threadIdx.x == 0) {
        max_of_parts(ws, &v, &idx);
        io_advance(io, ring, idx == 0x7fffffff ? 0 : idx);
    }
}

/* Sampling pass 1: m and its first id; resets the selection state and the histogram. */
extern "C" __global__ void __launch_bounds__(SB) samp_max(SampPassParams_fields) {
    pdl_begin();
    const SampParams p = samp_params(sp);
    int s0, s1;
    samp_slice(n, &s0, &s1);
    float v;
    int idx;
    slice_max(x, s0, s1, p.inv_t, true, &v, &idx);
    if (threadIdx.x == 0) {
        ws->pf[blockIdx.x] = v;
        ws->pi[blockIdx.x] = idx;
    }
    if (samp_last(ws)) {
        for (int b = threadIdx.x; b < NBINS; b += SB) ws->hist[b] = 0;
        if (threadIdx.x == 0) {
            max_of_parts(ws, &v, &idx);
            ws->m = v;
            ws->argm = idx == 0x7fffffff ? 0 : idx;
            ws->lo_k = ws->lo_p = 0;
            ws->inv_z = 0.f;
            ws->prefix = ws->pmask = ws->fail = 0;
            ws->above = 0;
        }
    }
}

__device__ __forceinline__ bool samp_cand(float z, float m) { return z >= m - 22.2f; }

/* One radix pass (0, 1, 2) of the top-k (sel 0: counts of candidates) or top-p (sel 1: masses of
   the top-k set passing min-p) cut-off. The last block of pass 2 stores the threshold. */
extern "C" __global__ void __launch_bounds__(SB)
    samp_radix(SampRadixParams_fields) {
    __shared__ u64 hist[NBINS];
    __shared__ u64 sh[33];
    __shared__ u32 s_prefix;
    __shared__ u64 s_above;
    __shared__ int s_found;
    pdl_begin();
    const SampParams p = samp_params(sp);
    const float m = __ldcg(&ws->m);
    const bool on = sel == 0 ? p.top_k > 0 : p.top_p < 1.f;
    if (!on || m == -INFINITY) return;
    /* An earlier pass of this select found too little weight: it stored "no cut-off" (0) and
       marked the rest of the select done (the mark is only ever written by a pass's last block,
       so no block of the same launch can see it change). */
    if (__ldcg(&ws->fail) == (u32)sel + 1) return;
    const u32 prefix = __ldcg(&ws->prefix), pmask = __ldcg(&ws->pmask), lo_k = __ldcg(&ws->lo_k);
    const float inv_z = __ldcg(&ws->inv_z);
    const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0, nb = pass == 2 ? 1024 : 2048;
    for (int b = threadIdx.x; b < nb; b += SB) hist[b] = 0;
    __syncthreads();
    int s0, s1;
    samp_slice(n, &s0, &s1);
    /* uniform trip count (warps stay converged for hist_add); 4 loads in flight */
    for (int base = s0; base < s1; base += 4 * SB) {
        float zz[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int i = base + u * SB + threadIdx.x;
            zz[u] = i < s1 ? scaled_logit(x, i, p.inv_t) : -INFINITY;
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int i = base + u * SB + threadIdx.x;
            u32 key = sort_key(zz[u]);
            bool act = i < s1 && samp_cand(zz[u], m) && (key & pmask) == prefix &&
                       (sel == 0 || kept(zz[u], lo_k, m, p.min_p));
            u64 w = act ? (sel ? fixed_mass(zz[u], m, inv_z) : 1ull) : 0ull;
            hist_add(hist, (key >> shift) & (nb - 1), w, w != 0);
        }
    }
    __syncthreads();
    for (int b = threadIdx.x; b < nb; b += SB)
        if (hist[b]) atomicAdd(&ws->hist[b], hist[b]);
    if (!samp_last(ws)) return;
    const u64 target = sel == 0 ? (u64)p.top_k : (u64)((double)p.top_p * 4294967296.0);
    const u64 above = __ldcg(&ws->above);
    /* Suffix sums: thread t owns bins 4r .. 4r + 3, r = SB - 1 - t (scan in reversed order). */
    const int r = SB - 1 - threadIdx.x;
    u64 h[4];
#pragma unroll
    for (int j = 0; j < 4; j++) h[j] = 4 * r + j < nb ? __ldcg(&ws->hist[4 * r + j]) : 0;
    u64 tot;
    u64 ex = block_scan_u64(h[0] + h[1] + h[2] + h[3], sh, &tot); /* weight in the bins above 4r + 3 */
    if (threadIdx.x == 0) s_found = 0;
    __syncthreads();
    u64 acc = above + ex;
    for (int j = 3; j >= 0; j--) {
        u64 next = acc + h[j]; /* W(bin >= 4r + j) */
        if (4 * r + j < nb && next >= target && acc < target) {
            s_prefix = prefix | ((u32)(4 * r + j) << shift);
            s_above = acc;
            s_found = 1;
        }
        acc = next;
    }
    __syncthreads();
    for (int b = threadIdx.x; b < nb; b += SB) ws->hist[b] = 0;
    if (threadIdx.x == 0) {
        if (s_found && pass < 2) {
            ws->prefix = s_prefix;
            ws->above = s_above;
            ws->pmask = pmask | ((u32)(nb - 1) << shift);
        } else { /* the select ends: its threshold (0: fewer than the target, no cut-off) */
            u32 lo = s_found ? s_prefix : 0;
            if (sel == 0) ws->lo_k = lo; else ws->lo_p = lo;
            ws->prefix = ws->pmask = 0;
            ws->above = 0;
            if (!s_found) ws->fail = (u32)sel + 1;
        }
    }
}

/* Z_k = sum of e^{z - m} over the top-k set (the candidates with key >= lo_k): inv_z = 1 / Z_k. */
extern "C" __global__ void __launch_bounds__(SB) samp_zsum(SampPassParams_fields) {
    __shared__ float shf[33];
    pdl_begin();
    const SampParams p = samp_params(sp);
    const float m = __ldcg(&ws->m);
    if (m == -INFINITY) return;
    const u32 lo_k = __ldcg(&ws->lo_k);
    int s0, s1;
    samp_slice(n, &s0, &s1);
    float zs = 0.f;
    for (int i = s0 + threadIdx.x; i < s1; i += SB) {
        float z = scaled_logit(x, i, p.inv_t);
        if (samp_cand(z, m) && sort_key(z) >= lo_k) zs += expf(z - m);
    }
    zs = block_sum(zs, shf);
    if (threadIdx.x == 0) ws->pf[blockIdx.x] = zs;
    if (samp_last(ws) && threadIdx.x == 0) {
        float t = 0.f;
        for (int b = 0; b < (int)gridDim.x; b++) t += __ldcg(&ws->pf[b]);
        ws->inv_z = 1.f / t;
    }
}

/* The draw over the kept ids (candidates, key >= max(lo_k, lo_p), min-p) in id order. */
extern "C" __global__ void __launch_bounds__(SB)
    samp_draw(SampDrawParams_fields) {
    __shared__ u64 sh[33];
    __shared__ int s_tok;
    __shared__ int s_blk;
    __shared__ u64 s_u;
    pdl_begin();
    const SampParams p = samp_params(sp);
    const float m = __ldcg(&ws->m), inv_z = __ldcg(&ws->inv_z);
    const u32 lo = max(__ldcg(&ws->lo_k), __ldcg(&ws->lo_p));
    int s0, s1;
    samp_slice(n, &s0, &s1);
    u64 mine = 0;
    if (m != -INFINITY)
        for (int i = s0 + threadIdx.x; i < s1; i += SB) {
            float z = scaled_logit(x, i, p.inv_t);
            if (samp_cand(z, m) && kept(z, lo, m, p.min_p)) mine += fixed_mass(z, m, inv_z);
        }
    u64 tot;
    block_scan_u64(mine, sh, &tot);
    if (threadIdx.x == 0) ws->pu[blockIdx.x] = tot;
    if (!samp_last(ws)) return;
    if (threadIdx.x == 0) {
        u64 total = 0;
        for (int b = 0; b < (int)gridDim.x; b++) total += __ldcg(&ws->pu[b]);
        s_tok = -1;
        s_blk = -1;
        if (total && m != -INFINITY) {
            u64 r = splitmix64(p.seed ^ splitmix64((u64)io[2] + 1));
            u64 u = (u64)((double)(r >> 11) * (1.0 / 9007199254740992.0) * (double)total);
            if (u >= total) u = total - 1;
            u64 off = 0;
            for (int b = 0; b < (int)gridDim.x; b++) {
                u64 w = __ldcg(&ws->pu[b]);
                if (u < off + w) {
                    s_blk = b;
                    s_u = u - off;
                    break;
                }
                off += w;
            }
        }
    }
    __syncthreads();
    if (s_blk >= 0) {
        /* rescan slice s_blk: thread t owns a contiguous run of ids, runs in thread order */
        int S = (n + gridDim.x - 1) / gridDim.x;
        int b0 = min(n, s_blk * S), b1 = min(n, b0 + S);
        int per = (b1 - b0 + SB - 1) / SB;
        int r0 = min(b1, b0 + (int)threadIdx.x * per), r1 = min(b1, r0 + per);
        u64 w = 0;
        for (int i = r0; i < r1; i++) {
            float z = scaled_logit(x, i, p.inv_t);
            if (samp_cand(z, m) && kept(z, lo, m, p.min_p)) w += fixed_mass(z, m, inv_z);
        }
        u64 t2;
        u64 off = block_scan_u64(w, sh, &t2);
        const u64 u = s_u;
        if (w && u >= off && u < off + w)
            for (int i = r0; i < r1; i++) {
                float z = scaled_logit(x, i, p.inv_t);
                if (samp_cand(z, m) && kept(z, lo, m, p.min_p)) {
                    off += fixed_mass(z, m, inv_z);
                    if (u < off) {
                        s_tok = i;
                        break;
                    }
                }
            }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        int tok = s_tok;
        if (tok < 0) tok = m == -INFINITY ? 0 : __ldcg(&ws->argm);
        io_advance(io, ring, tok);
    }
}
