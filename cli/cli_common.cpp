#include "cli_common.hpp"

#include <iostream>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "ductile/core/config.hpp"
#include "ductile/core/logging.hpp"
#include "ductile/core/text.hpp"

namespace ductile::cli {

core::RuntimeOptions CliContext::runtime_options() const {
  core::RuntimeOptions options;
  for (const auto& d : plugin_dirs) options.extra_plugin_dirs.emplace_back(d);
  options.logger = core::logger();
  return options;
}

core::PluginRegistry CliContext::make_registry(
    const std::vector<std::filesystem::path>& config_dirs) const {
  std::vector<std::filesystem::path> dirs;
  for (const auto& d : plugin_dirs) dirs.emplace_back(d);
  dirs.insert(dirs.end(), config_dirs.begin(), config_dirs.end());
  return core::PluginRegistry(core::PluginRegistry::default_search_path(dirs), core::logger());
}

core::Runtime CliContext::load_runtime(const std::filesystem::path& config_file) const {
  return load_runtime(core::ConfigDocument::from_file(config_file));
}

core::Runtime CliContext::load_runtime(const core::ConfigDocument& document) const {
  if (!log_level && !std::getenv("DUCTILE_LOG_LEVEL")) {
    if (auto level = document.log_level()) core::init_logging(*level);
  }
  return core::Runtime::from_document(document, runtime_options());
}

void set_action(CLI::App* sub, CliContext& context, std::function<int()> command,
                const bool* json) {
  sub->final_callback([&context, command = std::move(command), json]() {
    context.action = command;
    context.json = json;
  });
}

std::string error_type_name(const std::exception& e) {
  if (auto* config = dynamic_cast<const core::ConfigError*>(&e)) {
    if (!config->type().empty()) return config->type();
    return "ConfigError";
  }
  if (auto* error = dynamic_cast<const Error*>(&e)) {
    if (!error->type().empty()) return error->type();
    switch (error->kind()) {
      case ErrorKind::invalid_argument:
        return "InvalidArgument";
      case ErrorKind::config:
        return "ConfigError";
      case ErrorKind::not_found:
        return "NotFound";
      case ErrorKind::plugin:
        return "PluginError";
      case ErrorKind::io:
        return "IoError";
      case ErrorKind::incompatible:
        return "Incompatible";
      case ErrorKind::communication:
        return "CommunicationError";
      case ErrorKind::unsupported:
        return "Unsupported";
      case ErrorKind::internal:
        return "InternalError";
    }
  }
  return "InternalError";
}

void print_json_error(std::ostream& out, const std::string& type, const std::string& message) {
  nlohmann::json j = {{"error", {{"type", type}, {"message", message}}}};
  out << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
}

int run_guarded(const std::function<int()>& body, const bool* json) {
  auto report = [&](const std::exception& e, int code) {
    // Escaped: a NUL would cut the message, a control or bidi character
    // act on the terminal.
    const std::string message = core::printable(e.what());
    if (json && *json) {
      print_json_error(std::cout, error_type_name(e), message);
    } else {
      std::cerr << "ductile: " << (code == kExitBug ? "internal error: " : "error: ") << message
                << std::endl;
    }
    return code;
  };
  try {
    return body();
  } catch (const Error& e) {
    return report(e, e.is_user_error() ? kExitUserError : kExitBug);
  } catch (const std::bad_alloc& e) {
    return report(e, kExitBug);
  } catch (const std::exception& e) {
    return report(e, kExitBug);
  } catch (...) {
    std::runtime_error unknown("unknown exception");
    return report(unknown, kExitBug);
  }
}

}  // namespace ductile::cli
