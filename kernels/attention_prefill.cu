/*
 * attention_prefill.cu: causal gated attention for T new tokens (prefill) over the fp32 KV cache,
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
extern "C" __global__ void attn_prefill(const float* q, const float* kc, const float* vc, const float* qg,
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
                kv = kc[off];
                vv = vc[off];
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
