// MPI's lifetime in a process that ductile's engine serves: starting MPI
// (or adopting the host's), and ending it at exit without hanging on a dead
// peer. Called only from the engine thread (see mpi_engine.hpp).
#pragma once

#include "mpi_api.hpp"

#include <string>

namespace ductile::accel {

// What the engine learns about MPI when it starts.
struct MpiProcess {
  int rank = 0, size = 1;
  // The world the engine serves: MPI_COMM_WORLD, or the communicator that
  // processes started without an MPI launcher joined (mpi_join.hpp).
  MPI_Comm world = MPI_COMM_WORLD;
  bool owns = false;            // ductile called MPI_Init_thread (and finalises)
  bool helping = false;         // threads other than the engine's may call MPI
  bool oversubscribed = false;  // more ranks on this node than cores
};

// Initialises MPI with MPI_THREAD_MULTIPLE unless the host already did (it
// must then have asked for MPI_THREAD_MULTIPLE); when ductile initialised a
// world of one in a process that DUCTILE_MPI_JOIN asks to join others, joins
// them (mpi_join.hpp). False with `error` set when MPI cannot be used.
bool start_mpi(MpiProcess& process, std::string& error);

// Ends MPI that ductile initialised. With `max_timeout` > 0, first checks
// with a barrier bounded by it that every rank reached the end (MPI_Finalize
// is a fence over every rank, and Open MPI 4.1's mpirun can deadlock when
// ranks die while others sit in it), and bounds MPI_Finalize by it too; a
// rank whose peers did not arrive exits without finalising and lets the
// launcher end the job. Every communicator and op but `world` must be freed
// already; a joined world is freed here.
void finalize_mpi(MPI_Comm world, int rank, double max_timeout);

// Says on stderr that `rank` exits without MPI_Finalize because MPI may
// not be usable (a collective in flight, timed out or failed in MPI).
void report_exit_without_finalize(int rank);

// The MPI error string of `code`.
std::string mpi_error_string(int code);

}  // namespace ductile::accel
