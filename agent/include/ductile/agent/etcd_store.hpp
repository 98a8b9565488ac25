// KeyValueStore on etcd's v3 API over gRPC (HTTP/2 with libcurl; plain,
// or TLS for an https:// endpoint). Each object keeps one connection to
// the member that answered last, for its calls and its watch alike, and
// from its first keep_alive() on a second one, whose one LeaseKeepAlive
// stream stays open and carries every renewal (closed and opened again
// after an error or a timeout).
//
// Threading: one EtcdStore per thread (each call uses the object's own curl
// handles), but interrupt_watch(). Errors: see kv_store.hpp; every call
// gives up after `timeout`; an answer of over 64 MiB is an error.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ductile/agent/kv_store.hpp"

namespace ductile::agent {

// "etcd://HOST:PORT" or "http://HOST:PORT" -> "http://HOST:PORT";
// "https://HOST:PORT" (TLS) as it is. Throws ductile::Error(invalid_argument)
// naming `what` and the value otherwise.
std::string etcd_endpoint_from_url(const std::string& url, const std::string& what);

// TLS to an https:// endpoint: files in PEM. The server's certificate is
// checked against `ca_file` (empty: the system's CAs) and its host name;
// `cert_file` and `key_file` are this client's (etcd's --client-cert-auth).
struct EtcdTls {
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  bool configured() const { return !ca_file.empty() || !cert_file.empty() || !key_file.empty(); }
};

// Throws ductile::Error(invalid_argument) naming the option when `tls` is
// configured for a plaintext endpoint (`url` as given, etcd:// or http://),
// names a file that cannot be read, or gives a certificate without its key
// (or a key without its certificate). `options` names the options for
// messages, as {"--rdzv", "--rdzv-cacert", "--rdzv-cert", "--rdzv-key"}.
void check_etcd_tls(const std::string& url, const EtcdTls& tls,
                    const std::vector<std::string>& options);

// The keys from `key` up to, not including, `end` (etcd's key and
// range_end).
struct KeyRange {
  std::string key;
  std::string end;
  bool contains(const std::string& k) const { return k >= key && k < end; }
  friend bool operator==(const KeyRange&, const KeyRange&) = default;
};
// Every key that starts with `prefix`.
KeyRange prefix_range(const std::string& prefix);
// The key `key` alone.
KeyRange single_key(const std::string& key);

// One change a watch reports: a key written (kv whole) or deleted (kv.key
// and kv.mod_revision, the revision of the delete).
struct WatchEvent {
  bool deleted = false;
  KeyValue kv;
};

// One message of a watch stream.
struct WatchMessage {
  bool created = false;               // the watch is in place (no events yet)
  bool canceled = false;              // the server ended the watch
  std::int64_t compact_revision = 0;  // set: the start revision was compacted away
  std::vector<WatchEvent> events;     // in revision order
};

class EtcdStore final : public KeyValueStore {
 public:
  // `endpoint`: "http://HOST:PORT" or "https://HOST:PORT" (see
  // etcd_endpoint_from_url).
  explicit EtcdStore(std::string endpoint,
                     std::chrono::milliseconds timeout = std::chrono::milliseconds(2000),
                     EtcdTls tls = {});
  ~EtcdStore() override;
  EtcdStore(const EtcdStore&) = delete;
  EtcdStore& operator=(const EtcdStore&) = delete;

  std::int64_t grant_lease(std::int64_t ttl_seconds) override;
  bool keep_alive(std::int64_t lease) override;
  void revoke_lease(std::int64_t lease) override;
  std::int64_t lease_remaining(std::int64_t lease) override;
  void put(const std::string& key, const std::string& value, std::int64_t lease = 0) override;
  std::vector<std::vector<KeyValue>> read(const std::vector<RangeRead>& reads) override;
  void erase(const std::string& key) override;
  void erase_prefix(const std::string& prefix) override;
  bool compare_and_swap(const std::string& key, std::int64_t expected_mod_revision,
                        const std::string& value, std::int64_t lease = 0) override;
  std::optional<std::vector<std::vector<KeyValue>>> compare_and_swap_then_read(
      const std::string& key, std::int64_t expected_mod_revision, const std::string& value,
      std::int64_t lease, const std::vector<RangeRead>& reads) override;
  std::string describe() const override;

  // compare_and_swap_then_read(), and in the same transaction every key of
  // each of `ranges` into `contents` (read after the write, at
  // changed_at()): a mirror's first read rides on a registration. When the
  // swap fails, `contents` is left as it was.
  std::optional<std::vector<std::vector<KeyValue>>> compare_and_swap_then_read_ranges(
      const std::string& key, std::int64_t expected_mod_revision, const std::string& value,
      std::int64_t lease, const std::vector<RangeRead>& reads, const std::vector<KeyRange>& ranges,
      std::vector<std::vector<KeyValue>>& contents);

  // The revision at which the last call changed the store: a put, a
  // compare_and_swap that succeeded, an erase that deleted keys; 0 when the
  // last call changed nothing (or was a read, or a lease call).
  std::int64_t changed_at() const;

  // Streams etcd's watch of every key in `ranges` (one stream, a watch per
  // range) from `start_revision` (0: from now), calling `on_message` for each message on this
  // thread, until the server or the connection ends the stream (StoreUnavailable), it answers with
  // an error (StoreError), `on_message` returns false, or `stop` is set (seen within a second, at
  // once after interrupt_watch()): those two return normally. Only connecting is bounded by the
  // store's timeout; a peer gone silent is found by TCP keep-alive probes within about 5 s. A
  // message of over 64 MiB is an error.
  void watch(const std::vector<KeyRange>& ranges, std::int64_t start_revision,
             const std::function<bool(const WatchMessage&)>& on_message,
             const std::atomic<bool>& stop);

  // Wakes a watch() in progress on another thread, so that it sees its
  // `stop` at once. Thread-safe.
  void interrupt_watch();

  // Every key of each range, all at one revision, and that revision.
  std::pair<std::vector<std::vector<KeyValue>>, std::int64_t> read_ranges_at(
      const std::vector<KeyRange>& ranges);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ductile::agent
