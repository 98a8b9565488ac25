// The JSON of a record read from the rendezvous, parsed strictly: the one
// parse behind every record reader (records.cpp, snapshot_plan.cpp).
// Internal to libductile_agent.
//
// Threading: a pure function. Errors: none thrown; a problem is returned.
#pragma once

#include <cstddef>
#include <string>

#include <nlohmann/json.hpp>

namespace ductile::agent {

// Records nest a few levels; nlohmann's parser and destructor recurse once
// per level, so the depth is checked before parsing.
inline constexpr std::size_t kMaxRecordDepth = 8;

// Parses `text` into `out` when it is a JSON object of at most `limit`
// bytes, nested at most kMaxRecordDepth levels, with no key twice in one
// object (nlohmann keeps the last, so two readers, or an agent and
// etcdctl, could see different records). Returns "" then, else what is
// wrong ("not JSON: ...", "nested deeper than 8 levels").
std::string parse_record_object(const std::string& text, std::size_t limit, nlohmann::json& out);

}  // namespace ductile::agent
