#include "mpi_lifetime.hpp"

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <thread>

#include "mpi_join.hpp"

namespace ductile::accel {

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

bool start_mpi(MpiProcess& process, std::string& error) {
  if (!load_mpi_library(error)) return false;
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) {
    error = "MPI has already been finalized in this process";
    return false;
  }
  int provided = MPI_THREAD_SINGLE;
  // Also set below for the host-initialised case, which requires MULTIPLE.
  if (initialized) {
    MPI_Query_thread(&provided);
    if (provided != MPI_THREAD_MULTIPLE) {
      error =
          "MPI was initialised by the program with a thread level below MPI_THREAD_MULTIPLE; "
          "ductile's communicators make MPI calls from their own thread: initialise MPI with "
          "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or let ductile initialise it";
      return false;
    }
  }
  // A process that DUCTILE_MPI_JOIN asks to join others: read the request
  // (and bind rank 0's port) before MPI starts its own daemons.
  std::optional<JoinRequest> join;
  if (!initialized) {
    try {
      if (!join_request_from_env(detect_launch(), join, error)) return false;
    } catch (const Error& e) {
      error = e.what();
      return false;
    }
    if (join && join->rank == 0 && !listen_for_joiners(*join, error)) return false;
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) {
      if (join && join->listener >= 0) close(join->listener);
      error = "MPI_Init_thread failed: " + mpi_error_string(rc);
      return false;
    }
    process.owns = true;
  }
  // Calls are serialised by the engine's progress lock, so SERIALIZED is
  // enough for waiting threads to progress; below it only the engine thread
  // calls MPI.
  process.helping = provided >= MPI_THREAD_SERIALIZED;
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE"}) {
    const char* text = std::getenv(name);
    if (text != nullptr && *text != '\0') {
      unsigned cores = std::thread::hardware_concurrency();
      process.oversubscribed = cores > 0 && std::strtoul(text, nullptr, 10) > cores;
      break;
    }
  }
  MPI_Comm_size(MPI_COMM_WORLD, &process.size);
  if (join && process.size == 1) {
    process.world = join_world(*join, error);
    if (process.world == MPI_COMM_NULL) return false;
  } else if (join && join->listener >= 0) {
    close(join->listener);  // MPI's launcher made the world after all
  }
  MPI_Comm_rank(process.world, &process.rank);
  MPI_Comm_size(process.world, &process.size);
  return true;
}

void report_exit_without_finalize(int rank) {
  std::fprintf(stderr,
               "ductile: rank %d exits without MPI_Finalize because a collective was still in "
               "flight, timed out or failed in MPI (a peer may be gone); the launcher will end "
               "the job\n",
               rank);
}

void finalize_mpi(MPI_Comm world, int rank, double max_timeout) {
  // MPI_Finalize waits for every rank (a PMIx fence). A rank that leaves
  // mid-run (exit() between collectives) would wait there for peers that
  // are stuck waiting for it, and Open MPI 4.1's mpirun can deadlock when
  // ranks die while others sit in that fence. So first check, with a barrier
  // bounded by the timeout, that every rank has reached the end; if not, exit
  // without finalising and let the launcher end the job.
  if (max_timeout > 0) {
    MPI_Request request = MPI_REQUEST_NULL;
    bool all_arrived = false;
    if (MPI_Ibarrier(world, &request) == MPI_SUCCESS) {
      auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                         std::chrono::duration<double>(max_timeout));
      while (Clock::now() < deadline) {
        int flag = 0;
        if (MPI_Test(&request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
        if (flag) {
          all_arrived = true;
          break;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    if (!all_arrived) {
      std::fprintf(stderr,
                   "ductile: rank %d: not every rank reached the end of the job within %.0f s "
                   "(a peer has failed or is stuck); exiting without MPI_Finalize, the launcher "
                   "will end the job\n",
                   rank, max_timeout);
      std::fflush(stderr);
      return;
    }
  }
  if (world != MPI_COMM_WORLD) MPI_Comm_free(&world);
  // Bounded like a collective too, in case a peer dies in between.
  std::mutex watchdog_mutex;
  std::condition_variable watchdog_cv;
  bool finished = false;
  std::thread watchdog;
  if (max_timeout > 0) {
    watchdog = std::thread([&, timeout = max_timeout, rank] {
      std::unique_lock lock(watchdog_mutex);
      if (!watchdog_cv.wait_for(lock, std::chrono::duration<double>(timeout),
                                [&] { return finished; })) {
        std::fprintf(stderr,
                     "ductile: rank %d: MPI_Finalize did not complete within %.0f s (a peer has "
                     "failed or exited); exiting with status 1\n",
                     rank, timeout);
        std::fflush(stderr);
        _exit(1);
      }
    });
  }
  MPI_Finalize();
  if (watchdog.joinable()) {
    {
      std::lock_guard lock(watchdog_mutex);
      finished = true;
    }
    watchdog_cv.notify_all();
    watchdog.join();
  }
}

}  // namespace ductile::accel
