#include "ductile/core/logging.hpp"

#include <cstdlib>
#include <mutex>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "ductile/core/text.hpp"
#include "ductile/error.hpp"

namespace ductile::core {
namespace {

struct LoggingState {
  std::mutex mutex;
  spdlog::sink_ptr sink;
  std::shared_ptr<spdlog::logger> root;
  spdlog::level::level_enum level = spdlog::level::info;
};

LoggingState& state() {
  static LoggingState s;
  return s;
}

// The message of a log line, printable (text.hpp) and on one line: a file
// name or value quoted in it cannot act on the terminal nor forge a line.
class PrintablePayload final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const std::string text =
        printable(std::string_view(msg.payload.data(), msg.payload.size()), false);
    dest.append(text.data(), text.data() + text.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<PrintablePayload>();
  }
};

void ensure_root(LoggingState& s) {
  if (s.root) return;
  s.sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>(spdlog::color_mode::automatic);
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  formatter->add_flag<PrintablePayload>('*').set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] %*");
  s.sink->set_formatter(std::move(formatter));
  s.root = std::make_shared<spdlog::logger>("ductile", s.sink);
  s.root->set_level(s.level);
}

}  // namespace

spdlog::level::level_enum parse_log_level(std::string_view text, std::string_view where) {
  static const std::vector<std::string> names = {"trace", "debug",    "info", "warn",
                                                 "error", "critical", "off"};
  for (std::size_t i = 0; i < names.size(); ++i)
    if (text == names[i]) return static_cast<spdlog::level::level_enum>(i);
  if (text == "warning") return spdlog::level::warn;
  throw Error(ErrorKind::invalid_argument, std::string(where) + ": invalid log level '" +
                                               excerpt(text) + "'" + did_you_mean(text, names) +
                                               "; valid levels: " + join(names));
}

void init_logging(std::optional<std::string> level) {
  auto& s = state();
  std::lock_guard lock(s.mutex);
  ensure_root(s);
  if (level) {
    s.level = parse_log_level(*level, "--log-level");
  } else if (const char* env = std::getenv("DUCTILE_LOG_LEVEL"); env && *env) {
    s.level = parse_log_level(env, "DUCTILE_LOG_LEVEL");
  } else {
    s.level = spdlog::level::info;
  }
  s.root->set_level(s.level);
}

std::shared_ptr<spdlog::logger> logger() {
  auto& s = state();
  std::lock_guard lock(s.mutex);
  ensure_root(s);
  return s.root;
}

std::shared_ptr<spdlog::logger> make_logger(const std::string& name) {
  auto& s = state();
  std::lock_guard lock(s.mutex);
  ensure_root(s);
  auto l = std::make_shared<spdlog::logger>(name, s.sink);
  l->set_level(s.root->level());
  return l;
}

}  // namespace ductile::core
