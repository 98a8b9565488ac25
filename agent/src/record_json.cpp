// The strict parse of a record's JSON; see record_json.hpp.
#include "record_json.hpp"

#include <set>
#include <vector>

#include <fmt/format.h>

#include "ductile/agent/records.hpp"
#include "ductile/pipeline/json.hpp"

namespace ductile::agent {

std::string parse_record_object(const std::string& text, std::size_t limit, nlohmann::json& out) {
  using json = nlohmann::json;
  if (text.size() > limit)
    return fmt::format("{} bytes, more than the {} an agent writes", text.size(), limit);
  if (pipeline::json_depth_exceeded_at(text, kMaxRecordDepth) != std::string_view::npos)
    return fmt::format("nested deeper than {} levels", kMaxRecordDepth);
  std::vector<std::set<std::string>> objects;
  std::string duplicate;
  out = json::parse(
      text,
      [&](int, json::parse_event_t event, json& parsed) {
        if (event == json::parse_event_t::object_start) {
          objects.emplace_back();
        } else if (event == json::parse_event_t::object_end) {
          if (!objects.empty()) objects.pop_back();
        } else if (event == json::parse_event_t::key && !objects.empty() &&
                   !objects.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
          duplicate = parsed.get<std::string>();
        }
        return true;
      },
      false);
  if (out.is_discarded()) return fmt::format("not JSON: {}", excerpt(text));
  if (!duplicate.empty())
    return fmt::format("the key \"{}\" appears twice in one object", excerpt(duplicate, 80));
  if (!out.is_object()) return fmt::format("not a JSON object: {}", excerpt(text));
  return {};
}

}  // namespace ductile::agent
