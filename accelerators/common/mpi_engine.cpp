// The engine: its thread, the submission path and the progress loop. MPI's
// lifetime is in mpi_lifetime.cpp, the communicator table in
// mpi_comm_table.cpp, one operation's progress in mpi_operation.cpp and the
// reduction ops in mpi_reduce_ops.cpp.
#include "mpi_engine.hpp"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "library_pin.hpp"
#include "mpi_comm_table.hpp"
#include "mpi_lifetime.hpp"
#include "mpi_operation.hpp"
#include "mpi_reduce_ops.hpp"

namespace ductile::accel {
namespace {

using Clock = MpiClock;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Engine final : public MpiEngine {
 public:
  Engine() = default;

  void start();  // blocks until MPI is ready; throws on failure
  void shutdown() noexcept;

  int world_rank() const noexcept override { return process_.rank; }
  int world_size() const noexcept override { return process_.size; }
  bool owns_mpi() const noexcept override { return process_.owns; }
  int create_comm(double timeout_seconds) override;
  void release_comm(int comm) noexcept override;
  std::uint64_t next_sequence(int comm) override;
  void submit(int comm, std::uint64_t sequence, std::string what, MpiStart start,
              std::shared_ptr<Completion> done) override;
  void skip(int comm, std::uint64_t sequence) override;
  MPI_Op reduce_op(DataType type, ReduceOp op) const override { return ops_.get(type, op); }
  void wait_helping(Completion& done) override;

  static int on_self_delete(MPI_Comm, int, void*, void*);

 private:
  void run();
  bool initialize();
  // One round of progress: posts what is ready, tests what is in flight.
  // Caller holds progress_mutex_. Returns true if anything completed.
  bool progress_locked();
  void post_ready(std::vector<ActiveOp>& active);
  bool poll(std::vector<ActiveOp>& active);
  void fail_everything(std::vector<ActiveOp>& active, const std::string& why);
  void finalize_owned(bool mpi_usable);

  std::mutex mutex_;
  std::condition_variable cv_;
  MpiCommTable comms_;  // guarded by mutex_
  // Something was submitted, skipped or released. Written under mutex_;
  // read without it to skip an empty post_ready().
  std::atomic<bool> work_{false};
  bool stopping_ = false;
  std::atomic<bool> stop_requested_{false};  // mirrors stopping_ for lock-free checks
  std::atomic<bool> hot_{false};             // the engine thread is polling, not parked
  std::atomic<bool> stopped_{false};         // MPI may no longer be called

  // Every MPI call after initialisation is made by the holder of this
  // mutex: the engine thread, or a thread blocked in wait_helping() (which
  // then progresses like MPI_Wait would, without a thread hand-off).
  std::mutex progress_mutex_;
  std::vector<ActiveOp> active_;
  // Sources an earlier operation of the current poll() waits for.
  BlockedSources blocked_sources_;
  std::atomic<int> active_count_{0};
  std::atomic<int> waiters_{0};
  // A collective timed out or MPI reported an error: a peer may have died,
  // and MPI_Finalize (a fence over every rank) could then wait forever.
  // Sticky for the process, so that the decision at exit depends on what
  // happened, not on which communicators are still in the table. Guarded by
  // progress_mutex_.
  bool peer_may_be_lost_ = false;

  std::thread thread_;
  std::thread::id thread_id_;
  bool ready_ = false;
  std::string init_error_;
  MpiProcess process_;
  std::string where_ = " (rank 0 of 1)";  // ends error messages
  MpiReduceOps ops_;
};

std::mutex g_engine_mutex;
Engine* g_engine = nullptr;  // never deleted: objects may outlive exit handlers

void engine_at_exit() {
  if (g_engine != nullptr) g_engine->shutdown();
}

bool Engine::initialize() {
  if (!start_mpi(process_, init_error_)) return false;
  where_ = " (rank " + std::to_string(process_.rank) + " of " + std::to_string(process_.size) + ")";
  // Learn about MPI_Finalize before it tears MPI down (host-owned case).
  int keyval = MPI_KEYVAL_INVALID;
  if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &Engine::on_self_delete, &keyval, nullptr) ==
      MPI_SUCCESS)
    MPI_Comm_set_attr(MPI_COMM_SELF, keyval, this);
  ops_.create();
  comms_.add_world(process_.world);
  return true;
}

