// Where the host's 64-token expert product spends its time: Q4_K weights
// in CPU_REPACK's 8x8 layout, an expert's slice of columns per thread as
// ggml's repacked mul_mat_id splits them, each expert picked by ROWS rows.
// Times, on THREADS threads each walking its slices of every expert with no
// barrier between experts (ggml's repacked mul_mat_id has none):
//   gemv   ggml's one-row kernel, once a row (what mul_mat_id runs now)
//   rows   a multi-row AVX512-VNNI kernel: each 64 bytes of weights loaded
//          and split into nibbles once for up to 4 rows, scales decoded once
//   rows+pf  the same, prefetching the weights PF bytes ahead, across the
//          end of one expert's slice into the next one's (vendor patch 0009)
//   pairs+pf rows+pf in the order of patch 0009's second form (run 194):
//          a sub-block pair's 256 bytes unpacked into eight registers once,
//          then each row's eight dpbusd on them; each row's sub-block sums
//          broadcast from memory. Run 194 timed these kernels as separate
//          functions (commit a23be21's file); built as below their loops
//          stay rolled; ggml's build of the patch unrolls them by pragma.
// over EXPERTS experts (cold: more bytes than the caches) and over one
// expert repeated (hot: its slices stay in each core's L2), so the
// difference says how much of the time is waiting for memory. Checks that
// rows, rows+pf and pairs+pf give gemv's outputs bit for bit.
//   cpu-rows-bench MODULE.so   (env THREADS, ROWS, EXPERTS, PF, REPS)
// Build: g++ -O2 -march=sapphirerapids cpu-rows-bench.cpp -ldl -lpthread
#include <dlfcn.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace {

constexpr int QK = 256;
struct BlockQ4Kx8 {
    uint16_t d[8];
    uint16_t dmin[8];
    uint8_t scales[96];
    uint8_t qs[1024];
};
struct BlockQ8K {
    float d;
    int8_t qs[QK];
    int16_t bsums[QK / 16];
};
static_assert(sizeof(BlockQ4Kx8) == 1152, "block_q4_Kx8");
static_assert(sizeof(BlockQ8K) == 292, "block_q8_K");

using gemv_fn = void (*)(int, float *, size_t, const void *, const void *, int, int);

const char * env_or(const char * k, const char * d) {
    const char * v = getenv(k);
    return v ? v : d;
}

// A sub-block pair's scales (each repeated for its two lanes) and mins,
// decoded from a repacked block's 96 bytes of scales.
struct SubScales {
    __m512i sc0, sc1;
    __m256i mins;
};

SubScales sub_scales(const uint8_t * scales, int sb) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    const __m128i dupmask = _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    uint32_t u0[4], u1[4];
    memcpy(u0, scales + 24 * sb, 12);
    u0[3] = ((u0[2] >> 4) & kmask2) | (((u0[1] >> 6) & kmask3) << 4);
    const uint32_t a0 = u0[1] & kmask1;
    u0[1] = (u0[2] & kmask2) | (((u0[0] >> 6) & kmask3) << 4);
    u0[2] = a0;
    u0[0] &= kmask1;
    memcpy(u1, scales + 12 + sb * 24, 12);
    u1[3] = ((u1[2] >> 4) & kmask2) | (((u1[1] >> 6) & kmask3) << 4);
    const uint32_t a1 = u1[1] & kmask1;
    u1[1] = (u1[2] & kmask2) | (((u1[0] >> 6) & kmask3) << 4);
    u1[2] = a1;
    u1[0] &= kmask1;
    const __m128i ms0 = _mm_set_epi32(u0[3], u0[2], u0[1], u0[0]);
    const __m128i ms1 = _mm_set_epi32(u1[3], u1[2], u1[1], u1[0]);
    return {_mm512_cvtepu8_epi32(_mm_shuffle_epi8(ms0, dupmask)), _mm512_cvtepu8_epi32(_mm_shuffle_epi8(ms1, dupmask)),
            _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_shuffle_epi32(ms0, 78), _mm_shuffle_epi32(ms1, 78)))};
}

