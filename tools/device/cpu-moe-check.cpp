// Times and checks the CPU backend's expert product (mul_mat_id) over a
// mixture's stacked experts, in plain memory and in the repacked layout
// (CPU_REPACK), at several token counts: the product a hybrid step's host
// layers run (run 143 chose the repacked layout for the host's experts
// with it). Loads a CPU backend module (a
// ggml-cpu variant .so) and, for each token count of MOE_TOKENS (default
// "1 8 16 64"), routes the tokens to MOE_USED (8) of MOE_EXPERTS (128)
// experts (uniform, or MOE_SKEW=S: expert e drawn with weight 1/(e+1)^S),
// multiplies Qwen3-30B-A3B's expert shapes (gate/up: 768 x 2048, input
// broadcast; down: 2048 x 768, one input per pick), and prints each
// layout's time and GB/s of the picked experts' weights, and the repacked
// output's NMSE against the plain one (ggml's vec_dot kernels, the
// reference: both quantize the inputs to the same Q8_K rows), with a hash
// of the repacked output's bytes to compare two modules bit for bit.
//   cpu-moe-check MODULE.so THREADS
// MOE_TYPE: q4_K (default) or q6_K; MOE_REPS: timed repetitions (20).
#include "cpu-module.h"
#include "ggml.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

struct Case {
    const char * name;
    int64_t K, N;   // input width, output rows of one expert
    bool broadcast; // one input row per token (gate/up) or one per pick (down)
};

