/*
 * pstep_run.cu: the persistent decode step's loop (see pstep.cu's header for the phases, the
 * schedule and the synchronization): the producer warp's weight ring (ps_produce), the consumer
 * warps' chunks (ps_chunk: int8 or float dot products of the slot's rows with the staged input,
 * the row epilogues), the router's top-K (ps_route) and the kernel `pstep` that walks the phase
 * table. Launch: one block per SM, PS_THREADS + 32 threads, dynamic shared memory = PsShared
 * rounded to 128 B + ns slots of slot_bytes (src/cuda/model/pstep.rs).
 */
/* ---- producer: the chunks of one phase for this block ---- */
#if __CUDA_ARCH__ >= 900
struct PsRing {
    int slot;
    u32 par; /* bit s: parity of slot s's next use */
};

/* Waits for a free slot and writes its header; returns the slot's data pointer. */
__device__ __forceinline__ unsigned char* ps_take(PsShared& sm, unsigned char* ring, int slot_bytes, PsRing& rg,
                                                  PsHdr h, u32* twait) {
    int s = rg.slot;
    u32 t0 = twait ? ps_now() : 0;
    mb_wait(&sm.empty[s], ((rg.par >> s) & 1) ^ 1);
    if (twait) *twait += ps_now() - t0;
    sm.hdr[s] = h;
    return ring + (long long)s * slot_bytes;
}
__device__ __forceinline__ void ps_next(PsRing& rg, int ns) {
    rg.par ^= 1u << rg.slot;
    rg.slot = rg.slot + 1 == ns ? 0 : rg.slot + 1;
}

__device__ __noinline__ void ps_produce(const PsPhase* phases, int nphase, const u64* ctr, PsShared& sm, unsigned char* ring,
                           int slot_bytes, int ns, u32* trace) {
    int lane = threadIdx.x & 31, b = blockIdx.x, nb = gridDim.x;
    PsRing rg;
    rg.slot = 0;
    rg.par = 0;
    u32 rpar = 0; /* parity of sm.route's next completion */
    for (int rel = 0; rel < nphase; rel++) {
        const PsPhase& P = phases[rel];
        int endf = rel == nphase - 1 ? PS_END : 0;
        u32* tr = trace ? trace + PS_TW * (rel * nb + b) : 0;
        u32 twait = 0, *tw = tr ? &twait : 0;
        if (P.kind == PS_GDN) {
            if (lane == 0) {
                ps_take(sm, ring, slot_bytes, rg, PsHdr{rel, PS_FIRST | PS_LAST | endf, 0, 0}, tw);
                if (tr) tr[2] = ps_now(), tr[7] = twait;
                mb_arrive(&sm.full[rg.slot]);
            }
            ps_next(rg, ns);
            continue;
        }
        int cb = P.cols * P.bits / 8, sb = 2 * (P.cols / P.group);
        int nm = 1, total = P.rows, mrows = P.rows;
        if (P.kind == PS_MOE_GU) {
            /* the consumers ranked the router logits once every block finished them */
            mb_wait(&sm.route, rpar);
            rpar ^= 1;
            total = (P.topk + 1) * 2 * P.rows;
        } else if (P.kind == PS_MOE_DOWN) {
            nm = P.topk + 1;
        }
        int lo, hi;
        ps_share(total, b, nb, lo, hi);
        int per = slot_bytes / (nm * (cb + 2 * sb)); /* rows per chunk: whole rounds of the warps */
        if (per > PS_WARPS) per -= per % PS_WARPS;
        int r = lo;
        bool first = true;
        do {
            int n = min(per, hi - r);
            if (P.kind == PS_MOE_GU) n = min(n, mrows - r % mrows); /* one matrix per chunk */
            int flags = (first ? PS_FIRST : 0) | (r + n >= hi ? PS_LAST | endf : 0);
            if (lane == 0) {
                unsigned char* d = ps_take(sm, ring, slot_bytes, rg, PsHdr{rel, flags, r, n}, tw);
                if (tr && first) tr[2] = ps_now();
                if (tr && (flags & PS_LAST)) tr[7] = twait;
                u64* full = &sm.full[rg.slot];
                if (n <= 0) {
                    mb_arrive(full);
                } else {
                    mb_expect(full, (u32)(nm * n * (cb + 2 * sb)));
                    for (int k = 0; k < nm; k++) {
                        long long row; /* first global row of the copy */
                        if (P.kind == PS_MOE_GU) {
                            int v = r / mrows, kk = v >> 1, m = v & 1;
                            row = (long long)(2 * sm.chosen[kk] + m) * mrows + r % mrows;
                        } else if (P.kind == PS_MOE_DOWN) {
                            row = (long long)sm.chosen[k] * P.rows + r;
                        } else {
                            row = r;
                        }
                        bulk_g2s(d + (long long)(k * n) * cb, (const unsigned char*)P.w + row * cb, (u32)(n * cb), full);
                        unsigned char* ds = d + (long long)nm * n * cb;
                        bulk_g2s(ds + (long long)(k * n) * sb, (const unsigned char*)P.s + row * sb, (u32)(n * sb), full);
                        bulk_g2s(ds + (long long)nm * n * sb + (long long)(k * n) * sb,
                                 (const unsigned char*)P.b + row * sb, (u32)(n * sb), full);
                    }
                }
            }
            ps_next(rg, ns);
            r += max(n, 0);
            first = false;
        } while (r < hi);
    }
}
#endif

