// Logging set-up of the core. The core owns the sinks and the format; plugins
// receive loggers built on the same sinks through their HostContext.
//
// Threading: init_logging() is called once at start-up before other threads
// exist; the loggers it returns are thread-safe.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <spdlog/logger.h>

namespace ductile::core {

// Parses "trace", "debug", "info", "warn", "error", "critical", "off".
// Throws ductile::Error (invalid_argument) naming the valid values.
spdlog::level::level_enum parse_log_level(std::string_view text, std::string_view where);

// Sets the level of every ductile logger: `level` if given, else the
// DUCTILE_LOG_LEVEL environment variable, else "info". Throws on a bad level.
void init_logging(std::optional<std::string> level = std::nullopt);

// The core's logger (name "ductile"), writing to standard error.
std::shared_ptr<spdlog::logger> logger();

// A logger named `name` that shares the core's sinks and level; not
// registered globally, so any number may exist.
std::shared_ptr<spdlog::logger> make_logger(const std::string& name);

}  // namespace ductile::core
