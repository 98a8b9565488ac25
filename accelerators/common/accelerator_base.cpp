#include "accelerator_base.hpp"

#include "mpi_api.hpp"

#include "argument_checks.hpp"
#include "bootstrap.hpp"
#include "local_communicator.hpp"

namespace ductile::accel {

CommMode choose_comm_mode(std::string_view setting, std::string_view key) {
  LaunchInfo launch = detect_launch();
  if (setting == "mpi") return CommMode::mpi;
  if (setting == "host") return CommMode::host;
  if (setting == "local") {
    if (launch.size > 1)
      throw Error(ErrorKind::config,
                  std::string(key) +
                      " = \"local\" gives a single-process world, but the launcher (" +
                      launch.source + ") started " + std::to_string(launch.size) +
                      " ranks; use \"auto\" or \"mpi\"");
    return CommMode::local;
  }
  if (setting != "auto")
    throw Error(ErrorKind::config,
                std::string(key) + " = \"" + std::string(setting) +
                    "\" is not valid; expected \"auto\", \"mpi\", \"local\" or \"host\"");
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized || launch.from_launcher()) return CommMode::mpi;
  return CommMode::local;
}

AcceleratorBase::AcceleratorBase(const HostContext& context, std::string backend,
                                 std::string host_label, int exchange_max_ranks)
    : backend_(std::move(backend)),
      host_label_(std::move(host_label)),
      logger_(context.logger()),
      mode_(choose_comm_mode(context.params().get_string("communicator"),
                             "[accelerator] communicator")),
      auto_mode_(context.params().get_string("communicator") == "auto"),
      timeout_(context.params().get_double("timeout")),
      exchange_max_ranks_(exchange_max_ranks) {}

void* AcceleratorBase::allocate(std::size_t bytes, MemoryKind kind) {
  check_memory_kind(kind, "allocate");
  return do_allocate(bytes, kind);
}

DeviceInfo AcceleratorBase::device_info(int device) const {
  check_device(device, device_count(), backend_, "device_info");
  return do_device_info(device);
}

void AcceleratorBase::copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                                 Stream& stream) {
  const char* call = "copy_async";
  check_copy_kind(kind, call);
  check_buffer(dst, bytes, "dst", call);
  check_buffer(src, bytes, "src", call);
  do_copy_async(dst, src, bytes, kind, stream);
}

void AcceleratorBase::memset_async(void* dst, int value, std::size_t bytes, Stream& stream) {
  check_buffer(dst, bytes, "dst", "memset_async");
  do_memset_async(dst, value, bytes, stream);
}

int AcceleratorBase::choose_device(const HostContext& context, int count,
                                   std::string_view backend) {
  std::int64_t wanted = context.params().get_int("device");
  if (wanted >= count)
    throw Error(ErrorKind::config, "[accelerator] device = " + std::to_string(wanted) +
                                       " but only " + std::to_string(count) + " " +
                                       std::string(backend) + " device(s) exist (0.." +
                                       std::to_string(count - 1) + ")");
  return wanted >= 0 ? static_cast<int>(wanted) : detect_launch().local_rank % count;
}

std::shared_ptr<Communicator> AcceleratorBase::host_world_locked() {
  if (!host_world_) {
    if (mode_ == CommMode::host)
      throw Error(ErrorKind::config,
                  "[accelerator] communicator = \"host\": the embedding program supplies the "
                  "world communicator, and none was offered (ductile.torch.zero3 offers "
                  "torch.distributed's process group once torch.distributed.init_process_group() "
                  "has run); or use \"auto\", \"mpi\" or \"local\"");
    if (mode_ == CommMode::mpi) {
      auto mpi = std::make_shared<MpiCommunicator>(host_label_, timeout_, exchange_max_ranks_);
      LaunchInfo launch = detect_launch();
      if (launch.from_launcher() && launch.size != mpi->size())
        throw Error(ErrorKind::communication,
                    "the launcher (" + launch.source + ") started " + std::to_string(launch.size) +
                        " ranks but MPI sees " + std::to_string(mpi->size()) +
                        ": start the job with an MPI launcher such as mpirun, or let the "
                        "processes join one world (DUCTILE_MPI_JOIN, as `ductile agent "
                        "--mpi-world` does)");
      host_world_ = std::move(mpi);
    } else {
      host_world_ = make_local_communicator();
    }
    logger_->debug("{} accelerator: host world rank {} of {}", backend_, host_world_->rank(),
                   host_world_->size());
  }
  return host_world_;
}

std::shared_ptr<Bootstrap> AcceleratorBase::bootstrap_locked() {
  if (!bootstrap_)
    bootstrap_ = std::make_shared<CommunicatorBootstrap>(host_world_locked(), backend_);
  return bootstrap_;
}

std::shared_ptr<Communicator> AcceleratorBase::world() {
  std::lock_guard lock(mutex_);
  if (!world_) world_ = offered_ ? host_world_ : make_world();
  return world_;
}

bool AcceleratorBase::offer_world(std::shared_ptr<Communicator> world) {
  if (!world) throw Error(ErrorKind::invalid_argument, "offer_world: a null communicator");
  std::lock_guard lock(mutex_);
  if (mode_ != CommMode::host && !auto_mode_) return false;
  if (world_ || host_world_)
    throw Error(ErrorKind::incompatible,
                "offer_world: the " + backend_ +
                    " accelerator's world communicator is made already; offer the host's "
                    "before the first world() or bootstrap()");
  host_world_ = std::move(world);
  offered_ = true;
  mode_ = CommMode::host;
  logger_->debug("{} accelerator: the host's world communicator, rank {} of {}", backend_,
                 host_world_->rank(), host_world_->size());
  return true;
}

std::shared_ptr<Bootstrap> AcceleratorBase::bootstrap() {
  std::lock_guard lock(mutex_);
  return bootstrap_locked();
}

}  // namespace ductile::accel