int Engine::on_self_delete(MPI_Comm, int, void* value, void*) {
  auto* engine = static_cast<Engine*>(value);
  // When ductile finalises, this runs on the engine thread itself.
  if (std::this_thread::get_id() != engine->thread_id_) engine->shutdown();
  return MPI_SUCCESS;
}

void Engine::start() {
  std::unique_lock lock(mutex_);
  thread_ = std::thread([this] { run(); });
  cv_.wait(lock, [&] { return ready_ || !init_error_.empty(); });
  if (!ready_) {
    lock.unlock();
    thread_.join();
    throw Error(ErrorKind::communication, "cannot start MPI: " + init_error_);
  }
}

void Engine::shutdown() noexcept {
  {
    std::lock_guard lock(mutex_);
    if (stopping_ || !thread_.joinable()) return;
    stopping_ = true;
    stop_requested_.store(true);
  }
  cv_.notify_all();
  if (std::this_thread::get_id() != thread_.get_id()) thread_.join();
}

int Engine::create_comm(double timeout_seconds) {
  auto created = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
  int id;
  {
    std::lock_guard lock(mutex_);
    if (stopping_) throw Error(ErrorKind::communication, "MPI is shutting down" + where_);
    id = comms_.add(timeout_seconds);
  }
  auto done = std::make_shared<Completion>();
  submit(
      MpiCommTable::kWorld, next_sequence(MpiCommTable::kWorld),
      "creating a communicator (MPI_Comm_idup)",
      [created](MPI_Comm world, MpiPosting& posting) {
        return MPI_Comm_idup(world, created.get(),
                             &posting.requests.emplace_back(MPI_REQUEST_NULL));
      },
      done);
  try {
    wait_helping(*done);
  } catch (...) {
    release_comm(id);
    throw;
  }
  {
    // Errors on ductile's communicators come back as codes (and become
    // ductile::Error) instead of aborting the job.
    std::lock_guard progress(progress_mutex_);
    MPI_Comm_set_errhandler(*created, MPI_ERRORS_RETURN);
  }
  {
    std::lock_guard lock(mutex_);
    comms_.set_comm(id, *created);
  }
  return id;
}

void Engine::release_comm(int comm) noexcept {
  {
    std::lock_guard lock(mutex_);
    if (!comms_.release(comm)) return;
    work_ = true;
  }
  cv_.notify_all();
}

std::uint64_t Engine::next_sequence(int comm) {
  std::lock_guard lock(mutex_);
  return comms_.next_sequence(comm);
}

void Engine::submit(int comm, std::uint64_t sequence, std::string what, MpiStart start,
                    std::shared_ptr<Completion> done) {
  {
    std::lock_guard lock(mutex_);
    if (stopped_.load() || !comms_.contains(comm)) {
      done->fail(what + " failed: MPI has been shut down" + where_);
      return;
    }
    comms_.enqueue(comm, sequence, PendingOp{std::move(what), std::move(start), std::move(done)});
    work_ = true;
  }
  // Post from this thread when nobody else is in MPI: the peers can start
  // at once, without waiting for the engine thread to wake up. Only posted
  // here: local work and completion are left to the engine thread or a
  // waiting caller.
  if (process_.helping && progress_mutex_.try_lock()) {
    if (!stopped_.load()) {
      post_ready(active_);
      active_count_.store(static_cast<int>(active_.size()));
    }
    progress_mutex_.unlock();
  }
  // A polling engine thread sees the work itself; waking one is a system
  // call and may cost this thread its core.
  if (!hot_.load()) {
    // active_count_ changed outside mutex_: pass through it, so that the
    // engine thread is either before its check (and sees the new state) or
    // already waiting (and gets the notification).
    { std::lock_guard lock(mutex_); }
    cv_.notify_all();
  }
}

