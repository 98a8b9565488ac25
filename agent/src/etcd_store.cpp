// etcd v3 over gRPC (HTTP/2 through libcurl: prior knowledge on plain
// HTTP, ALPN on TLS), the messages encoded by etcd_wire. A unary call is a
// POST of one length-prefixed message; the answer is one message and a
// grpc-status in the trailers (or the headers, when it failed at once).
// The lease keep-alives run on one stream that stays open: each renewal
// is a message on it and its one answer. A watch sends its creates and
// reads its messages until it ends (etcd keeps a watch after the client's
// half of the stream closes).
#include "ductile/agent/etcd_store.hpp"

#include <curl/curl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cctype>
#include <charconv>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>

#include <fmt/format.h>

#include "agent_common.hpp"
#include "ductile/error.hpp"
#include "etcd_wire.hpp"

namespace ductile::agent {
namespace {

namespace wire = etcd_wire;

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

wire::Range range_of(const RangeRead& r) {
  return wire::Range{r.key, r.prefix ? prefix_end(r.key) : std::string(), r.limit, r.keys_only,
                     r.oldest_first};
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

// grpc-message is percent-encoded.
std::string percent_decoded(std::string_view text) {
  std::string out;
  for (std::size_t i = 0; i < text.size(); ++i) {
    unsigned value = 0;
    if (text[i] == '%' && i + 2 < text.size() &&
        std::from_chars(text.data() + i + 1, text.data() + i + 3, value, 16).ptr ==
            text.data() + i + 3) {
      out += static_cast<char>(value);
      i += 2;
    } else {
      out += text[i];
    }
  }
  return out;
}

}  // namespace

// Named, not anonymous: EtcdStore::Impl holds one (a unity build would
// otherwise warn).
namespace etcd_store_detail {

// An answer as it comes: its messages, and the gRPC status of its headers
// or trailers.
struct Answer {
  static constexpr std::size_t kMaxStatusChars = 4096;
  wire::Deframer messages;
  std::optional<int> status;
  std::string status_message;
  bool grpc = false;  // content-type application/grpc
  // A watch's: each message as it is whole (false: stop reading).
  const std::function<bool(const WatchMessage&)>* on_message = nullptr;
  bool done = false;
  std::exception_ptr error;

  static std::size_t take(char* data, std::size_t size, std::size_t count, void* user) {
    auto& self = *static_cast<Answer*>(user);
    try {
      self.messages.feed(std::string_view(data, size * count));
      if (self.on_message) {
        std::string message;
        while (self.messages.next(message))
          if (!(*self.on_message)(wire::decode_watch_response(message))) {
            self.done = true;
            return 0;
          }
      } else if (self.messages.pending() > wire::kMaxMessageBytes + 5) {
        throw StoreError(
            fmt::format("etcd sent an answer of over {} bytes", wire::kMaxMessageBytes));
      }
    } catch (...) {
      self.error = std::current_exception();
      return 0;
    }
    return size * count;
  }

  static std::size_t header(char* data, std::size_t size, std::size_t count, void* user) {
    auto& self = *static_cast<Answer*>(user);
    std::string_view line(data, size * count);
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.remove_suffix(1);
    const auto colon = line.find(':');
    if (colon == std::string_view::npos) return size * count;
    std::string name(line.substr(0, colon));
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    std::string_view value = line.substr(colon + 1);
    while (!value.empty() && value.front() == ' ') value.remove_prefix(1);
    if (name == "grpc-status") {
      int code = 0;
      if (std::from_chars(value.data(), value.data() + value.size(), code).ptr ==
          value.data() + value.size())
        self.status = code;
      else
        self.status = 2;  // UNKNOWN: a status no gRPC server sends
    } else if (name == "grpc-message") {
      self.status_message = percent_decoded(value.substr(0, kMaxStatusChars));
    } else if (name == "content-type") {
      self.grpc = value.starts_with("application/grpc");
    }
    return size * count;
  }
};

}  // namespace etcd_store_detail

using etcd_store_detail::Answer;

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
  // Every call runs on this multi handle, so that they all, the watch
  // too, use its one connection (an easy handle added to a multi handle
  // uses the multi's connections, not its own).
  CURLM* multi = nullptr;
  curl_slist* grpc_headers = nullptr;  // every call's: gRPC's content type, trailers

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    if (multi) curl_multi_cleanup(multi);
    if (curl) curl_easy_cleanup(curl);
    curl_slist_free_all(grpc_headers);
  }
  std::mutex watch_mutex;
  bool watching = false;  // a watch runs: interrupt_watch() wakes it

