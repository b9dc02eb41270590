/* See shim.h. */
#define _GNU_SOURCE
#include "shim.h"

#include <dlfcn.h>
#include <stddef.h>

/* A function of the module behind `reg`: the registry's own table first,
 * then the module's dynamic symbols. The module is found from an address
 * the registry hands out (dladdr), and reopened with RTLD_NOLOAD, which
 * never loads anything new; the reference it takes is never dropped, and the
 * module stays loaded for the life of the process anyway. */
static void * module_fn(ggml_backend_reg_t reg, const char * name) {
    if (reg == NULL) {
        return NULL;
    }
    void * p = ggml_backend_reg_get_proc_address(reg, name);
    if (p != NULL) {
        return p;
    }
    void * known = ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_new");
    Dl_info info;
    if (known == NULL || dladdr(known, &info) == 0 || info.dli_fname == NULL) {
        return NULL;
    }
    void * h = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
    return h == NULL ? NULL : dlsym(h, name);
}

static ggml_backend_reg_t reg_of(ggml_backend_t backend) {
    ggml_backend_dev_t dev = backend == NULL ? NULL : ggml_backend_get_device(backend);
    return dev == NULL ? NULL : ggml_backend_dev_backend_reg(dev);
}

/* the type of a declared function, so that a call through the looked-up
 * pointer is checked against the header's declaration */
#define FN(name) __typeof__(name) *

bool strata_cpu_set_n_threads(ggml_backend_t backend, int n_threads) {
    FN(ggml_backend_cpu_set_n_threads) f = (FN(ggml_backend_cpu_set_n_threads)) module_fn(reg_of(backend), "ggml_backend_set_n_threads");
    if (f == NULL) {
        return false;
    }
    f(backend, n_threads);
    return true;
}

bool strata_cpu_set_use_ref(ggml_backend_t backend, bool use_ref) {
    FN(ggml_backend_cpu_set_use_ref) f = (FN(ggml_backend_cpu_set_use_ref)) module_fn(reg_of(backend), "ggml_backend_cpu_set_use_ref");
    if (f == NULL) {
        return false;
    }
    f(backend, use_ref);
    return true;
}

struct ggml_threadpool * strata_cpu_attach_threadpool(ggml_backend_t backend, int n_threads, int poll) {
    ggml_backend_reg_t reg = reg_of(backend);
    FN(ggml_threadpool_new) make = (FN(ggml_threadpool_new)) module_fn(reg, "ggml_threadpool_new");
    FN(ggml_backend_cpu_set_threadpool) set = (FN(ggml_backend_cpu_set_threadpool)) module_fn(reg, "ggml_backend_cpu_set_threadpool");
    if (make == NULL || set == NULL || n_threads < 1) {
        return NULL;
    }
    struct ggml_threadpool_params params = ggml_threadpool_params_default(n_threads);
    params.poll = (uint32_t) (poll < 0 ? 0 : poll > 100 ? 100 : poll);
    struct ggml_threadpool * pool = make(&params);
    if (pool != NULL) {
        set(backend, pool);
    }
    return pool;
}

bool strata_cpu_threadpool_pause(ggml_backend_t backend, struct ggml_threadpool * pool) {
    FN(ggml_threadpool_pause) f = (FN(ggml_threadpool_pause)) module_fn(reg_of(backend), "ggml_threadpool_pause");
    if (f == NULL || pool == NULL) {
        return false;
    }
    f(pool);
    return true;
}

bool strata_cpu_threadpool_free(ggml_backend_reg_t cpu_reg, struct ggml_threadpool * pool) {
    if (cpu_reg == NULL) {
        cpu_reg = ggml_backend_reg_by_name("CPU");
    }
    FN(ggml_threadpool_free) f = (FN(ggml_threadpool_free)) module_fn(cpu_reg, "ggml_threadpool_free");
    if (f == NULL || pool == NULL) {
        return false;
    }
    f(pool);
    return true;
}
