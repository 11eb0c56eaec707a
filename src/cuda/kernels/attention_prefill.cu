/*
 * attention_prefill.cu: causal gated attention for T new tokens (prefill) over the KV cache (fp32,
 *   or bf16 for the `_bf16` entry points; see attention.cu),
 * after attn_prep has written their K/V rows and normalized, rotated queries.
 *
 * attn_prefill: query rows r = t*G + gi (G = H_q/H_kv query heads per KV head, head h = kvh*G + gi);
 *   token t sits at position pos0 + t (pos0 = pos_p[0]) and attends to positions 0..pos0+t.
 *   grid (ceil(T*G/8), H_kv), block 256 = 8 warps; warp w owns row 8*blockIdx.x + w, so the 8 rows
 *   of a block share one KV head (GQA packing) and each K/V tile staged in shared memory serves
 *   all of them. Keys go in tiles of 16 positions: K and V rows [16][D] in shared memory (32 KB at
 *   D = 256); a warp computes its 16 dots (lane holds dims lane + 32i, D/32 <= 8), reduces them
 *   with 16 independent warp sums, then makes one online-softmax update (running max m, sum l,
 *   output o) per tile.
 *   q [T, H_q, D]; caches [capacity, H_kv, D]; out[t, h] = o / l, times sigmoid(gate) when gated
 *   (gate at qg[t*ldg + h*2D + D + d]). scale = 1/sqrt(D).
 */
template <typename KV>
__device__ __forceinline__ void attn_prefill_t(const float* q, const KV* kc, const KV* vc, const float* qg,
                                               long long ldg, float* out, int nh, int hkv, int hd, int T,
                                               const int* pos_p, float scale, int gated) {
    __shared__ float Ks[16][256], Vs[16][256];
    int pos0 = pos_p[0];
    int G = nh / hkv, kvh = blockIdx.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * 8 + warp;
    bool valid = row < T * G;
    int t = valid ? row / G : 0, gi = row % G;
    int h = kvh * G + gi;
    int qp = pos0 + t;
    int last = min(T * G - 1, (int)blockIdx.x * 8 + 7);
    int kend = pos0 + last / G + 1;
    int nd = hd / 32;
    float qv[8], o[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        qv[i] = (valid && i < nd) ? q[((long long)t * nh + h) * hd + lane + 32 * i] : 0.f;
        o[i] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (int k0 = 0; k0 < kend; k0 += 16) {
        __syncthreads();
        for (int e = threadIdx.x; e < 16 * hd; e += blockDim.x) {
            int j = e / hd, d = e - j * hd, p = k0 + j;
            float kv = 0.f, vv = 0.f;
            if (p < kend) {
                long long off = ((long long)p * hkv + kvh) * hd + d;
                kv = kv_ld(kc + off);
                vv = kv_ld(vc + off);
            }
            Ks[j][d] = kv;
            Vs[j][d] = vv;
        }
        __syncthreads();
        if (!valid || k0 > qp) continue;
        float dd[16];
#pragma unroll
        for (int j = 0; j < 16; j++) {
            float acc = 0.f;
#pragma unroll
            for (int i = 0; i < 8; i++)
                if (i < nd) acc += qv[i] * Ks[j][lane + 32 * i];
            dd[j] = acc;
        }
        float mx = m;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            float s = warp_sum(dd[j]) * scale;
            dd[j] = k0 + j <= qp ? s : -INFINITY;
            mx = fmaxf(mx, dd[j]);
        }
        float corr = expf(m - mx);
        l *= corr;
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] *= corr;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            if (k0 + j <= qp) {
                float pw = expf(dd[j] - mx);
                l += pw;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    if (i < nd) o[i] += pw * Vs[j][lane + 32 * i];
            }
        }
        m = mx;
    }
    if (!valid) return;
    for (int i = 0; i < nd; i++) {
        int d = lane + 32 * i;
        float r = o[i] / l;
        if (gated) r *= sigmoid_f(qg[(long long)t * ldg + (long long)h * 2 * hd + hd + d]);
        out[((long long)t * nh + h) * hd + d] = r;
    }
}

#define ATTN_PREFILL(NAME, KV)                                                                                 \
    extern "C" __global__ void NAME(AttnPrefillParams_fields) {                                                \
        attn_prefill_t<KV>(q, (const KV*)kc, (const KV*)vc, qg, ldg, out, nh, hkv, hd, T, pos_p, scale, gated); \
    }
