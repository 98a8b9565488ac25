// etcd v3 over its HTTP/JSON gateway. Requests and answers are the gateway's
// JSON mapping of the gRPC messages: 64-bit integers as strings, bytes as
// base64, fields with default values left out.
#include "ductile/agent/etcd_store.hpp"

#include <curl/curl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/evp.h>
#include <sys/socket.h>

#include <array>
#include <charconv>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "agent_common.hpp"
#include "ductile/error.hpp"

namespace ductile::agent {
namespace {

using json = nlohmann::json;

std::string base64_encode(const std::string& in) {
  std::string out(4 * ((in.size() + 2) / 3) + 1, '\0');  // EVP_EncodeBlock ends it with a NUL
  out.resize(static_cast<std::size_t>(EVP_EncodeBlock(
      reinterpret_cast<unsigned char*>(out.data()),
      reinterpret_cast<const unsigned char*>(in.data()), static_cast<int>(in.size()))));
  return out;
}

// The key just after every key starting with `prefix` (etcd's range_end).
std::string prefix_end(std::string prefix) {
  while (!prefix.empty()) {
    if (std::uint8_t(prefix.back()) < 0xff) {
      prefix.back() = char(std::uint8_t(prefix.back()) + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');
}

// The gateway writes 64-bit integers as strings; anything else in their
// place is an answer no etcd gives (StoreError, never a crash).
std::int64_t as_int(const json& object, const char* field) {
  if (!object.is_object())
    throw StoreError("etcd answered with a non-object where one is expected");
  auto it = object.find(field);
  if (it == object.end()) return 0;
  if (it->is_number_integer() && !it->is_number_unsigned()) return it->get<std::int64_t>();
  if (it->is_string()) {
    const auto& s = it->get_ref<const std::string&>();
    std::int64_t value = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
    if (ec == std::errc() && end == s.data() + s.size() && !s.empty()) return value;
  }
  throw StoreError(fmt::format("etcd answered with {} = {}, not a 64-bit integer", field,
                               it->dump(-1, ' ', false, json::error_handler_t::replace)));
}

std::string as_bytes(const json& kv, const char* field) {
  auto it = kv.find(field);
  if (it == kv.end()) return {};
  // The gateway pads every value: an unpadded or invalid one is an answer
  // no etcd gives.
  const auto* text = it->is_string() ? &it->get_ref<const std::string&>() : nullptr;
  std::string bytes(text ? text->size() / 4 * 3 : 0, '\0');
  const int size = text && text->size() % 4 == 0
                       ? EVP_DecodeBlock(reinterpret_cast<unsigned char*>(bytes.data()),
                                         reinterpret_cast<const unsigned char*>(text->data()),
                                         static_cast<int>(text->size()))
                       : -1;
  if (size < 0) throw StoreError(fmt::format("etcd answered with a {} that is not base64", field));
  // EVP_DecodeBlock counts the padding as bytes.
  bytes.resize(static_cast<std::size_t>(size) - (text->ends_with("==") ? 2 : text->ends_with('=')));
  return bytes;
}

KeyValue to_key_value(const json& kv) {
  if (!kv.is_object()) throw StoreError("etcd answered with a key-value that is not an object");
  KeyValue out;
  out.key = as_bytes(kv, "key");
  out.value = as_bytes(kv, "value");
  out.create_revision = as_int(kv, "create_revision");
  out.mod_revision = as_int(kv, "mod_revision");
  out.lease = as_int(kv, "lease");
  return out;
}

// A transaction's range requests for `reads`.
json range_ops(const std::vector<RangeRead>& reads) {
  json ops = json::array();
  for (const auto& r : reads) {
    json range = {{"key", base64_encode(r.key)}};
    if (r.prefix) range["range_end"] = base64_encode(prefix_end(r.key));
    if (r.limit > 0) range["limit"] = std::to_string(r.limit);
    if (r.keys_only) range["keys_only"] = true;
    if (r.oldest_first) {
      range["sort_target"] = "CREATE";
      range["sort_order"] = "ASCEND";
    }
    ops.push_back({{"request_range", range}});
  }
  return ops;
}

// The "kvs" of a range answer.
std::vector<KeyValue> key_values(const json& reply) {
  std::vector<KeyValue> out;
  if (!reply.is_object() || !reply.contains("kvs")) return out;
  const json& kvs = reply["kvs"];
  if (!kvs.is_array()) throw StoreError("etcd answered a range request with kvs not a list");
  for (const auto& kv : kvs) out.push_back(to_key_value(kv));
  return out;
}

std::size_t append_body(char* data, std::size_t size, std::size_t count, void* user) {
  static_cast<std::string*>(user)->append(data, size * count);
  return size * count;
}

// The revision in an answer's header (0 when it has none).
std::int64_t header_revision(const json& reply) {
  auto it = reply.find("header");
  return it != reply.end() && it->is_object() ? as_int(*it, "revision") : 0;
}

// A watch's socket sends keep-alive probes after 2 s of silence, one a
// second, and gives up after 3 unanswered: a peer that is gone (a host
// down, a cable cut) ends the stream within about 5 s, where a quiet watch
// could otherwise wait forever.
int keep_probing(void*, curl_socket_t fd, curlsocktype purpose) {
  if (purpose != CURLSOCKTYPE_IPCXN) return CURL_SOCKOPT_OK;
  const int on = 1, idle = 2, interval = 1, count = 3;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
  return CURL_SOCKOPT_OK;
}

// A watch's answer as it streams in: one JSON message a line.
struct WatchStream {
  static constexpr std::size_t kMaxMessage = std::size_t{64} << 20;
  const std::function<bool(const WatchMessage&)>* on_message = nullptr;
  std::string pending;
  bool done = false;  // on_message said to stop
  std::exception_ptr error;

  static std::size_t take(char* data, std::size_t size, std::size_t count, void* user) {
    auto& self = *static_cast<WatchStream*>(user);
    self.pending.append(data, size * count);
    try {
      for (auto end = self.pending.find('\n'); end != std::string::npos;
           end = self.pending.find('\n')) {
        const std::string line = self.pending.substr(0, end);
        self.pending.erase(0, end + 1);
        if (!line.empty() && !(*self.on_message)(parse(line))) {
          self.done = true;
          return 0;
        }
      }
      if (self.pending.size() > kMaxMessage)
        throw StoreError(fmt::format("etcd sent a watch message of over {} bytes", kMaxMessage));
    } catch (...) {
      self.error = std::current_exception();
      return 0;
    }
    return size * count;
  }

  static WatchMessage parse(const std::string& line) {
    const json message = json::parse(line, nullptr, false);
    if (message.is_discarded() || !message.is_object())
      throw StoreError("etcd sent a watch message that is not a JSON object");
    if (message.contains("error"))
      throw StoreError(
          fmt::format("etcd ended the watch: {}",
                      message["error"].dump(-1, ' ', false, json::error_handler_t::replace)));
    auto result = message.find("result");
    if (result == message.end() || !result->is_object())
      throw StoreError("etcd sent a watch message without its result");
    WatchMessage out;
    auto flag = [&](const char* field) {
      auto it = result->find(field);
      return it != result->end() && it->is_boolean() && it->get<bool>();
    };
    out.created = flag("created");
    out.canceled = flag("canceled");
    out.compact_revision = as_int(*result, "compact_revision");
    if (auto events = result->find("events"); events != result->end()) {
      if (!events->is_array()) throw StoreError("etcd sent watch events that are not a list");
      for (const auto& event : *events) {
        if (!event.is_object() || !event.contains("kv"))
          throw StoreError("etcd sent a watch event without its key");
        auto type = event.find("type");
        out.events.push_back(
            {type != event.end() && type->is_string() && type->get<std::string>() == "DELETE",
             to_key_value(event["kv"])});
      }
    }
    return out;
  }
};

}  // namespace

std::string etcd_endpoint_from_url(const std::string& url, const std::string& what) {
  std::string rest, scheme = "http://";
  for (const char* prefix : {"etcd://", "http://", "https://"})
    if (url.starts_with(prefix)) {
      rest = url.substr(std::string(prefix).size());
      if (std::string(prefix) == "https://") scheme = prefix;
    }
  // HOST:PORT, or several (the members of an etcd cluster) separated by
  // commas.
  std::string endpoints;
  bool valid = !rest.empty();
  for (std::string one : split(rest, ',')) {
    if (!valid) break;
    while (!one.empty() && one.back() == '/') one.pop_back();
    auto colon = one.rfind(':');
    valid = !one.empty() && colon != std::string::npos && colon > 0 && colon + 1 < one.size() &&
            colon + 6 >= one.size() &&
            one.find_first_not_of("0123456789", colon + 1) == std::string::npos &&
            one.find_first_of("/,@ ") == std::string::npos;
    if (valid) {
      long port = std::stol(one.substr(colon + 1));
      valid = port > 0 && port < 65536;
    }
    endpoints += (endpoints.empty() ? "" : ",") + scheme + one;
  }
  if (!valid)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("{} '{}' is not an etcd address: give etcd://HOST:PORT (for example "
                            "etcd://127.0.0.1:2379; a cluster's members separated by commas, "
                            "etcd://h1:2379,h2:2379,h3:2379), or https://HOST:PORT for TLS",
                            what, url));
  return endpoints;
}

void check_etcd_tls(const std::string& url, const EtcdTls& tls,
                    const std::vector<std::string>& options) {
  auto bad = [](const std::string& message) { throw Error(ErrorKind::invalid_argument, message); };
  const std::string endpoint = etcd_endpoint_from_url(url, options.at(0));
  const std::pair<const std::string*, int> files[] = {
      {&tls.ca_file, 1}, {&tls.cert_file, 2}, {&tls.key_file, 3}};
  if (tls.configured() && !endpoint.starts_with("https://")) {
    std::string given;
    for (auto [file, option] : files)
      if (!file->empty()) given += (given.empty() ? "" : ", ") + options.at(option);
    bad(fmt::format(
        "{} '{}' is plaintext HTTP but TLS is configured ({}): give the etcd's TLS "
        "endpoint as https://{}, or leave the TLS options out",
        options.at(0), url, given, [&] {
          std::string hosts = endpoint;
          for (auto at = hosts.find("http://"); at != std::string::npos; at = hosts.find("http://"))
            hosts.erase(at, 7);
          return hosts;
        }()));
  }
  if (tls.cert_file.empty() != tls.key_file.empty())
    bad(
        fmt::format("{} and {} go together: give both (the client's certificate and its key) or "
                    "neither",
                    options.at(2), options.at(3)));
  for (auto [file, option] : files) {
    if (file->empty()) continue;
    std::ifstream in(*file);
    std::error_code ec;
    if (!in || !std::filesystem::is_regular_file(*file, ec))
      bad(fmt::format("{} '{}' cannot be read: give a PEM file", options.at(option), *file));
  }
}

struct EtcdStore::Impl {
  std::string endpoints;             // as given, for messages
  std::vector<std::string> members;  // one URL per cluster member
  std::size_t current = 0;           // the member that answered last
  std::chrono::milliseconds timeout;
  EtcdTls tls;
  CURL* curl = nullptr;
  std::int64_t changed = 0;  // see changed_at()
  std::mutex watch_mutex;
  CURLM* watching = nullptr;  // the watch's, while one runs

  // TLS to an https:// endpoint, with the files given.
  void set_tls(const std::string& endpoint) {
    if (!endpoint.starts_with("https://")) return;
    curl_easy_setopt(curl, CURLOPT_SSL_VERIFYPEER, 1L);
    curl_easy_setopt(curl, CURLOPT_SSL_VERIFYHOST, 2L);
    if (!tls.ca_file.empty()) curl_easy_setopt(curl, CURLOPT_CAINFO, tls.ca_file.c_str());
    if (!tls.cert_file.empty()) {
      curl_easy_setopt(curl, CURLOPT_SSLCERT, tls.cert_file.c_str());
      curl_easy_setopt(curl, CURLOPT_SSLKEY, tls.key_file.c_str());
    }
  }

  // The request to the member that answered last, else to the others in
  // turn: a member that is down, or cannot serve without a quorum, is
  // skipped. StoreUnavailable when no member could serve it.
  json call(const std::string& path, const json& request) {
    for (std::size_t tried = 0;; ++tried) {
      try {
        return call_one(members[current], path, request);
      } catch (const StoreUnavailable&) {
        if (tried + 1 >= members.size()) throw;
        current = (current + 1) % members.size();
      }
    }
  }

  // A transaction of `ops` (range requests only: without comparisons it
  // runs its success branch, every range at one revision, in one round
  // trip): each range's keys, and the revision they were read at.
  std::pair<std::vector<std::vector<KeyValue>>, std::int64_t> read_ranges(const json& ops) {
    changed = 0;
    const auto reply = call("/v3/kv/txn", {{"success", ops}});
    auto it = reply.find("responses");
    if (it == reply.end() || !it->is_array() || it->size() != ops.size())
      throw StoreError(fmt::format("etcd at {} answered a read of {} ranges with another count",
                                   endpoints, ops.size()));
    std::vector<std::vector<KeyValue>> out;
    for (const auto& response : *it) {
      if (!response.is_object() || !response.contains("response_range"))
        throw StoreError("etcd answered a range of a transaction without its result");
      out.push_back(key_values(response["response_range"]));
    }
    return {std::move(out), header_revision(reply)};
  }

  json call_one(const std::string& endpoint, const std::string& path, const json& request) {
    std::string body = request.dump();
    std::string answer;
    curl_easy_reset(curl);
    std::string url = endpoint + path;
    curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
    curl_easy_setopt(curl, CURLOPT_POST, 1L);
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, body.c_str());
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE, long(body.size()));
    curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, long(timeout.count()));
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, long(timeout.count()));
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl, CURLOPT_NOPROXY, "*");
    set_tls(endpoint);
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, append_body);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &answer);
    struct curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
    CURLcode rc = curl_easy_perform(curl);
    long status = 0;
    curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
    curl_slist_free_all(headers);
    if (rc == CURLE_OPERATION_TIMEDOUT)
      throw StoreTimeout(
          fmt::format("etcd at {}: {} failed: {}", endpoint, path, curl_easy_strerror(rc)));
    if (rc != CURLE_OK)
      throw StoreUnavailable(
          fmt::format("etcd at {}: {} failed: {}", endpoint, path, curl_easy_strerror(rc)));
    json reply = json::parse(answer, nullptr, false);
    if (reply.is_discarded() || !reply.is_object())
      throw StoreError(
          fmt::format("etcd at {}: {} answered HTTP {} with a body that is not "
                      "a JSON object: {}",
                      endpoint, path, status, answer.substr(0, 200)));
    if (status != 200 || reply.contains("error")) {
      auto text_of = [&](const char* field) -> std::string {
        auto it = reply.find(field);
        return it != reply.end() && it->is_string() ? it->get<std::string>() : std::string();
      };
      std::string message = text_of("message");
      if (message.empty()) message = text_of("error");
      if (message.empty()) message = answer.substr(0, 200);
      auto code_it = reply.find("code");
      std::int64_t code =
          code_it != reply.end() && code_it->is_number_integer() ? code_it->get<std::int64_t>() : 0;
      const std::string what =
          fmt::format("etcd at {}: {} failed (HTTP {}): {}", endpoint, path, status, message);
      // gRPC codes 4 (deadline exceeded), 14 (unavailable): no leader yet,
      // a restart in progress; retrying helps.
      if (status >= 500 || code == 4 || code == 14) throw StoreUnavailable(what);
      throw StoreError(what);
    }
    return reply;
  }
};

