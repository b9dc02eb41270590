// Checks vendor/patches/0004 and 0006 on the GPU: the vectorized
// dequantizations (Q4_0; the K-quants Q4_K, Q5_K, Q6_K) against ggml's own
// kernels (both in the patched convert.cu, included here), bit for bit,
// into BF16, F16 and F32, on random blocks of a 7168 x 8192 weight (a
// 70B-shaped FFN matrix's half); then times both into BF16 (what cuBLAS
// multiplies). Built and run on the device by tools/device/dequant-ab.sh;
// exits 1 on any difference.
#include "convert.cu"

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#define CHECK(x)                                                                   \
    do {                                                                           \
        cudaError_t e_ = (x);                                                      \
        if (e_ != cudaSuccess) {                                                   \
            fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));               \
            exit(2);                                                               \
        }                                                                          \
    } while (0)

// One quantized type: its block, ggml's kernel launched as ggml launched it
// before the patch, and the row function the patch routes (which takes the
// vectorized kernel wherever it applies).
struct TQ4_0 {
    using block = block_q4_0;
    static constexpr const char * name = "q4_0";
    static constexpr int qk = QK4_0;
    template <typename T> static void old(const void * x, T * y, int64_t k) {
        dequantize_block_q4_0<<<(k + 255) / 256, 32>>>(x, y, k / QK4_0);
    }
    template <typename T> static void row(const void * x, T * y, int64_t k) { dequantize_row_q4_0_cuda(x, y, k, 0); }
};
struct TQ4_K {
    using block = block_q4_K;
    static constexpr const char * name = "q4_K";
    static constexpr int qk = QK_K;
    template <typename T> static void old(const void * x, T * y, int64_t k) { dequantize_block_q4_K<<<k / QK_K, 32>>>(x, y); }
    template <typename T> static void row(const void * x, T * y, int64_t k) { dequantize_row_q4_K_cuda(x, y, k, 0); }
};
struct TQ5_K {
    using block = block_q5_K;
    static constexpr const char * name = "q5_K";
    static constexpr int qk = QK_K;
    template <typename T> static void old(const void * x, T * y, int64_t k) { dequantize_block_q5_K<<<k / QK_K, 64>>>(x, y); }
    template <typename T> static void row(const void * x, T * y, int64_t k) { dequantize_row_q5_K_cuda(x, y, k, 0); }
};
struct TQ6_K {
    using block = block_q6_K;
    static constexpr const char * name = "q6_K";
    static constexpr int qk = QK_K;
    template <typename T> static void old(const void * x, T * y, int64_t k) { dequantize_block_q6_K<<<k / QK_K, 64>>>(x, y); }
    template <typename T> static void row(const void * x, T * y, int64_t k) { dequantize_row_q6_K_cuda(x, y, k, 0); }
};

// Random blocks: random bytes, then every half-precision scale set to a
// finite value (random bytes could make infinities and NaNs, whose bits
// need not survive arithmetic alike).
static void fill(block_q4_0 & b, std::mt19937 & r, std::uniform_real_distribution<float> & s) { b.d = __float2half(s(r)); }
static void fill(block_q4_K & b, std::mt19937 & r, std::uniform_real_distribution<float> & s) {
    b.dm = make_half2(__float2half(s(r)), __float2half(s(r)));
}
static void fill(block_q5_K & b, std::mt19937 & r, std::uniform_real_distribution<float> & s) {
    b.dm = make_half2(__float2half(s(r)), __float2half(s(r)));
}
static void fill(block_q6_K & b, std::mt19937 & r, std::uniform_real_distribution<float> & s) { b.d = __float2half(s(r)); }

template <typename Q, typename T> static bool same(const void * x, int64_t k, const char * what) {
    T *a, *b;
    CHECK(cudaMalloc(&a, k * sizeof(T)));
    CHECK(cudaMalloc(&b, k * sizeof(T)));
    CHECK(cudaMemset(a, 0xAB, k * sizeof(T)));
    CHECK(cudaMemset(b, 0xCD, k * sizeof(T)));
    Q::old(x, a, k);
    Q::row(x, b, k);
    CHECK(cudaDeviceSynchronize());
    std::vector<unsigned char> ha(k * sizeof(T)), hb(k * sizeof(T));
    CHECK(cudaMemcpy(ha.data(), a, ha.size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(hb.data(), b, hb.size(), cudaMemcpyDeviceToHost));
    const bool ok = memcmp(ha.data(), hb.data(), ha.size()) == 0;
    printf("%s %s: %s\n", Q::name, what, ok ? "identical" : "DIFFERENT");
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    return ok;
}

template <typename Q> static bool check() {
    using B = typename Q::block;
    const int64_t k = int64_t(7168) * 8192, nb = k / Q::qk;
    std::vector<B> h(nb);
    std::mt19937 rng(42);
    std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
    for (auto & b : h) {
        for (size_t i = 0; i < sizeof(B); ++i) {
            ((unsigned char *) &b)[i] = uint8_t(rng());
        }
        fill(b, rng, scale);
    }
    void * x;
    CHECK(cudaMalloc(&x, nb * sizeof(B)));
    CHECK(cudaMemcpy(x, h.data(), nb * sizeof(B), cudaMemcpyHostToDevice));
    bool ok = same<Q, nv_bfloat16>(x, k, "bf16") & same<Q, half>(x, k, "f16") & same<Q, float>(x, k, "f32");
    // odd sizes: a single block, and a row's worth past a round count
    ok &= same<Q, nv_bfloat16>(x, Q::qk, "bf16, one block") & same<Q, float>(x, 8192 + Q::qk, "f32, one block past 8192");

    nv_bfloat16 * y;
    CHECK(cudaMalloc(&y, k * sizeof(nv_bfloat16)));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    const double bytes = nb * sizeof(B) + k * sizeof(nv_bfloat16);
    for (int v = 0; v < 2; ++v) {
        const int reps = 50;
        for (int r = -5; r < reps; ++r) {
            if (r == 0) {
                CHECK(cudaEventRecord(t0));
            }
            if (v == 0) {
                Q::old(x, y, k);
            } else {
                Q::row(x, y, k);
            }
        }
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        printf("%s %s: %.1f us a 7168 x 8192 matrix into BF16, %.2f TB/s\n", Q::name,
               v == 0 ? "ggml's kernel" : "vectorized", 1e3 * ms / reps, bytes * reps / (ms * 1e-3) / 1e12);
    }
    CHECK(cudaFree(y));
    CHECK(cudaFree(x));
    return ok;
}

int main() {
    bool ok = check<TQ4_0>();
    ok &= check<TQ4_K>();
    ok &= check<TQ5_K>();
    ok &= check<TQ6_K>();
    return ok ? 0 : 1;
}

// What the included file's other functions reach in the rest of ggml (this
// check calls none of them).
void ggml_abort(const char * file, int line, const char * fmt, ...) {
    fprintf(stderr, "ggml_abort at %s:%d (%s)\n", file, line, fmt);
    abort();
}
int ggml_cuda_get_device() {
    int d = 0;
    CHECK(cudaGetDevice(&d));
    return d;
}
const ggml_cuda_device_info & ggml_cuda_info() {
    fprintf(stderr, "ggml_cuda_info: not part of this check\n");
    abort();
}
