// scripts/emu.sh's cases: the decode kernels' device code (included before this file, built for
// the host with shim.h) against double-precision references, with the kernel tests' bound
// (NMSE 1e-9). gq_body is the streaming GEMV (gemv_q2 with the fused RMSNorm); mf2_body is
// moe_fused_q2 whole: the top-K of each form, the input staging, the gate/up pairs, the blocks'
// meeting (here a grid barrier: the counter protocol itself is not what this checks) and the down
// projection added into x; moe_down_q's body; the GDN state step in both forms (the same bits);
// the persistent step's consumer chunks (pstep.cu: staging, int8 dot, conv epilogue, residual).
#include <algorithm>
#include <array>
#include <cstdio>
#include <random>
static u16 to_bf16(float f) { unsigned u = __float_as_uint(f); u += 0x7FFF + ((u >> 16) & 1); return u >> 16; }
static std::mt19937 rng(7);
static float U() { return std::uniform_real_distribution<float>(-1, 1)(rng); }
struct Q4 { int rows, cols, group; std::vector<u32> w; std::vector<u16> sc, bi; std::vector<int> q;
    Q4(int r, int c, int g, int bits = 4) : rows(r), cols(c), group(g), w((size_t)r * c * bits / 32), sc((size_t)r * c / g), bi((size_t)r * c / g), q((size_t)r * c) {
        int per = 32 / bits;
        for (size_t i = 0; i < q.size(); i++) { q[i] = rng() & ((1 << bits) - 1); w[i / per] |= (u32)q[i] << (bits * (i % per)); }
        for (auto& s : sc) s = to_bf16(0.01f + 0.05f * std::fabs(U()));
        for (auto& b : bi) b = to_bf16(0.1f * U()); }
    double at(size_t r, int c) const { size_t g = r * (cols / group) + c / group; return __uint_as_float((u32)sc[g] << 16) * (double)q[r * cols + c] + __uint_as_float((u32)bi[g] << 16); }
};
static double nmse(const float* y, const std::vector<double>& want) { double n = 0, d = 0; for (size_t i = 0; i < want.size(); i++) { n += (y[i] - want[i]) * (y[i] - want[i]); d += want[i] * want[i]; } return n / d; }
static int fails = 0;
static void report(const char* what, double e) { printf("%-6s %-58s nmse %.3e%s\n", VARIANT, what, e, e <= 1e-9 ? "" : "  FAIL"); fails += e > 1e-9; }