EtcdStore::EtcdStore(std::string endpoint, std::chrono::milliseconds timeout, EtcdTls tls)
    : impl_(std::make_unique<Impl>()) {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  impl_->endpoints = endpoint;
  for (auto& member : split(endpoint, ','))
    if (!member.empty()) impl_->members.push_back(std::move(member));
  if (impl_->members.empty()) impl_->members.push_back(endpoint);
  impl_->timeout = timeout;
  impl_->tls = std::move(tls);
  impl_->curl = curl_easy_init();
  if (!impl_->curl) throw StoreError("curl_easy_init failed");
}

EtcdStore::~EtcdStore() {
  curl_easy_cleanup(impl_->curl);
}

std::int64_t EtcdStore::grant_lease(std::int64_t ttl_seconds) {
  auto reply = impl_->call("/v3/lease/grant", {{"TTL", std::to_string(ttl_seconds)}});
  auto id = as_int(reply, "ID");
  if (id == 0) throw StoreError("etcd at " + impl_->endpoints + ": lease grant returned no id");
  return id;
}

bool EtcdStore::keep_alive(std::int64_t lease) {
  auto reply = impl_->call("/v3/lease/keepalive", {{"ID", std::to_string(lease)}});
  // The gateway streams LeaseKeepAliveResponse messages as {"result": {...}};
  // a TTL of 0 (left out) means the lease no longer exists.
  const json& result = reply.contains("result") ? reply["result"] : reply;
  return as_int(result, "TTL") > 0;
}

