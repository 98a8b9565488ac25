#include "mpi_comm_table.hpp"

#include <algorithm>

namespace ductile::accel {

void MpiCommTable::add_world(MPI_Comm comm) {
  Entry world;
  world.comm = comm;
  comms_.emplace(kWorld, std::move(world));
}

int MpiCommTable::add(double timeout_seconds) {
  int id = next_id_++;
  Entry entry;
  entry.timeout = timeout_seconds;
  comms_.emplace(id, std::move(entry));
  max_timeout_ = std::max(max_timeout_, timeout_seconds);
  return id;
}

void MpiCommTable::set_comm(int id, MPI_Comm comm) {
  comms_.at(id).comm = comm;
}

bool MpiCommTable::release(int id) {
  auto it = comms_.find(id);
  if (it == comms_.end()) return false;
  it->second.released = true;
  return true;
}

std::uint64_t MpiCommTable::next_sequence(int id) {
  auto it = comms_.find(id);
  if (it == comms_.end()) throw Error(ErrorKind::internal, "unknown communicator id");
  return it->second.assigned++;
}

bool MpiCommTable::enqueue(int id, std::uint64_t sequence, PendingOp op) {
  auto it = comms_.find(id);
  if (it == comms_.end()) return false;
  it->second.waiting[sequence] = std::move(op);
  return true;
}

void MpiCommTable::take_ready(std::vector<ReadyOp>& ready) {
  for (auto& [id, entry] : comms_) {
    while (!entry.waiting.empty() && entry.waiting.begin()->first == entry.next_post) {
      PendingOp op = std::move(entry.waiting.begin()->second);
      entry.waiting.erase(entry.waiting.begin());
      ++entry.next_post;
      if (op.skipped) continue;
      if (!entry.broken.empty()) {
        op.done->fail(op.what + " failed: the communicator is unusable after an earlier failure (" +
                      entry.broken + ")");
        continue;
      }
      ++entry.in_flight;
      ready.push_back({id, entry.comm, entry.timeout, std::move(op)});
    }
  }
  free_released();
}

// Frees communicators that were released and have nothing left to post.
void MpiCommTable::free_released() {
  for (auto it = comms_.begin(); it != comms_.end();) {
    Entry& entry = it->second;
    if (it->first != kWorld && entry.released && entry.in_flight == 0 && entry.waiting.empty() &&
        entry.next_post == entry.assigned) {
      // A broken communicator may still have requests MPI is working on.
      if (entry.comm != MPI_COMM_NULL && entry.broken.empty()) MPI_Comm_free(&entry.comm);
      it = comms_.erase(it);
    } else {
      ++it;
    }
  }
}

void MpiCommTable::finished(int id, const std::string& failure) {
  Entry& entry = comms_.at(id);
  --entry.in_flight;
  if (!failure.empty() && entry.broken.empty()) entry.broken = failure;
}

void MpiCommTable::fail_waiting(const std::string& why, const std::string& suffix) {
  for (auto& [id, entry] : comms_) {
    for (auto& [sequence, op] : entry.waiting)
      if (!op.skipped) op.done->fail(op.what + " failed: " + why + suffix);
    entry.waiting.clear();
  }
}

void MpiCommTable::free_all() {
  for (auto& [id, entry] : comms_)
    if (id != kWorld && entry.comm != MPI_COMM_NULL && entry.broken.empty())
      MPI_Comm_free(&entry.comm);
  comms_.clear();
}

}  // namespace ductile::accel
