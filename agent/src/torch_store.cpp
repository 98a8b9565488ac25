// The workers' store of a StoreServer (see torch_store.hpp).
//
// torch's TCPStore protocol (as torch 2.13's clients speak it): a client
// first sends VALIDATE and a magic number, then commands of one byte and
// their fields; integers in the host's byte order, strings and values as a
// 64-bit length and the bytes. WAIT answers once every key exists (or the
// client cancels); keys are stored as the clients send them.
//
// Against a client that does not play by it, every command costs work
// linear in its size (a WAIT waits on its distinct keys; a write wakes its
// key's waiters once each), and what the store holds is bounded (its keys
// and bytes, StoreLimits).
#include "torch_store.hpp"

#include <algorithm>
#include <exception>
#include <utility>
#include <vector>

#include "store_wire.hpp"

namespace ductile::agent {

using namespace wire;

namespace {

constexpr std::uint32_t kValidationMagic = 0x3C85F7CE;
constexpr std::uint8_t kReady = 0, kNotReady = 1;            // CHECK
constexpr std::uint8_t kStopWaiting = 0, kWaitCanceled = 1;  // WAIT, BARRIER

// Reads `count` keys; false when the buffer ends first.
bool keys(Cursor& in, std::vector<std::string>& out) {
  std::uint64_t count = 0;
  if (!in.value(count)) return false;
  if (count > kMaxKeys) throw BadMessage("too many keys in one command");
  // Each key takes 8 bytes at least: a count the buffer cannot hold yet
  // reserves nothing.
  if (count > in.left() / sizeof(std::uint64_t)) return false;
  out.resize(static_cast<std::size_t>(count));
  for (auto& k : out)
    if (!in.bytes(k, kMaxKey)) return false;
  return true;
}

std::int64_t as_counter(const std::string& value) {
  try {
    std::size_t used = 0;
    std::int64_t v = std::stoll(value, &used);
    if (used == value.size()) return v;
  } catch (const std::exception&) {
  }
  throw BadMessage("ADD on a key whose value is not a number");
}

}  // namespace

TorchStore::TorchStore(const StoreLimits& limits, TorchClients& clients)
    : max_keys_(limits.max_keys), max_stored_bytes_(limits.max_stored_bytes), clients_(clients) {}

bool TorchStore::present(const std::string& key) const {
  return values_.count(key) || queues_.count(key);
}

// Room for `keys` more keys and `bytes` more bytes in the workers'
// store, else the writer's connection is closed.
void TorchStore::make_room(std::size_t keys, std::size_t bytes) {
  if (stored_keys_ + keys > max_keys_) throw BadMessage("the workers' store holds its most keys");
  if (stored_bytes_ + bytes > max_stored_bytes_)
    throw BadMessage("the workers' store holds its most bytes");
}

void TorchStore::store(const std::string& key, std::string value) {
  auto it = values_.find(key);
  if (it == values_.end()) {
    make_room(queues_.count(key) ? 0 : 1, key.size() + value.size());
    if (!queues_.count(key)) ++stored_keys_;
    stored_bytes_ += key.size() + value.size();
    values_.emplace(key, std::move(value));
    return;
  }
  if (value.size() > it->second.size()) make_room(0, value.size() - it->second.size());
  stored_bytes_ = stored_bytes_ - it->second.size() + value.size();
  it->second = std::move(value);
}

std::size_t TorchStore::erase_value(const std::string& key) {
  auto it = values_.find(key);
  if (it == values_.end()) return 0;
  stored_bytes_ -= it->first.size() + it->second.size();
  if (!queues_.count(key)) --stored_keys_;
  values_.erase(it);
  return 1;
}

void TorchStore::push(const std::string& key, std::string value) {
  auto q = queues_.find(key);
  const bool new_key = q == queues_.end() && !values_.count(key);
  make_room(new_key ? 1 : 0, value.size() + (q == queues_.end() ? key.size() : 0));
  if (new_key) ++stored_keys_;
  stored_bytes_ += value.size() + (q == queues_.end() ? key.size() : 0);
  queues_[key].push_back(std::move(value));
}

std::string TorchStore::pop(std::unordered_map<std::string, std::deque<std::string>>::iterator q) {
  std::string value = std::move(q->second.front());
  q->second.pop_front();
  stored_bytes_ -= value.size();
  if (q->second.empty()) {
    stored_bytes_ -= q->first.size();
    if (!values_.count(q->first)) --stored_keys_;
    queues_.erase(q);
  }
  return value;
}

// Every connection waiting for `key` counts it as there; those with all
// their keys get STOP_WAITING. `one`: only the first of them (a queue
// push wakes one popper). Each waiter is looked at once.
void TorchStore::arrived(const std::string& key, bool one) {
  auto w = waiting_.find(key);
  if (w == waiting_.end()) return;
  TorchWaiters& ids = w->second;
  while (!ids.empty()) {
    const std::uint64_t id = ids.front();
    ids.pop_front();
    TorchClient* client = clients_.find(id);
    if (!client) continue;
    client->awaited.erase(key);
    if (client->awaited.empty()) {
      clients_.answer(id, std::string(1, static_cast<char>(kStopWaiting)));
      if (one) break;
    }
  }
  if (ids.empty()) waiting_.erase(w);
}

void TorchStore::await(std::uint64_t id, TorchClient& c, const std::string& key) {
  if (c.awaited.count(key)) return;  // a key named twice is waited for once
  TorchWaiters& ids = waiting_[key];
  c.awaited.emplace(key, ids.insert(ids.end(), id));
}

void TorchStore::forget_waits(TorchClient& c) {
  for (auto& [key, place] : c.awaited) {
    auto w = waiting_.find(key);
    if (w == waiting_.end()) continue;
    w->second.erase(place);
    if (w->second.empty()) waiting_.erase(w);
  }
  c.awaited.clear();
}

std::size_t TorchStore::command(std::uint64_t id, TorchClient& c, const std::string& bytes,
                                std::string& reply) {
  Cursor in(bytes);
  std::uint8_t byte = 0;
  if (!in.value(byte)) return 0;
  const auto command = static_cast<TorchCommand>(byte);
  if (!c.validated) {
    std::uint32_t magic = 0;
    if (command != TorchCommand::validate) throw BadMessage("a client that did not validate");
    if (!in.value(magic)) return 0;
    if (magic != kValidationMagic) throw BadMessage("a wrong validation number");
    c.validated = true;
    return in.used();
  }
  std::string key, value;
  switch (command) {
    case TorchCommand::ping: {
      std::uint32_t nonce = 0;
      if (!in.value(nonce)) return 0;
      put(reply, nonce);
      break;
    }
    case TorchCommand::set:
      if (!in.bytes(key, kMaxKey) || !in.bytes(value, kMaxValue)) return 0;
      store(key, std::move(value));
      arrived(key);
      break;
    case TorchCommand::compare_set: {
      std::string expected;
      if (!in.bytes(key, kMaxKey) || !in.bytes(expected, kMaxValue) || !in.bytes(value, kMaxValue))
        return 0;
      // torch's answer: the value now there; a missing key is created
      // only when `expected` is empty, else `expected` comes back.
      auto it = values_.find(key);
      if (it == values_.end()) {
        if (expected.empty()) store(key, value);
        put_bytes(reply, expected.empty() ? value : expected);
      } else {
        if (it->second == expected) store(key, value);
        put_bytes(reply, values_.find(key)->second);
      }
      arrived(key);
      break;
    }
    case TorchCommand::get: {
      if (!in.bytes(key, kMaxKey)) return 0;
      auto it = values_.find(key);
      put_bytes(reply, it == values_.end() ? std::string() : it->second);
      break;
    }
    case TorchCommand::add: {
      std::int64_t delta = 0;
      if (!in.bytes(key, kMaxKey) || !in.value(delta)) return 0;
      auto it = values_.find(key);
      const std::int64_t sum = (it == values_.end() ? 0 : as_counter(it->second)) + delta;
      store(key, std::to_string(sum));
      put(reply, sum);
      arrived(key);
      break;
    }
    case TorchCommand::check: {
      std::vector<std::string> ks;
      if (!keys(in, ks)) return 0;
      const bool all = std::all_of(ks.begin(), ks.end(), [&](auto& k) { return present(k); });
      put(reply, all ? kReady : kNotReady);
      break;
    }
    case TorchCommand::wait: {
      std::vector<std::string> ks;
      if (!keys(in, ks)) return 0;
      for (const auto& k : ks)
        if (!present(k)) await(id, c, k);
      if (c.awaited.empty()) put(reply, kStopWaiting);
      break;
    }
    case TorchCommand::num_keys:
      put(reply, static_cast<std::int64_t>(values_.size()));
      break;
    case TorchCommand::delete_key:
      if (!in.bytes(key, kMaxKey)) return 0;
      put(reply, static_cast<std::int64_t>(erase_value(key)));
      break;
    case TorchCommand::append: {
      if (!in.bytes(key, kMaxKey) || !in.bytes(value, kMaxValue)) return 0;
      auto it = values_.find(key);
      if (it == values_.end()) {
        store(key, std::move(value));
      } else {
        if (it->second.size() + value.size() > kMaxValue)
          throw BadMessage("APPEND past the largest value");
        make_room(0, value.size());
        stored_bytes_ += value.size();
        it->second += value;
      }
      arrived(key);
      break;
    }
    case TorchCommand::multi_get: {
      std::vector<std::string> ks;
      if (!keys(in, ks)) return 0;
      for (const auto& k : ks) {
        auto it = values_.find(k);
        const std::size_t size = it == values_.end() ? 0 : it->second.size();
        // One key named many times would make an answer of any size.
        if (reply.size() + sizeof(std::uint64_t) + size > kMaxUnread)
          throw BadMessage("MULTI_GET whose answer is over the limit");
        put_bytes(reply, it == values_.end() ? std::string() : it->second);
      }
      break;
    }
    case TorchCommand::multi_set: {
      std::uint64_t count = 0;
      if (!in.value(count)) return 0;
      if (count > kMaxKeys) throw BadMessage("too many keys in one command");
      if (count > in.left() / (2 * sizeof(std::uint64_t))) return 0;
      std::vector<std::pair<std::string, std::string>> pairs(static_cast<std::size_t>(count));
      for (auto& [k, v] : pairs)
        if (!in.bytes(k, kMaxKey) || !in.bytes(v, kMaxValue)) return 0;
      for (auto& [k, v] : pairs) {
        store(k, std::move(v));
        arrived(k);
      }
      break;
    }
    case TorchCommand::cancel_wait:
      forget_waits(c);
      put(reply, kWaitCanceled);
      break;
    case TorchCommand::queue_push:
      if (!in.bytes(key, kMaxKey) || !in.bytes(value, kMaxValue)) return 0;
      push(key, std::move(value));
      arrived(key, true);
      break;
    case TorchCommand::queue_pop: {
      if (!in.bytes(key, kMaxKey)) return 0;
      auto q = queues_.find(key);
      if (q == queues_.end()) {
        put(reply, std::int64_t{0});
      } else {
        put(reply, static_cast<std::int64_t>(q->second.size()));
        put_bytes(reply, pop(q));
      }
      break;
    }
    case TorchCommand::queue_len: {
      if (!in.bytes(key, kMaxKey)) return 0;
      auto q = queues_.find(key);
      put(reply, static_cast<std::int64_t>(q == queues_.end() ? 0 : q->second.size()));
      break;
    }
    case TorchCommand::list_keys:
      put(reply, static_cast<std::int64_t>(values_.size()));
      for (const auto& [k, v] : values_) put_bytes(reply, k);
      break;
    case TorchCommand::barrier: {
      std::int64_t world = 0;
      if (!in.bytes(key, kMaxKey) || !in.value(world)) return 0;
      auto it = values_.find(key);
      const std::int64_t count = (it == values_.end() ? 0 : as_counter(it->second)) + 1;
      store(key, std::to_string(count));
      if (count >= world) {
        arrived(key);
        put(reply, kStopWaiting);
      } else {
        await(id, c, key);
      }
      break;
    }
    default:
      throw BadMessage("an unknown command");
  }
  return in.used();
}

void TorchStore::clear() {
  values_.clear();
  queues_.clear();
  waiting_.clear();
  stored_keys_ = stored_bytes_ = 0;
}

}  // namespace ductile::agent