  // Runs the transfer prepared on `curl` until it ends (or `stop` is set):
  // libcurl's code.
  CURLcode perform(const std::atomic<bool>* stop = nullptr) {
    curl_multi_add_handle(multi, curl);
    for (int running = 1; running && !(stop && stop->load());) {
      if (curl_multi_perform(multi, &running) != CURLM_OK) break;
      if (running) curl_multi_poll(multi, nullptr, 0, 1000, nullptr);
    }
    CURLcode rc = CURLE_OK;
    int left = 0;
    while (CURLMsg* done = curl_multi_info_read(multi, &left))
      if (done->msg == CURLMSG_DONE) rc = done->data.result;
    curl_multi_remove_handle(multi, curl);
    return rc;
  }

  // libcurl 7.88 cannot use again an HTTP/2 connection that it opened with
  // prior knowledge (the call fails at once, "Error in the HTTP2 framing
  // layer"; fixed in 8.0). With it, a call on the connection of the last
  // one asks for HTTP/2 without prior knowledge, which uses that
  // connection; should the connection be gone, that call is made on a new
  // one in HTTP/1.1, which etcd answers without gRPC, and is made again.
  bool reuse_quirk = [] {
    const auto* info = curl_version_info(CURLVERSION_NOW);
    return info->version_num >= 0x075800 && info->version_num < 0x080000;
  }();
  std::string open_h2;  // the endpoint of this handle's last HTTP/2 call