/* ---- consumers: one chunk ---- */

/* The end of one output row: store (or add to the residual prev), and for rows < conv_c the GDN
   conv epilogue. cw / cx / prev hold the side loads of 8 rows (lane 4j + t: tap t of row j), jj
   is this row's j. Warp-uniform (row is). */
__device__ __forceinline__ void ps_row_out(const PsPhase& P, int row, float acc, int jj, float cw, float cx,
                                           float prev) {
    int lane = threadIdx.x & 31;
    float* y = (float*)P.y;
    float pv = __shfl_sync(0xffffffffu, prev, jj << 2);
    if (lane == 0) {
        float v = P.accumulate && P.kind != PS_MOE_GU ? pv + acc : acc;
        if (P.otag) ll_store(y, row, v, P.otag);
        else y[row] = v;
    }
    if (P.conv_c > row) {
        int K = P.conv_k;
        float w = __shfl_sync(0xffffffffu, cw, (jj << 2) + (lane & 3));
        float c = __shfl_sync(0xffffffffu, cx, (jj << 2) + (lane & 3));
        if (lane == K - 1) c = acc;
        float p = warp_sum(lane < K ? w * c : 0.f);
        float nx = __shfl_down_sync(0xffffffffu, c, 1);
        if (lane == 0) ((float*)P.aux[2])[row] = silu_f(p);
        if (lane < K - 1) ((float*)P.aux[0])[(long long)lane * P.conv_c + row] = nx;
    }
}

/* Warp w takes rows w, w + 16, w + 32, ... of the chunk, two per pass (x read once for both).
   The rows' side data (conv taps and state, the residual) are loaded 8 rows at a time by the
   whole warp before their dot products, so a chunk pays one global latency, not one per row. */
template <int BITS, int TY>
__device__ void ps_chunk_t(const PsPhase& P, const PsHdr& h, const unsigned char* d, float rr, const float* xs,
                           const float* xsum) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int n4 = P.cols * BITS / 128, ng = P.cols / P.group, gsh = __ffs(P.group) - 1;
    int nm = P.kind == PS_MOE_DOWN ? P.topk + 1 : 1;
    bool resid = P.accumulate && P.kind != PS_MOE_GU;
    for (int j0 = 0; warp + 16 * j0 < h.n; j0 += 8) {
        int jr = warp + 16 * (j0 + (lane >> 2)), t = lane & 3;
        int row = h.row0 + jr;
        float cw = 0.f, cx = 0.f, prev = 0.f;
        if (jr < h.n) {
            if (P.conv_c > row) {
                if (t < P.conv_k) cw = __ldg((const float*)P.aux[1] + (long long)row * P.conv_k + t);
                if (t < P.conv_k - 1) cx = __ldcg((const float*)P.aux[0] + (long long)t * P.conv_c + row);
            }
            if (resid && t == 0) prev = __ldcg((const float*)P.y + row);
        }
        for (int jj = 0; jj < 8; jj += 2) {
            int ra = warp + 16 * (j0 + jj);
            if (ra >= h.n) break;
            bool two = ra + 16 < h.n;
            float a, b;
            ps_rows_dot<BITS, TY>(d, h.n, nm, ra, two, n4, ng, gsh, xs, xsum, a, b);
            ps_row_out(P, h.row0 + ra, a * rr, jj, cw, cx, prev);
            if (two) ps_row_out(P, h.row0 + ra + 16, b * rr, jj + 1, cw, cx, prev);
        }
    }
}

