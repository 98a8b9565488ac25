// ductile plugins list | describe
#include <iostream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "ductile/core/config.hpp"
#include "ductile/core/text.hpp"

namespace ductile::cli {
namespace {

struct PluginsOptions {
  bool json = false;
  std::string name;
};

std::string default_text(const ParamSpec& p) {
  if (p.flags & param_required) return "required";
  if (p.default_value) return std::string("default ") + p.default_value;
  return "optional";
}

std::string range_text(const ParamSpec& p) {
  bool integral = p.type == ParamType::integer || p.type == ParamType::integer_list;
  auto num = [&](double v) {
    return integral ? fmt::format("{}", static_cast<long long>(v)) : fmt::format("{}", v);
  };
  std::string out;
  if ((p.flags & param_has_min) && (p.flags & param_has_max))
    out = fmt::format("[{}, {}]", num(p.min_value), num(p.max_value));
  else if (p.flags & param_has_min)
    out = fmt::format(">= {}", num(p.min_value));
  else if (p.flags & param_has_max)
    out = fmt::format("<= {}", num(p.max_value));
  if (p.allowed_values) {
    std::string values;
    for (auto v = p.allowed_values; *v; ++v)
      values += (values.empty() ? "" : "|") + std::string(*v);
    out += (out.empty() ? "" : " ") + values;
  }
  return out;
}

nlohmann::json schema_json(const core::PluginInfo& info) {
  nlohmann::json params = nlohmann::json::array();
  for (const auto& p : info.params) {
    nlohmann::json j = {{"key", p.key},
                        {"type", to_string(p.type)},
                        {"required", (p.flags & param_required) != 0},
                        {"doc", p.doc ? p.doc : ""}};
    j["default"] = p.default_value ? nlohmann::json(p.default_value) : nlohmann::json(nullptr);
    if (p.flags & param_has_min) j["min"] = p.min_value;
    if (p.flags & param_has_max) j["max"] = p.max_value;
    if (p.allowed_values) {
      j["allowed"] = nlohmann::json::array();
      for (auto v = p.allowed_values; *v; ++v) j["allowed"].push_back(*v);
    }
    params.push_back(j);
  }
  return params;
}

int list_plugins(const CliContext& context, const PluginsOptions& options) {
  auto registry = context.make_registry();
  if (options.json) {
    nlohmann::json out = {{"plugins", nlohmann::json::array()},
                          {"problems", nlohmann::json::array()},
                          {"search_path", nlohmann::json::array()}};
    for (const auto& p : registry.plugins())
      out["plugins"].push_back({{"kind", to_string(p.kind)},
                                {"name", p.name},
                                {"version", p.version},
                                {"file", p.file.string()},
                                {"description", p.description}});
    for (const auto& p : registry.problems())
      out["problems"].push_back({{"file", p.file.string()}, {"message", p.message}});
    for (const auto& d : registry.search_path()) out["search_path"].push_back(d.string());
    std::cout << out.dump(2) << std::endl;
    return kExitOk;
  }
  std::size_t wk = 4, wn = 4, wv = 7;
  for (const auto& p : registry.plugins()) {
    wk = std::max(wk, std::string(to_string(p.kind)).size());
    wn = std::max(wn, p.name.size());
    wv = std::max(wv, p.version.size());
  }
  std::cout << fmt::format("{:<{}}  {:<{}}  {:<{}}  {}\n", "KIND", wk, "NAME", wn, "VERSION", wv,
                           "DESCRIPTION");
  // What a plugin says of itself and the names of files are shown escaped
  // (core::printable): they cannot act on the terminal.
  for (const auto& p : registry.plugins())
    std::cout << core::printable(
        fmt::format("{:<{}}  {:<{}}  {:<{}}  {}\n", to_string(p.kind), wk, p.name, wn, p.version,
                    wv, p.description) +
        fmt::format("{:<{}}  {}\n", "", wk + wn + wv + 4, p.file.string()));
  if (registry.plugins().empty()) std::cout << "(no plugins found)\n";
  for (const auto& p : registry.problems())
    std::cout << "problem: " << core::printable(p.message, false) << "\n";
  return kExitOk;
}

int describe_plugin(const CliContext& context, const PluginsOptions& options) {
  auto registry = context.make_registry();
  const auto& info = registry.find_any(options.name);
  if (options.json) {
    nlohmann::json out = {{"kind", to_string(info.kind)}, {"name", info.name},
                          {"version", info.version},      {"description", info.description},
                          {"file", info.file.string()},   {"build_tag", info.build_tag},
                          {"abi", info.abi_version},      {"params", schema_json(info)}};
    std::cout << out.dump(2) << std::endl;
    return kExitOk;
  }
  std::cout << fmt::format("{}/{} {}\n  {}\n  file: {}\n  built with: {} (ABI {})\n",
                           to_string(info.kind), info.name, info.version, info.description,
                           info.file.string(), info.build_tag, info.abi_version);
  if (info.params.empty()) {
    std::cout << "  parameters: none\n";
    return kExitOk;
  }
  std::cout << "  parameters:\n";
  for (const auto& p : info.params) {
    std::cout << fmt::format("    {} ({}, {}{}{})\n        {}\n", p.key, to_string(p.type),
                             default_text(p), range_text(p).empty() ? "" : ", ", range_text(p),
                             p.doc ? p.doc : "");
  }
  return kExitOk;
}

}  // namespace

void register_plugins_command(CLI::App& app, CliContext& context) {
  auto options = std::make_shared<PluginsOptions>();
  auto* plugins = app.add_subcommand("plugins", "List and inspect plugins");
  plugins->require_subcommand(1);
  auto* list = plugins->add_subcommand("list", "List the plugins found on the search path");
  list->add_flag("--json", options->json, "Print JSON");
  set_action(
      list, context, [&context, options] { return list_plugins(context, *options); },
      &options->json);
  auto* describe = plugins->add_subcommand("describe", "Show a plugin's parameter schema");
  describe->add_option("NAME", options->name, "Plugin name, or kind/name")->required();
  describe->add_flag("--json", options->json, "Print JSON");
  set_action(
      describe, context, [&context, options] { return describe_plugin(context, *options); },
      &options->json);
}

}  // namespace ductile::cli
