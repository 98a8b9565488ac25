// Loads Open MPI's libmpi when a process first asks for an MPI world
// (mpi_api.hpp says why the library links none).
#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "ductile/error.hpp"
#include "mpi_api.hpp"

namespace ductile::accel {
namespace {

// Open MPI 3.0 to 5.x; the headers this library was compiled with are Open
// MPI's, whose handles are objects of the library (MPICH's are integers of
// another ABI, so its libmpi.so.12 cannot stand in).
constexpr const char* kDefaultLibrary = "libmpi.so.40";

std::mutex g_mutex;
void* g_handle = nullptr;
std::string g_error;

std::string wanted_library() {
  const char* chosen = std::getenv("DUCTILE_MPI_LIBRARY");
  return chosen != nullptr && *chosen != '\0' ? chosen : kDefaultLibrary;
}

// The library already in the process (the host program's, mpi4py's) or the
// one the loader finds; RTLD_GLOBAL because Open MPI's components, loaded
// with dlopen at MPI_Init, resolve libmpi's symbols through the global scope.
void* load_locked(std::string& error) {
  if (g_handle != nullptr) return g_handle;
  if (!g_error.empty()) {
    error = g_error;
    return nullptr;
  }
  std::string library = wanted_library();
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_GLOBAL | RTLD_NODELETE);
  if (handle == nullptr) {
    const char* why = dlerror();
    g_error =
        "an MPI world was asked for ([accelerator] communicator = \"mpi\", or \"auto\" "
        "under an MPI launcher such as mpirun) but Open MPI's library " +
        library + " could not be loaded (" + (why != nullptr ? why : "no reason given") +
        "; looked in the loader's path: LD_LIBRARY_PATH, the ld.so cache, /lib and "
        "/usr/lib). Install Open MPI 4.1 or later (Debian/Ubuntu: apt-get install "
        "openmpi-bin libopenmpi3; conda: conda install -c conda-forge openmpi), or set "
        "DUCTILE_MPI_LIBRARY to the path of its libmpi.so.40. Jobs without MPI need none: "
        "communicator = \"local\" for one process, and ductile.torch.zero3 under torchrun "
        "uses torch.distributed's process group";
    error = g_error;
    return nullptr;
  }
  g_handle = handle;
  return g_handle;
}

// libmpi when it is in the process already, without loading it.
void* loaded_library() {
  std::lock_guard lock(g_mutex);
  if (g_handle != nullptr) return g_handle;
  std::string library = wanted_library();
  return dlopen(library.c_str(), RTLD_NOW | RTLD_NOLOAD);
}

using FlagQuery = int (*)(int*);

int query_if_loaded(const char* name, int* flag) {
  void* handle = loaded_library();
  if (handle == nullptr) {
    *flag = 0;
    return MPI_SUCCESS;
  }
  auto query = reinterpret_cast<FlagQuery>(dlsym(handle, name));
  if (query == nullptr) throw Error(ErrorKind::unsupported, "libmpi has no " + std::string(name));
  return query(flag);
}

}  // namespace

bool load_mpi_library(std::string& error) {
  std::lock_guard lock(g_mutex);
  return load_locked(error) != nullptr;
}

void* mpi_symbol(const char* name) {
  void* handle = nullptr;
  std::string error;
  {
    std::lock_guard lock(g_mutex);
    handle = load_locked(error);
  }
  if (handle == nullptr) throw Error(ErrorKind::unsupported, error);
  void* found = dlsym(handle, name);
  if (found == nullptr)
    throw Error(ErrorKind::unsupported, "Open MPI's library " + wanted_library() +
                                            " has no symbol " + name +
                                            ": ductile needs Open MPI 4.1 or later");
  return found;
}

int mpi_initialized(int* flag) {
  return query_if_loaded("MPI_Initialized", flag);
}

int mpi_finalized(int* flag) {
  return query_if_loaded("MPI_Finalized", flag);
}

}  // namespace ductile::accel
