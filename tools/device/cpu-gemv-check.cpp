// Checks vendor/patches/0007 (Q4_K's one-row product over repacked
// weights with AVX512-VNNI) on a CPU that has it: loads a CPU backend
// module (a ggml-cpu variant .so), multiplies random Q4_K weights of 70B
// FFN shapes (in the module's CPU_REPACK buffer, as strata's host copies
// are) by one random row, and writes the outputs to OUT_PREFIX.N.K.bin;
// then times the product at each thread count given, in GB/s of weights.
// Run it with the module before the patch and after, and compare the
// files (tools/device/cpu-gemv.sh does): they must be equal bit for bit.
//   cpu-gemv-check MODULE.so OUT_PREFIX THREADS...
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static void die(const char * what) {
    fprintf(stderr, "cpu-gemv-check: %s\n", what);
    exit(2);
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        die("usage: cpu-gemv-check MODULE.so OUT_PREFIX THREADS...");
    }
    ggml_backend_reg_t reg = ggml_backend_load(argv[1]);
    if (!reg) {
        die("the module did not load");
    }
    ggml_backend_dev_t dev = ggml_backend_reg_dev_get(reg, 0);
    ggml_backend_t backend = ggml_backend_dev_init(dev, nullptr);
    auto set_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (!backend || !set_threads || !get_extra) {
        die("the module lacks a CPU backend, its thread count or its extra buffer types");
    }
    ggml_backend_buffer_type_t repack = nullptr;
    for (ggml_backend_buffer_type_t * b = get_extra(dev); b && *b; ++b) {
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) {
            repack = *b;
        }
    }
    if (!repack) {
        die("no CPU_REPACK buffer type");
    }
    printf("module %s\n", argv[1]);

    // (rows, columns): a 70B FFN's gate/up and down, and one of 8 rows
    const int64_t shapes[][2] = { { 28672, 8192 }, { 8192, 28672 }, { 8, 256 } };
    int rc = 0;
    for (const auto & sh : shapes) {
        const int64_t N = sh[0], K = sh[1];
        ggml_init_params pw = { 2 * ggml_tensor_overhead(), nullptr, true };
        ggml_context * cw = ggml_init(pw);
        ggml_tensor * w = ggml_new_tensor_2d(cw, GGML_TYPE_Q4_K, K, N);
        ggml_backend_buffer_t bw = ggml_backend_alloc_ctx_tensors_from_buft(cw, repack);
        ggml_init_params pa = { 8 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
        ggml_context * ca = ggml_init(pa);
        ggml_tensor * x = ggml_new_tensor_2d(ca, GGML_TYPE_F32, K, 1);
        ggml_tensor * y = ggml_mul_mat(ca, w, x);
        ggml_cgraph * gf = ggml_new_graph(ca);
        ggml_build_forward_expand(gf, y);
        ggml_backend_buffer_t ba = ggml_backend_alloc_ctx_tensors(ca, backend);
        if (!bw || !ba) {
            die("allocation failed");
        }

        // random Q4_K blocks (144 bytes: d, dmin, 12 bytes of scales, 128 of
        // quants) with finite scales, and a random row
        std::mt19937 rng(7);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        const size_t nbytes = ggml_nbytes(w);
        std::vector<uint8_t> wq(nbytes);
        for (auto & b : wq) {
            b = uint8_t(rng());
        }
        for (size_t o = 0; o < nbytes; o += 144) {
            const ggml_fp16_t d = ggml_fp32_to_fp16(0.01f * u(rng)), m = ggml_fp32_to_fp16(0.01f * u(rng));
            memcpy(&wq[o], &d, 2);
            memcpy(&wq[o + 2], &m, 2);
        }
        std::vector<float> xv(K);
        for (auto & v : xv) {
            v = u(rng);
        }
        ggml_backend_tensor_set(w, wq.data(), 0, nbytes);
        ggml_backend_tensor_set(x, xv.data(), 0, xv.size() * sizeof(float));

        set_threads(backend, atoi(argv[3]));
        if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
            die("compute failed");
        }
        std::vector<float> out(N);
        ggml_backend_tensor_get(y, out.data(), 0, N * sizeof(float));
        const std::string path = std::string(argv[2]) + "." + std::to_string(N) + "." + std::to_string(K) + ".bin";
        FILE * f = fopen(path.c_str(), "wb");
        if (!f || fwrite(out.data(), sizeof(float), N, f) != size_t(N)) {
            die("cannot write the outputs");
        }
        fclose(f);
        printf("%lld x %lld: y[0] %.6g, y[N-1] %.6g -> %s\n", (long long) N, (long long) K, out[0], out[N - 1], path.c_str());

        for (int a = 3; a < argc && N >= 1024; ++a) {
            set_threads(backend, atoi(argv[a]));
            const int reps = 30;
            double best = 1e9, sum = 0;
            for (int r = -3; r < reps; ++r) {
                const auto t0 = std::chrono::steady_clock::now();
                ggml_backend_graph_compute(backend, gf);
                const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                if (r >= 0) {
                    sum += s;
                    best = s < best ? s : best;
                }
            }
            printf("  %2s threads: mean %.1f us (%.1f GB/s), best %.1f us (%.1f GB/s)\n", argv[a], 1e6 * sum / reps,
                   nbytes * reps / sum / 1e9, 1e6 * best, nbytes / best / 1e9);
        }
        ggml_backend_buffer_free(ba);
        ggml_backend_buffer_free(bw);
        ggml_free(ca);
        ggml_free(cw);
    }
    ggml_backend_free(backend);
    return rc;
}
