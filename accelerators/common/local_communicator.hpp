// The single-process world (rank 0 of 1, no MPI at all), used when a program
// runs without a launcher. (With MPI: MpiCommunicator, mpi_communicator.hpp.)
#pragma once

#include <memory>

#include "ductile/accelerator.hpp"

namespace ductile::accel {

// Collectives copy send to recv where they differ, on the stream (a
// HostStream), in order.
std::shared_ptr<Communicator> make_local_communicator();

}  // namespace ductile::accel
