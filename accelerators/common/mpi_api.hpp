// Open MPI's API as the accelerators' common library uses it: mpi.h's
// declarations and constants, with every function and predefined handle
// (MPI_COMM_WORLD, MPI_FLOAT, MPI_SUM, ...) looked up in libmpi when first
// used. The library links no MPI: libmpi is loaded (mpi_library.cpp) only
// when a process asks for an MPI world, so that a machine without Open MPI
// runs everything else, and one that asks for MPI without it gets an error
// saying what to install. Include this header, never <mpi.h>, in code of
// the common library; a call of an MPI function not listed below fails the
// link (the library is linked with --no-undefined): add it here.
#pragma once

#include <mpi.h>

#include <string>

#include "accel_export.hpp"

namespace ductile::accel {

// The address of `name` in libmpi, loading libmpi first (RTLD_GLOBAL: Open
// MPI's components resolve its symbols). Throws Error(communication) saying
// what to install when Open MPI cannot be loaded, or naming the symbol when
// the library lacks it. Thread-safe.
DUCTILE_ACCEL_API void* mpi_symbol(const char* name);

// Loads libmpi if it is not loaded yet: false with `error` set (what was
// tried, what to install) when it cannot be. Thread-safe.
DUCTILE_ACCEL_API bool load_mpi_library(std::string& error);

// MPI_Initialized and MPI_Finalized without loading libmpi: a process in
// which no libmpi is loaded has neither initialised nor finalised MPI.
DUCTILE_ACCEL_API int mpi_initialized(int* flag);
DUCTILE_ACCEL_API int mpi_finalized(int* flag);

}  // namespace ductile::accel

// A function or object of libmpi, looked up once per place of use.
#define DUCTILE_MPI_LAZY(name)                                                    \
  ([]() -> decltype(&::name) {                                                    \
    static const auto ductile_mpi_found_ =                                        \
        reinterpret_cast<decltype(&::name)>(::ductile::accel::mpi_symbol(#name)); \
    return ductile_mpi_found_;                                                    \
  }())

// Open MPI's predefined handles are addresses of objects in libmpi.
#undef OMPI_PREDEFINED_GLOBAL
#define OMPI_PREDEFINED_GLOBAL(type, global)                      \
  ([]() -> type {                                                 \
    static const auto ductile_mpi_handle_ =                       \
        static_cast<type>(::ductile::accel::mpi_symbol(#global)); \
    return ductile_mpi_handle_;                                   \
  }())

#define MPI_Initialized ::ductile::accel::mpi_initialized
#define MPI_Finalized ::ductile::accel::mpi_finalized
#define OMPI_C_MPI_COMM_NULL_COPY_FN DUCTILE_MPI_LAZY(OMPI_C_MPI_COMM_NULL_COPY_FN)
#define MPI_Allgather DUCTILE_MPI_LAZY(MPI_Allgather)
#define MPI_Close_port DUCTILE_MPI_LAZY(MPI_Close_port)
#define MPI_Comm_accept DUCTILE_MPI_LAZY(MPI_Comm_accept)
#define MPI_Comm_connect DUCTILE_MPI_LAZY(MPI_Comm_connect)
#define MPI_Comm_create_keyval DUCTILE_MPI_LAZY(MPI_Comm_create_keyval)
#define MPI_Comm_dup DUCTILE_MPI_LAZY(MPI_Comm_dup)
#define MPI_Comm_free DUCTILE_MPI_LAZY(MPI_Comm_free)
#define MPI_Comm_idup DUCTILE_MPI_LAZY(MPI_Comm_idup)
#define MPI_Comm_rank DUCTILE_MPI_LAZY(MPI_Comm_rank)
#define MPI_Comm_set_attr DUCTILE_MPI_LAZY(MPI_Comm_set_attr)
#define MPI_Comm_set_errhandler DUCTILE_MPI_LAZY(MPI_Comm_set_errhandler)
#define MPI_Comm_size DUCTILE_MPI_LAZY(MPI_Comm_size)
#define MPI_Comm_split DUCTILE_MPI_LAZY(MPI_Comm_split)
#define MPI_Error_string DUCTILE_MPI_LAZY(MPI_Error_string)
#define MPI_Finalize DUCTILE_MPI_LAZY(MPI_Finalize)
#define MPI_Get_count DUCTILE_MPI_LAZY(MPI_Get_count)
#define MPI_Iallgather DUCTILE_MPI_LAZY(MPI_Iallgather)
#define MPI_Iallreduce DUCTILE_MPI_LAZY(MPI_Iallreduce)
#define MPI_Ibarrier DUCTILE_MPI_LAZY(MPI_Ibarrier)
#define MPI_Ibcast DUCTILE_MPI_LAZY(MPI_Ibcast)
#define MPI_Improbe DUCTILE_MPI_LAZY(MPI_Improbe)
#define MPI_Imrecv DUCTILE_MPI_LAZY(MPI_Imrecv)
#define MPI_Init_thread DUCTILE_MPI_LAZY(MPI_Init_thread)
#define MPI_Intercomm_merge DUCTILE_MPI_LAZY(MPI_Intercomm_merge)
#define MPI_Ireduce_scatter_block DUCTILE_MPI_LAZY(MPI_Ireduce_scatter_block)
#define MPI_Isend DUCTILE_MPI_LAZY(MPI_Isend)
#define MPI_Op_create DUCTILE_MPI_LAZY(MPI_Op_create)
#define MPI_Op_free DUCTILE_MPI_LAZY(MPI_Op_free)
#define MPI_Open_port DUCTILE_MPI_LAZY(MPI_Open_port)
#define MPI_Query_thread DUCTILE_MPI_LAZY(MPI_Query_thread)
#define MPI_Test DUCTILE_MPI_LAZY(MPI_Test)
#define MPI_Testall DUCTILE_MPI_LAZY(MPI_Testall)
#define MPI_Wait DUCTILE_MPI_LAZY(MPI_Wait)
