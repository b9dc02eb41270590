// What the CPU-kernel checks (tools/device/cpu-gemv-check.cpp,
// cpu-moe-check.cpp) share: a CPU backend module (a ggml-cpu variant .so)
// loaded by path, with its backend, thread count setter and extra buffer
// types, and the small helpers both use. Each check sets TOOL to its name
// for its messages.
#pragma once

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

static const char * TOOL = "cpu-check";

static const char * env_or(const char * name, const char * dflt) {
    const char * v = getenv(name);
    return v && *v ? v : dflt;
}

static void die(const char * what) {
    fprintf(stderr, "%s: %s\n", TOOL, what);
    exit(2);
}

struct CpuModule {
    ggml_backend_dev_t dev;
    ggml_backend_t backend;
    ggml_backend_set_n_threads_t set_threads;
    ggml_backend_dev_get_extra_bufts_t get_extra;

    // the extra buffer type named `name` (CPU_REPACK, AMX), or nullptr
    ggml_backend_buffer_type_t extra(const char * name) const {
        for (ggml_backend_buffer_type_t * b = get_extra(dev); b && *b; ++b) {
            if (strcmp(ggml_backend_buft_name(*b), name) == 0) {
                return *b;
            }
        }
        return nullptr;
    }
};

// Loads the module at `path` and starts its CPU backend, or dies saying why.
static CpuModule load_cpu_module(const char * path) {
    ggml_backend_reg_t reg = ggml_backend_load(path);
    if (!reg) {
        die("the module did not load");
    }
    CpuModule m;
    m.dev = ggml_backend_reg_dev_get(reg, 0);
    m.backend = ggml_backend_dev_init(m.dev, nullptr);
    m.set_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
    m.get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (!m.backend || !m.set_threads || !m.get_extra) {
        die("the module lacks a CPU backend, its thread count or its extra buffer types");
    }
    return m;
}
