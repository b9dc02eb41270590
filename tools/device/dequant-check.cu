// Checks vendor/patches/0004 on the GPU: the vectorized Q4_0 dequantization
// against ggml's own kernel (both in the patched convert.cu, included
// here), bit for bit, into BF16, F16 and F32, on random blocks of a
// 7168 x 8192 weight (a 70B-shaped FFN matrix's half); then times both
// into BF16 (what cuBLAS multiplies). Built and run on the device by
// tools/device/dequant-check.sh; exits 1 on any difference.
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

template <typename T>
static bool same(const void * x, int64_t k, const char * name) {
    const int64_t nb = k / QK4_0;
    T *a, *b;
    CHECK(cudaMalloc(&a, k * sizeof(T)));
    CHECK(cudaMalloc(&b, k * sizeof(T)));
    CHECK(cudaMemset(a, 0xAB, k * sizeof(T)));
    CHECK(cudaMemset(b, 0xCD, k * sizeof(T)));
    dequantize_block_q4_0<<<(k + 255) / 256, 32>>>(x, a, nb);
    dequantize_row_q4_0_cuda(x, b, k, 0);
    CHECK(cudaDeviceSynchronize());
    std::vector<unsigned char> ha(k * sizeof(T)), hb(k * sizeof(T));
    CHECK(cudaMemcpy(ha.data(), a, ha.size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(hb.data(), b, hb.size(), cudaMemcpyDeviceToHost));
    const bool ok = memcmp(ha.data(), hb.data(), ha.size()) == 0;
    printf("%s: %s\n", name, ok ? "identical" : "DIFFERENT");
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    return ok;
}

int main() {
    const int64_t k = int64_t(7168) * 8192, nb = k / QK4_0;
    std::vector<block_q4_0> h(nb);
    std::mt19937 rng(42);
    std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
    for (auto & b : h) {
        b.d = __float2half(scale(rng));
        for (auto & q : b.qs) {
            q = uint8_t(rng());
        }
    }
    void * x;
    CHECK(cudaMalloc(&x, nb * sizeof(block_q4_0)));
    CHECK(cudaMemcpy(x, h.data(), nb * sizeof(block_q4_0), cudaMemcpyHostToDevice));
    bool ok = same<nv_bfloat16>(x, k, "bf16") & same<half>(x, k, "f16") & same<float>(x, k, "f32");
    // odd sizes: a single block, and a row's worth past a round count
    ok &= same<nv_bfloat16>(x, QK4_0, "bf16, one block") & same<float>(x, 8192 + 32, "f32, 257 blocks");

    nv_bfloat16 * y;
    CHECK(cudaMalloc(&y, k * sizeof(nv_bfloat16)));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    const double bytes = nb * sizeof(block_q4_0) + k * sizeof(nv_bfloat16);
    for (int v = 0; v < 2; ++v) {
        const int reps = 50;
        for (int r = -5; r < reps; ++r) {
            if (r == 0) {
                CHECK(cudaEventRecord(t0));
            }
            if (v == 0) {
                dequantize_block_q4_0<<<(k + 255) / 256, 32>>>(x, y, nb);
            } else {
                dequantize_row_q4_0_cuda(x, y, k, 0);
            }
        }
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        printf("%s: %.1f us a 7168 x 8192 matrix into BF16, %.2f TB/s\n",
               v == 0 ? "ggml's kernel" : "vectorized", 1e3 * ms / reps, bytes * reps / (ms * 1e-3) / 1e12);
    }
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