void EtcdStore::revoke_lease(std::int64_t lease) {
  try {
    impl_->call("/v3/lease/revoke", {{"ID", std::to_string(lease)}});
  } catch (const StoreUnavailable&) {
    throw;
  } catch (const StoreError&) {
    // Already expired: nothing left to revoke.
  }
}

std::int64_t EtcdStore::lease_remaining(std::int64_t lease) {
  auto reply = impl_->call("/v3/lease/timetolive", {{"ID", std::to_string(lease)}});
  // An expired or unknown lease: TTL -1.
  return as_int(reply, "TTL");
}

void EtcdStore::put(const std::string& key, const std::string& value, std::int64_t lease) {
  json request = {{"key", base64_encode(key)}, {"value", base64_encode(value)}};
  if (lease != 0) request["lease"] = std::to_string(lease);
  impl_->changed = 0;
  impl_->changed = header_revision(impl_->call("/v3/kv/put", request));
}

std::vector<std::vector<KeyValue>> EtcdStore::read(const std::vector<RangeRead>& reads) {
  if (reads.empty()) return {};
  return impl_->read_ranges(range_ops(reads)).first;
}

void EtcdStore::erase(const std::string& key) {
  impl_->changed = 0;
  const auto reply = impl_->call("/v3/kv/deleterange", {{"key", base64_encode(key)}});
  if (as_int(reply, "deleted") > 0) impl_->changed = header_revision(reply);
}

