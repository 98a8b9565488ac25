#include "mpi_reduce_ops.hpp"

#include <cstddef>

#include "half.hpp"

namespace ductile::accel {

MPI_Datatype mpi_datatype(DataType type) {
  // Indexed by DataType (checked by CheckedCommunicator before a collective
  // gets here); 16-bit floats travel as their bits.
  static const MPI_Datatype kTypes[] = {MPI_FLOAT,   MPI_DOUBLE,  MPI_UINT16_T, MPI_UINT16_T,
                                        MPI_INT32_T, MPI_INT64_T, MPI_UINT8_T};
  return kTypes[static_cast<std::size_t>(type)];
}

namespace {

// MPI user functions reducing 16-bit floats in fp32.
template <DataType Type, ReduceOp Op>
void reduce_16bit(void* in, void* inout, int* length, MPI_Datatype*) {
  reduce_into(in, inout, static_cast<std::size_t>(*length), Type, Op);
}

}  // namespace

void MpiReduceOps::create() {
  MPI_Op_create(&reduce_16bit<DataType::f16, ReduceOp::sum>, 1, &half_[0][0]);
  MPI_Op_create(&reduce_16bit<DataType::f16, ReduceOp::prod>, 1, &half_[0][1]);
  MPI_Op_create(&reduce_16bit<DataType::f16, ReduceOp::min>, 1, &half_[0][2]);
  MPI_Op_create(&reduce_16bit<DataType::f16, ReduceOp::max>, 1, &half_[0][3]);
  MPI_Op_create(&reduce_16bit<DataType::bf16, ReduceOp::sum>, 1, &half_[1][0]);
  MPI_Op_create(&reduce_16bit<DataType::bf16, ReduceOp::prod>, 1, &half_[1][1]);
  MPI_Op_create(&reduce_16bit<DataType::bf16, ReduceOp::min>, 1, &half_[1][2]);
  MPI_Op_create(&reduce_16bit<DataType::bf16, ReduceOp::max>, 1, &half_[1][3]);
}

void MpiReduceOps::release() noexcept {
  for (auto& row : half_)
    for (MPI_Op& op : row)
      if (op != MPI_OP_NULL) MPI_Op_free(&op);
}

MPI_Op MpiReduceOps::get(DataType type, ReduceOp op) const {
  // `op` was checked by CheckedCommunicator before a collective got here.
  const auto index = static_cast<std::size_t>(op);
  if (type == DataType::f16) return half_[0][index];
  if (type == DataType::bf16) return half_[1][index];
  static const MPI_Op kBuiltin[] = {MPI_SUM, MPI_PROD, MPI_MIN, MPI_MAX};
  return kBuiltin[index];
}

}  // namespace ductile::accel