// R rows (1 to 4) against one slice of repacked Q4_K weights: the same
// integer sums as ggml's one-row kernel and, per row, its floating-point
// operations in its order, so each output is bit for bit the one-row
// kernel's. PREFETCH: prefetch the weights PF bytes ahead of the block
// being read, continuing into `next` (the next expert's slice) past this
// one's end. PAIRS: patch 0009's second order (each sub-block pair's 256
// bytes unpacked once into eight registers, then each row's eight dpbusd
// and its sums, the rows' sub-block sums broadcast from memory); else its
// first (each 64 bytes' two dpbusd for every row in turn, each row's dot
// sums and sub-block sums in registers).
template <int R, bool PREFETCH, bool PAIRS>
void rows_kernel(int n, float * const * s, const void * vx, const BlockQ8K * const * a_ptr, int nc, const char * next,
                 int pf) {
    const int64_t nb = n / QK;
    const __m512i m4b = _mm512_set1_epi8(0x0F);
    const __m512i evens = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odds = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 15, 13, 11, 9, 7, 5, 3, 1);
    const BlockQ4Kx8 * b_start = (const BlockQ4Kx8 *) vx;
    const int64_t total = (int64_t) (nc / 8) * nb * (int64_t) sizeof(BlockQ4Kx8);

    for (int64_t x = 0; x < nc / 8; x++) {
        const BlockQ4Kx8 * b_ptr = b_start + x * nb;
        __m256 acc_row[R], acc_min[R];
        for (int r = 0; r < R; r++) {
            acc_row[r] = _mm256_setzero_ps();
            acc_min[r] = _mm256_setzero_ps();
        }
        for (int64_t b = 0; b < nb; b++) {
            if (PREFETCH) {
                const int64_t at = (x * nb + b) * (int64_t) sizeof(BlockQ4Kx8) + pf;
                const char * p = at < total ? (const char *) vx + at : (next ? next + (at - total) : nullptr);
                if (p) {
                    for (int l = 0; l < (int) sizeof(BlockQ4Kx8); l += 64) {
                        _mm_prefetch(p + l, _MM_HINT_T0);
                    }
                }
            }
            const __m256 col_scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b_ptr[b].d));
            const __m256 col_dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b_ptr[b].dmin));
            // each row's 8 sub-block sums, a pair to a 32-bit lane: in a
            // register shifted a lane a sub-block pair (first order), or in
            // memory (second)
            __m256i q8s[R], iacc_min[R];
            alignas(16) int32_t pairs[R][4];
            __m512i iacc[R];
            for (int r = 0; r < R; r++) {
                const __m256i sums = _mm256_loadu_si256((const __m256i *) a_ptr[r][b].bsums);
                const __m128i sub = _mm_hadd_epi16(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
                if (PAIRS) {
                    _mm_store_si128((__m128i *) pairs[r], sub);
                } else {
                    q8s[r] = _mm256_castsi128_si256(sub);
                    q8s[r] = _mm256_permute2f128_si256(q8s[r], q8s[r], 0);
                }
                iacc[r] = _mm512_setzero_si512();
                iacc_min[r] = _mm256_setzero_si256();
            }
            for (int sb = 0; sb < QK / 64; sb++) {
                const SubScales sc = sub_scales(b_ptr[b].scales, sb);
                // a lane holds 16 products of a nibble and a Q8_K value,
                // |sum| <= 30720: madd_epi16 against the zero-extended scale
                // is its exact 32-bit product
                auto add_sums = [&](int r, __m512i d0, __m512i d1) {
                    iacc[r] = _mm512_add_epi32(
                        iacc[r], _mm512_add_epi32(_mm512_madd_epi16(d0, sc.sc0), _mm512_madd_epi16(d1, sc.sc1)));
                    const __m256i q8pair = PAIRS ? _mm256_set1_epi32(pairs[r][sb]) : _mm256_shuffle_epi32(q8s[r], 0);
                    iacc_min[r] = _mm256_add_epi32(iacc_min[r], _mm256_madd_epi16(q8pair, sc.mins));
                    if (!PAIRS) {
                        q8s[r] = _mm256_bsrli_epi128(q8s[r], 4);
                    }
                };
                if (PAIRS) {
                    __m512i lo[4], hi[4];
                    for (int k = 0; k < 4; k++) {
                        const __m512i w = _mm512_loadu_si512((const void *) (b_ptr[b].qs + sb * 256 + 64 * k));
                        lo[k] = _mm512_and_si512(w, m4b);
                        hi[k] = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4b);
                    }
                    for (int r = 0; r < R; r++) {
                        const int8_t * q = a_ptr[r][b].qs + sb * 64;
                        __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
                        for (int k = 0; k < 4; k++) {
                            int64_t l0, l1;
                            memcpy(&l0, q + 8 * k, 8);
                            memcpy(&l1, q + 32 + 8 * k, 8);
                            d0 = _mm512_dpbusd_epi32(d0, lo[k], _mm512_set1_epi64(l0));
                            d1 = _mm512_dpbusd_epi32(d1, hi[k], _mm512_set1_epi64(l1));
                        }
                        add_sums(r, d0, d1);
                    }
                } else {
                    __m512i d0[R], d1[R];
                    for (int r = 0; r < R; r++) {
                        d0[r] = _mm512_setzero_si512();
                        d1[r] = _mm512_setzero_si512();
                    }
                    for (int k = 0; k < 4; k++) {
                        const __m512i w = _mm512_loadu_si512((const void *) (b_ptr[b].qs + sb * 256 + 64 * k));
                        const __m512i lo = _mm512_and_si512(w, m4b);
                        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4b);
                        for (int r = 0; r < R; r++) {
                            int64_t l0, l1;
                            memcpy(&l0, a_ptr[r][b].qs + sb * 64 + 8 * k, 8);
                            memcpy(&l1, a_ptr[r][b].qs + sb * 64 + 32 + 8 * k, 8);
                            d0[r] = _mm512_dpbusd_epi32(d0[r], lo, _mm512_set1_epi64(l0));
                            d1[r] = _mm512_dpbusd_epi32(d1[r], hi, _mm512_set1_epi64(l1));
                        }
                    }
                    for (int r = 0; r < R; r++) {
                        add_sums(r, d0[r], d1[r]);
                    }
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256 row_scale = _mm256_set1_ps(a_ptr[r][b].d);
                const __m256i ib = _mm256_add_epi32(_mm512_castsi512_si256(_mm512_permutexvar_epi32(evens, iacc[r])),
                                                    _mm512_castsi512_si256(_mm512_permutexvar_epi32(odds, iacc[r])));
                acc_row[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib), _mm256_mul_ps(col_scale, row_scale), acc_row[r]);
                acc_min[r] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc_min[r]), _mm256_mul_ps(col_dmin, row_scale), acc_min[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(s[r] + x * 8, _mm256_sub_ps(acc_row[r], acc_min[r]));
        }
    }
}

