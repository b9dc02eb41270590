// Host-to-device copy rate from pinned memory by how the copies are issued:
// one stream or several (the GPU's copy engines), whole group-sized copies
// or chunks, and a kernel reading mapped pinned memory itself. The pager
// issues each streamed group as one cudaMemcpyAsync on one copy stream;
// this says whether another way moves the same bytes faster.
// With reader threads, that many host threads stream through 1 GiB each
// meanwhile, as the host CPU reads its groups beside the uploads.
//   nvcc -O2 -o bus-streams tools/device/bus-streams.cu && ./bus-streams [group MiB] [groups] [reps] [reader threads]
#include <cuda_runtime.h>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#define CK(x)                                                                  \
    do {                                                                       \
        cudaError_t err_ = (x);                                                \
        if (err_ != cudaSuccess) {                                             \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,          \
                    cudaGetErrorString(err_));                                 \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

// Each thread copies 16-byte words of a mapped host range into the device.
__global__ void pull(const int4 *__restrict__ src, int4 *__restrict__ dst, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (; i < n; i += stride) dst[i] = src[i];
}

struct Way {
    const char *name;
    int streams;      // copy streams used round robin
    size_t chunk;     // bytes per cudaMemcpyAsync (0: a whole group)
    bool kernel;      // the SMs read mapped pinned memory
};

int main(int argc, char **argv) {
    size_t group_mib = argc > 1 ? atoi(argv[1]) : 355;
    int groups = argc > 2 ? atoi(argv[2]) : 8;
    int reps = argc > 3 ? atoi(argv[3]) : 5;
    int readers = argc > 4 ? atoi(argv[4]) : 0;
    std::atomic<bool> stop{false};
    std::vector<std::thread> load;
    std::atomic<long> sink{0};
    for (int t = 0; t < readers; t++) {
        load.emplace_back([&] {
            std::vector<long> buf((1u << 30) / sizeof(long), 1);
            long acc = 0;
            while (!stop.load(std::memory_order_relaxed))
                for (size_t i = 0; i < buf.size(); i += 8) acc += buf[i];
            sink += acc;
        });
    }
    size_t group = group_mib << 20;
    size_t total = group * groups;
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    printf("%s, asyncEngineCount %d, %d SMs; %d groups of %zu MiB a pass, %d host reader threads\n",
           p.name, p.asyncEngineCount, p.multiProcessorCount, groups, group_mib, readers);
    char *host;
    CK(cudaHostAlloc((void **)&host, total, cudaHostAllocMapped));
    for (size_t i = 0; i < total; i += 4096) host[i] = (char)i;
    char *host_dev;
    CK(cudaHostGetDevicePointer((void **)&host_dev, host, 0));
    // three slots, as the FFN ring has, reused in turn
    char *dev;
    CK(cudaMalloc((void **)&dev, group * 3));
    std::vector<cudaStream_t> s(4);
    for (auto &x : s) CK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<Way> ways = {
        {"1 stream, a copy per group", 1, 0, false},
        {"1 stream, 64 MiB copies", 1, 64 << 20, false},
        {"1 stream, 8 MiB copies", 1, 8 << 20, false},
        {"2 streams, each group in halves", 2, 0, false},
        {"2 streams, 64 MiB copies", 2, 64 << 20, false},
        {"2 streams, 8 MiB copies", 2, 8 << 20, false},
        {"4 streams, 16 MiB copies", 4, 16 << 20, false},
        {"kernel reading mapped memory", 1, 0, true},
    };
    for (int round = 0; round < 2; round++) {
        for (auto &w : ways) {
            std::vector<float> gbs;
            for (int r = 0; r < reps; r++) {
                CK(cudaDeviceSynchronize());
                CK(cudaEventRecord(a, s[0]));
                for (int k = 1; k < w.streams; k++) CK(cudaStreamWaitEvent(s[k], a, 0));
                for (int g = 0; g < groups; g++) {
                    const char *src = host + g * group;
                    char *dst = dev + (g % 3) * group;
                    if (w.kernel) {
                        size_t n = group / 16;
                        pull<<<p.multiProcessorCount * 4, 512, 0, s[0]>>>(
                            (const int4 *)(host_dev + g * group), (int4 *)dst, n);
                        continue;
                    }
                    size_t chunk = w.chunk ? w.chunk : (w.streams > 1 ? group / w.streams : group);
                    int k = 0;
                    for (size_t off = 0; off < group; off += chunk, k++) {
                        size_t len = std::min(chunk, group - off);
                        CK(cudaMemcpyAsync(dst + off, src + off, len, cudaMemcpyHostToDevice,
                                           s[k % w.streams]));
                    }
                }
                for (int k = 1; k < w.streams; k++) {
                    cudaEvent_t e;
                    CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
                    CK(cudaEventRecord(e, s[k]));
                    CK(cudaStreamWaitEvent(s[0], e, 0));
                    CK(cudaEventDestroy(e));
                }
                CK(cudaEventRecord(b, s[0]));
                CK(cudaEventSynchronize(b));
                float ms;
                CK(cudaEventElapsedTime(&ms, a, b));
                gbs.push_back(total / (ms * 1e-3) / 1e9);
            }
            std::sort(gbs.begin(), gbs.end());
            printf("round %d  %-34s median %6.2f GB/s  (min %6.2f, max %6.2f)\n", round + 1,
                   w.name, gbs[gbs.size() / 2], gbs.front(), gbs.back());
        }
    }
    stop = true;
    for (auto &t : load) t.join();
    return sink == 42 ? 1 : 0;
}