void EtcdStore::erase_prefix(const std::string& prefix) {
  impl_->changed = 0;
  const auto reply = impl_->call(
      "/v3/kv/deleterange",
      {{"key", base64_encode(prefix)}, {"range_end", base64_encode(prefix_end(prefix))}});
  if (as_int(reply, "deleted") > 0) impl_->changed = header_revision(reply);
}

bool EtcdStore::compare_and_swap(const std::string& key, std::int64_t expected_mod_revision,
                                 const std::string& value, std::int64_t lease) {
  return compare_and_swap_then_read(key, expected_mod_revision, value, lease, {}).has_value();
}

std::optional<std::vector<std::vector<KeyValue>>> EtcdStore::compare_and_swap_then_read(
    const std::string& key, std::int64_t expected_mod_revision, const std::string& value,
    std::int64_t lease, const std::vector<RangeRead>& reads) {
  json put = {{"key", base64_encode(key)}, {"value", base64_encode(value)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  // The ranges after the put, in its branch: read at the revision it wrote.
  json success = json::array({{{"request_put", put}}});
  for (auto& op : range_ops(reads)) success.push_back(std::move(op));
  json request = {{"compare",
                   {{{"key", base64_encode(key)},
                     {"target", "MOD"},
                     {"result", "EQUAL"},
                     {"mod_revision", std::to_string(expected_mod_revision)}}}},
                  {"success", std::move(success)}};
  impl_->changed = 0;
  auto reply = impl_->call("/v3/kv/txn", request);
  auto it = reply.find("succeeded");
  if (it == reply.end() || !it->is_boolean() || !it->get<bool>()) return std::nullopt;
  impl_->changed = header_revision(reply);
  std::vector<std::vector<KeyValue>> out;
  if (reads.empty()) return out;
  auto responses = reply.find("responses");
  if (responses == reply.end() || !responses->is_array() || responses->size() != reads.size() + 1)
    throw StoreError(fmt::format("etcd at {} answered a write and {} reads with another count",
                                 impl_->endpoints, reads.size()));
  for (std::size_t i = 1; i < responses->size(); ++i) {
    const json& response = (*responses)[i];
    if (!response.is_object() || !response.contains("response_range"))
      throw StoreError("etcd answered a range of a transaction without its result");
    out.push_back(key_values(response["response_range"]));
  }
  return out;
}

std::string EtcdStore::describe() const {
  return "etcd at " + impl_->endpoints;
}

void EtcdStore::interrupt_watch() {
  std::lock_guard lock(impl_->watch_mutex);
  if (impl_->watching) curl_multi_wakeup(impl_->watching);
}

std::int64_t EtcdStore::changed_at() const {
  return impl_->changed;
}

KeyRange prefix_range(const std::string& prefix) {
  return KeyRange{prefix, prefix_end(prefix)};
}

KeyRange single_key(const std::string& key) {
  return KeyRange{key, key + '\0'};
}

std::pair<std::vector<std::vector<KeyValue>>, std::int64_t> EtcdStore::read_ranges_at(
    const std::vector<KeyRange>& ranges) {
  json ops = json::array();
  for (const auto& r : ranges)
    ops.push_back(
        {{"request_range", {{"key", base64_encode(r.key)}, {"range_end", base64_encode(r.end)}}}});
  return impl_->read_ranges(ops);
}

void EtcdStore::watch(const std::vector<KeyRange>& ranges, std::int64_t start_revision,
                      const std::function<bool(const WatchMessage&)>& on_message,
                      const std::atomic<bool>& stop) {
  Impl& m = *impl_;
  m.changed = 0;
  const std::string endpoint = m.members[m.current];
  // The gateway reads the body as a stream of requests: one watch a range,
  // all on this stream.
  std::string body;
  for (const auto& r : ranges) {
    json create = {{"key", base64_encode(r.key)}, {"range_end", base64_encode(r.end)}};
    if (start_revision > 0) create["start_revision"] = std::to_string(start_revision);
    body += json{{"create_request", create}}.dump() + "\n";
  }
  WatchStream stream;
  stream.on_message = &on_message;
  curl_easy_reset(m.curl);
  const std::string url = endpoint + "/v3/watch";
  curl_easy_setopt(m.curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(m.curl, CURLOPT_POST, 1L);
  curl_easy_setopt(m.curl, CURLOPT_POSTFIELDS, body.c_str());
  curl_easy_setopt(m.curl, CURLOPT_POSTFIELDSIZE, long(body.size()));
  curl_easy_setopt(m.curl, CURLOPT_CONNECTTIMEOUT_MS, long(m.timeout.count()));
  curl_easy_setopt(m.curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(m.curl, CURLOPT_NOPROXY, "*");
  m.set_tls(endpoint);
  curl_easy_setopt(m.curl, CURLOPT_SOCKOPTFUNCTION, keep_probing);
  curl_easy_setopt(m.curl, CURLOPT_WRITEFUNCTION, WatchStream::take);
  curl_easy_setopt(m.curl, CURLOPT_WRITEDATA, &stream);
  struct curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  curl_easy_setopt(m.curl, CURLOPT_HTTPHEADER, headers);
  // On a multi handle, so that interrupt_watch() can wake the wait at once.
  CURLM* multi = curl_multi_init();
  curl_multi_add_handle(multi, m.curl);
  {
    std::lock_guard lock(m.watch_mutex);
    m.watching = multi;
  }
  CURLcode rc = CURLE_OK;
  for (int running = 1; running && !stop.load();) {
    if (curl_multi_perform(multi, &running) != CURLM_OK) break;
    if (running) curl_multi_poll(multi, nullptr, 0, 1000, nullptr);
  }
  int left = 0;
  while (CURLMsg* done = curl_multi_info_read(multi, &left))
    if (done->msg == CURLMSG_DONE) rc = done->data.result;
  {
    std::lock_guard lock(m.watch_mutex);
    m.watching = nullptr;
  }
  curl_multi_remove_handle(multi, m.curl);
  curl_multi_cleanup(multi);
  curl_slist_free_all(headers);
  if (stream.done || stop.load()) return;
  if (stream.error) std::rethrow_exception(stream.error);
  // The next attempt goes to the next member of a cluster.
  m.current = (m.current + 1) % m.members.size();
  throw StoreUnavailable(
      fmt::format("etcd at {}: the watch of {} ended: {}", endpoint,
                  ranges.empty() ? std::string("nothing") : ranges.front().key,
                  rc == CURLE_OK ? "the server closed it" : curl_easy_strerror(rc)));
}

}  // namespace ductile::agent