__device__ void ps_chunk(const PsPhase& P, const PsHdr& h, const unsigned char* d, float rr, const float* xs,
                         const float* xsum) {
    if (P.bits == 8) {
        if (P.ty == TY_BF16) ps_chunk_t<8, TY_BF16>(P, h, d, rr, xs, xsum);
        else ps_chunk_t<8, TY_F16>(P, h, d, rr, xs, xsum);
    } else {
        if (P.ty == TY_BF16) ps_chunk_t<4, TY_BF16>(P, h, d, rr, xs, xsum);
        else ps_chunk_t<4, TY_F16>(P, h, d, rr, xs, xsum);
    }
}

/* The router's top-K for the expert phase G once every block finished the router: warp 0 ranks
   the logits (route_warp's redux2 form, moe.cu: the graph's picks and weights) and completes
   sm.route, on which the producer issues the experts' copies; meanwhile, when `stage` (a 4-bit
   gate/up in the int8 build, whose input differs from the 8-bit router's staging), warps 1-15
   stage the gate/up's input. Returns its rr (1 without staging). Every consumer thread calls it.
   tag != 0 (PS_LL_IN): the logits are LL words, which the consumers poll instead of the counter. */
__device__ float ps_route(const PsPhase& G, const u64* ctr, u64 target, u32 tag, PsShared& sm, u32* tr, int dbg,
                          float* xs, bool stage) {
    if (tag) ps_ll_block((const u64*)G.aux[0], G.nexp + 1, tag, sm.ls);
    else ps_wait_ctr(ctr, target, dbg);
    ps_cbar();
    if (tr && threadIdx.x == 0) tr[4] = ps_now();
    float ss = 0.f;
    if (threadIdx.x < 32) {
        if (tag) { /* the host allows it for E <= 512 (route_warp_smem's limit) */
            route_warp_smem(4, sm.ls, G.nexp, G.topk, G.renorm, sm.chosen, sm.wsel);
        } else {
            route_warp(4, (const float*)G.aux[0], G.nexp, G.topk, G.renorm, 1, sm.ls, sm.chosen, sm.wsel);
        }
        if (threadIdx.x == 0) {
            if (dbg & PS_DBG_FIXED) /* measurement only: the same experts every token */
                for (int k = 0; k < G.topk; k++) sm.chosen[k] = k;
            if (tr) tr[5] = ps_now();
            mb_arrive(&sm.route);
        }
    } else if (stage) {
        ss = ps_stage_x_i8((const float*)G.x, (const float*)G.normw, G.cols, xs, threadIdx.x - 32, PS_THREADS - 32);
    }
    return stage ? ps_rms(ss, G.cols, G.eps, sm.red) : 1.f;
}