  // A POST of `body` to `endpoint`'s `method` ("KV/Range"), HTTP/2, TLS
  // with the files given to an https:// endpoint; the answer into `answer`
  // (`fresh`: on a new connection, with prior knowledge). Not reset between calls: with
  // libcurl 7.88 that too loses the connection; every option is set for each call.
  // `handle`: `curl` unless another; no `body`: the request's body comes
  // from the handle's read function, as the caller sets it.
  void prepare(const std::string& endpoint, const char* method, const std::string* body,
               Answer& answer, bool fresh, CURL* handle = nullptr) {
    CURL* curl = handle ? handle : this->curl;
    const std::string url = endpoint + "/etcdserverpb." + method;
    const bool tls_endpoint = endpoint.starts_with("https://");
    curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
    // With the quirk, prior knowledge goes on a new connection only (after
    // a failed call the old one may still be there).
    const bool reuse = reuse_quirk && !fresh && open_h2 == endpoint;
    curl_easy_setopt(curl, CURLOPT_HTTP_VERSION,
                     tls_endpoint ? long(CURL_HTTP_VERSION_2TLS)
                     : reuse      ? long(CURL_HTTP_VERSION_2_0)
                                  : long(CURL_HTTP_VERSION_2_PRIOR_KNOWLEDGE));
    curl_easy_setopt(curl, CURLOPT_FRESH_CONNECT,
                     fresh || (reuse_quirk && !tls_endpoint && !reuse) ? 1L : 0L);
    curl_easy_setopt(curl, CURLOPT_POST, 1L);
    if (body) {
      curl_easy_setopt(curl, CURLOPT_POSTFIELDS, body->data());
      curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE, long(body->size()));
    }
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, long(timeout.count()));
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(curl, CURLOPT_SOCKOPTFUNCTION, keep_probing);
    if (tls_endpoint) {
      curl_easy_setopt(curl, CURLOPT_SSL_VERIFYPEER, 1L);
      curl_easy_setopt(curl, CURLOPT_SSL_VERIFYHOST, 2L);
      if (!tls.ca_file.empty()) curl_easy_setopt(curl, CURLOPT_CAINFO, tls.ca_file.c_str());
      if (!tls.cert_file.empty()) {
        curl_easy_setopt(curl, CURLOPT_SSLCERT, tls.cert_file.c_str());
        curl_easy_setopt(curl, CURLOPT_SSLKEY, tls.key_file.c_str());
      }
    }
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, Answer::take);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &answer);
    curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, Answer::header);
    curl_easy_setopt(curl, CURLOPT_HEADERDATA, &answer);
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, grpc_headers);
  }

  // After a call to `endpoint` that ended with `rc`: whether it must be
  // made again on a new connection (see reuse_quirk).
  bool again_on_new_connection(const std::string& endpoint, CURLcode rc, const Answer& answer,
                               bool fresh) {
    long used = 0;
    curl_easy_getinfo(curl, CURLINFO_HTTP_VERSION, &used);
    const bool again = !fresh && rc == CURLE_OK && !answer.status && open_h2 == endpoint &&
                       used != CURL_HTTP_VERSION_2_0;
    open_h2 = rc == CURLE_OK && used == CURL_HTTP_VERSION_2_0 ? endpoint : std::string();
    return again;
  }

  // The error of an answer that ended with a gRPC status other than OK, or
  // without one: StoreUnavailable where trying again helps (no leader yet,
  // a restart in progress, too many requests), else StoreError.
  [[noreturn]] void fail(const std::string& endpoint, const char* method, const Answer& answer,
                         long http) {
    if (!answer.status) {
      const std::string what = fmt::format(
          "etcd at {}: {} failed: HTTP {} {}", endpoint, method, http,
          answer.grpc ? "without a gRPC status" : "that is not gRPC (is this etcd's client URL?)");
      if (http >= 500) throw StoreUnavailable(what);
      throw StoreError(what);
    }
    const int code = *answer.status;
    const std::string what =
        fmt::format("etcd at {}: {} failed: {} (gRPC status {})", endpoint, method,
                    answer.status_message.empty() ? "no message" : answer.status_message, code);
    // 4 deadline exceeded, 8 resource exhausted, 14 unavailable.
    if (code == 4 || code == 8 || code == 14) throw StoreUnavailable(what);
    throw StoreError(what);
  }

  std::string call_one(const std::string& endpoint, const char* method,
                       const std::string& request) {
    const std::string body = wire::frame(request);
    for (bool fresh = false;; fresh = true) {
      Answer answer;
      prepare(endpoint, method, &body, answer, fresh);
      curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, long(timeout.count()));
      const CURLcode rc = perform();
      long http = 0;
      curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &http);
      if (again_on_new_connection(endpoint, rc, answer, fresh)) continue;
      if (answer.error) std::rethrow_exception(answer.error);
      if (rc == CURLE_OPERATION_TIMEDOUT)
        throw StoreTimeout(
            fmt::format("etcd at {}: {} failed: {}", endpoint, method, curl_easy_strerror(rc)));
      if (rc != CURLE_OK)
        throw StoreUnavailable(
            fmt::format("etcd at {}: {} failed: {}", endpoint, method, curl_easy_strerror(rc)));
      if (!answer.status || *answer.status != 0) fail(endpoint, method, answer, http);
      std::string message;
      if (!answer.messages.next(message) || answer.messages.pending() != 0)
        throw StoreError(fmt::format("etcd at {}: {} answered with {} one message", endpoint,
                                     method, message.empty() ? "less than" : "more than"));
      return message;
    }
  }

  // `one()` made to the member that answered last, else to the others in
  // turn (`one` reads `current`): a member that is down, or cannot serve
  // without a quorum, is skipped. StoreUnavailable when no member could
  // serve it.
  template <class One>
  std::string on_members(const One& one) {
    for (std::size_t tried = 0;; ++tried) {
      try {
        return one();
      } catch (const StoreUnavailable&) {
        if (tried + 1 >= members.size()) throw;
        current = (current + 1) % members.size();
      }
    }
  }

  std::string call(const char* method, const std::string& request) {
    return on_members([&] { return call_one(members[current], method, request); });
  }

  // The lease keep-alives' stream: open from the first renewal on, on a
  // connection of its own (the calls' connection cannot carry a second
  // stream with libcurl 7.88, see reuse_quirk). A renewal on a stream of
  // its own cost etcd 7 times the CPU of a message on this one.
  struct Renewals {
    CURL* curl = nullptr;
    CURLM* multi = nullptr;
    std::string endpoint;
    Answer answer;
    std::string outgoing;  // request frames libcurl has not taken yet
    bool paused = false;   // libcurl waits for outgoing

    Renewals() = default;
    Renewals(const Renewals&) = delete;
    Renewals& operator=(const Renewals&) = delete;
    ~Renewals() {
      if (multi && curl) curl_multi_remove_handle(multi, curl);
      if (curl) curl_easy_cleanup(curl);
      if (multi) curl_multi_cleanup(multi);
    }
    static std::size_t give(char* buffer, std::size_t size, std::size_t count, void* user) {
      auto& self = *static_cast<Renewals*>(user);
      if (self.outgoing.empty()) {
        self.paused = true;
        return CURL_READFUNC_PAUSE;
      }
      const std::size_t n = std::min(size * count, self.outgoing.size());
      std::memcpy(buffer, self.outgoing.data(), n);
      self.outgoing.erase(0, n);
      return n;
    }
  };
  std::unique_ptr<Renewals> renewals;

  // One renewal on the stream (opened first when there is none): the
  // answer's message. Throws as call_one(); the caller closes the stream
  // then, so that a late answer is never taken for the next renewal's.
  std::string renew_once(const std::string& request) {
    constexpr const char* kMethod = "Lease/LeaseKeepAlive";
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    if (!renewals) {
      auto r = std::make_unique<Renewals>();
      r->curl = curl_easy_init();
      r->multi = curl_multi_init();
      if (!r->curl || !r->multi) throw StoreError("curl_easy_init failed");
      r->endpoint = members[current];
      prepare(r->endpoint, kMethod, nullptr, r->answer, true, r->curl);
      curl_easy_setopt(r->curl, CURLOPT_READFUNCTION, Renewals::give);
      curl_easy_setopt(r->curl, CURLOPT_READDATA, r.get());
      curl_easy_setopt(r->curl, CURLOPT_TIMEOUT_MS, 0L);
      r->outgoing = wire::frame(request);
      curl_multi_add_handle(r->multi, r->curl);
      renewals = std::move(r);
    } else {
      renewals->outgoing += wire::frame(request);
      if (std::exchange(renewals->paused, false)) curl_easy_pause(renewals->curl, CURLPAUSE_CONT);
    }
    Renewals& r = *renewals;
    for (std::string message;;) {
      int running = 0;
      const CURLMcode mc = curl_multi_perform(r.multi, &running);
      if (r.answer.error) std::rethrow_exception(r.answer.error);
      if (r.answer.messages.next(message)) return message;
      if (mc != CURLM_OK)
        throw StoreUnavailable(
            fmt::format("etcd at {}: {} failed: {}", r.endpoint, kMethod, curl_multi_strerror(mc)));
      if (!running) {
        CURLcode rc = CURLE_OK;
        int left = 0;
        while (CURLMsg* done = curl_multi_info_read(r.multi, &left))
          if (done->msg == CURLMSG_DONE) rc = done->data.result;
        long http = 0;
        curl_easy_getinfo(r.curl, CURLINFO_RESPONSE_CODE, &http);
        if (rc != CURLE_OK)
          throw StoreUnavailable(fmt::format("etcd at {}: {} failed: {}", r.endpoint, kMethod,
                                             curl_easy_strerror(rc)));
        if (!r.answer.status || *r.answer.status != 0) fail(r.endpoint, kMethod, r.answer, http);
        throw StoreUnavailable(fmt::format("etcd at {}: {} failed: the server closed the stream",
                                           r.endpoint, kMethod));
      }
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline)
        throw StoreTimeout(fmt::format("etcd at {}: {} failed: no answer within {} ms", r.endpoint,
                                       kMethod, timeout.count()));
      const auto wait = std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
      curl_multi_poll(r.multi, nullptr, 0,
                      static_cast<int>(std::min<std::int64_t>(wait.count(), 1000)), nullptr);
    }
  }

  // A renewal, to the members in turn (as call()); the stream is closed
  // after any error.
  std::string renew(const std::string& request) {
    return on_members([&] {
      try {
        return renew_once(request);
      } catch (...) {
        renewals.reset();
        throw;
      }
    });
  }

  // A transaction of range ops only (without comparisons it runs its
  // success branch, every range at one revision, in one round trip): each
  // range's keys, and the revision they were read at.
  std::pair<std::vector<std::vector<KeyValue>>, std::int64_t> read_ranges(
      const std::vector<wire::Range>& ranges) {
    changed = 0;
    std::vector<std::string> ops;
    for (const auto& r : ranges) ops.push_back(wire::range_op(r));
    auto answer = wire::decode_txn_response(call("KV/Txn", wire::txn_request({}, ops)));
    if (answer.responses.size() != ranges.size())
      throw StoreError(fmt::format("etcd at {} answered a read of {} ranges with another count",
                                   endpoints, ranges.size()));
    std::vector<std::vector<KeyValue>> out;
    for (auto& response : answer.responses) {
      if (!response.is_range)
        throw StoreError("etcd answered a range of a transaction without its result");
      out.push_back(std::move(response.kvs));
    }
    return {std::move(out), answer.revision};
  }
};

