#include "completion.hpp"

namespace ductile::accel {

void Completion::complete() {
  {
    std::lock_guard lock(mutex_);
    if (state_.load(std::memory_order_relaxed) != kPending) return;
    state_.store(kOk, std::memory_order_release);
  }
  cv_.notify_all();
}

void Completion::fail(std::string message) {
  {
    std::lock_guard lock(mutex_);
    if (state_.load(std::memory_order_relaxed) != kPending) return;
    message_ = std::move(message);
    state_.store(kFailed, std::memory_order_release);
  }
  cv_.notify_all();
}

void Completion::wait() {
  if (state_.load(std::memory_order_acquire) == kPending) {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return state_.load(std::memory_order_relaxed) != kPending; });
  }
  if (failed()) throw Error(ErrorKind::communication, message());
}

std::string Completion::message() const {
  std::lock_guard lock(mutex_);
  return message_;
}

}  // namespace ductile::accel
