// The base of every backend's Accelerator: the set-up they share and the
// argument checks of the memory and copy calls.
//
// Set-up: the `communicator` ("auto", "mpi", "local", "host") and `timeout`
// keys every backend's schema has, and the host world made from them: the
// communicator the embedding program offered (HostWorld, with "host" or
// "auto"), an MpiCommunicator over the process's one MPI engine (refused
// when the launcher started another number of ranks than MPI sees) or the
// local communicator. bootstrap() runs over the host world; world() is the
// backend's own communicator (make_world(); by default the host world), or
// the offered one itself.
//
// Checks: allocate, device_info, copy_async and memset_async check their
// arguments (memory and copy kinds, device numbers, null buffers) and then
// call the backend's do_* hook.
//
// Threading: world(), bootstrap() and make_world() are serialised by one
// mutex; the rest follows the Accelerator interface.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "accel_export.hpp"
#include "ductile/accelerator.hpp"
#include "mpi_communicator.hpp"

namespace ductile::accel {

// The values of the `communicator` key, for the backends' schemas.
inline constexpr const char* kCommunicatorModes[] = {"auto", "mpi", "local", "host", nullptr};

// How a backend's world communicator is made (the `communicator` key).
// `host`: the embedding program supplies it (HostWorld::offer_world).
enum class CommMode { local, mpi, host };

// "auto": MPI when MPI is already initialised or a launcher started the
// process (see detect_launch()), else local (a communicator the host offers
// before world() replaces either). "mpi" / "local" force it; a local world
// under a launcher with more than one rank is refused. "host": the host's.
// Throws Error(config) naming `key` for an unknown value or that conflict.
DUCTILE_ACCEL_API CommMode choose_comm_mode(std::string_view setting, std::string_view key);

class DUCTILE_ACCEL_API AcceleratorBase : public Accelerator, public HostWorld {
 public:
  std::string_view backend() const final { return backend_; }

  void* allocate(std::size_t bytes, MemoryKind kind) final;
  DeviceInfo device_info(int device) const final;
  void copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                  Stream& stream) final;
  void memset_async(void* dst, int value, std::size_t bytes, Stream& stream) final;

  // Created on first call (collective: every rank calls it). With a host
  // world (offer_world), that communicator itself.
  std::shared_ptr<Communicator> world() final;
  std::shared_ptr<Bootstrap> bootstrap() final;
  bool offer_world(std::shared_ptr<Communicator> world) final;

 protected:
  // Reads `communicator` and `timeout` from the context's parameters
  // (Error(config) for a mode the launcher contradicts). `host_label` names
  // the host world in collective error messages. `exchange_max_ranks`: see
  // MpiCommunicator.
  AcceleratorBase(const HostContext& context, std::string backend, std::string host_label,
                  int exchange_max_ranks = MpiCommunicator::kDefaultExchangeMaxRanks);

  // Called with checked arguments only.
  virtual void* do_allocate(std::size_t bytes, MemoryKind kind) = 0;
  virtual DeviceInfo do_device_info(int device) const = 0;
  virtual void do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                             Stream& stream) = 0;
  virtual void do_memset_async(void* dst, int value, std::size_t bytes, Stream& stream) = 0;
  // The backend's world communicator, made once under the set-up mutex; it
  // may use host_world_locked() and bootstrap_locked().
  virtual std::shared_ptr<Communicator> make_world() { return host_world_locked(); }

  // The device this rank uses among `count`: the `device` key of the
  // context's parameters when set (>= 0; Error(config) when not below
  // `count`), else the launcher's local rank modulo `count`.
  static int choose_device(const HostContext& context, int count, std::string_view backend);

  std::shared_ptr<Communicator> host_world_locked();
  std::shared_ptr<Bootstrap> bootstrap_locked();

  const std::shared_ptr<spdlog::logger>& logger() const noexcept { return logger_; }
  CommMode mode() const noexcept { return mode_; }
  double timeout() const noexcept { return timeout_; }

 private:
  std::string backend_;
  std::string host_label_;
  std::shared_ptr<spdlog::logger> logger_;
  CommMode mode_;
  bool auto_mode_;  // `communicator = "auto"`: an offered host world replaces mode_
  double timeout_;
  int exchange_max_ranks_;
  std::mutex mutex_;
  std::shared_ptr<Communicator> host_world_;
  bool offered_ = false;  // host_world_ is the host's (offer_world)
  std::shared_ptr<Bootstrap> bootstrap_;
  std::shared_ptr<Communicator> world_;
};

}  // namespace ductile::accel
