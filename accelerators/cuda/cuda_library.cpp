// The CUDA runtime and NCCL, found when the backend first calls them: the
// plugin links neither, so that one build serves wherever the user's CUDA
// lives. cuda_accelerator.cpp calls the API as declared in
// cuda_runtime_api.h and nccl.h; the definitions here (hidden, like
// everything of the plugin but its entry point) forward each call to the
// library, loaded on the first call of one of its functions from, in order:
//   1. the process, when it has it already (torch's CUDA build loads both
//      when imported, from its nvidia-* packages);
//   2. the nvidia-* packages beside the ductile package in site-packages
//      (nvidia/cu13/lib, nvidia/cuda_runtime/lib, nvidia/nccl/lib), where
//      torch's CUDA wheels put them;
//   3. the directories this build was configured with
//      (DUCTILE_CUDA_LIBRARY_DIRS; none in a wheel);
//   4. $CUDA_HOME/lib64, $CUDA_PATH/lib64 and /usr/local/cuda/lib64;
//   5. the loader's own search (LD_LIBRARY_PATH, the ld.so cache).
// When none has it, the call throws Error(unsupported) naming the library,
// every place tried and what to install. A function the backend starts to
// call must be added below: the plugin is linked with --no-undefined, so a
// missing one fails the link.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "ductile/error.hpp"

#ifndef DUCTILE_CUDA_LIBRARY_DIRS
#define DUCTILE_CUDA_LIBRARY_DIRS ""
#endif

namespace ductile::accel {
namespace {

namespace fs = std::filesystem;

struct CudaLibrary {
  std::string soname;                     // what the loader is asked for
  std::string what;                       // for messages
  std::vector<std::string> package_dirs;  // below site-packages
  std::string install;                    // what to install when it is missing
  std::once_flag once;
  void* handle = nullptr;
  std::string error;
};

CudaLibrary& cudart() {
  static CudaLibrary library{
      "libcudart.so." + std::to_string(CUDART_VERSION / 1000),
      "the CUDA " + std::to_string(CUDART_VERSION / 1000) + " runtime",
      {"nvidia/cu" + std::to_string(CUDART_VERSION / 1000) + "/lib", "nvidia/cuda_runtime/lib"},
      "torch's CUDA " + std::to_string(CUDART_VERSION / 1000) +
          " build brings it (pip install torch --index-url "
          "https://download.pytorch.org/whl/cu" +
          std::to_string(CUDART_VERSION / 1000) + "0), as does `pip install nvidia-cuda-runtime` " +
          "or a CUDA toolkit of that major version on LD_LIBRARY_PATH",
      {},
      nullptr,
      {}};
  return library;
}

CudaLibrary& nccl() {
  static CudaLibrary library{"libnccl.so.2",
                             "NCCL 2",
                             {"nvidia/nccl/lib"},
                             "torch's CUDA build brings it, as does `pip install nvidia-nccl-cu" +
                                 std::to_string(CUDART_VERSION / 1000) +
                                 "`, or put NCCL's lib directory on LD_LIBRARY_PATH",
                             {},
                             nullptr,
                             {}};
  return library;
}

// site-packages when this plugin lies in an installed wheel
// (<site-packages>/ductile/lib/ductile/plugins/), else empty.
fs::path site_packages() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&site_packages), &info) == 0 || !info.dli_fname)
    return {};
  std::error_code ignored;
  fs::path plugin = fs::weakly_canonical(info.dli_fname, ignored);
  fs::path site = plugin.parent_path().parent_path().parent_path().parent_path().parent_path();
  if (!fs::exists(site / "ductile" / "__init__.py", ignored)) return {};
  return site;
}

std::vector<fs::path> candidate_dirs(const CudaLibrary& library) {
  std::vector<fs::path> dirs;
  fs::path site = site_packages();
  if (!site.empty())
    for (const std::string& below : library.package_dirs) dirs.push_back(site / below);
  std::string configured = DUCTILE_CUDA_LIBRARY_DIRS;
  for (std::size_t start = 0; start < configured.size();) {
    std::size_t end = configured.find(':', start);
    if (end == std::string::npos) end = configured.size();
    if (end > start) dirs.emplace_back(configured.substr(start, end - start));
    start = end + 1;
  }
  for (const char* variable : {"CUDA_HOME", "CUDA_PATH"}) {
    const char* value = std::getenv(variable);
    if (value != nullptr && *value != '\0') dirs.push_back(fs::path(value) / "lib64");
  }
  dirs.emplace_back("/usr/local/cuda/lib64");
  return dirs;
}

void load(CudaLibrary& library) {
  constexpr int kMode = RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE;
  library.handle = dlopen(library.soname.c_str(), kMode | RTLD_NOLOAD);
  if (library.handle != nullptr) return;
  std::string looked = "the process (not loaded)";
  for (const fs::path& dir : candidate_dirs(library)) {
    fs::path file = dir / library.soname;
    looked += ", " + dir.string();
    std::error_code missing;
    if (!fs::exists(file, missing)) continue;
    library.handle = dlopen(file.c_str(), kMode);
    if (library.handle != nullptr) return;
    const char* why = dlerror();
    looked += std::string(" (") + (why != nullptr ? why : "not loadable") + ")";
  }
  library.handle = dlopen(library.soname.c_str(), kMode);
  if (library.handle != nullptr) return;
  const char* why = dlerror();
  library.error = "cuda accelerator: " + library.what + " (" + library.soname +
                  ") was not found; looked in " + looked +
                  " and the loader's path (LD_LIBRARY_PATH, the ld.so cache: " +
                  (why != nullptr ? why : "not found") + "). " + library.install;
}