template <bool PREFETCH, bool PAIRS>
void rows_any(int n, float * const * s, const void * vx, const BlockQ8K * const * a, int nr, int nc, const char * next,
              int pf) {
    for (int i = 0; i < nr; i += 4) {
        switch (std::min(4, nr - i)) {
            case 1: rows_kernel<1, PREFETCH, PAIRS>(n, s + i, vx, a + i, nc, next, pf); break;
            case 2: rows_kernel<2, PREFETCH, PAIRS>(n, s + i, vx, a + i, nc, next, pf); break;
            case 3: rows_kernel<3, PREFETCH, PAIRS>(n, s + i, vx, a + i, nc, next, pf); break;
            default: rows_kernel<4, PREFETCH, PAIRS>(n, s + i, vx, a + i, nc, next, pf); break;
        }
    }
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: cpu-rows-bench MODULE.so\n");
        return 2;
    }
    void * h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "cpu-rows-bench: %s\n", dlerror());
        return 1;
    }
    const auto gemv = (gemv_fn) dlsym(h, "ggml_gemv_q4_K_8x8_q8_K");
    if (!gemv) {
        fprintf(stderr, "cpu-rows-bench: no ggml_gemv_q4_K_8x8_q8_K in %s\n", argv[1]);
        return 1;
    }
    const int T = atoi(env_or("THREADS", "14")), R = atoi(env_or("ROWS", "4")), E = atoi(env_or("EXPERTS", "384"));
    const int pf = atoi(env_or("PF", "4608")), reps = atoi(env_or("REPS", "5"));
    const int K = 2048, N = 768, nb = K / QK;  // Qwen3-30B-A3B's gate/up: 768 x 2048
    const size_t exp_bytes = (size_t) N / 8 * nb * sizeof(BlockQ4Kx8);

    std::mt19937 rng(1);
    std::vector<BlockQ4Kx8> W((size_t) E * N / 8 * nb);
    for (auto & blk : W) {
        for (int i = 0; i < 8; i++) {
            blk.d[i] = (uint16_t) (0x1000 + (rng() & 0x3ff));  // small positive halves
            blk.dmin[i] = (uint16_t) (0x0c00 + (rng() & 0x3ff));
        }
        for (auto & b : blk.scales) b = (uint8_t) rng();
        for (auto & b : blk.qs) b = (uint8_t) rng();
    }
    std::vector<BlockQ8K> A((size_t) R * nb);
    for (auto & a : A) {
        a.d = 0.01f + (rng() % 100) * 1e-4f;
        for (auto & q : a.qs) q = (int8_t) rng();
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += a.qs[16 * j + i];
            a.bsums[j] = (int16_t) s;
        }
    }

    // each thread's columns, as the repacked mul_mat_id rounds them to 8
    auto cols = [&](int t) {
        int64_t s = (int64_t) t * N / T, e = (int64_t) (t + 1) * N / T;
        s = (s + 7) / 8 * 8;
        e = std::min<int64_t>((e + 7) / 8 * 8, N);
        return std::pair<int64_t, int64_t>(s, e);
    };
    // mode 0 gemv a row, 1 rows, 2 rows+pf, 3 pairs+pf; hot: expert 0 every time
    auto run = [&](int mode, bool hot, std::vector<float> * out) {
        std::atomic<int> go{0};
        std::vector<std::thread> th;
        std::vector<double> us(T);
        for (int t = 0; t < T; t++) {
            th.emplace_back([&, t] {
                const auto [c0, c1] = cols(t);
                std::vector<float> o((size_t) R * N);
                float * s[64];
                const BlockQ8K * a[64];
                for (int r = 0; r < R; r++) {
                    s[r] = o.data() + (size_t) r * N + c0;
                    a[r] = A.data() + (size_t) r * nb;
                }
                go.fetch_add(1);
                while (go.load() < T) {
                }
                const auto t0 = std::chrono::steady_clock::now();
                for (int e = 0; e < E; e++) {
                    const int ee = hot ? 0 : e;
                    const char * w = (const char *) W.data() + ee * exp_bytes + c0 / 8 * nb * sizeof(BlockQ4Kx8);
                    const char * next = (hot || e + 1 == E) ? w : w + exp_bytes;
                    if (c0 >= c1) continue;
                    if (mode == 0) {
                        for (int r = 0; r < R; r++) gemv(K, s[r], 0, w, a[r], 1, (int) (c1 - c0));
                    } else if (mode == 1) {
                        rows_any<false, false>(K, s, w, a, R, (int) (c1 - c0), next, pf);
                    } else if (mode == 2) {
                        rows_any<true, false>(K, s, w, a, R, (int) (c1 - c0), next, pf);
                    } else {
                        rows_any<true, true>(K, s, w, a, R, (int) (c1 - c0), next, pf);
                    }
                }
                us[t] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
                if (out) {
                    for (int r = 0; r < R; r++) memcpy(out->data() + (size_t) r * N + c0, o.data() + (size_t) r * N + c0, (c1 - c0) * 4);
                }
            });
        }
        for (auto & x : th) x.join();
        return *std::max_element(us.begin(), us.end());
    };

    std::vector<float> ref((size_t) R * N), got((size_t) R * N);
    run(0, false, &ref);
    const char * names[] = {"gemv", "rows", "rows+pf", "pairs+pf"};
    for (int mode = 1; mode <= 3; mode++) {
        run(mode, false, &got);
        printf("check %s: outputs %s gemv's bit for bit\n", names[mode],
               memcmp(ref.data(), got.data(), ref.size() * 4) == 0 ? "equal" : "DIFFER from");
    }
    const double macs = (double) E * R * N * K;
    for (int hot = 0; hot <= 1; hot++) {
        for (int mode = 0; mode <= 3; mode++) {
            std::vector<double> t;
            for (int i = 0; i < reps; i++) t.push_back(run(mode, hot, nullptr));
            std::sort(t.begin(), t.end());
            const double m = t[t.size() / 2];
            printf("%-4s %-8s threads %2d rows %d experts %3d pf %5d: median %9.1f us, %6.1f GB/s of weights, %6.1f GMAC/s (%5.1f a thread)\n",
                   hot ? "hot" : "cold", names[mode], T, R, E, pf, m, E * exp_bytes / m / 1e3, macs / m / 1e3,
                   macs / m / 1e3 / T);
        }
    }
    return 0;
}
