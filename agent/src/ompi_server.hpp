// The ompi-server of `ductile agent --mpi-world`: Open MPI's rendezvous for
// processes that connect without a common mpirun (MPI_Comm_connect/accept
// between workers that each started MPI alone; see
// accelerators/common/mpi_join.hpp). Every agent of such a job runs one; the
// leader publishes its address in the round record.
//
// The server is a child process that dies with the agent
// (PR_SET_PDEATHSIG), so it outlives no agent, even one killed with
// SIGKILL; the destructor stops it (SIGTERM, then SIGKILL) and reaps it.
//
// Threading: construct before the agent starts other threads (it forks).
// Errors: the constructor throws ductile::Error (config) naming the program
// when it cannot be started or does not report its address within `limit`.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <string>

namespace ductile::agent {

class OmpiServer {
 public:
  explicit OmpiServer(std::chrono::milliseconds limit = std::chrono::seconds(30),
                      std::string program = "ompi-server");
  ~OmpiServer();
  OmpiServer(const OmpiServer&) = delete;
  OmpiServer& operator=(const OmpiServer&) = delete;

  // The server's address, as OMPI_MCA_pmix_server_uri takes it.
  const std::string& uri() const { return uri_; }

 private:
  void stop() noexcept;  // the server stopped and reaped, its directory removed

  std::filesystem::path dir_;
  pid_t pid_ = -1;
  std::string uri_;
};

}  // namespace ductile::agent
