// Copies and one-GPU collectives through the cuda accelerator, raced against
// the CUDA runtime called directly on the same buffers in the same run (a
// program that prints medians, not a test). One process, one GPU:
//   build/bin/accelerator_cuda_copy_bench [iterations]
//
// Table 1: per direction (pinned host -> device, device -> pinned host,
// device -> device) and size, the median of copy_async + Stream::synchronize
// against cudaMemcpyAsync + cudaStreamSynchronize; GB/s = bytes copied / time
// (device -> device moves twice that through HBM: read and write). The two
// alternate which goes first. Table 2: all_gather, all_reduce and barrier of
// a world of one rank on NCCL: what a one-GPU job pays per collective.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ductile/accelerator.hpp"
#include "ductile/core/runtime.hpp"

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", call, cudaGetErrorString(status));
    std::exit(1);
  }
}

const char* label(ductile::CopyKind kind) {
  switch (kind) {
    case ductile::CopyKind::host_to_device:
      return "pinned->device";
    case ductile::CopyKind::device_to_host:
      return "device->pinned";
    default:
      return "device->device";
  }
}

cudaMemcpyKind cuda_kind(ductile::CopyKind kind) {
  switch (kind) {
    case ductile::CopyKind::host_to_device:
      return cudaMemcpyHostToDevice;
    case ductile::CopyKind::device_to_host:
      return cudaMemcpyDeviceToHost;
    default:
      return cudaMemcpyDeviceToDevice;
  }
}

}  // namespace

int main(int argc, char** argv) {
  int iterations = argc > 1 ? std::atoi(argv[1]) : 30;
  if (iterations < 1) {
    std::fprintf(stderr, "accelerator_cuda_copy_bench: iterations '%s' must be >= 1\n", argv[1]);
    return 2;
  }
  try {
    auto runtime = ductile::core::Runtime::from_string(
        std::string("[plugins]\npath = [\"") + DUCTILE_PLUGIN_DIR +
            "\"]\n[log]\nlevel = \"warn\"\n[accelerator]\nbackend = \"cuda\"\n"
            "communicator = \"local\"\n",
        "bench.toml");
    auto accel = runtime.get<ductile::Accelerator>();
    auto info = accel->device_info(accel->current_device());
    std::printf("%s, %.1f GiB; medians of %d (after 3 warm-ups)\n\n", info.name.c_str(),
                static_cast<double>(info.total_memory) / (1u << 30), iterations);
    std::size_t largest = std::size_t{1} << 30;
    void* host = accel->allocate(largest, ductile::MemoryKind::pinned_host);
    void* a = accel->allocate(largest, ductile::MemoryKind::device);
    void* b = accel->allocate(largest, ductile::MemoryKind::device);
    auto stream = accel->create_stream();
    cudaStream_t raw = nullptr;
    check(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");

    std::printf("%-15s %10s %12s %12s %12s %12s %7s\n", "copy", "bytes", "ductile us",
                "ductile GB/s", "cuda us", "cuda GB/s", "ratio");
    for (auto kind : {ductile::CopyKind::host_to_device, ductile::CopyKind::device_to_host,
                      ductile::CopyKind::device_to_device}) {
      void* dst = kind == ductile::CopyKind::device_to_host ? host : b;
      const void* src = kind == ductile::CopyKind::host_to_device ? host : a;
      for (std::size_t bytes = 4096; bytes <= largest; bytes *= 16) {
        auto ours = [&] {
          double t0 = now();
          accel->copy_async(dst, src, bytes, kind, *stream);
          stream->synchronize();
          return now() - t0;
        };
        auto theirs = [&] {
          double t0 = now();
          check(cudaMemcpyAsync(dst, src, bytes, cuda_kind(kind), raw), "cudaMemcpyAsync");
          check(cudaStreamSynchronize(raw), "cudaStreamSynchronize");
          return now() - t0;
        };
        std::vector<double> t_ours, t_theirs;
        for (int i = -3; i < iterations; ++i) {
          double x, y;
          if (i % 2 == 0) {
            x = ours();
            y = theirs();
          } else {
            y = theirs();
            x = ours();
          }
          if (i >= 0) {
            t_ours.push_back(x);
            t_theirs.push_back(y);
          }
        }
        double m_ours = median(t_ours), m_theirs = median(t_theirs);
        std::printf("%-15s %10zu %12.1f %12.2f %12.1f %12.2f %7.2f\n", label(kind), bytes,
                    m_ours * 1e6, static_cast<double>(bytes) / m_ours / 1e9, m_theirs * 1e6,
                    static_cast<double>(bytes) / m_theirs / 1e9, m_ours / m_theirs);
      }
    }

    auto world = accel->world();
    std::printf("\nworld of %d rank(s) on NCCL\n%-12s %10s %12s\n", world->size(), "collective",
                "bytes", "median us");
    auto time_collective = [&](const char* name, std::size_t bytes, auto&& post) {
      std::vector<double> t;
      for (int i = -3; i < iterations; ++i) {
        double t0 = now();
        post()->wait();
        if (i >= 0) t.push_back(now() - t0);
      }
      std::printf("%-12s %10zu %12.1f\n", name, bytes, median(t) * 1e6);
    };
    for (std::size_t bytes : {std::size_t{4}, std::size_t{1} << 20, std::size_t{64} << 20}) {
      time_collective("all_gather", bytes, [&] {
        return world->all_gather(a, b, bytes / 4, ductile::DataType::f32, *stream);
      });
      time_collective("all_reduce", bytes, [&] {
        return world->all_reduce(a, b, bytes / 4, ductile::DataType::f32, ductile::ReduceOp::sum,
                                 *stream);
      });
    }
    time_collective("barrier", 0, [&] { return world->barrier(*stream); });

    check(cudaStreamDestroy(raw), "cudaStreamDestroy");
    accel->deallocate(a, ductile::MemoryKind::device);
    accel->deallocate(b, ductile::MemoryKind::device);
    accel->deallocate(host, ductile::MemoryKind::pinned_host);
  } catch (const ductile::Error& error) {
    std::fprintf(stderr, "accelerator_cuda_copy_bench: %s\n", error.what());
    return error.is_user_error() ? 2 : 1;
  }
  return 0;
}
