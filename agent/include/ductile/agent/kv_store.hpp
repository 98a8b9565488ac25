// The key-value store the rendezvous runs on: the few etcd v3 operations the
// agent needs (keys with leases, compare-and-swap, prefix reads), behind an
// interface so that the rendezvous logic can be tested without a server.
//
// Ownership: a store is owned by its user; values are copied in and out.
// Threading: one store object is used by one thread at a time; use one object
// per thread (EtcdStore objects are cheap).
// Errors: StoreUnavailable when the server cannot be reached or does not
// answer in time (the caller may retry); StoreError for an answer that is an
// error (a malformed request, a server-side failure that retrying will not fix).
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace ductile::agent {

class StoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The server could not be reached, or did not answer within the timeout.
class StoreUnavailable : public StoreError {
 public:
  using StoreError::StoreError;
};

// The server did not answer within the request's timeout: it is there but
// slow (overloaded, or stopped for a moment); trying again may succeed.
class StoreTimeout : public StoreUnavailable {
 public:
  using StoreUnavailable::StoreUnavailable;
};

// A server that answered before refuses connections: its process is gone,
// and with it a store held in its memory (a c10d or static rendezvous).
class StoreGone : public StoreUnavailable {
 public:
  using StoreUnavailable::StoreUnavailable;
};

struct KeyValue {
  std::string key;
  std::string value;
  std::int64_t create_revision = 0;  // store-wide revision at which the key was created
  std::int64_t mod_revision = 0;     // ... last modified
  std::int64_t lease = 0;            // 0: no lease
};

// One read of several (see KeyValueStore::read).
struct RangeRead {
  std::string key;
  bool prefix = false;        // every key starting with `key`
  std::int64_t limit = 0;     // at most this many (0: all)
  bool oldest_first = false;  // by create revision (else key order)
  // The keys and their revisions and leases only (values may be left
  // empty: a store that has them at hand may still give them).
  bool keys_only = false;
};

class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;

  // A lease of `ttl_seconds` (the server may round it up); returns its id.
  virtual std::int64_t grant_lease(std::int64_t ttl_seconds) = 0;
  // Renews a lease; false when it no longer exists (expired or revoked).
  virtual bool keep_alive(std::int64_t lease) = 0;
  // Revokes a lease, deleting its keys. A lease that does not exist is no error.
  virtual void revoke_lease(std::int64_t lease) = 0;
  // Seconds the lease has left (the server rounds to whole seconds); -1
  // when it no longer exists.
  virtual std::int64_t lease_remaining(std::int64_t lease) = 0;

  // Writes `key` (attached to `lease` when not 0).
  virtual void put(const std::string& key, const std::string& value, std::int64_t lease = 0) = 0;
  // get() and get_prefix() are one read() each unless a store overrides them.
  virtual std::optional<KeyValue> get(const std::string& key) {
    auto found = read({RangeRead{key}});
    if (found.front().empty()) return std::nullopt;
    return found.front().front();
  }
  // Every key starting with `prefix`, in key order.
  virtual std::vector<KeyValue> get_prefix(const std::string& prefix) {
    return read({RangeRead{prefix, true}}).front();
  }
  // Several reads in one request, from one revision of the store; one
  // result per read, in order.
  virtual std::vector<std::vector<KeyValue>> read(const std::vector<RangeRead>& reads) = 0;
  virtual void erase(const std::string& key) = 0;
  virtual void erase_prefix(const std::string& prefix) = 0;

  // Writes `key` only when its mod revision is `expected_mod_revision`
  // (0: only when the key does not exist). True when written.
  virtual bool compare_and_swap(const std::string& key, std::int64_t expected_mod_revision,
                                const std::string& value, std::int64_t lease = 0) = 0;
  // compare_and_swap(), then, when it wrote, read(`reads`) from the revision
  // it wrote at: one request where the store can (etcd: one transaction).
  // nullopt when not written. Errors: those of the two calls.
  virtual std::optional<std::vector<std::vector<KeyValue>>> compare_and_swap_then_read(
      const std::string& key, std::int64_t expected_mod_revision, const std::string& value,
      std::int64_t lease, const std::vector<RangeRead>& reads) {
    if (!compare_and_swap(key, expected_mod_revision, value, lease)) return std::nullopt;
    return read(reads);
  }

  // Where the store is, for messages: "etcd at http://127.0.0.1:2379".
  virtual std::string describe() const = 0;
  // A descriptor that becomes readable (POLLIN) once a key under one of
  // `prefixes` changed after this object's last read, so that the caller
  // reads again at once rather than after its poll interval; -1 when this
  // store cannot tell (the caller polls on its timer). The descriptor is
  // the store's: valid until the store is destroyed, emptied and re-armed
  // by each call (an earlier call's prefixes are forgotten). Threading: the
  // store's caller's thread.
  virtual int changes_fd(const std::vector<std::string>& prefixes) {
    (void)prefixes;
    return -1;
  }
};

}  // namespace ductile::agent