EtcdStore::EtcdStore(std::string endpoint, std::chrono::milliseconds timeout, EtcdTls tls)
    : impl_(std::make_unique<Impl>()) {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  if (const auto* version = curl_version_info(CURLVERSION_NOW);
      !(version->features & CURL_VERSION_HTTP2))
    throw Error(ErrorKind::unsupported,
                fmt::format("libcurl {} has no HTTP/2 (it was built without nghttp2), and the "
                            "agent reaches etcd over gRPC, which runs on HTTP/2: install a "
                            "libcurl with HTTP/2 (`curl -V` lists HTTP2 among its features)",
                            version->version));
  impl_->endpoints = endpoint;
  for (auto& member : split(endpoint, ','))
    if (!member.empty()) impl_->members.push_back(std::move(member));
  if (impl_->members.empty()) impl_->members.push_back(endpoint);
  impl_->timeout = timeout;
  impl_->tls = std::move(tls);
  impl_->curl = curl_easy_init();
  impl_->multi = curl_multi_init();
  // One connection kept: a new one (another member, or one made after an
  // answer in HTTP/1.1, see reuse_quirk) closes the one before.
  if (impl_->multi) curl_multi_setopt(impl_->multi, CURLMOPT_MAXCONNECTS, 1L);
  impl_->grpc_headers = curl_slist_append(nullptr, "Content-Type: application/grpc");
  if (impl_->grpc_headers)
    if (auto* both = curl_slist_append(impl_->grpc_headers, "TE: trailers"))
      impl_->grpc_headers = both;
  if (!impl_->curl || !impl_->multi || !impl_->grpc_headers || !impl_->grpc_headers->next) {
    throw StoreError("curl_easy_init failed");  // ~Impl frees what was made
  }
}

