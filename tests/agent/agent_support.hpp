// Helpers of the agent tests: an etcd server on loopback with its own data
// dir, and a scan of /proc for processes that carry a test's marker in their
// environment (processes themselves: child_process.hpp).
#pragma once

#include <dirent.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "child_process.hpp"
#include "ductile/agent/etcd_store.hpp"
#include "ports.hpp"
#include "process.hpp"

namespace ductile::test {

#ifdef DUCTILE_ETCD
// Certificates for an etcd with TLS and client certificate authentication,
// made with openssl: a CA, etcd's certificate for 127.0.0.1 (server and
// client use: etcd's HTTP gateway connects to its own gRPC server with it)
// and a client's.
struct TlsFiles {
  std::filesystem::path ca, ca_key, server_cert, server_key, client_cert, client_key;
  agent::EtcdTls client() const { return {ca.string(), client_cert.string(), client_key.string()}; }
};

inline void openssl(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {"openssl"};
  argv.insert(argv.end(), args.begin(), args.end());
  ProcessResult r = run_process(argv);
  if (r.exit_code != 0) throw std::runtime_error("openssl failed: " + r.out + r.err);
}

// A CA named `name` in `dir` and, signed by it, a server and a client
// certificate.
inline TlsFiles make_certificates(const std::filesystem::path& dir, const std::string& name) {
  TlsFiles f{dir / (name + "-ca.pem"),     dir / (name + "-ca.key"),
             dir / (name + "-server.pem"), dir / (name + "-server.key"),
             dir / (name + "-client.pem"), dir / (name + "-client.key")};
  openssl({"req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f.ca_key.string(), "-out",
           f.ca.string(), "-days", "2", "-subj", "/CN=ductile-test-" + name});
  auto sign = [&](const std::filesystem::path& cert, const std::filesystem::path& key,
                  const std::string& subject, const std::string& extensions) {
    auto csr = dir / (cert.stem().string() + ".csr");
    auto ext = dir / (cert.stem().string() + ".ext");
    std::ofstream(ext) << extensions;
    openssl({"req", "-newkey", "rsa:2048", "-nodes", "-keyout", key.string(), "-out", csr.string(),
             "-subj", subject});
    openssl({"x509", "-req", "-in", csr.string(), "-CA", f.ca.string(), "-CAkey", f.ca_key.string(),
             "-CAcreateserial", "-out", cert.string(), "-days", "2", "-extfile", ext.string()});
  };
  sign(f.server_cert, f.server_key, "/CN=127.0.0.1",
       "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n");
  sign(f.client_cert, f.client_key, "/CN=ductile-agent", "extendedKeyUsage=clientAuth\n");
  return f;
}

// etcd on loopback with free client and peer ports and its own data dir;
// with `tls`, its clients must speak TLS and show a certificate of its CA.
class EtcdServer {
 public:
  // `host`: the address its clients reach it at (loopback by default).
  explicit EtcdServer(std::filesystem::path dir, std::optional<TlsFiles> tls = std::nullopt,
                      std::string host = "127.0.0.1")
      : dir_(std::move(dir)),
        tls_(std::move(tls)),
        host_(std::move(host)),
        client_port_(free_tcp_port()),
        peer_port_(free_tcp_port()) {
    start();
  }
  ~EtcdServer() { stop(); }

  std::string host_port() const { return host_ + ":" + std::to_string(client_port_); }
  std::string url() const { return (tls_ ? "https://" : "etcd://") + host_port(); }
  std::string endpoint() const { return (tls_ ? "https://" : "http://") + host_port(); }
  pid_t pid() const { return process_ ? process_->pid() : -1; }

  void start() {
    std::string client = endpoint();
    std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
    std::vector<std::string> argv = {DUCTILE_ETCD,
                                     "--name",
                                     "test",
                                     "--data-dir",
                                     (dir_ / "etcd-data").string(),
                                     "--listen-client-urls",
                                     client,
                                     "--advertise-client-urls",
                                     client,
                                     "--listen-peer-urls",
                                     peer,
                                     "--initial-advertise-peer-urls",
                                     peer,
                                     "--initial-cluster",
                                     "test=" + peer};
    if (tls_)
      for (const auto& arg :
           {std::string("--cert-file"), tls_->server_cert.string(), std::string("--key-file"),
            tls_->server_key.string(), std::string("--client-cert-auth"),
            std::string("--trusted-ca-file"), tls_->ca.string()})
        argv.push_back(arg);
    process_ = std::make_unique<Child>(argv, std::vector<std::string>{}, dir_ / "etcd.log");
    agent::EtcdStore probe(endpoint(), 500ms, tls_ ? tls_->client() : agent::EtcdTls{});
    bool up = wait_until(
        [&] {
          try {
            probe.get("/probe");
            return true;
          } catch (const agent::StoreError&) {
            return false;
          }
        },
        30s);
    if (!up) throw std::runtime_error("etcd did not start: " + read_text(dir_ / "etcd.log"));
  }
  void kill_hard() {
    process_->signal(SIGKILL);
    process_->wait(10s);
    process_.reset();
  }
  void stop() {
    if (!process_) return;
    process_->signal(SIGTERM);
    if (!process_->wait(10s)) process_->signal(SIGKILL);
    process_.reset();
  }