void Engine::skip(int comm, std::uint64_t sequence) {
  {
    std::lock_guard lock(mutex_);
    PendingOp op;
    op.skipped = true;
    if (!comms_.enqueue(comm, sequence, std::move(op))) return;
    work_ = true;
  }
  cv_.notify_all();
}

void Engine::post_ready(std::vector<ActiveOp>& active) {
  if (!work_.load()) return;
  std::vector<ReadyOp> ready;
  {
    std::lock_guard lock(mutex_);
    work_ = false;
    comms_.take_ready(ready);
  }
  for (ReadyOp& item : ready) {
    ActiveOp op;
    op.comm = item.comm;
    op.what = std::move(item.op.what);
    op.done = std::move(item.op.done);
    op.deadline = item.timeout > 0 ? Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                        std::chrono::duration<double>(item.timeout))
                                   : Clock::time_point::max();
    int rc = item.op.start(item.mpi_comm, op.posting);
    op.statuses.resize(op.posting.requests.size());
    if (rc != MPI_SUCCESS) {
      std::string message = op.what + " failed" + where_ + ": " + mpi_error_string(rc);
      peer_may_be_lost_ = true;
      op.done->fail(message);
      std::lock_guard lock(mutex_);
      comms_.finished(item.comm, message);
      continue;
    }
    active.push_back(std::move(op));
  }
}

bool Engine::poll(std::vector<ActiveOp>& active) {
  bool progressed = false;
  auto now = Clock::now();
  blocked_sources_.clear();
  for (std::size_t i = 0; i < active.size();) {
    ActiveOp& op = active[i];
    OpStep step = advance(op, now, blocked_sources_, where_);
    if (step.peer_may_be_lost) peer_may_be_lost_ = true;
    if (step.finished) {
      {
        std::lock_guard lock(mutex_);
        comms_.finished(op.comm, step.failure);
      }
      if (step.failure.empty()) {
        op.done->complete();
      } else {
        op.done->fail(step.failure);
      }
      active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
      progressed = true;
    } else {
      ++i;
    }
  }
  return progressed;
}

void Engine::fail_everything(std::vector<ActiveOp>& active, const std::string& why) {
  std::lock_guard lock(mutex_);
  for (ActiveOp& op : active) {
    op.done->fail(op.what + " failed: " + why + where_);
    comms_.finished(op.comm, why);
  }
  active.clear();
  comms_.fail_waiting(why, where_);
  stopped_.store(true);
  active_count_.store(0);
}

void Engine::finalize_owned(bool mpi_usable) {
  if (!mpi_usable) {
    report_exit_without_finalize(process_.rank);
    return;
  }
  double max_timeout;
  {
    std::lock_guard lock(mutex_);
    max_timeout = comms_.max_timeout();
    comms_.free_all();
  }
  ops_.release();
  finalize_mpi(process_.world, process_.rank, max_timeout);
}

bool Engine::progress_locked() {
  if (stopped_.load()) return false;
  post_ready(active_);
  bool progressed = !active_.empty() && poll(active_);
  active_count_.store(static_cast<int>(active_.size()));
  return progressed;
}

void Engine::wait_helping(Completion& done) {
  if (!process_.helping || std::this_thread::get_id() == thread_id_) return done.wait();
  waiters_.fetch_add(1);
  // Busy polling like MPI_Wait: yielding on a loaded machine hands the core
  // to other processes for a whole time slice. After a while (a long
  // transfer, or a peer that is late) yield now and then; when ranks
  // oversubscribe the cores, yield at every poll so the peers get to run.
  // When the engine thread holds the progress lock (it is inside an MPI
  // call, perhaps a long copy, and parks once that returns), yield: it
  // may share this core, and spinning would only delay it.
  long polls = 0;
  while (!done.done()) {
    bool progressing = progress_mutex_.try_lock();
    if (progressing) {
      progress_locked();
      progress_mutex_.unlock();
    }
    if (done.done() || stopped_.load()) break;
    ++polls;
    if (!progressing || process_.oversubscribed || (polls > 20000 && polls % 256 == 0)) {
      std::this_thread::yield();
    } else {
      cpu_relax();
    }
  }
  // The engine thread parks while a thread waits; wake it if work is left.
  {
    std::lock_guard lock(mutex_);
    waiters_.fetch_sub(1);
  }
  if (active_count_.load() > 0 || work_.load()) cv_.notify_all();
  done.wait();  // blocks only if shutting down; rethrows a failure
}