EtcdStore::~EtcdStore() = default;

std::int64_t EtcdStore::grant_lease(std::int64_t ttl_seconds) {
  const auto answer = wire::decode_lease_response(
      impl_->call("Lease/LeaseGrant", wire::lease_grant_request(ttl_seconds)));
  if (!answer.error.empty())
    throw StoreError(fmt::format("etcd at {}: lease grant failed: {}", impl_->endpoints,
                                 excerpt(answer.error, 200)));
  if (answer.id == 0)
    throw StoreError("etcd at " + impl_->endpoints + ": lease grant returned no id");
  return answer.id;
}

bool EtcdStore::keep_alive(std::int64_t lease) {
  // One message on the stream, and its answer: a TTL of 0 means the lease
  // no longer exists.
  return wire::decode_lease_response(impl_->renew(wire::lease_id_request(lease))).ttl > 0;
}

void EtcdStore::revoke_lease(std::int64_t lease) {
  try {
    impl_->call("Lease/LeaseRevoke", wire::lease_id_request(lease));
  } catch (const StoreUnavailable&) {
    throw;
  } catch (const StoreError&) {
    // Already expired: nothing left to revoke.
  }
}

std::int64_t EtcdStore::lease_remaining(std::int64_t lease) {
  // An expired or unknown lease: TTL -1.
  return wire::decode_lease_response(
             impl_->call("Lease/LeaseTimeToLive", wire::lease_id_request(lease)))
      .ttl;
}

void EtcdStore::put(const std::string& key, const std::string& value, std::int64_t lease) {
  impl_->changed = 0;
  impl_->changed =
      wire::decode_change_response(impl_->call("KV/Put", wire::put_request(key, value, lease)))
          .revision;
}

std::vector<std::vector<KeyValue>> EtcdStore::read(const std::vector<RangeRead>& reads) {
  if (reads.empty()) return {};
  std::vector<wire::Range> ranges;
  for (const auto& r : reads) ranges.push_back(range_of(r));
  return impl_->read_ranges(ranges).first;
}

void EtcdStore::erase(const std::string& key) {
  impl_->changed = 0;
  const auto answer = wire::decode_change_response(
      impl_->call("KV/DeleteRange", wire::delete_range_request(key, {})));
  if (answer.deleted > 0) impl_->changed = answer.revision;
}

void EtcdStore::erase_prefix(const std::string& prefix) {
  impl_->changed = 0;
  const auto answer = wire::decode_change_response(
      impl_->call("KV/DeleteRange", wire::delete_range_request(prefix, prefix_end(prefix))));
  if (answer.deleted > 0) impl_->changed = answer.revision;
}

bool EtcdStore::compare_and_swap(const std::string& key, std::int64_t expected_mod_revision,
                                 const std::string& value, std::int64_t lease) {
  return compare_and_swap_then_read(key, expected_mod_revision, value, lease, {}).has_value();
}