// the plain GEMV with the fused norm: y = rr W (x nw)
static void gemv_case(int rows, int cols, int G, int T, double outlier) {
    Q4 W(rows, cols, 64);
    std::vector<float> x(cols), nw(cols), y(rows, NAN), smem(cols + cols / 32 + 64, NAN);
    for (auto& v : x) v = U();
    for (auto& v : nw) v = 1.f + 0.5f * U();
    x[5] *= outlier;
    double ss = 0; for (float v : x) ss += (double)v * v;
    double rr = 1.0 / std::sqrt(ss / cols + 1e-6);
    std::vector<double> want(rows);
    for (int r = 0; r < rows; r++) { double a = 0; for (int c = 0; c < cols; c++) a += W.at(r, c) * x[c] * nw[c]; want[r] = a * rr; }
    std::vector<std::vector<float>> sm(G, smem); std::vector<std::array<float, 33>> red(G);
    emu_launch(G, T, [&] { gq_body<4, 2, 2, 2, false, false, false>(W.w.data(), W.sc.data(), W.bi.data(), 64, x.data(), y.data(), rows, cols, 0, 0, nw.data(), 1e-6f, sm[blockIdx.x].data(), red[blockIdx.x].data()); });
    char b[128]; snprintf(b, sizeof b, "gemv %dx%d grid %dx%d outlier %g", rows, cols, G, T, outlier); report(b, nmse(y.data(), want));
}
// moe_fused_q2 (shf: q2s's, the shared expert's pairs first): top-K of E logits + shared slot,
// gate/up pairs, meeting, down into x.
static void q2_case(int E, int K, int H, int inter, int G, int rank, int renorm = 1, bool shf = false) {
    const bool alt = shf; // a second pass, which must give q2's bits
    int S = K + 1;
    Q4 GU(2 * (E + 1) * inter, H, 64), DN((E + 1) * H, inter, 64);
    std::vector<float> x(H), nw(H), logits(E + 1), gu(S * inter, NAN);
    for (auto& v : x) v = U();
    for (auto& v : nw) v = 1.f + 0.5f * U();
    for (auto& v : logits) v = 2 * U();
    logits[3] = logits[7]; // a tie
    // reference routing: top-K by (-value, index), softmax weights renormalized
    auto route = [&](const std::vector<float>& lg, std::vector<int>& idx, std::vector<double>& wk) {
        idx.resize(E); for (int e = 0; e < E; e++) idx[e] = e;
        std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return lg[a] > lg[b]; });
        double mx = lg[idx[0]], sel = 0; for (int k = 0; k < K; k++) sel += std::exp(lg[idx[k]] - mx);
        if (!renorm) { sel = 0; for (int e = 0; e < E; e++) sel += std::exp(lg[e] - mx); }
        wk.assign(S, 0); for (int k = 0; k < K; k++) wk[k] = std::exp(lg[idx[k]] - mx) / sel;
        wk[K] = 1 / (1 + std::exp(-(double)lg[E])); idx.resize(K); idx.push_back(E);
    };
    std::vector<int> idx; std::vector<double> wk;
    route(logits, idx, wk);
    double ss = 0; for (float v : x) ss += (double)v * v;
    double rr = 1.0 / std::sqrt(ss / H + 1e-6);
    std::vector<double> want(H);
    for (int r = 0; r < H; r++) want[r] = x[r];
    for (int s = 0; s < S; s++) {
        int e = idx[s];
        std::vector<double> h(inter);
        for (int i = 0; i < inter; i++) {
            double g = 0, u = 0;
            for (int c = 0; c < H; c++) { double xw = x[c] * nw[c] * rr; g += GU.at((size_t)(2 * e) * inter + i, c) * xw; u += GU.at((size_t)(2 * e + 1) * inter + i, c) * xw; }
            h[i] = wk[s] * g / (1 + std::exp(-g)) * u;
        }
        for (int r = 0; r < H; r++) { double a = 0; for (int i = 0; i < inter; i++) a += DN.at((size_t)e * H + r, i) * h[i]; want[r] += a; }
    }
    std::vector<int> ids(S, -1); std::vector<float> wts(S, NAN);
    unsigned long long ctr[2] = {0, 0};
    const std::vector<float> x0 = x;
    int smem = std::max(H + H / 16, S * inter + S * inter / 32) + 64;
    std::vector<std::vector<float>> xs(G, std::vector<float>(smem, NAN)), red(G, std::vector<float>(33)), wsel(G, std::vector<float>(65)), ls(G, std::vector<float>(MF2_LS));
    std::vector<std::vector<int>> chosen(G, std::vector<int>(65));
    std::vector<float> x2; // alt: q2's result on the same input, which q2s's must equal bit for bit
    for (int pass = 0; pass < 1 + alt; pass++) {
        bool sp = shf && pass == 1;
        if (pass == 1) { x2 = x; x = x0; std::fill(gu.begin(), gu.end(), NAN); }
        emu_launch(G, 512, [&] {
            int b = blockIdx.x;
#define Q2_ARGS(LG) GU.w.data(), GU.sc.data(), GU.bi.data(), DN.w.data(), DN.sc.data(), DN.bi.data(), 4, 64, 64, 2, x.data(), gu.data(), inter, H, nw.data(), 1e-6f, LG, E, K, renorm, ids.data(), wts.data(), ctr + 1, 1, rank, nullptr, nullptr, nullptr, 0, 0, 0, 0, nullptr, 0, 1, H / 32, xs[b].data(), red[b].data(), wsel[b].data(), chosen[b].data(), ls[b].data(), nullptr
            if (sp) mf2_body<4, 2, true>(Q2_ARGS(logits.data()));
            else mf2_body<4, 2>(Q2_ARGS(logits.data()));
#undef Q2_ARGS
        });
    }
    if (shf) { // moe_fused_q2s_given: the routing read from ids/wts as the q2s pass left them: its bits
        const std::vector<float> xq = x;
        x = x0; std::fill(gu.begin(), gu.end(), NAN);
        emu_launch(G, 512, [&] {
            int b = blockIdx.x;
            mf2_body<4, 2, true, true>(GU.w.data(), GU.sc.data(), GU.bi.data(), DN.w.data(), DN.sc.data(), DN.bi.data(), 4, 64, 64, 2, x.data(), gu.data(), inter, H, nw.data(), 1e-6f,
                nullptr, E, K, renorm, ids.data(), wts.data(), ctr + 1, 1, rank, nullptr, nullptr, nullptr, 0, 0, 0, 0, nullptr, 0, 1, H / 32, xs[b].data(), red[b].data(), wsel[b].data(), chosen[b].data(), ls[b].data(), nullptr);
        });
        if (memcmp(x.data(), xq.data(), 4 * H) != 0) { printf("%-6s moe_fused_q2s_given E%d K%d H%d: not moe_fused_q2s's bits\n", VARIANT, E, K, H); fails++; }
        else printf("%-6s moe_fused_q2s_given E%d K%d H%d: moe_fused_q2s's bits\n", VARIANT, E, K, H);
        // moe_fused_q2s_acc: the router's sums in fixed point (round(logit 2^32)) with the H / 32
        // sums of squares summing to H (so the norm's factor is 1 / sqrt(1 + eps)), against
        // moe_fused_q2s on the logits those sums give in float: the same picks and bits, and the
        // sums zero after the launch
        const int Gr = H / 32;
        std::vector<unsigned long long> acc(E + 1 + (Gr + 1) / 2, 0);
        float* sq = (float*)acc.data() + 2 * (E + 1);
        sq[0] = (float)H;
        const float rr1 = 1.f / sqrtf((float)H / (float)H + 1e-6f);
        std::vector<float> lg2(E + 1);
        for (int j = 0; j <= E; j++) {
            acc[j] = (unsigned long long)std::llrint((double)logits[j] * 4294967296.0);
            lg2[j] = (float)((double)(long long)acc[j] * (1.0 / 4294967296.0));
            lg2[j] *= rr1;
        }
        // the same with the 8-warp top-K (moe_fused_q2s_accb, pass 2) on the same sums
        const std::vector<unsigned long long> acc0 = acc;
        std::vector<float> xo[3];
        std::vector<int> io[3];
        std::vector<float> wo[3];
        int nz[3] = {0, 0, 0};
        for (int pass = 0; pass < 3; pass++) {
            x = x0; std::fill(gu.begin(), gu.end(), NAN); std::fill(ids.begin(), ids.end(), -1);
            acc = acc0;
            emu_launch(G, 512, [&] {
                int b = blockIdx.x;
#define Q2_ARGS(LG) GU.w.data(), GU.sc.data(), GU.bi.data(), DN.w.data(), DN.sc.data(), DN.bi.data(), 4, 64, 64, 2, x.data(), gu.data(), inter, H, nw.data(), 1e-6f, LG, E, K, renorm, ids.data(), wts.data(), ctr + 1, 1, rank, nullptr, nullptr, nullptr, 0, 0, 0, 0, nullptr, 0, 1, H / 32, xs[b].data(), red[b].data(), wsel[b].data(), chosen[b].data(), ls[b].data(), nullptr
                if (pass == 0) mf2_body<4, 2, true>(Q2_ARGS(lg2.data()));
                else if (pass == 1) mf2_body<4, 2, true, false, 1>(Q2_ARGS((float*)acc.data()));
                else mf2_body<4, 2, true, false, 2>(Q2_ARGS((float*)acc.data()));
#undef Q2_ARGS
            });
            xo[pass] = x; io[pass] = ids; wo[pass] = wts;
            for (int j = 0; j <= E; j++) nz[pass] += acc[j] != 0;
        }
        for (int pass = 1; pass < 3; pass++) {
            bool same = memcmp(xo[0].data(), xo[pass].data(), 4 * H) == 0 && io[0] == io[pass] && memcmp(wo[0].data(), wo[pass].data(), 4 * S) == 0;
            printf("%-6s moe_fused_q2s_acc%s E%d K%d H%d: %s, %d sums left nonzero\n", VARIANT, pass == 2 ? "b" : "", E, K, H, same ? "moe_fused_q2s's picks and bits" : "NOT moe_fused_q2s's picks and bits", nz[pass]);
            fails += !same || nz[pass];
        }
        x = xq;
    }
    if (alt && memcmp(x.data(), x2.data(), 4 * H) != 0) { printf("%-6s moe_fused_q2s E%d K%d H%d: not moe_fused_q2's bits\n", VARIANT, E, K, H); fails++; }
    bool ok = true; for (int s = 0; s < S; s++) ok &= ids[s] == idx[s];
    double werr = 0; for (int s = 0; s < S; s++) werr = std::max(werr, std::fabs(wts[s] - wk[s]));
    char b[160]; snprintf(b, sizeof b, "moe_fused_%s E%d K%d H%d I%d grid %d route %d%s: ids %s, weights %.1e", shf ? "q2s" : "q2", E, K, H, inter, G, rank, renorm ? "" : " (softmax over all)", ok ? "ok" : "WRONG", werr);
    fails += !ok || werr > 1e-6;
    report(b, nmse(x.data(), want));
}
// moe_down_q's body: x += sum_k wts[k] D_{ids[k]} (silu(g_k) * u_k), the staging from gu = [2S, inter]
static void down_case(int E, int S, int H, int inter, int G) {
    Q4 DN((size_t)E * H, inter, 64);
    std::vector<float> gu(2 * S * inter), x(H), wts(S);
    std::vector<int> ids(S);
    for (auto& v : gu) v = 2 * U();
    for (auto& v : x) v = U();
    for (int k = 0; k < S; k++) { ids[k] = (k * 7 + 3) % E; wts[k] = 0.1f + std::fabs(U()); }
    std::vector<double> want(H);
    for (int r = 0; r < H; r++) {
        double a = x[r];
        for (int k = 0; k < S; k++) for (int i = 0; i < inter; i++) {
            double g = gu[(size_t)2 * k * inter + i], u = gu[(size_t)(2 * k + 1) * inter + i];
            a += DN.at((size_t)ids[k] * H + r, i) * (wts[k] * (g / (1 + std::exp(-g)) * u));
        }
        want[r] = a;
    }
    int n = S * inter;
    std::vector<std::vector<float>> sm(G, std::vector<float>(n + n / 32 + 64, NAN));
    emu_launch(G, 512, [&] { gq_body<4, 2, 1, 5, false, true>(DN.w.data(), DN.sc.data(), DN.bi.data(), 64, gu.data(), x.data(), H, inter, 0, 1, wts.data(), 0.f, sm[blockIdx.x].data(), nullptr, ids.data(), S); });
    char b[128]; snprintf(b, sizeof b, "moe_down_q E%d S%d H%d I%d grid %d", E, S, H, inter, G); report(b, nmse(x.data(), want));
}
// A decode GDN step's random inputs (y = [q | k | v], b, a, z, weights, the state S0) and its
// double-precision reference: the output and the new state.
struct GdnIn {
    int hk, hv, dk, dv, kd;
    std::vector<float> y, b, a, z, dtb, na, nw, S0;
    GdnIn(int hk_, int hv_, int dk_, int dv_)
        : hk(hk_), hv(hv_), dk(dk_), dv(dv_), kd(hk_ * dk_), y(2 * kd + hv * dv), b(hv), a(hv), z(hv * dv), dtb(hv),
          na(hv), nw(dv), S0((size_t)hv * dk * dv) {
        for (auto& v : y) v = U();
        for (auto* vec : {&b, &a, &dtb}) for (auto& v : *vec) v = U();
        for (auto& v : na) v = -std::fabs(U());
        for (auto& v : z) v = U();
        for (auto& v : nw) v = 1 + 0.3f * U();
        for (auto& v : S0) v = 0.3f * U();
    }
    void reference(std::vector<double>& want, std::vector<double>& wS) const {
        want.assign(hv * dv, 0); wS.assign(S0.size(), 0);
        for (int h = 0; h < hv; h++) {
            int kh = h / (hv / hk);
            double nq = 0, nk = 0;
            for (int i = 0; i < dk; i++) { nq += (double)y[kh * dk + i] * y[kh * dk + i]; nk += (double)y[kd + kh * dk + i] * y[kd + kh * dk + i]; }
            double rq = 1 / std::sqrt(nq + 1e-6) / std::sqrt((double)dk), rk = 1 / std::sqrt(nk + 1e-6);
            double beta = 1 / (1 + std::exp(-(double)b[h])), sp = a[h] + dtb[h];
            double alpha = std::exp(na[h] * (sp > 20 ? sp : std::log1p(std::exp(sp))));
            std::vector<double> o(dv);
            double ss = 0;
            for (int j = 0; j < dv; j++) {
                double u = 0;
                for (int i = 0; i < dk; i++) u += alpha * S0[((size_t)h * dk + i) * dv + j] * y[kd + kh * dk + i] * rk;
                double delta = beta * (y[2 * kd + h * dv + j] - u), oj = 0;
                for (int i = 0; i < dk; i++) {
                    double st = alpha * S0[((size_t)h * dk + i) * dv + j] + y[kd + kh * dk + i] * rk * delta;
                    wS[((size_t)h * dk + i) * dv + j] = st;
                    oj += st * y[kh * dk + i] * rq;
                }
                o[j] = oj; ss += oj * oj;
            }
            double r = 1 / std::sqrt(ss / dv + 1e-6);
            for (int j = 0; j < dv; j++) { double zz = z[h * dv + j]; want[h * dv + j] = o[j] * r * nw[j] * zz / (1 + std::exp(-zz)); }
        }
    }
};
// gdn_step_par (one block per value head) and gdn_step_par_e: the same bits, and the CPU math
static void gdn_case(int hk, int hv, int dk, int dv) {
    const GdnIn g(hk, hv, dk, dv);
    int T = dv * ((dk + 31) / 32);
    std::vector<float> S1 = g.S0, S2 = g.S0, o1(hv * dv, NAN), o2(hv * dv, NAN);
    for (int h = 0; h < hv; h++) {
        emu_launch(1, T, [&] { gdn_step_par_body<false, false>(g.y.data(), g.b.data(), g.a.data(), g.z.data(), g.dtb.data(), g.na.data(), g.nw.data(), S1.data(), o1.data(), hk, hv, dk, dv, 1e-6f, nullptr, 0, 0, 0, h); });
        emu_launch(1, T, [&] { gdn_step_par_body<false, true>(g.y.data(), g.b.data(), g.a.data(), g.z.data(), g.dtb.data(), g.na.data(), g.nw.data(), S2.data(), o2.data(), hk, hv, dk, dv, 1e-6f, nullptr, 0, 0, 0, h); });
    }
    bool same = !memcmp(S1.data(), S2.data(), S1.size() * 4) && !memcmp(o1.data(), o2.data(), o1.size() * 4);
    std::vector<double> want, wS;
    g.reference(want, wS);
    char buf[128]; snprintf(buf, sizeof buf, "gdn_step_par hk%d hv%d dk%d dv%d: early %s", hk, hv, dk, dv, same ? "same bits" : "DIFFERS");
    fails += !same;
    report(buf, nmse(o1.data(), want));
}
// gdn_step_c4's body (the decode default): each value head on a cluster of 4 blocks (run
// concurrently, with the cluster exchange of the norm's partial sums), against the CPU math
static void gdn_c4_case(int hk, int hv, int dk) {
    const int dv = 128;
    const GdnIn g(hk, hv, dk, dv);
    std::vector<float> S = g.S0, o(hv * dv, NAN);
    const int G = 4 * hv;
    std::vector<std::vector<float>> arena(G, std::vector<float>(GSC_SMEM));
    emu_cluster = 4;
    for (int blk = 0; blk < G; blk++) emu_cl_base[blk] = arena[blk].data();
    emu_launch(G, 512, [&] { gdn_step_c4_body(g.y.data(), g.b.data(), g.a.data(), g.z.data(), g.dtb.data(), g.na.data(), g.nw.data(), S.data(), o.data(), hk, hv, dk, dv, 1e-6f, arena[blockIdx.x].data()); });
    emu_cluster = 1;
    std::vector<double> want, wS;
    g.reference(want, wS);
    char buf[128];
    snprintf(buf, sizeof buf, "gdn_step_c4 hk%d hv%d dk%d: the output", hk, hv, dk); report(buf, nmse(o.data(), want));
    snprintf(buf, sizeof buf, "gdn_step_c4 hk%d hv%d dk%d: the state", hk, hv, dk); report(buf, nmse(S.data(), wS));
}
// gemv_q2_conv's body: y = rr W (x nw), then rows c < C through the causal conv (K taps) + SiLU
// into cy with the state [K-1, C] shifted
static void conv_case(int rows, int cols, int C, int K, int G, int T) {
    Q4 W(rows, cols, 64);
    std::vector<float> x(cols), nw(cols), y(rows, NAN), cw((size_t)C * K), st((size_t)(K - 1) * C), cy(C, NAN);
    for (auto& v : x) v = U();
    for (auto& v : nw) v = 1.f + 0.5f * U();
    for (auto& v : cw) v = U();
    for (auto& v : st) v = U();
    std::vector<float> st0 = st;
    double ss = 0; for (float v : x) ss += (double)v * v;
    double rr = 1.0 / std::sqrt(ss / cols + 1e-6);
    std::vector<double> want(rows), wcy(C), wst((size_t)(K - 1) * C);
    for (int r = 0; r < rows; r++) { double a = 0; for (int c = 0; c < cols; c++) a += W.at(r, c) * x[c] * nw[c]; want[r] = a * rr; }
    for (int c = 0; c < C; c++) {
        double a = 0;
        for (int j = 0; j < K; j++) a += cw[(size_t)c * K + j] * (j < K - 1 ? st0[(size_t)j * C + c] : want[c]);
        wcy[c] = a / (1 + std::exp(-a));
        for (int j = 0; j < K - 1; j++) wst[(size_t)j * C + c] = j + 1 < K - 1 ? st0[(size_t)(j + 1) * C + c] : want[c];
    }
    std::vector<std::vector<float>> sm(G, std::vector<float>(cols + cols / 32 + 64, NAN)); std::vector<std::array<float, 33>> red(G);
    ConvEpi cv{st.data(), cw.data(), cy.data(), C, K};
    emu_launch(G, T, [&] { gq_body<4, 2, 2, 2, false, false, true>(W.w.data(), W.sc.data(), W.bi.data(), 64, x.data(), y.data(), rows, cols, 0, 0, nw.data(), 1e-6f, sm[blockIdx.x].data(), red[blockIdx.x].data(), nullptr, 1, cv); });
    char b[128];
    snprintf(b, sizeof b, "gemv_q2_conv %dx%d C%d K%d: the product", rows, cols, C, K); report(b, nmse(y.data(), want));
    snprintf(b, sizeof b, "gemv_q2_conv %dx%d C%d K%d: conv + SiLU", rows, cols, C, K); report(b, nmse(cy.data(), wcy));
    snprintf(b, sizeof b, "gemv_q2_conv %dx%d C%d K%d: the state", rows, cols, C, K); report(b, nmse(st.data(), wst));
}
// the top-K forms against each other on edge values: ties, -0 and +0, -inf (NaN aside: route_topk
// never picks it, the register forms rank it as -inf). Where every logit is -inf, route_topk picks
// expert 0 K times (its taken mark is -inf too) and the register forms experts 0..K-1; the
// weights are NaN in all (0/0): only the register forms' distinct picks are checked there.
static void route_edges() {
    int E = 256, K = 8;
    float edge[] = {0.f, -0.f, 1.f, 1.f, -INFINITY, -INFINITY, 3.f, 0.f, -0.f, 3.f};
    for (int t = 0; t < 80; t++) {
        int renorm = t < 40; // then the weights over the softmax of all E (tot)
        std::vector<float> lg(E + 1);
        for (int e = 0; e <= E; e++) lg[e] = (t & 1) ? edge[(e * 7 + t) % 10] : (float)((int)(rng() % 5) - 2);
        if (t % 4 == 2) for (int e = 0; e < E; e++) lg[e] = -INFINITY; // every logit -inf
        if (t % 4 == 3) for (int e = 0; e < E; e++) lg[e] = 0.f;
        std::vector<std::vector<int>> ids(6, std::vector<int>(K + 1, -1));
        std::vector<std::vector<float>> w(6, std::vector<float>(K + 1, NAN));
        for (int mode : {0, 2, 3, 4, 5}) {
            std::vector<float> ls(512);
            emu_launch(1, 32, [&] { route_warp(mode, lg.data(), E, K, renorm, 1, ls.data(), ids[mode].data(), w[mode].data()); });
        }
        for (int mode : {2, 3, 4, 5}) {
            if (t % 4 == 2) {
                for (int k = 0; k < K; k++)
                    if (ids[mode][k] != k) { printf("%-6s route form %d: all -inf, pick %d is %d\n", VARIANT, mode, k, ids[mode][k]); fails++; }
                continue;
            }
            bool same = ids[mode] == ids[0];
            for (int k = 0; k <= K; k++) same &= memcmp(&w[mode][k], &w[0][k], 4) == 0 || (w[mode][k] != w[mode][k] && w[0][k] != w[0][k]);
            if (!same) { printf("%-6s route form %d differs from route_topk on edge set %d\n", VARIANT, mode, t); fails++; }
        }
    }
    printf("%-6s route_topk_reg / _redux / _redux2 / _thresh against route_topk on 40 edge sets (ties, -0, -inf), renormalized and not\n", VARIANT);
}
// attn_prep's early form against attn_prep's (a block of D threads): two gated query heads and a
// K head at position pos, the same bits; and the queries against the double RMSNorm + RoPE
static void prep_case(int rot, int pos) {
    constexpr int D = 256, nh = 2;
    std::vector<float> proj(nh * 2 * D + 2 * D), qn(D), kn(D), qo(nh * D, NAN);
    for (auto& v : proj) v = 2 * U();
    for (auto* w : {&qn, &kn}) for (auto& v : *w) v = 1 + 0.5f * U();
    std::vector<u16> kc((size_t)(pos + 1) * D, 0), vc((size_t)(pos + 1) * D, 0);
    const float* kin = proj.data() + nh * 2 * D;
    // one block at a time (attn_prep's __shared__ arrays are one static copy here); the early
    // form (angles before the wait) into a second query buffer and cache: the same bits
    std::vector<float> qe(nh * D, NAN);
    std::vector<u16> ke(kc.size(), 0), ve(vc.size(), 0);
    for (int early : {0, 1})
        for (int b = 0; b <= nh; b++)
            emu_launch(nh + 1, D, [&] {
                if (blockIdx.x == (unsigned)b)
                    attn_prep_t<u16>(proj.data(), kin, kin + D, qn.data(), kn.data(), (early ? qe : qo).data(), (early ? ke : kc).data(), (early ? ve : vc).data(), nh, 1, D, 1, rot, &pos, 1e7, 1e-6f, 0, nullptr, early);
            });
    bool same = !memcmp(qe.data(), qo.data(), nh * D * 4) && ke == kc && ve == vc;
    std::vector<double> want(nh * D);
    for (int h = 0; h < nh; h++) {
        const float* x = proj.data() + h * 2 * D;
        double ss = 0;
        for (int j = 0; j < D; j++) ss += (double)x[j] * x[j];
        double r = 1 / std::sqrt(ss / D + 1e-6);
        std::vector<double> xn(D);
        for (int j = 0; j < D; j++) xn[j] = x[j] * r * qn[j];
        for (int j = 0; j < D; j++) {
            double o = xn[j];
            if (j < rot) {
                int half = rot / 2, i = j < half ? j : j - half;
                double a = pos * std::pow(1e7, -2.0 * i / rot);
                o = j < half ? xn[j] * std::cos(a) - xn[j + half] * std::sin(a) : xn[j] * std::cos(a) + xn[j - half] * std::sin(a);
            }
            want[h * D + j] = o;
        }
    }
    char b[128]; snprintf(b, sizeof b, "attn_prep early D%d rot %d pos %d: attn_prep's %s", D, rot, pos, same ? "bits" : "bits DIFFER");
    fails += !same;
    report(b, nmse(qo.data(), want));
}
// pstep's consumer side (kernels/pstep.cu; its producer, counters and mbarriers are not emulated):
// one block of its 16 consumer warps stages a phase's input (the RMS-normed x, the GDN gated
// norm, the MoE down's w silu(g) u products; int8 parts in the i8 build) and runs one slot of n
// rows (from row r0 of the phase) through ps_chunk: two rows a warp pass, the GDN conv epilogue
// on rows below conv_c, the residual add. The slot holds the rows' codes, scales and biases in
// the producer's layout, copied here from the matrices.
static std::vector<unsigned char> ps_slot(const std::vector<const Q4*>& mats, int r0, int n) {
    int cols = mats[0]->cols, ng = cols / mats[0]->group, cb = cols / 2;
    std::vector<unsigned char> s(mats.size() * n * (cb + 4 * ng));
    unsigned char* p = s.data();
    for (auto* M : mats) for (int r = 0; r < n; r++, p += cb) memcpy(p, (const unsigned char*)M->w.data() + (size_t)(r0 + r) * cb, cb);
    for (auto* M : mats) for (int r = 0; r < n; r++, p += 2 * ng) memcpy(p, M->sc.data() + (size_t)(r0 + r) * ng, 2 * ng);
    for (auto* M : mats) for (int r = 0; r < n; r++, p += 2 * ng) memcpy(p, M->bi.data() + (size_t)(r0 + r) * ng, 2 * ng);
    return s;
}
static double silu_d(double v) { return v / (1 + std::exp(-v)); }
// pstep.cu's #defines (the preprocessed kernels keep none): phase kinds, input forms, chunk flags,
// the consumer block, TY_BF16 (common.cuh)
enum { PS_GEMV_ = 0, PS_MOE_DOWN_ = 3, PX_PLAIN_ = 0, PX_RMS_ = 1, PX_GATED_ = 2, PS_FIRST_ = 1, PS_LAST_ = 2, PS_WARPS_ = 16, TY_BF16_ = 2 };
// kind 0: PX_RMS GEMV with the conv epilogue on rows below conv_c; 1: PX_GATED (hv heads of dv)
// into a residual; 2: the MoE down of S slots (cols = inter) into a residual. ll: kind 0 writes
// its rows as LL words (PS_LL_OUT), kind 2 reads its gate/up as LL words (PS_LL_IN).
static void pstep_case(int kind, int r0, int n, int cols, int hv = 0, int S = 0, bool ll = false) {
    const int K = 4;
    int dv = kind == 1 ? cols / hv : 0, inter = kind == 2 ? cols : 0, xw = kind == 2 ? S * cols : cols;
    std::vector<Q4> mats;
    for (int k = 0; k < (kind == 2 ? S : 1); k++) mats.emplace_back(r0 + n, cols, 64);
    std::vector<const Q4*> mp; for (auto& m : mats) mp.push_back(&m);
    auto slot = ps_slot(mp, r0, n);
    int rows = r0 + n, conv_c = kind == 0 ? r0 + n / 2 : 0;
    std::vector<float> x(kind == 2 ? 2 * S * cols : cols), z(cols), nw(kind == 1 ? dv : cols), wsel(S + 1), y(rows), cw(conv_c * K), st((K - 1) * conv_c), cy(conv_c, NAN);
    for (auto& v : x) v = U();
    for (auto& v : z) v = 2 * U();
    for (auto& v : nw) v = 1.f + 0.5f * U();
    for (auto& v : wsel) v = 0.5f + 0.5f * U();
    for (auto& v : y) v = kind == 0 ? NAN : U();
    for (auto& v : cw) v = U();
    for (auto& v : st) v = U();
    // the phase's input as the reference sees it
    const double eps = 1e-6;
    std::vector<double> in(xw);
    double rr = 1;
    if (kind == 0) {
        double ss = 0; for (float v : x) ss += (double)v * v;
        rr = 1 / std::sqrt(ss / cols + eps);
        for (int c = 0; c < cols; c++) in[c] = (double)x[c] * nw[c];
    } else if (kind == 1) {
        for (int h = 0; h < hv; h++) {
            double ss = 0; for (int c = 0; c < dv; c++) ss += (double)x[h * dv + c] * x[h * dv + c];
            double r = 1 / std::sqrt(ss / dv + eps);
            for (int c = 0; c < dv; c++) in[h * dv + c] = x[h * dv + c] * r * nw[c] * silu_d(z[h * dv + c]);
        }
    } else {
        for (int k = 0; k < S; k++) for (int c = 0; c < inter; c++) in[k * inter + c] = wsel[k] * silu_d(x[(2 * k) * inter + c]) * x[(2 * k + 1) * inter + c];
    }
    std::vector<double> want;
    for (int r = r0; r < rows; r++) {
        double a = 0;
        for (int k = 0; k < (int)mats.size(); k++) for (int c = 0; c < cols; c++) a += mats[k].at(r, c) * in[k * cols + c];
        want.push_back(kind == 0 ? a * rr : y[r] + a);
    }
    std::vector<double> want_conv;
    for (int r = r0; r < conv_c; r++) { // silu(conv) of [state; y], then the state shifted
        double a = cw[r * K + K - 1] * want[r - r0];
        for (int t = 0; t < K - 1; t++) a += cw[r * K + t] * (double)st[t * conv_c + r];
        want_conv.push_back(silu_d(a));
        for (int t = 0; t < K - 1; t++) want_conv.push_back(t < K - 2 ? st[(t + 1) * conv_c + r] : want[r - r0]);
    }
    PsPhase P{};
    P.kind = kind == 2 ? PS_MOE_DOWN_ : PS_GEMV_;
    P.xf = kind == 0 ? PX_RMS_ : kind == 1 ? PX_GATED_ : PX_PLAIN_;
    P.rows = rows; P.cols = cols; P.group = 64; P.ty = TY_BF16_; P.accumulate = kind != 0; P.bits = 4; P.eps = (float)eps;
    P.conv_c = conv_c; P.conv_k = K; P.hv = hv; P.dv = dv; P.topk = S - 1;
    P.x = (u64)x.data(); P.y = (u64)y.data(); P.normw = (u64)nw.data();
    P.aux[0] = (u64)st.data(); P.aux[1] = (u64)cw.data(); P.aux[2] = (u64)cy.data(); P.aux[3] = (u64)z.data();
    const unsigned tag = 0x5a5a1u;
    std::vector<unsigned long long> yl(ll ? rows : 0, 0), xl;
    if (ll && kind == 0) P.y = (u64)yl.data(), P.otag = tag;
    if (ll && kind == 2)
        for (float v : x) xl.push_back((unsigned long long)tag << 32 | __float_as_uint(v));
    const float* xin = ll && kind == 2 ? (const float*)xl.data() : x.data();
    PsHdr h{0, PS_FIRST_ | PS_LAST_, r0, n};
    std::vector<float> xs(xw + xw / 16 + 64, NAN), red(2 * PS_WARPS_ * 32), hs(256);
    emu_launch(1, 32 * PS_WARPS_, [&] {
        float* xsum = xs.data() + xw;
        float r = 1.f;
        if (kind == 0) r = ps_stage_x(x.data(), nw.data(), cols, (float)eps, xs.data(), xsum, red.data(), GQ_I8);
        else if (kind == 1) ps_stage_gated(x.data(), z.data(), nw.data(), hv, dv, (float)eps, xs.data(), xsum, hs.data(), GQ_I8);
        else ps_stage_moe(xin, ll ? tag : 0u, wsel.data(), S, inter, xs.data(), xsum, GQ_I8);
        ps_chunk(P, h, slot.data(), r, xs.data(), xsum);
    });
    std::vector<float> got(y.begin() + r0, y.end());
    if (ll && kind == 0)
        for (int r = r0; r < rows; r++) // a word without the phase's tag fails as NaN
            got[r - r0] = (unsigned)(yl[r] >> 32) == tag ? __uint_as_float((unsigned)yl[r]) : NAN;
    for (int r = r0; r < conv_c; r++) { got.push_back(cy[r]); for (int t = 0; t < K - 1; t++) got.push_back(st[t * conv_c + r]); }
    want.insert(want.end(), want_conv.begin(), want_conv.end());
    const char* names[] = {"PX_RMS + conv", "PX_GATED", "MoE down"};
    char b[128]; snprintf(b, sizeof b, "pstep chunk %s%s: rows %d..%d of %d cols", names[kind], ll ? " (LL)" : "", r0, rows, cols); report(b, nmse(got.data(), want));
}
// pstep's GDN tasks wait for the blocks whose shares hold their rows: ps_owner must invert
// ps_share (row r's owner b has lo(b) <= r < hi(b)) for every row, blocks with empty shares too.
static void ps_owner_case() {
    int bad = 0;
    for (int total : {1, 7, 131, 132, 133, 12352, 8448})
        for (int nb : {1, 3, 132, 264}) {
            emu_launch(1, 1, [&] {
                for (int r = 0; r < total; r++) {
                    int b = ps_owner(r, total, nb), lo, hi;
                    ps_share(total, b, nb, lo, hi);
                    bad += b < 0 || b >= nb || r < lo || r >= hi;
                }
            });
        }
    printf("%-6s %-58s %s\n", VARIANT, "ps_owner inverts ps_share (7 row counts x 4 grids)", bad ? "FAIL" : "ok");
    fails += bad != 0;
}
// attn_decode_tc{D}_fold's tail (dec_fold, D = 64): the blocks of H_kv KV heads x S splits
// arrive on the heads' counters and the last ones merge synthetic partials (every third split
// empty: M = -inf, its l and o NaN, selected away) into the gated output, against double
// precision; launches of different S on the same counters, from a nonzero epoch, each of which
// must leave the counters at the next epoch with no arrivals. Each block its own scratch.
static void fold_case(const std::vector<int>& launches, int hkv) {
    constexpr int D = 64, G = 8;
    std::vector<unsigned long long> ctr(hkv, 5ull << 32);
    for (int li = 0; li < (int)launches.size(); li++) {
        const int S = launches[li], nh = hkv * G;
        std::vector<float> part((size_t)nh * S * (D + 2)), qg(nh * 2 * D), out(nh * D, NAN);
        for (auto& v : qg) v = 2 * U();
        for (int h = 0; h < nh; h++)
            for (int s = 0; s < S; s++) {
                float* p = part.data() + ((size_t)h * S + s) * (D + 2);
                const bool empty = s % 3 == 2;
                p[0] = empty ? -INFINITY : 3 * U();
                p[1] = empty ? NAN : 1 + U() * 0.9f;
                for (int d = 0; d < D; d++) p[2 + d] = empty ? NAN : U();
            }
        std::vector<double> want(nh * D);
        for (int h = 0; h < nh; h++) {
            double M = -INFINITY, den = 0;
            for (int s = 0; s < S; s++) M = std::max(M, (double)part[((size_t)h * S + s) * (D + 2)]);
            std::vector<double> o(D, 0.0);
            for (int s = 0; s < S; s++) {
                const float* p = part.data() + ((size_t)h * S + s) * (D + 2);
                if (p[0] == -INFINITY) continue;
                double e = std::exp(p[0] - M);
                den += e * p[1];
                for (int d = 0; d < D; d++) o[d] += e * p[2 + d];
            }
            for (int d = 0; d < D; d++) want[h * D + d] = o[d] / den / (1 + std::exp(-(double)qg[h * 2 * D + D + d]));
        }
        std::vector<std::vector<float>> scratch(hkv * S, std::vector<float>(1200));
        DecFold f{qg.data(), out.data(), 1, ctr.data()};
        emu_launch(hkv * S, 128, [&] { dec_fold<D>(part.data(), f, blockIdx.x / S, S, scratch[blockIdx.x].data()); });
        bool ok = true;
        for (auto c : ctr) ok &= c == (6ull + li) << 32;
        char b[128];
        snprintf(b, sizeof b, "dec_fold D%d H_kv %d, S %d (launch %d)%s", D, hkv, S, li, ok ? "" : ": counters WRONG");
        fails += !ok;
        report(b, nmse(out.data(), want));
    }
}
// gemv_q2_route (gemv_route.cu): x += W o over G = H / 32 blocks of 512 threads (one row group a
// warp), then the router's logits on rms_norm(x) * nw from the blocks' parts, summed by the last
// block to arrive; several launches on one counter, fresh inputs each.
// fx: gemv_q2_route_fx's fixed-point sums (the accumulators zero before and after each launch);
// acc: gemv_q2_route_acc's (no last block), the logits and top-K then formed by
// moe_fused_q2s_acc's mf2_route_acc in one warp, the sums zeroed after it as its block 0 does;
// rb 16: gemv_q2_route16_*'s blocks of 16 rows (fixed-point forms only)
static void route_case(int H, int C, int R, int rbits, int launches, int K = 0, bool fx = false, bool acc = false, int rb = 32) {
    fx |= acc;
    Q4 W(H, C, 64), WR(R, H, 64, rbits);
    const int G = H / rb;
    std::vector<float> o(C), x(H), nw(H), part((size_t)G * (R + 1), fx ? 0.f : NAN), lg(R, NAN);
    for (auto& v : nw) v = 1.f + 0.5f * U();
    unsigned long long ctr = 0;
    for (int l = 0; l < launches; l++) {
        for (auto& v : o) v = U();
        for (auto& v : x) v = 2 * U();
        std::vector<double> wy(H), wl(R);
        for (int r = 0; r < H; r++) { double a = x[r]; for (int c = 0; c < C; c++) a += W.at(r, c) * o[c]; wy[r] = a; }
        double ss = 0; for (double v : wy) ss += v * v;
        double rr = 1.0 / std::sqrt(ss / H + 1e-6);
        for (int j = 0; j < R; j++) { double a = 0; for (int c = 0; c < H; c++) a += WR.at(j, c) * nw[c] * wy[c]; wl[j] = a * rr; }
        std::fill(lg.begin(), lg.end(), NAN);
        std::vector<std::vector<float>> xs(G, std::vector<float>(C + C / 32 + 64, NAN)), red(G, std::vector<float>(33)), ys(G, std::vector<float>(32, NAN)),
            vs(G, std::vector<float>(32)), tot(G, std::vector<float>(2)), nws(G, std::vector<float>(32));
        std::vector<std::vector<u32>> rw(G, std::vector<u32>(512 * 8)), rsb(G, std::vector<u32>(1024));
        std::vector<int> last(G, -1), ids(K + 1, -1);
        std::vector<float> wts(K + 1, NAN);
        std::vector<std::vector<int>> chosen(G, std::vector<int>(65));
        std::vector<std::vector<float>> wsel(G, std::vector<float>(65));
        RtRoute rt; // K > 0: the MoE's top-K too (thresh, renormalized)
        if (K) rt = RtRoute{ids.data(), wts.data(), K, 1, 5};
        emu_launch(G, 512, [&] {
            int b = blockIdx.x;
            (rb == 16 ? rt_request<16> : rt_request<32>)(WR.w.data(), WR.sc.data(), WR.bi.data(), rbits, 64, H, R, nw.data(), rw[b].data(), rsb[b].data(), nws[b].data());
            (rb == 16 ? gq_body<4, 2, 1, 2, false, false, false, true> : gq_body<4, 2, 2, 2, false, false, false, true>)(
                W.w.data(), W.sc.data(), W.bi.data(), 64, o.data(), x.data(), H, C, 0, 1, nullptr, 0.f, xs[b].data(),
                red[b].data(), 0, 1, ConvEpi{0, 0, 0, 0, 1}, -1, 0, 0, 0, 0, ys[b].data());
            (rb == 16 ? (acc ? rt_tail<RT_ACC, 16> : rt_tail<RT_FX, 16>) : acc ? rt_tail<RT_ACC> : fx ? rt_tail<RT_FX> : rt_tail<RT_PARTS>)(rw[b].data(), rsb[b].data(), nws[b].data(), rbits, 64, 2, R, H, 1e-6f, part.data(), lg.data(), &ctr, ys[b].data(), vs[b].data(), tot[b].data(),
                    (float*)rw[b].data(), &last[b], rt, chosen[b].data(), wsel[b].data());
        });
        if (acc) { // moe_fused_q2s_acc's warp 0 (mode 5, renormalized), then its block 0's zeroing
            std::vector<float> ls(512, NAN), ws(65);
            std::vector<int> ch(65, -1);
            emu_launch(1, 32, [&] { mf2_route_acc((const unsigned long long*)part.data(), R - 1, H, G, 1e-6f, 5, K ? K : 1, 1, ls.data(), ch.data(), ws.data()); });
            std::copy(ls.begin(), ls.begin() + R, lg.begin());
            for (int j = 0; j < 2 * R; j++) part[j] = 0.f;
            if (K) { std::copy(ch.begin(), ch.begin() + K + 1, ids.begin()); std::copy(ws.begin(), ws.begin() + K + 1, wts.begin()); }
        }
        int lasts = 0; for (int v : last) lasts += v == 1;
        char b[128];
        const char* form = rb == 16 ? (acc ? "gemv_q2_route16_acc" : "gemv_q2_route16_fx") : acc ? "gemv_q2_route_acc" : fx ? "gemv_q2_route_fx" : "gemv_q2_route";
        snprintf(b, sizeof b, "%s H%d C%d R%d q%d launch %d: x", form, H, C, R, rbits, l); report(b, nmse(x.data(), wy));
        snprintf(b, sizeof b, "%s H%d C%d R%d q%d launch %d: logits", form, H, C, R, rbits, l); report(b, nmse(lg.data(), wl));
        if (fx) {
            int nz = 0; for (int j = 0; j < 2 * R; j++) nz += part[j] != 0.f;
            if (nz) { printf("%-6s %s launch %d: %d accumulator words left nonzero\n", VARIANT, form, l, nz); fails++; }
        }
        if (K) { // the picks by (-logit, index) among the R - 1 routed, softmax over them; the shared gate's sigmoid
            std::vector<int> idx(R - 1); for (int e = 0; e < R - 1; e++) idx[e] = e;
            std::stable_sort(idx.begin(), idx.end(), [&](int a, int c) { return lg[a] > lg[c]; });
            double mx = lg[idx[0]], sel = 0; for (int k = 0; k < K; k++) sel += std::exp((double)lg[idx[k]] - mx);
            bool ok = ids[K] == R - 1; double werr = std::fabs(wts[K] - 1 / (1 + std::exp(-(double)lg[R - 1])));
            for (int k = 0; k < K; k++) { ok &= ids[k] == idx[k]; werr = std::max(werr, std::fabs(wts[k] - std::exp((double)lg[idx[k]] - mx) / sel)); }
            printf("%-6s gemv_q2_route H%d R%d K%d launch %d: top-K ids %s, weights %.1e\n", VARIANT, H, R, K, l, ok ? "ok" : "WRONG", werr);
            fails += !ok || werr > 1e-6;
        }
        if (acc) { if (lasts != 0 || ctr != 0) { printf("%-6s gemv_q2_route_acc launch %d: %d last blocks, counter %llu\n", VARIANT, l, lasts, ctr); fails++; } }
        else if (lasts != 1 || ctr != (unsigned long long)G * (l + 1)) { printf("%-6s gemv_q2_route launch %d: %d last blocks, counter %llu\n", VARIANT, l, lasts, ctr); fails++; }
    }
}
int main() {
    gemv_case(37, 2048, 3, 128, 1);
    gemv_case(37, 2048, 3, 128, 300);
    gemv_case(19, 4096, 2, 512, 1);
    gemv_case(37, 192, 2, 128, 1);
    gemv_case(301, 256, 2, 128, 1);
    gemv_case(5, 8192, 1, 128, 1);
    for (int rank : {0, 2, 3, 4}) q2_case(64, 4, 256, 64, 3, rank);
    q2_case(64, 4, 256, 64, 3, 4, 0);
    q2_case(256, 8, 512, 64, 2, 3);
    q2_case(256, 8, 512, 64, 2, 4);
    // q2s: 9 x 64 pairs over 2 x 16 warps (the first 64 warps' first pair the shared expert's,
    // preloaded; up to 18 a warp), and 5 x 64 at H 4096 (two trips a pair, the first preloaded)
    q2_case(256, 8, 512, 64, 2, 4, 1, true);
    q2_case(64, 4, 4096, 64, 3, 4, 1, true);
    q2_case(100, 6, 512, 64, 2, 5, 0, true); // E not a multiple of 32, the softmax over all
    q2_case(500, 16, 512, 64, 2, 5, 1, true); // two segments a routing warp
    down_case(16, 9, 256, 64, 3);
    down_case(16, 3, 64, 512, 1);
    gdn_case(2, 4, 64, 64);
    gdn_case(1, 2, 128, 128);
    gdn_c4_case(1, 2, 128);
    gdn_c4_case(2, 6, 40);
    conv_case(300, 256, 200, 4, 2, 128);
    conv_case(96, 2048, 64, 4, 1, 512);
    prep_case(64, 5);
    prep_case(64, 3000);
    // S 7 (each merger 2-3 slices), 20 (16 mergers, 4 blocks only arrive), 16
    fold_case({7, 20, 16}, 2);
    route_edges();
    route_case(256, 512, 65, 8, 3);
    route_case(128, 256, 257, 4, 2, 8);
    route_case(64, 128, 9, 8, 1); // one group a row: the last scale read alone
    route_case(256, 512, 65, 8, 3, 0, true);
    route_case(128, 256, 257, 4, 2, 8, true);
    route_case(64, 128, 9, 8, 2, 0, true); // two blocks: the fewest the fixed-point form takes
    route_case(256, 512, 65, 8, 3, 4, false, true);
    route_case(128, 256, 257, 4, 2, 8, false, true);
    route_case(256, 512, 65, 8, 3, 4, true, false, 16); // 16-row blocks: 16 columns of 8 bits a part (16 bytes)
    route_case(128, 256, 257, 4, 2, 8, false, true, 16); // and of 4 bits (8 bytes)
    pstep_case(0, 7, 45, 2048);
    pstep_case(0, 0, 64, 512);
    pstep_case(1, 3, 37, 1024, 8);
    pstep_case(2, 5, 37, 128, 0, 9);
    ps_owner_case();
    pstep_case(0, 7, 45, 2048, 0, 0, true);
    pstep_case(2, 5, 37, 128, 0, 9, true);
    printf("%s: %d failures\n", VARIANT, fails);
    return fails != 0;
}