void Engine::run() {
  thread_id_ = std::this_thread::get_id();
  // Precise short sleeps while polling; a name for top/gdb.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  prctl(PR_SET_NAME, "ductile-mpi", 0, 0, 0);
  // Being woken (work posted) must not preempt the thread that posted it:
  // that thread is about to compute or block, and on a shared core an
  // immediate switch would run the transfer before the computation
  // instead of beside it. SCHED_BATCH keeps a fair share but no wake-up
  // preemption; failure only costs overlap.
  sched_param batch{};
  batch.sched_priority = 0;
  sched_setscheduler(0, SCHED_BATCH, &batch);
  // SIGPIPE blocked here, and so in the threads MPI_Init starts from here:
  // in a joined world (mpi_join.hpp) a rank that finalises first closes
  // sockets Open MPI's threads in the others still write to during their
  // MPI_Finalize; that must be an EPIPE for MPI, not a signal that kills
  // the process. The application's own threads keep their disposition.
  sigset_t pipe_signal;
  sigemptyset(&pipe_signal);
  sigaddset(&pipe_signal, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
  bool ok = initialize();
  {
    std::lock_guard lock(mutex_);
    if (ok) {
      ready_ = true;
    } else if (init_error_.empty()) {
      init_error_ = "unknown failure";
    }
  }
  cv_.notify_all();
  if (!ok) return;

  // While a collective is in flight and no thread waits for it, poll
  // continuously: a transfer advances only inside MPI calls, and a caller
  // that computes elsewhere (a GPU, another core) or blocks expects it to
  // finish meanwhile. Between polls the thread yields, so that a thread
  // woken on its core (the caller, a peer) gets to run at once. Only when
  // nothing has completed for a while (a late peer) does it sleep between
  // polls, so that it does not hold a core indefinitely.
  using namespace std::chrono_literals;
  Clock::time_point last_event = Clock::now();
  hot_.store(true);
  for (;;) {
    if (waiters_.load() > 0 || (active_count_.load() == 0 && !work_.load())) {
      std::unique_lock lock(mutex_);
      hot_.store(false);
      cv_.wait(lock, [&] {
        return stopping_ || (waiters_.load() == 0 && (work_.load() || active_count_.load() > 0));
      });
      hot_.store(true);
      if (stopping_) break;
      last_event = Clock::now();
    } else if (stop_requested_.load()) {
      break;
    }
    bool progressed;
    {
      std::lock_guard progress(progress_mutex_);
      progressed = progress_locked();
    }
    if (progressed) {
      last_event = Clock::now();
    } else if (active_count_.load() > 0) {
      if (Clock::now() - last_event < 20ms) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(50us);
      }
    }
  }
  hot_.store(false);

  // Whether MPI_Finalize is safe is decided from what happened, never from
  // the communicator table: a released communicator stays in comms_ until
  // the next progress round, which the exit may or may not come after. A
  // collective that failed because the ranks disagreed (the size check)
  // proves the peers alive; then the bounded barrier in finalize_owned()
  // decides whether every rank reached the end.
  std::lock_guard progress(progress_mutex_);
  bool in_flight = !active_.empty();
  fail_everything(active_, "the process is exiting (MPI is shutting down)");
  if (process_.owns) finalize_owned(!in_flight && !peer_may_be_lost_);
}

}  // namespace

MpiEngine& MpiEngine::get() {
  std::lock_guard lock(g_engine_mutex);
  if (g_engine == nullptr) {
    // The engine's thread and exit handler live in this library.
    pin_library_of(reinterpret_cast<const void*>(&engine_at_exit));
    auto* engine = new Engine();
    try {
      engine->start();
    } catch (...) {
      delete engine;
      throw;
    }
    g_engine = engine;
    if (engine->owns_mpi()) std::atexit(&engine_at_exit);
  }
  return *g_engine;
}

}  // namespace ductile::accel