int main(int argc, char ** argv) {
    TOOL = "cpu-moe-check";
    if (argc < 3) {
        die("usage: cpu-moe-check MODULE.so THREADS");
    }
    const CpuModule mod = load_cpu_module(argv[1]);
    ggml_backend_buffer_type_t repack = mod.extra("CPU_REPACK");
    const bool q6 = strcmp(env_or("MOE_TYPE", "q4_K"), "q6_K") == 0;
    const ggml_type type = q6 ? GGML_TYPE_Q6_K : GGML_TYPE_Q4_K;
    const int64_t E = atoll(env_or("MOE_EXPERTS", "128")), U = atoll(env_or("MOE_USED", "8"));
    const double skew = atof(env_or("MOE_SKEW", "0"));
    const int reps = atoi(env_or("MOE_REPS", "20"));
    const int threads = atoi(argv[2]);
    std::vector<int64_t> tokens;
    {
        std::istringstream s(env_or("MOE_TOKENS", "1 8 16 64"));
        for (int64_t t; s >> t;) {
            tokens.push_back(t);
        }
    }
    setvbuf(stdout, nullptr, _IOLBF, 0);
    mod.set_threads(mod.backend, threads);
    printf("module %s, %s experts, %lld of %lld used, skew %.2f, %d threads\n", argv[1], ggml_type_name(type),
           (long long) U, (long long) E, skew, threads);

    const Case cases[] = { { "gate/up 768x2048", 2048, 768, true }, { "down 2048x768", 768, 2048, false } };
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<double> pop(E);
    for (int64_t e = 0; e < E; ++e) {
        pop[e] = 1.0 / std::pow(double(e + 1), skew);
    }
    std::discrete_distribution<int> pick(pop.begin(), pop.end());

    for (const Case & c : cases) {
        // random weights: quantized from random floats, so scales are sane
        const int64_t n_w = c.K * c.N * E;
        std::vector<float> wf(n_w);
        for (auto & v : wf) {
            v = u(rng);
        }
        std::vector<uint8_t> wq(ggml_row_size(type, c.K) * c.N * E);
        ggml_quantize_chunk(type, wf.data(), wq.data(), 0, c.N * E, c.K, nullptr);
        const double expert_bytes = double(wq.size()) / E;

        for (int64_t T : tokens) {
            // the picks: U distinct experts a token
            std::vector<int32_t> ids(U * T);
            std::set<int> touched;
            for (int64_t t = 0; t < T; ++t) {
                std::set<int> mine;
                while ((int64_t) mine.size() < U) {
                    mine.insert(pick(rng));
                }
                int k = 0;
                for (int e : mine) {
                    ids[t * U + k++] = e;
                    touched.insert(e);
                }
            }
            const int64_t rows_in = c.broadcast ? 1 : U;
            std::vector<float> xv(c.K * rows_in * T);
            for (auto & v : xv) {
                v = u(rng);
            }
            std::vector<float> ref;
            for (int layout = 0; layout < 2; ++layout) {
                ggml_backend_buffer_type_t buft = layout == 0 ? ggml_backend_dev_buffer_type(mod.dev) : repack;
                if (!buft || (layout == 1 && q6)) {
                    continue;  // no repacked layout (x86 repacks no Q6_K)
                }
                ggml_init_params pw = { 2 * ggml_tensor_overhead(), nullptr, true };
                ggml_context * cw = ggml_init(pw);
                ggml_tensor * w = ggml_new_tensor_3d(cw, type, c.K, c.N, E);
                ggml_backend_buffer_t bw = ggml_backend_alloc_ctx_tensors_from_buft(cw, buft);
                ggml_init_params pa = { 8 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
                ggml_context * ca = ggml_init(pa);
                ggml_tensor * x = ggml_new_tensor_3d(ca, GGML_TYPE_F32, c.K, rows_in, T);
                ggml_tensor * id = ggml_new_tensor_2d(ca, GGML_TYPE_I32, U, T);
                ggml_tensor * y = ggml_mul_mat_id(ca, w, x, id);
                ggml_cgraph * gf = ggml_new_graph(ca);
                ggml_build_forward_expand(gf, y);
                ggml_backend_buffer_t ba = ggml_backend_alloc_ctx_tensors(ca, mod.backend);
                if (!bw || !ba) {
                    die("allocation failed");
                }
                ggml_backend_tensor_set(w, wq.data(), 0, wq.size());
                ggml_backend_tensor_set(x, xv.data(), 0, xv.size() * sizeof(float));
                ggml_backend_tensor_set(id, ids.data(), 0, ids.size() * sizeof(int32_t));
                if (ggml_backend_graph_compute(mod.backend, gf) != GGML_STATUS_SUCCESS) {
                    die("compute failed");
                }
                std::vector<float> out(ggml_nelements(y));
                ggml_backend_tensor_get(y, out.data(), 0, out.size() * sizeof(float));
                std::vector<double> times;
                for (int r = -2; r < reps; ++r) {
                    const auto t0 = std::chrono::steady_clock::now();
                    ggml_backend_graph_compute(mod.backend, gf);
                    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                    if (r >= 0) {
                        times.push_back(s);
                    }
                }
                std::sort(times.begin(), times.end());
                const double med = times[times.size() / 2];
                const double gb = touched.size() * expert_bytes / 1e9;
                printf("%-17s %3lld tokens, %3zu experts picked, %-10s median %8.1f us, %6.1f GB/s", c.name,
                       (long long) T, touched.size(), layout == 0 ? "plain" : "CPU_REPACK", 1e6 * med, gb / med);
                // FNV-1a of the output's bytes: the same inputs (fixed seeds) give the
                // same hash from two modules exactly when their outputs are bit for bit equal
                uint64_t h = 1469598103934665603ull;
                const unsigned char * p = (const unsigned char *) out.data();
                for (size_t i = 0; i < out.size() * sizeof(float); ++i) {
                    h = (h ^ p[i]) * 1099511628211ull;
                }
                if (layout == 0) {
                    ref = out;
                    printf(", output hash %016llx\n", (unsigned long long) h);
                } else {
                    double num = 0, den = 0;
                    for (size_t i = 0; i < out.size(); ++i) {
                        num += (out[i] - ref[i]) * (double) (out[i] - ref[i]);
                        den += ref[i] * (double) ref[i];
                    }
                    printf(", NMSE against plain %.3g, output hash %016llx\n", den > 0 ? num / den : 0.0,
                           (unsigned long long) h);
                }
                ggml_backend_buffer_free(ba);
                ggml_backend_buffer_free(bw);
                ggml_free(ca);
                ggml_free(cw);
            }
        }
    }
    ggml_backend_free(mod.backend);
    return 0;
}
