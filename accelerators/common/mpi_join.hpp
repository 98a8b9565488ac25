// An MPI world for processes that no MPI launcher started. `ductile agent`
// and torchrun start each worker on its own with RANK and WORLD_SIZE in its
// environment; MPI_Init then makes each of them a world of one (a
// "singleton"). With DUCTILE_MPI_JOIN=HOST:PORT set, the engine joins them
// into one communicator with Open MPI's dynamic-process calls: rank RANK = 0
// opens an MPI port (MPI_Open_port), listens on PORT, and hands the port name
// over TCP to one joiner at a time, in rank order; the processes already in
// the group accept it together (MPI_Comm_accept) and the joiner connects
// (MPI_Comm_connect). The result is ordered by RANK.
//
// Open MPI 4.1 connects separately started processes only through an
// ompi-server that all of them reach: OMPI_MCA_pmix_server_uri must name it
// (`ductile agent --mpi-world` starts one and sets both variables).
// DUCTILE_MPI_JOIN_TIMEOUT (seconds, default 300) bounds the TCP part: a
// joiner that cannot reach rank 0, or a rank 0 that does not hear from every
// joiner in time, fails instead of hanging. The MPI part is not bounded: a
// process that dies between its connect and the end of the join leaves the
// others waiting in MPI_Comm_accept, as a dead peer does in a collective
// without timeout (the agent stops such a round's workers).
//
// Called only from the engine thread, around MPI_Init_thread (mpi_lifetime.cpp).
#pragma once

#include "mpi_api.hpp"

#include <optional>
#include <string>

#include "ductile/accelerator.hpp"

namespace ductile::accel {

struct JoinRequest {
  int rank = 0, size = 1;
  std::string host;
  int port = 0;
  double timeout_seconds = 300;
  int listener = -1;  // rank 0: its listening socket (listen_for_joiners)
};

// The join this process is asked to make: nullopt when DUCTILE_MPI_JOIN is
// unset or the launch is not a torchrun-style one of more than one rank.
// False with `error` set for a malformed DUCTILE_MPI_JOIN or
// DUCTILE_MPI_JOIN_TIMEOUT, or when OMPI_MCA_pmix_server_uri is missing.
bool join_request_from_env(const LaunchInfo& launch, std::optional<JoinRequest>& request,
                           std::string& error);

// Rank 0: binds and listens on the request's port. Called before
// MPI_Init_thread, so that nothing started meanwhile (MPI's own daemons
// open ports too) can take the port the other ranks were given. False
// with `error` set when the port cannot be bound.
bool listen_for_joiners(JoinRequest& request, std::string& error);

// Collective over the `size` processes of the request: the world
// communicator, ranks ordered as RANK, errors returned as codes. On failure
// MPI_COMM_NULL with `error` set (naming the peer or the variable at fault).
// Closes the request's listener.
MPI_Comm join_world(JoinRequest& request, std::string& error);

}  // namespace ductile::accel
