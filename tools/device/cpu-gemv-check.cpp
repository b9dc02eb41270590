// Checks a patch to the CPU backend's kernels (vendor/patches/0007: Q4_K's
// one-row product over repacked weights; 0008: Q4_K's and Q6_K's plain dot
// products) on a CPU that has the instructions: loads a CPU backend module
// (a ggml-cpu variant .so), multiplies random weights of 70B FFN shapes
// (by default Q4_K in the module's CPU_REPACK buffer, as strata's host
// copies are) by random rows, and writes the outputs to OUT_PREFIX.N.K.bin;
// then times the product at each thread count given, in GB/s of weights.
// Run it with the module before the patch and after, and compare the
// files (tools/device/cpu-gemv.sh does): they must be equal bit for bit.
// GEMV_TYPE (q4_0, q4_K, q6_K; default q4_K), GEMV_BUFT (an extra buffer
// type's name: CPU_REPACK, the default, or AMX; or CPU, plain memory) and GEMV_ROWS (the rows
// multiplied, default 1) choose another product to time; GEMV_ONE_SHAPE
// keeps the first shape alone.
//   cpu-gemv-check MODULE.so OUT_PREFIX THREADS...
#include "cpu-module.h"
#include "ggml.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

// A type's block size and where its half-precision scales lie in a block.
struct TypeInfo {
    const char * name;
    ggml_type type;
    size_t block;
    std::vector<size_t> halves;
};
static const TypeInfo TYPES[] = {
    { "q4_0", GGML_TYPE_Q4_0, 18, { 0 } },
    { "q4_K", GGML_TYPE_Q4_K, 144, { 0, 2 } },
    { "q6_K", GGML_TYPE_Q6_K, 210, { 208 } },
};

int main(int argc, char ** argv) {
    TOOL = "cpu-gemv-check";
    if (argc < 4) {
        die("usage: cpu-gemv-check MODULE.so OUT_PREFIX THREADS...");
    }
    const CpuModule mod = load_cpu_module(argv[1]);
    ggml_backend_dev_t dev = mod.dev;
    ggml_backend_t backend = mod.backend;
    auto set_threads = mod.set_threads;
    const char * buft_name = env_or("GEMV_BUFT", "CPU_REPACK");
    const char * type_name = env_or("GEMV_TYPE", "q4_K");
    const int64_t rows = atoll(env_or("GEMV_ROWS", "1"));
    ggml_backend_buffer_type_t repack = mod.extra(buft_name);
    if (strcmp(buft_name, "CPU") == 0) {
        repack = ggml_backend_dev_buffer_type(dev);  // plain memory: ggml's vec_dot kernels
    }
    if (!repack) {
        die("no such extra buffer type in this module");
    }
    const TypeInfo * ti = nullptr;
    for (const auto & t : TYPES) {
        if (strcmp(t.name, type_name) == 0) {
            ti = &t;
        }
    }
    if (!ti || rows < 1) {
        die("GEMV_TYPE is one of q4_0, q4_K, q6_K; GEMV_ROWS at least 1");
    }
    printf("module %s, %s weights in %s, %lld row(s)\n", argv[1], ti->name, buft_name, (long long) rows);

    // (rows, columns): a 70B FFN's gate/up and down, and one of 8 rows
    const int64_t shapes[][2] = { { 28672, 8192 }, { 8192, 28672 }, { 8, 256 } };
    const int n_shapes = getenv("GEMV_ONE_SHAPE") ? 1 : 3;  // timing alone: the first
    for (int si = 0; si < n_shapes; ++si) {
        const int64_t N = shapes[si][0], K = shapes[si][1];
        ggml_init_params pw = { 2 * ggml_tensor_overhead(), nullptr, true };
        ggml_context * cw = ggml_init(pw);
        ggml_tensor * w = ggml_new_tensor_2d(cw, ti->type, K, N);
        ggml_backend_buffer_t bw = ggml_backend_alloc_ctx_tensors_from_buft(cw, repack);
        ggml_init_params pa = { 8 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
        ggml_context * ca = ggml_init(pa);
        ggml_tensor * x = ggml_new_tensor_2d(ca, GGML_TYPE_F32, K, rows);
        ggml_tensor * y = ggml_mul_mat(ca, w, x);
        ggml_cgraph * gf = ggml_new_graph(ca);
        ggml_build_forward_expand(gf, y);
        ggml_backend_buffer_t ba = ggml_backend_alloc_ctx_tensors(ca, backend);
        if (!bw || !ba) {
            die("allocation failed");
        }

        // random blocks with finite scales, and random rows
        std::mt19937 rng(7);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        const size_t nbytes = ggml_nbytes(w);
        std::vector<uint8_t> wq(nbytes);
        for (auto & b : wq) {
            b = uint8_t(rng());
        }
        for (size_t o = 0; o < nbytes; o += ti->block) {
            for (size_t h : ti->halves) {
                const ggml_fp16_t d = ggml_fp32_to_fp16(0.01f * u(rng));
                memcpy(&wq[o + h], &d, 2);
            }
        }
        std::vector<float> xv(K * rows);
        for (auto & v : xv) {
            v = u(rng);
        }
        ggml_backend_tensor_set(w, wq.data(), 0, nbytes);
        ggml_backend_tensor_set(x, xv.data(), 0, xv.size() * sizeof(float));

        set_threads(backend, atoi(argv[3]));
        if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
            die("compute failed");
        }
        std::vector<float> out(N * rows);
        ggml_backend_tensor_get(y, out.data(), 0, out.size() * sizeof(float));
        const std::string path = std::string(argv[2]) + "." + std::to_string(N) + "." + std::to_string(K) + ".bin";
        FILE * f = fopen(path.c_str(), "wb");
        if (!f || fwrite(out.data(), sizeof(float), out.size(), f) != out.size()) {
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
    return 0;
}
