// What a stop signal does: leave now, or drain after the round's
// checkpoint. See signals.hpp.
#include "signals.hpp"

#include <fmt/format.h>

namespace ductile::agent {

void StopSignals::mark_draining() {
  // On the lease of this node's registration: a mark on a lease that
  // expired went with it, and the node would count as a new arrival.
  conn_.store().put(self_.key("draining/" + self_.id), mark_json(self_.id, 0), conn_.lease());
}

std::optional<int> StopSignals::on_stop_signal(int sig) {
  if (drain_) {
    if (workers_.current_round() == drain_->round &&
        std::chrono::steady_clock::now() < drain_->deadline)
      return std::nullopt;
    self_.log(fmt::format("signal {}: {}; leaving the job", sig,
                          workers_.current_round() != drain_->round
                              ? "the round re-formed without this node"
                              : "the checkpoint timeout passed"));
    return 128 + sig;
  }
  if (settings_.checkpoint_timeout.count() > 0 && workers_.member() && workers_.running()) {
    // A drain: the round's workers save first (every rank: a save is
    // collective), then the leader re-forms without this node.
    try {
      mark_draining();
      CheckpointRequest request{workers_.current_round(), self_.id,
                                fmt::format("node {} drains (signal {})", self_.id, sig),
                                now_ms().count()};
      conn_.store().compare_and_swap(
          self_.key("checkpoint/" + std::to_string(workers_.current_round())), 0, to_json(request),
          conn_.lease());
      drain_ = Drain{workers_.current_round(), std::chrono::steady_clock::now() +
                                                   settings_.checkpoint_timeout + o_.lease_ttl};
      self_.log(fmt::format(
          "signal {}: asking the workers of round {} to checkpoint before this node leaves "
          "(up to {} ms)",
          sig, workers_.current_round(), settings_.checkpoint_timeout.count()));
      return std::nullopt;
    } catch (const StoreError& e) {
      self_.log(
          fmt::format("signal {}: cannot ask for a checkpoint ({}); leaving now", sig, e.what()));
      return 128 + sig;
    }
  }
  self_.log(fmt::format("signal {}: stopping the workers and leaving the job", sig));
  return 128 + sig;
}

StopWatch::StopWatch(const std::atomic<int>* stop_signal, std::function<void(int)> leave)
    : stop_signal_(stop_signal), leave_(std::move(leave)) {
  if (stop_signal_) thread_ = std::thread([this] { watch(); });
}

StopWatch::~StopWatch() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  armed_or_stopping_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void StopWatch::arm() {
  {
    std::lock_guard lock(mutex_);
    armed_ = true;
  }
  armed_or_stopping_.notify_all();
}

void StopWatch::disarm() {
  std::lock_guard lock(mutex_);
  armed_ = false;
}

void StopWatch::watch() {
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    // The signal's handler can only set the flag: it is looked at in short
    // steps, and only while armed.
    if (!armed_) {
      armed_or_stopping_.wait(lock, [this] { return armed_ || stopping_; });
      continue;
    }
    armed_or_stopping_.wait_for(lock, std::chrono::milliseconds(20), [this] { return stopping_; });
    if (const int sig = stop_signal_->load(); sig != 0 && armed_ && !stopping_) leave_(sig);
  }
}

void StopSignals::renew_mark() {
  if (drain_) mark_draining();
}

}  // namespace ductile::agent