 private:
  std::filesystem::path dir_;
  std::optional<TlsFiles> tls_;
  std::string host_;
  int client_port_, peer_port_;
  std::unique_ptr<Child> process_;
};

// An etcd cluster of `size` members on loopback, each with its own ports
// and data dir; members can be killed and started again.
class EtcdCluster {
 public:
  EtcdCluster(std::filesystem::path dir, int size) : dir_(std::move(dir)) {
    for (int i = 0; i < size; ++i) {
      client_ports_.push_back(free_tcp_port());
      peer_ports_.push_back(free_tcp_port());
    }
    members_.resize(size);
    for (int i = 0; i < size; ++i) start(i);
    wait_ready();
  }
  ~EtcdCluster() {
    for (int i = 0; i < static_cast<int>(members_.size()); ++i) kill(i);
  }

  std::string member(int i) const { return "127.0.0.1:" + std::to_string(client_ports_[i]); }
  std::string url() const { return "etcd://" + joined(""); }
  std::string endpoints() const { return joined("http://"); }

  void start(int i) {
    std::string initial;
    for (std::size_t m = 0; m < members_.size(); ++m)
      initial += (m ? "," : "") + name(static_cast<int>(m)) + "=" + peer(static_cast<int>(m));
    std::string client = "http://" + member(i);
    members_[i] = std::make_unique<Child>(
        std::vector<std::string>{DUCTILE_ETCD, "--name", name(i), "--data-dir",
                                 (dir_ / ("etcd-" + name(i))).string(), "--listen-client-urls",
                                 client, "--advertise-client-urls", client, "--listen-peer-urls",
                                 peer(i), "--initial-advertise-peer-urls", peer(i),
                                 "--initial-cluster", initial, "--initial-cluster-state", "new"},
        std::vector<std::string>{}, dir_ / ("etcd-" + name(i) + ".log"));
  }
  void kill(int i) {
    if (!members_[i]) return;
    members_[i]->signal(SIGKILL);
    members_[i]->wait(10s);
    members_[i].reset();
  }
  // Until the cluster has a leader and takes writes.
  void wait_ready() {
    agent::EtcdStore probe(endpoints(), 1000ms);
    bool up = wait_until(
        [&] {
          try {
            probe.put("/probe", "up");
            return true;
          } catch (const agent::StoreError&) {
            return false;
          }
        },
        60s);
    if (!up)
      throw std::runtime_error("the etcd cluster did not form: " + read_text(dir_ / "etcd-m0.log"));
  }

 private:
  std::string name(int i) const { return "m" + std::to_string(i); }
  std::string peer(int i) const { return "http://127.0.0.1:" + std::to_string(peer_ports_[i]); }
  std::string joined(const std::string& scheme) const {
    std::string out;
    for (std::size_t i = 0; i < members_.size(); ++i)
      out += (i ? "," : "") + scheme + member(static_cast<int>(i));
    return out;
  }
  std::filesystem::path dir_;
  std::vector<int> client_ports_, peer_ports_;
  std::vector<std::unique_ptr<Child>> members_;
};
#endif

// A unique marker: every process of a test's job has it in its environment.
inline std::string new_marker() {
  std::random_device random;
  return "DUCTILE_AGENT_TEST_MARKER=" + std::to_string(getpid()) + "-" + std::to_string(random());
}

// Processes (not zombies) whose environment holds `marker`.
inline std::vector<int> marked_processes(const std::string& marker) {
  std::vector<int> found;
  DIR* proc = opendir("/proc");
  if (!proc) return found;
  while (dirent* entry = readdir(proc)) {
    std::string name = entry->d_name;
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string environ_text = read_text("/proc/" + name + "/environ");
    std::string needle = marker;
    needle.push_back('\0');
    if (environ_text.find(needle) != std::string::npos ||
        (environ_text.size() >= marker.size() &&
         environ_text.compare(environ_text.size() - marker.size(), marker.size(), marker) == 0))
      found.push_back(std::stoi(name));
  }
  closedir(proc);
  return found;
}

inline bool no_marked_processes(const std::string& marker, std::chrono::milliseconds limit = 10s) {
  return wait_until([&] { return marked_processes(marker).empty(); }, limit);
}

}  // namespace ductile::test
