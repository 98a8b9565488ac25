// KeyValueStore on etcd v3 through its HTTP/JSON gateway (/v3/kv/*,
// /v3/lease/*; keys and values base64), with libcurl, over plain HTTP or
// TLS.
//
// Threading: one EtcdStore per thread (each call uses the object's own curl
// handle). Errors: see kv_store.hpp; every call gives up after `timeout`.
#pragma once

#include <chrono>
#include <memory>
#include <string>
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
  std::string describe() const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ductile::agent
