// MPI datatypes for ductile's DataType and the reduction ops for them:
// MPI's built-in ops, and user-defined ops that reduce fp16 and bf16 in fp32
// (MPI has no 16-bit float types; they travel as MPI_UINT16_T).
#pragma once

#include "mpi_api.hpp"

#include "ductile/accelerator.hpp"

namespace ductile::accel {

// The MPI datatype carrying `type`, a valid DataType (callers check it).
MPI_Datatype mpi_datatype(DataType type);

// The ops for every (DataType, ReduceOp). Created and freed by the engine
// while MPI is usable (create() after MPI_Init, release() before
// MPI_Finalize); get() is thread-safe once created.
class MpiReduceOps {
 public:
  void create();
  void release() noexcept;
  // `op` must be a valid ReduceOp (callers check it).
  MPI_Op get(DataType type, ReduceOp op) const;

 private:
  MPI_Op half_[2][4] = {};  // [f16, bf16][sum, prod, min, max]
};

}  // namespace ductile::accel
