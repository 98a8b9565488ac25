// The [plugins] section: where plugins are searched beyond the built-in
// directory, and which built-in plugins a plugin found there may replace.
#include <fmt/format.h>
#include <toml++/toml.h>

#include "config_internal.hpp"
#include "ductile/core/config.hpp"
#include "ductile/core/registry.hpp"
#include "ductile/core/text.hpp"

namespace ductile::core {

namespace fs = std::filesystem;

namespace {

// The strings of [plugins] `key`, when it is an array (its type is checked
// by the schema).
template <class Visit>
void for_each_string(const toml::table* plugins, std::string_view key, Visit&& visit) {
  const auto* node = plugins ? plugins->get(key) : nullptr;
  const auto* array = node ? node->as_array() : nullptr;
  if (!array) return;
  for (const auto& element : *array)
    if (const auto* s = element.as_string()) visit(s->get(), element);
}

const toml::table* plugins_of(const toml::table& root) {
  const auto* plugins = root.get("plugins");
  return plugins ? plugins->as_table() : nullptr;
}

}  // namespace

std::vector<fs::path> ConfigDocument::plugin_dirs() const {
  std::vector<fs::path> dirs;
  for_each_string(plugins_of(impl().root), "path", [&](const std::string& text, const toml::node&) {
    fs::path p(text);
    dirs.push_back(p.is_absolute() ? p : impl().base_dir / p);
  });
  return dirs;
}

std::vector<PluginRef> ConfigDocument::builtin_overrides() const {
  std::vector<PluginRef> refs;
  for_each_string(plugins_of(impl().root), "override_builtin",
                  [&](const std::string& text, const toml::node&) {
                    if (auto ref = parse_plugin_ref(text)) refs.push_back(std::move(*ref));
                  });
  return refs;
}

void check_plugins_section(const toml::table& plugins, const std::string& file, Problems& errors) {
  for_each_string(
      &plugins, "override_builtin", [&](const std::string& text, const toml::node& node) {
        if (!parse_plugin_ref(text) && errors.wanted(position_of(file, node.source())))
          errors.add(
              {position_of(file, node.source()),
               fmt::format("[plugins] override_builtin: '{}' is not kind/name (kinds: {}), as in "
                           "\"batching/greedy\"",
                           excerpt(text), join(plugin_kind_names()))});
      });
}

}  // namespace ductile::core
