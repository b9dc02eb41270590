// What the device's free memory loses to things outside ggml's buffers
// (docs/device-runs.md, session 68): pinned host memory of growing size
// (cudaMallocHost, as ggml's pinned buffer type allocates), then cuBLAS's
// handle and a first SGEMM of a mixture router's shape (F32 [2048, 128]
// weights, 1024 tokens), as ggml's CUDA backend runs float matrices of
// large steps. Prints MiB taken from the device's free memory by each.
//   nvcc -arch=sm_90 -O2 -o mem-probe tools/device/mem-probe.cu -lcublas && ./mem-probe
#include <cstdio>
#include <vector>
#include <cuda_runtime.h>
#include <cublas_v2.h>

static double free_mib() {
  size_t f = 0, t = 0;
  cudaMemGetInfo(&f, &t);
  return f / 1048576.0;
}

int main() {
  cudaFree(0);  // the context
  double f0 = free_mib();
  std::vector<void *> held;
  size_t gib = 1ull << 30, total = 0;
  for (int n : {1, 3, 7, 11}) {  // cumulative: 1, 4, 11, 22 GiB
    void *p = nullptr;
    if (cudaMallocHost(&p, n * gib) != cudaSuccess) { printf("cudaMallocHost %d GiB failed\n", n); break; }
    held.push_back(p);
    total += n;
    printf("pinned host %zu GiB: device free down %.1f MiB\n", total, f0 - free_mib());
  }
  double f1 = free_mib();
  cublasHandle_t h;
  cublasCreate(&h);
  printf("cublasCreate: %.1f MiB\n", f1 - free_mib());
  int k = 2048, m = 128, n = 1024;
  float *a, *b, *c;
  cudaMalloc(&a, sizeof(float) * k * m); cudaMalloc(&b, sizeof(float) * k * n); cudaMalloc(&c, sizeof(float) * m * n);
  double f2 = free_mib();
  float one = 1, zero = 0;
  cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, a, k, b, k, &zero, c, m);
  cudaDeviceSynchronize();
  printf("first SGEMM [%d,%d] x %d tokens: %.1f MiB\n", k, m, n, f2 - free_mib());
  cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, m, 64, k, &one, a, k, b, k, &zero, c, m);
  cudaDeviceSynchronize();
  printf("after an SGEMM of 64 tokens: %.1f MiB since the first\n", f2 - free_mib());
  cublasDestroy(h);
  for (void *p : held) cudaFreeHost(p);
  printf("all freed: device free down %.1f MiB from the start\n", f0 - free_mib());
  return 0;
}
