/* strata's C shim: the functions of ggml's CPU backend module that its
 * headers declare but a dynamically loaded module does not export to the
 * program (the module is dlopen'ed at run time, so the program cannot link
 * to them). Each looks the function up in the module that registered the
 * backend's device and calls it with the signature from ggml-cpu.h, which
 * the C compiler checks. Each returns false when the module lacks it. */
#pragma once

#include <stdbool.h>

#include "ggml-backend.h"
#include "ggml-cpu.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ggml_backend_cpu_set_n_threads */
bool strata_cpu_set_n_threads(ggml_backend_t backend, int n_threads);
/* ggml_backend_cpu_set_use_ref: reference kernels (batch invariance) */
bool strata_cpu_set_use_ref(ggml_backend_t backend, bool use_ref);
/* ggml_threadpool_new with ggml_threadpool_params_default(n_threads) and
 * the given poll level, then ggml_backend_cpu_set_threadpool; NULL when the
 * module lacks either function or the pool could not be made */
struct ggml_threadpool * strata_cpu_attach_threadpool(ggml_backend_t backend, int n_threads, int poll);
/* ggml_threadpool_pause */
bool strata_cpu_threadpool_pause(ggml_backend_t backend, struct ggml_threadpool * pool);
/* ggml_threadpool_free; call after the backend that used the pool is freed,
 * with any CPU backend of the same module (or NULL: the CPU registry) */
bool strata_cpu_threadpool_free(ggml_backend_reg_t cpu_reg, struct ggml_threadpool * pool);

#ifdef __cplusplus
}
#endif
