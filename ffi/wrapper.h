/* What ffi/src/bindings.rs binds: libllama (llama.h includes ggml.h,
 * ggml-cpu.h, ggml-backend.h, ggml-alloc.h and ggml-opt.h), gguf, and
 * strata's C shim. */
#include "llama.h"
#include "gguf.h"
#include "shim/shim.h"