extern "C" __global__ void __launch_bounds__(PS_THREADS + 32, 1)
    pstep(PstepParams_fields) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char ps_smem[];
    PsShared& sm = *(PsShared*)ps_smem;
    float* xs = (float*)(ps_smem + ((sizeof(PsShared) + 127) / 128) * 128);
    float* xsum = xs + xmax;
    unsigned char* ring = (unsigned char*)xs + (((xmax + xmax / 16) * 4 + 127) / 128) * 128;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nb = gridDim.x;
    if (tid == 0) {
        for (int i = 0; i < ns; i++) {
            mb_init(&sm.full[i], 1);
            mb_init(&sm.empty[i], PS_WARPS);
        }
        mb_init(&sm.route, 1);
        sm.ep = (u32)__ldcg(ctr + 2) + 1; /* ctr[2]: launches so far */
        sm.cwait = 0;
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == PS_WARPS) {
        ps_produce(phases, nphase, ctr, sm, ring, slot_bytes, ns, trace);
        return;
    }
    int slot = 0;
    u32 par = 0; /* bit s: parity of slot s's next use */
    float rr = 1.f;
    int staged = -1; /* the phase whose input xs holds */
    const PsPhase& P = sm.cur;
    const int pwords = (int)(sizeof(PsPhase) / 4);
    for (;;) {
        u32 t0 = trace ? ps_now() : 0;
        mb_wait(&sm.full[slot], (par >> slot) & 1);
        if (trace && tid == 0) sm.cwait += ps_now() - t0;
        PsHdr h = sm.hdr[slot];
        /* A phase starts with every warp done with the previous one (its last chunk ends with a
           block barrier), so sm.cur and the staging are free. */
        if (h.flags & PS_FIRST) {
            u32* tr = trace ? trace + PS_TW * (h.rel * nb + blockIdx.x) : 0;
            if (tr && tid == 0) tr[3] = ps_now();
            if (tid < pwords) {
                u32 v = __ldg((const u32*)(phases + h.rel) + tid);
                if (tid == PS_OTAG_WORD) v = phases[h.rel].ll & PS_LL_OUT ? ps_tag(sm.ep, h.rel) : 0u;
                ((u32*)&sm.cur)[tid] = v;
            }
            int kind = phases[h.rel].kind;
            if (kind != PS_GDN && h.rel > 0 && !(phases[h.rel].ll & PS_LL_IN)) ps_wait_ctr(ctr, (u64)h.rel * nb, dbg);
            ps_cbar();
            if (kind == PS_GDN) {
                ps_gdn(P, sm.red, sm.qs, sm.ks, flags + (h.rel - 1) * nb, sm.ep, tr, dbg);
            } else {
                bool i8 = GQ_I8 && P.bits == 4;
                if (tr && tid == 0) tr[0] = ps_now();
                if (staged == h.rel) {
                    /* staged while the router's logits were ranked (ps_route) */
                } else if (h.n > 0 && P.same_x && staged == h.rel - 1) {
                    staged = h.rel; /* xs, xsum and rr hold this input already */
                } else if (h.n > 0) {
                    staged = h.rel;
                    if (P.kind == PS_MOE_DOWN)
                        ps_stage_moe((const float*)P.x, P.ll & PS_LL_IN ? ps_tag(sm.ep, h.rel - 1) : 0u, sm.wsel,
                                     P.topk + 1, P.cols, xs, xsum, i8),
                            rr = 1.f;
                    else if (P.xf == PX_GATED)
                        ps_stage_gated((const float*)P.x, (const float*)P.aux[3], (const float*)P.normw, P.hv, P.dv,
                                       P.eps, xs, xsum, sm.hs, i8),
                            rr = 1.f;
                    else
                        rr = ps_stage_x((const float*)P.x, P.xf == PX_RMS ? (const float*)P.normw : 0, P.cols, P.eps,
                                        xs, xsum, sm.red, i8);
                }
                if (tr && tid == 0) tr[8] = ps_now();
            }
        }
        /* Each warp takes its rows of the chunk and frees the slot for itself (the empty barrier
           counts the warps): no block barrier between the chunks of a phase. */
        if (P.kind != PS_GDN && h.n > 0) ps_chunk(P, h, ring + (long long)slot * slot_bytes, rr, xs, xsum);
        __syncwarp();
        if (lane == 0) mb_arrive(&sm.empty[slot]);
        if (h.flags & PS_LAST) {
            ps_cbar(); /* every warp finished the phase */
            if (tid == 0) {
                if (trace) trace[PS_TW * (h.rel * nb + blockIdx.x) + 1] = ps_now(),
                    trace[PS_TW * (h.rel * nb + blockIdx.x) + 6] = sm.cwait, sm.cwait = 0;
                u32* flag = flags + h.rel * nb + blockIdx.x;
                if (dbg & PS_DBG_FENCES) {
                    __threadfence();
                    asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(ctr) : "memory");
                    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(sm.ep) : "memory");
                } else {
                    /* one release fence, then two strong relaxed writes: each is a release
                       pattern (one MEMBAR.GPU instead of three). A phase of LL outputs needs
                       none: its readers poll the words, and the next fenced phase end of this
                       block releases them to the counter's later waiters. */
                    if (!(P.ll & PS_LL_OUT)) asm volatile("fence.acq_rel.gpu;" ::: "memory");
                    asm volatile("red.relaxed.gpu.global.add.u64 [%0], 1;" ::"l"(ctr) : "memory");
                    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(sm.ep) : "memory");
                }
            }
            if (h.rel + 1 < nphase && phases[h.rel + 1].kind == PS_MOE_GU) {
                const PsPhase& G = phases[h.rel + 1];
                bool st = GQ_I8 && G.bits == 4;
                float r = ps_route(G, ctr, (u64)(h.rel + 1) * nb, G.ll & PS_LL_IN ? ps_tag(sm.ep, h.rel) : 0u, sm,
                                   trace ? trace + PS_TW * ((h.rel + 1) * nb + blockIdx.x) : 0, dbg, xs, st);
                if (st) staged = h.rel + 1, rr = r;
            }
        }
        par ^= 1u << slot;
        slot = slot + 1 == ns ? 0 : slot + 1;
        if (h.flags & PS_END) break;
    }
    /* the last block out resets the counters for the next launch */
    if (tid == 0) {
        __threadfence();
        u64 t = atomicAdd(ctr + 1, 1ull);
        if (t == (u64)nb - 1) {
            ctr[0] = 0;
            ctr[1] = 0;
            ctr[2] += 1;
            __threadfence();
        }
    }
#else
    __trap();
#endif
}