ATTN_PREFILL(attn_prefill, float)
ATTN_PREFILL(attn_prefill_bf16, u16)

/*
 * attn_prefill_tc: the same attention on tensor cores (mma.sync m16n8k16, bf16 inputs, fp32
 *   accumulation and softmax), the fast prefill mode.
 *   Rows r = t*G + gi as above; grid (ceil(T*G/64), H_kv), block 128 = 4 warps, warp w owns rows
 *   64*blockIdx.x + 16w .. +15 (one m16 tile). Q fragments (bf16) stay in registers for the whole
 *   key loop (D/16 k-steps x 4 regs); O accumulates in registers (D/8 n-tiles x 4 floats).
 *   Keys in tiles of 32: K staged as Ks[key][D + 8] bf16 and V transposed as Vt[d][32 + 8] bf16,
 *   so both mma B operands are contiguous u32 pairs and the padded rows spread the fragment loads
 *   over the 32 banks. Per tile: S = Q K^T (16 x 32 per warp), scale, causal mask, online softmax
 *   per row (quad shuffles: a row's 32 scores live in the 4 lanes with the same g), P rounded
 *   to bf16 and reused directly as the A fragments of O += P V (FlashAttention-2 register layout).
 *   Rows past T*G compute with the last valid token and are not written.
 */
template <typename KV>
__device__ __forceinline__ void attn_prefill_tc_t(const float* q, const KV* kc, const KV* vc, const float* qg,
                                                  long long ldg, float* out, int nh, int hkv, int hd, int T,
                                                  const int* pos_p, float scale, int gated) {
    __shared__ __align__(16) u16 Ks[32 * 264];
    __shared__ __align__(16) u16 Vt[256 * 40];
    const int LDK = hd + 8, LDV = 40;
    int pos0 = pos_p[0];
    int G = nh / hkv, kvh = blockIdx.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    int nrows = T * G;
    int rbase = blockIdx.x * 64 + warp * 16;
    /* the two rows this thread accumulates: g and g + 8 of the warp's tile */
    int rr[2], tt[2], hh[2], qpos[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        rr[i] = rbase + g + 8 * i;
        int rc = min(rr[i], nrows - 1);
        tt[i] = rc / G;
        hh[i] = kvh * G + rc % G;
        qpos[i] = pos0 + tt[i];
    }
    int last_row = min(nrows - 1, (int)blockIdx.x * 64 + 63);
    int kend = pos0 + last_row / G + 1;
    int warp_last = min(nrows - 1, rbase + 15);
    int warp_kend = pos0 + warp_last / G + 1;
    int nks = hd / 16;

    u32 qf[16][4];
#pragma unroll
    for (int ks = 0; ks < 16; ks++) {
        if (ks < nks) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int i = j & 1, d = ks * 16 + 2 * t4 + 8 * (j >> 1);
                const float* p = q + ((long long)tt[i] * nh + hh[i]) * hd + d;
                qf[ks][j] = pack_bf16(p[0], p[1]);
            }
        }
    }
    float o[32][4];
#pragma unroll
    for (int n = 0; n < 32; n++)
