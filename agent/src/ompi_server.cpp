#include "ompi_server.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "ductile/error.hpp"

namespace ductile::agent {
namespace {

std::string read_text(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

OmpiServer::OmpiServer(std::chrono::milliseconds limit, std::string program) {
  std::string pattern =
      (std::filesystem::temp_directory_path() / "ductile-ompi-server-XXXXXX").string();
  if (!mkdtemp(pattern.data()))
    throw Error(ErrorKind::config, "--mpi-world: cannot create a directory for ompi-server");
  dir_ = pattern;
  const std::string uri_file = (dir_ / "uri").string(), log = (dir_ / "log").string();
  std::vector<std::string> args = {program, "--no-daemonize", "--report-uri", uri_file};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // Its session directory under its own folder: Open MPI creates
  // <tmpdir>/ompi.<host>.<uid> with a check-then-mkdir that fails ("File
  // exists") when another Open MPI process on the host (another agent's
  // server, a worker) creates the same directory at the same moment. Built
  // before fork: the child only calls async-signal-safe functions.
  const std::string tmpdir_key = "OMPI_MCA_orte_tmpdir_base=";
  std::string own_tmpdir = tmpdir_key + dir_.string();
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e)
    if (std::string_view(*e).substr(0, tmpdir_key.size()) != tmpdir_key) envp.push_back(*e);
  envp.push_back(own_tmpdir.data());
  envp.push_back(nullptr);
  pid_t parent = getpid();
  pid_ = fork();
  if (pid_ < 0) throw Error(ErrorKind::config, "--mpi-world: cannot fork for ompi-server");
  if (pid_ == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    setpgid(0, 0);  // a terminal's Ctrl-C goes to the agent, which stops it
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    execvpe(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    std::string text = read_text(uri_file);
    // Complete once its line ends.
    if (auto eol = text.find('\n'); eol != std::string::npos && eol > 0) {
      uri_ = text.substr(0, eol);
      return;
    }
    int status = 0;
    bool exited = waitpid(pid_, &status, WNOHANG) == pid_;
    if (exited || std::chrono::steady_clock::now() > deadline) {
      if (exited) pid_ = -1;
      std::string output = read_text(log);
      if (output.size() > 2000) output = output.substr(0, 2000) + "...";
      std::string why =
          exited && WIFEXITED(status) && WEXITSTATUS(status) == 127 && output.empty()
              ? fmt::format("'{}' was not found on PATH (Debian: openmpi-bin)", program)
              : fmt::format("'{}' {} without reporting its address{}", program,
                            exited ? "exited" : "did not start in time",
                            output.empty() ? "" : ": " + output);
      stop();
      throw Error(ErrorKind::config, "--mpi-world: " + why);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

OmpiServer::~OmpiServer() {
  stop();
}

void OmpiServer::stop() noexcept {
  if (pid_ > 0) {
    kill(pid_, SIGTERM);
    for (int i = 0; i < 100; ++i) {
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  std::error_code ignored;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
}

}  // namespace ductile::agent
