// A CUDA injection library that records every kernel and copy a process
// runs on any GPU (CUPTI's activity API: the GPU's own start and end
// times, on one clock for all devices, kernels inside CUDA graphs
// included) as tab-separated lines, for machines without Nsight Systems.
// Loaded by the CUDA driver where CUDA_INJECTION64_PATH names it; writes
// $CUPTI_TRACE_OUT (default /tmp/cupti-trace.tsv):
//   K  start end device stream name          a kernel (ns)
//   C  start end device stream kind bytes    a copy (CUPTI's copyKind)
// Built on the device by tools/device/cupti-trace.sh, which picks the
// record versions this CUPTI writes (KERNEL_T, MEMCPY_T, PTOP_T).
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

#define BUF_BYTES (16u << 20)

static FILE *out;

static void CUPTIAPI buffer_requested(uint8_t **buf, size_t *size, size_t *max_records) {
  *buf = aligned_alloc(8, BUF_BYTES);
  *size = *buf ? BUF_BYTES : 0;
  *max_records = 0;
}

static void copy_line(unsigned long long start, unsigned long long end, unsigned device,
                      unsigned stream, unsigned kind, unsigned long long bytes) {
  fprintf(out, "C\t%llu\t%llu\t%u\t%u\t%u\t%llu\n", start, end, device, stream, kind, bytes);
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
                                      size_t valid) {
  CUpti_Activity *r = NULL;
  (void)ctx, (void)stream, (void)size;
  while (out && cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
    switch (r->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        KERNEL_T *k = (KERNEL_T *)r;
        fprintf(out, "K\t%llu\t%llu\t%u\t%u\t%s\n", (unsigned long long)k->start,
                (unsigned long long)k->end, k->deviceId, k->streamId, k->name ? k->name : "?");
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        MEMCPY_T *c = (MEMCPY_T *)r;
        copy_line(c->start, c->end, c->deviceId, c->streamId, c->copyKind, c->bytes);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY2: {
        PTOP_T *c = (PTOP_T *)r;
        copy_line(c->start, c->end, c->deviceId, c->streamId, c->copyKind, c->bytes);
        break;
      }
      default:
        break;
    }
  }
  free(buf);
}

static void flush_at_exit(void) {
  cuptiActivityFlushAll(1);
  if (out) fclose(out);
  out = NULL;
}

int InitializeInjection(void) {
  const char *path = getenv("CUPTI_TRACE_OUT");
  out = fopen(path ? path : "/tmp/cupti-trace.tsv", "w");
  if (!out) return 0;
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) return 0;
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY2);
  atexit(flush_at_exit);
  return 1;
}
