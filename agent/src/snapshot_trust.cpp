// What an agent checks before it trusts a snapshot. See snapshot_trust.hpp.
#include "snapshot_trust.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "ductile/error.hpp"
#include "snapshot_area.hpp"

namespace ductile::agent {

// Not an anonymous namespace: a unity build puts several of the library's
// files into one translation unit, where their helpers' names would clash.
namespace snapshot_trust_detail {

namespace fs = std::filesystem;

std::string hex(const unsigned char* bytes, std::size_t size) {
  std::string out;
  out.reserve(2 * size);
  for (std::size_t i = 0; i < size; ++i) out += fmt::format("{:02x}", bytes[i]);
  return out;
}

// The problem of one copy, "" when it fits.
std::string copy_problem(const SnapshotCopy& copy, const std::string& place,
                         const SnapshotBounds& bounds) {
  if (!std::binary_search(bounds.worlds.begin(), bounds.worlds.end(), copy.world))
    return fmt::format("\"{}.world\" is {}; expected a world size of this job ({})", place,
                       copy.world, fmt::join(bounds.worlds, ", "));
  if (bounds.reached && copy.step > *bounds.reached + bounds.ahead)
    return fmt::format(
        "\"{}.step\" is {}; expected at most {} (the newest step this node's workers reached, "
        "{}, and {} more)",
        place, copy.step, *bounds.reached + bounds.ahead, *bounds.reached, bounds.ahead);
  return "";
}

}  // namespace snapshot_trust_detail

using namespace snapshot_trust_detail;

std::vector<std::int64_t> job_world_sizes(const std::vector<std::int64_t>& valid_gpus,
                                          std::int64_t nproc_per_node, std::int64_t min_nodes,
                                          std::int64_t max_nodes) {
  std::vector<std::int64_t> out;
  for (std::int64_t n = std::max<std::int64_t>(1, min_nodes); n <= max_nodes; ++n) {
    const std::int64_t world = n * nproc_per_node;
    if (valid_gpus.empty() ||
        std::find(valid_gpus.begin(), valid_gpus.end(), world) != valid_gpus.end())
      out.push_back(world);
  }
  return out;
}

void note_reached(SnapshotBounds& bounds, const std::vector<SnapshotCopy>& own,
                  std::int64_t restored) {
  if (own.empty() && restored < 0) return;
  const std::int64_t newest = std::max(own.empty() ? -1 : own.front().step, restored);
  bounds.reached = std::max(bounds.reached.value_or(newest), newest);
  // One own copy: the first snapshot of the job (or of a round), its step
  // the interval's upper bound.
  const std::int64_t interval =
      own.size() >= 2 ? own[0].step - own[1].step : std::max<std::int64_t>(newest, 1);
  bounds.ahead = std::max<std::int64_t>(1, 2 * interval);
}

std::string holdings_problem(const Holdings& holdings, const SnapshotBounds& bounds) {
  for (std::size_t i = 0; i < holdings.own.size(); ++i)
    if (auto p = copy_problem(holdings.own[i], fmt::format("own[{}]", i), bounds); !p.empty())
      return "snapshots record: " + p;
  for (const auto& [node, copies] : holdings.replicas)
    for (std::size_t i = 0; i < copies.size(); ++i)
      if (auto p = copy_problem(copies[i], fmt::format("replicas.{}[{}]", node, i), bounds);
          !p.empty())
        return "snapshots record: " + p;
  return "";
}

void verify_signed_snapshot(const fs::path& folder, const core::CheckpointKey& key) {
  const fs::path manifest = folder / kSnapshotManifest, sidecar = folder / kSnapshotHmac;
  const auto data = read_small_file(manifest, kMaxManifestBytes);
  if (!data)
    throw Error(ErrorKind::io, fmt::format("'{}' cannot be read (at most {} bytes)",
                                           manifest.string(), kMaxManifestBytes));
  const auto text = read_small_file(sidecar, kMaxSidecarBytes);
  if (!text)
    throw Error(ErrorKind::io,
                fmt::format("'{}': no HMAC of the manifest, and {} gives a key: the snapshot was "
                            "saved without that key; it is not restored",
                            sidecar.string(), key.variable));
  // "hmac-sha256 <64 hex digits>  manifest.json\n", as the workers write it.
  const std::string prefix = "hmac-sha256 ", suffix = "  manifest.json\n";
  std::string recorded;
  if (text->size() == prefix.size() + 64 + suffix.size() && text->starts_with(prefix) &&
      text->ends_with(suffix))
    recorded = text->substr(prefix.size(), 64);
  if (recorded.empty() || recorded.find_first_not_of("0123456789abcdef") != std::string::npos)
    throw Error(ErrorKind::io, fmt::format("'{}' is not a manifest HMAC (one line "
                                           "'hmac-sha256 <64 hex digits>  manifest.json')",
                                           sidecar.string()));
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  if (!HMAC(EVP_sha256(), key.bytes.data(), static_cast<int>(key.bytes.size()),
            reinterpret_cast<const unsigned char*>(data->data()), data->size(), digest, &size))
    throw Error(ErrorKind::internal, "HMAC-SHA256 failed");
  const std::string actual = hex(digest, size);
  if (CRYPTO_memcmp(actual.data(), recorded.data(), actual.size()) != 0)
    throw Error(ErrorKind::io,
                fmt::format("'{}': its HMAC-SHA256 under the key of {} is not the one '{}' "
                            "records: the manifest was changed after the save, or signed with "
                            "another key; it is not restored",
                            manifest.string(), key.variable, sidecar.string()));
  const auto json = nlohmann::json::parse(*data, nullptr, false);
  const auto shards = json.is_object() ? json.find("shards") : json.end();
  if (json.is_discarded() || !json.is_object() || shards == json.end() || !shards->is_array() ||
      shards->size() > kMaxSnapshotFiles)
    throw Error(ErrorKind::io, fmt::format("'{}' lists no shard files", manifest.string()));
  for (const auto& shard : *shards) {
    const auto file = shard.is_object() ? shard.find("file") : shard.end();
    const auto sha = shard.is_object() ? shard.find("sha256") : shard.end();
    if (!shard.is_object() || file == shard.end() || !file->is_string() ||
        !snapshot_file_name(file->get<std::string>()) || sha == shard.end() || !sha->is_string())
      throw Error(ErrorKind::io, fmt::format("'{}': a shard record without its file name and "
                                             "SHA-256 (a signed manifest records both)",
                                             manifest.string()));
    const fs::path path = folder / file->get<std::string>();
    // A node's own copy holds its own ranks' files only: the others are
    // checked where they are copied from.
    std::error_code ec;
    if (fs::symlink_status(path, ec).type() == fs::file_type::not_found) continue;
    const auto digest_of = file_sha256(path, UINTMAX_MAX);
    if (digest_of != sha->get<std::string>())
      throw Error(ErrorKind::io,
                  fmt::format("'{}': its SHA-256 is {}, but the signed manifest records {}: the "
                              "shard file was changed after the save; it is not restored",
                              path.string(), digest_of.value_or("<unreadable>"),
                              excerpt(sha->get<std::string>(), 80)));
  }
}

void LogLimiter::log(const std::string& kind, const std::string& line) {
  // The kinds of a job's nodes, at most; past it the counts start again.
  constexpr std::size_t kMaxKinds = 4096;
  const auto now = std::chrono::steady_clock::now();
  std::size_t unlogged = 0;
  {
    std::unique_lock lock(mutex_);
    if (kinds_.size() >= kMaxKinds && !kinds_.count(kind)) kinds_.clear();
    auto [it, first] = kinds_.try_emplace(kind);
    if (!first && now - it->second.last < interval_) {
      ++it->second.unlogged;
      return;
    }
    it->second.last = now;
    unlogged = std::exchange(it->second.unlogged, 0);
  }
  if (unlogged == 0)
    self_.log(line);
  else
    self_.log(
        fmt::format("{} ({} more of {} since the last such line, not logged: one line "
                    "every {} ms)",
                    line, unlogged, kind, interval_.count()));
}

}  // namespace ductile::agent