std::optional<std::vector<std::vector<KeyValue>>> EtcdStore::compare_and_swap_then_read(
    const std::string& key, std::int64_t expected_mod_revision, const std::string& value,
    std::int64_t lease, const std::vector<RangeRead>& reads) {
  std::vector<std::vector<KeyValue>> none;
  return compare_and_swap_then_read_ranges(key, expected_mod_revision, value, lease, reads, {},
                                           none);
}

std::optional<std::vector<std::vector<KeyValue>>> EtcdStore::compare_and_swap_then_read_ranges(
    const std::string& key, std::int64_t expected_mod_revision, const std::string& value,
    std::int64_t lease, const std::vector<RangeRead>& reads, const std::vector<KeyRange>& ranges,
    std::vector<std::vector<KeyValue>>& contents) {
  // The ranges after the put, in its branch: read at the revision it wrote.
  std::vector<std::string> success = {wire::put_op(key, value, lease)};
  for (const auto& r : reads) success.push_back(wire::range_op(range_of(r)));
  for (const auto& r : ranges) success.push_back(wire::range_op(wire::Range{r.key, r.end}));
  impl_->changed = 0;
  auto answer = wire::decode_txn_response(impl_->call(
      "KV/Txn",
      wire::txn_request({wire::compare_mod_revision(key, expected_mod_revision)}, success)));
  if (!answer.succeeded) return std::nullopt;
  impl_->changed = answer.revision;
  std::vector<std::vector<KeyValue>> out;
  if (success.size() == 1) return out;
  if (answer.responses.size() != success.size())
    throw StoreError(fmt::format("etcd at {} answered a write and {} reads with another count",
                                 impl_->endpoints, success.size() - 1));
  for (std::size_t i = 1; i < answer.responses.size(); ++i)
    if (!answer.responses[i].is_range)
      throw StoreError("etcd answered a range of a transaction without its result");
  for (std::size_t i = 0; i < reads.size(); ++i)
    out.push_back(std::move(answer.responses[1 + i].kvs));
  if (ranges.empty()) return out;
  contents.clear();
  for (std::size_t i = 1 + reads.size(); i < answer.responses.size(); ++i)
    contents.push_back(std::move(answer.responses[i].kvs));
  return out;
}

std::string EtcdStore::describe() const {
  return "etcd at " + impl_->endpoints;
}

void EtcdStore::interrupt_watch() {
  std::lock_guard lock(impl_->watch_mutex);
  if (impl_->watching) curl_multi_wakeup(impl_->multi);
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
  std::vector<wire::Range> reads;
  for (const auto& r : ranges) reads.push_back(wire::Range{r.key, r.end});
  return impl_->read_ranges(reads);
}

void EtcdStore::watch(const std::vector<KeyRange>& ranges, std::int64_t start_revision,
                      const std::function<bool(const WatchMessage&)>& on_message,
                      const std::atomic<bool>& stop) {
  Impl& m = *impl_;
  m.changed = 0;
  const std::string endpoint = m.members[m.current];
  // One watch a range, all on this stream; its sending half then closes.
  std::string body;
  for (const auto& r : ranges) body += wire::frame(wire::watch_create_request(r, start_revision));
  for (bool fresh = false;; fresh = true) {
    Answer answer;
    answer.on_message = &on_message;
    m.prepare(endpoint, "Watch/Watch", &body, answer, fresh);
    curl_easy_setopt(m.curl, CURLOPT_TIMEOUT_MS, 0L);
    {
      std::lock_guard lock(m.watch_mutex);
      m.watching = true;
    }
    const CURLcode rc = m.perform(&stop);
    long http = 0;
    curl_easy_getinfo(m.curl, CURLINFO_RESPONSE_CODE, &http);
    {
      std::lock_guard lock(m.watch_mutex);
      m.watching = false;
    }
    if (answer.done || stop.load()) return;
    if (m.again_on_new_connection(endpoint, rc, answer, fresh)) continue;
    if (answer.error) std::rethrow_exception(answer.error);
    // A status other than OK: the server refused or ended the watch.
    if (rc == CURLE_OK && (!answer.status || *answer.status != 0))
      m.fail(endpoint, "Watch/Watch", answer, http);
    // The next attempt goes to the next member of a cluster.
    m.current = (m.current + 1) % m.members.size();
    throw StoreUnavailable(
        fmt::format("etcd at {}: the watch of {} ended: {}", endpoint,
                    ranges.empty() ? std::string("nothing") : ranges.front().key,
                    rc == CURLE_OK ? "the server closed it" : curl_easy_strerror(rc)));
  }
}

}  // namespace ductile::agent