void* symbol(CudaLibrary& library, const char* name) {
  std::call_once(library.once, [&] { load(library); });
  if (library.handle == nullptr) throw Error(ErrorKind::unsupported, library.error);
  void* found = dlsym(library.handle, name);
  if (found == nullptr)
    throw Error(ErrorKind::unsupported, "cuda accelerator: " + library.soname + " has no " + name +
                                            ": " + library.what +
                                            " is older than this build needs");
  return found;
}

}  // namespace
}  // namespace ductile::accel

// One definition per function the backend calls: the library's function,
// looked up once.
#define DUCTILE_CUDA_FORWARD(library, result, name, parameters, arguments)  \
  extern "C" result name parameters {                                       \
    using ductile_function_ = result(*) parameters;                         \
    static const auto ductile_found_ = reinterpret_cast<ductile_function_>( \
        ::ductile::accel::symbol(::ductile::accel::library(), #name));      \
    return ductile_found_ arguments;                                        \
  }

DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaEventCreateWithFlags,
                     (cudaEvent_t * event, unsigned int flags), (event, flags))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaEventDestroy, (cudaEvent_t event), (event))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaEventQuery, (cudaEvent_t event), (event))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaEventRecord, (cudaEvent_t event, cudaStream_t stream),
                     (event, stream))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaEventSynchronize, (cudaEvent_t event), (event))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaFree, (void* pointer), (pointer))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaFreeHost, (void* pointer), (pointer))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaGetDeviceCount, (int* count), (count))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaGetDeviceProperties,
                     (struct cudaDeviceProp * properties, int device), (properties, device))
DUCTILE_CUDA_FORWARD(cudart, const char*, cudaGetErrorName, (cudaError_t error), (error))
DUCTILE_CUDA_FORWARD(cudart, const char*, cudaGetErrorString, (cudaError_t error), (error))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaMalloc, (void** pointer, size_t size),
                     (pointer, size))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaMallocHost, (void** pointer, size_t size),
                     (pointer, size))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaMemGetInfo, (size_t * free, size_t* total),
                     (free, total))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaMemcpyAsync,
                     (void* dst, const void* src, size_t count, enum cudaMemcpyKind kind,
                      cudaStream_t stream),
                     (dst, src, count, kind, stream))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaMemsetAsync,
                     (void* pointer, int value, size_t count, cudaStream_t stream),
                     (pointer, value, count, stream))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaSetDevice, (int device), (device))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaStreamCreateWithFlags,
                     (cudaStream_t * stream, unsigned int flags), (stream, flags))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaStreamDestroy, (cudaStream_t stream), (stream))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaStreamQuery, (cudaStream_t stream), (stream))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaStreamSynchronize, (cudaStream_t stream), (stream))
DUCTILE_CUDA_FORWARD(cudart, cudaError_t, cudaStreamWaitEvent,
                     (cudaStream_t stream, cudaEvent_t event, unsigned int flags),
                     (stream, event, flags))

DUCTILE_CUDA_FORWARD(nccl, ncclResult_t, ncclAllGather,
                     (const void* send, void* recv, size_t count, ncclDataType_t type,
                      ncclComm_t comm, cudaStream_t stream),
                     (send, recv, count, type, comm, stream))
DUCTILE_CUDA_FORWARD(nccl, ncclResult_t, ncclAllReduce,
                     (const void* send, void* recv, size_t count, ncclDataType_t type,
                      ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream),
                     (send, recv, count, type, op, comm, stream))
DUCTILE_CUDA_FORWARD(nccl, ncclResult_t, ncclBroadcast,
                     (const void* send, void* recv, size_t count, ncclDataType_t type, int root,
                      ncclComm_t comm, cudaStream_t stream),
                     (send, recv, count, type, root, comm, stream))
DUCTILE_CUDA_FORWARD(nccl, ncclResult_t, ncclCommAbort, (ncclComm_t comm), (comm))
DUCTILE_CUDA_FORWARD(nccl, ncclResult_t, ncclCommDestroy, (ncclComm_t comm), (comm))
DUCTILE_CUDA_FORWARD(nccl, ncclResult_t, ncclCommFinalize, (ncclComm_t comm), (comm))
DUCTILE_CUDA_FORWARD(nccl, ncclResult_t, ncclCommGetAsyncError,
                     (ncclComm_t comm, ncclResult_t* error), (comm, error))
DUCTILE_CUDA_FORWARD(nccl, ncclResult_t, ncclCommInitRank,
                     (ncclComm_t * comm, int ranks, ncclUniqueId id, int rank),
                     (comm, ranks, id, rank))
DUCTILE_CUDA_FORWARD(nccl, const char*, ncclGetErrorString, (ncclResult_t result), (result))
DUCTILE_CUDA_FORWARD(nccl, const char*, ncclGetLastError, (ncclComm_t comm), (comm))
DUCTILE_CUDA_FORWARD(nccl, ncclResult_t, ncclGetUniqueId, (ncclUniqueId * id), (id))
DUCTILE_CUDA_FORWARD(nccl, ncclResult_t, ncclGroupEnd, (), ())
DUCTILE_CUDA_FORWARD(nccl, ncclResult_t, ncclGroupStart, (), ())
DUCTILE_CUDA_FORWARD(nccl, ncclResult_t, ncclReduceScatter,
                     (const void* send, void* recv, size_t count, ncclDataType_t type,
                      ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream),
                     (send, recv, count, type, op, comm, stream))