#pragma unroll
        for (int c = 0; c < 4; c++) o[n][c] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const u32* K32 = (const u32*)Ks;
    const u32* V32 = (const u32*)Vt;
    int nd4 = hd / 4;
    for (int k0 = 0; k0 < kend; k0 += 32) {
        __syncthreads();
        for (int e = threadIdx.x; e < 32 * nd4; e += blockDim.x) {
            int j = e / nd4, d = (e - j * nd4) * 4, p = k0 + j;
            float4 kv = make_float4(0.f, 0.f, 0.f, 0.f), vv = kv;
            if (p < kend) {
                long long off = ((long long)p * hkv + kvh) * hd + d;
                kv = kv_ld4(kc + off);
                vv = kv_ld4(vc + off);
            }
            *(uint2*)(Ks + j * LDK + d) = make_uint2(pack_bf16(kv.x, kv.y), pack_bf16(kv.z, kv.w));
            Vt[(d + 0) * LDV + j] = (u16)bf16_bits(vv.x);
            Vt[(d + 1) * LDV + j] = (u16)bf16_bits(vv.y);
            Vt[(d + 2) * LDV + j] = (u16)bf16_bits(vv.z);
            Vt[(d + 3) * LDV + j] = (u16)bf16_bits(vv.w);
        }
        __syncthreads();
        if (k0 >= warp_kend) continue;
        float s[4][4];
#pragma unroll
        for (int n = 0; n < 4; n++) {
#pragma unroll
            for (int c = 0; c < 4; c++) s[n][c] = 0.f;
#pragma unroll
            for (int ks = 0; ks < 16; ks++) {
                if (ks < nks) {
                    u32 b0 = K32[(n * 8 + g) * (LDK / 2) + ks * 8 + t4];
                    u32 b1 = K32[(n * 8 + g) * (LDK / 2) + ks * 8 + 4 + t4];
                    asm volatile(
                        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                        "{%8,%9}, {%0,%1,%2,%3};\n"
                        : "+f"(s[n][0]), "+f"(s[n][1]), "+f"(s[n][2]), "+f"(s[n][3])
                        : "r"(qf[ks][0]), "r"(qf[ks][1]), "r"(qf[ks][2]), "r"(qf[ks][3]), "r"(b0), "r"(b1));
                }
            }
        }
        /* scale, mask, online softmax; s[n][2i + c] is row i (g or g+8), key k0 + 8n + 2t4 + c */
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int i = c >> 1, key = k0 + 8 * n + 2 * t4 + (c & 1);
                float v = key <= qpos[i] ? s[n][c] * scale : -INFINITY;
                s[n][c] = v;
                mx[i] = fmaxf(mx[i], v);
            }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        }
        float corr[2], rs[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 2; i++) corr[i] = mx[i] == -INFINITY ? 1.f : expf(m[i] - mx[i]);
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int i = c >> 1;
                float p = mx[i] == -INFINITY ? 0.f : expf(s[n][c] - mx[i]);
                s[n][c] = p;
                rs[i] += p;
            }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            rs[i] += __shfl_xor_sync(0xffffffffu, rs[i], 1);
            rs[i] += __shfl_xor_sync(0xffffffffu, rs[i], 2);
            l[i] = l[i] * corr[i] + rs[i];
            m[i] = mx[i];
        }
#pragma unroll
        for (int n = 0; n < 32; n++) {
            o[n][0] *= corr[0];
            o[n][1] *= corr[0];
            o[n][2] *= corr[1];
            o[n][3] *= corr[1];
        }
        /* O += P V: the k-step kk covers keys 16kk..16kk+15 = S tiles 2kk, 2kk+1 */
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            u32 a0 = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            u32 a1 = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            u32 a2 = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            u32 a3 = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int n = 0; n < 32; n++) {
                if (n < hd / 8) {
                    u32 b0 = V32[(n * 8 + g) * (LDV / 2) + kk * 8 + t4];
                    u32 b1 = V32[(n * 8 + g) * (LDV / 2) + kk * 8 + 4 + t4];
                    asm volatile(
                        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                        "{%8,%9}, {%0,%1,%2,%3};\n"
                        : "+f"(o[n][0]), "+f"(o[n][1]), "+f"(o[n][2]), "+f"(o[n][3])
                        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (rr[i] >= nrows) continue;
        float inv = 1.f / l[i];
        long long ob = ((long long)tt[i] * nh + hh[i]) * hd;
        const float* gp = qg + (long long)tt[i] * ldg + (long long)hh[i] * 2 * hd + hd;
#pragma unroll
        for (int n = 0; n < 32; n++) {
            if (n < hd / 8) {
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    int d = n * 8 + 2 * t4 + c;
                    float r = o[n][2 * i + c] * inv;
                    if (gated) r *= sigmoid_f(gp[d]);
                    out[ob + d] = r;
                }
            }
        }
    }
}

#define ATTN_PREFILL_TC(NAME, KV)                                                                              \
    extern "C" __global__ void __launch_bounds__(128) NAME(AttnPrefillParams_fields) {                         \
        attn_prefill_tc_t<KV>(q, (const KV*)kc, (const KV*)vc, qg, ldg, out, nh, hkv, hd, T, pos_p, scale,      \
                              gated);                                                                           \
    }
ATTN_PREFILL_TC(attn_prefill_tc, float)
ATTN_PREFILL_TC(attn_prefill_tc_bf16, u16)
