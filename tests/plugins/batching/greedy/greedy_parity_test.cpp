// Parity with DeepSpeed's batch_by_seqlens over every case of
// tests/data/reference/pack_vectors.jsonl (outputs of DeepSpeed itself): every
// micro-batch DeepSpeed emits we emit identically and in the same order, with
// the same step ids, batch sizes and longest sequences; we may add the final
// group DeepSpeed never emits, after them.
#include <doctest/doctest.h>

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "sampler_support.hpp"

using nlohmann::json;

TEST_CASE("greedy reproduces DeepSpeed on every reference vector") {
  std::ifstream in(std::string(DUCTILE_TEST_DATA_DIR) + "/reference/pack_vectors.jsonl");
  REQUIRE(in.good());
  std::string line;
  int cases = 0, errors = 0, extended = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    ++cases;
    const json v = json::parse(line);
    const auto lengths = v.at("seqlens").get<std::vector<std::int64_t>>();
    const json& a = v.at("args");
    ductile::Params p;
    p.set("max_tokens", a.at("max_tokens").get<std::int64_t>());
    p.set("min_batch_size", a.value("min_batch_size", std::int64_t{1}));
    p.set("max_batch_size", a.at("max_batch_size").is_null()
                                ? std::int64_t{0}
                                : a.at("max_batch_size").get<std::int64_t>());
    p.set("order", a.at("sequence_picking_order").get<std::string>());
    p.set("effective_batch_size", a.at("effective_batch_size").get<std::int64_t>());
    p.set("same_size_microbatches", a.at("required_microbatches_of_same_size").get<bool>());
    p.set("seed", a.at("seed").get<std::int64_t>());
    const json& expect = v.at("expect");
    INFO("case ", cases, ": ", a.dump());
    if (expect.contains("error")) {
      // DeepSpeed fails when it forms fewer micro-batches than one step
      // needs. With the final group added we may have enough; otherwise we
      // refuse with a clear error of our own: min_batch_size above
      // max_batch_size when the sampler is created, too few samples when packing.
      ++errors;
      std::shared_ptr<ductile::BatchSampler> sampler;
      try {
        sampler = batching_test::sampler("greedy", p);
      } catch (const ductile::Error& e) {
        CHECK(std::string(e.what()).find("is larger than max_batch_size") != std::string::npos);
        continue;
      }
      try {
        auto r = sampler->pack({lengths, std::nullopt});
        batching_test::check_packing(r, lengths, batching_test::iota_ids(lengths.size()),
                                     sampler->options());
        ++extended;
      } catch (const ductile::Error& e) {
        CHECK(e.kind() == ductile::ErrorKind::incompatible);
        CHECK(e.type() == "NotEnoughSamples");
      }
      continue;
    }
    auto sampler = batching_test::sampler("greedy", p);
    auto r = sampler->pack({lengths, std::nullopt});
    batching_test::check_packing(r, lengths, batching_test::iota_ids(lengths.size()),
                                 sampler->options());
    const json& mbs = expect.at("microbatch_ids");
    REQUIRE(r.microbatch_count() >= mbs.size());
    for (std::size_t i = 0; i < mbs.size(); ++i) {
      INFO("micro-batch ", i);
      CHECK(r.microbatch_steps[i] == mbs[i][0].get<std::int64_t>());
      auto ours = r.microbatch(i);
      CHECK(std::vector<std::int64_t>(ours.begin(), ours.end()) ==
            mbs[i][1].get<std::vector<std::int64_t>>());
    }
    const auto sizes = expect.at("batch_sizes").get<std::vector<std::int64_t>>();
    const auto longest = expect.at("batch_max_seqlens").get<std::vector<std::int64_t>>();
    REQUIRE(r.batch_sizes.size() >= sizes.size());
    CHECK(std::vector<std::int64_t>(r.batch_sizes.begin(), r.batch_sizes.begin() + sizes.size()) ==
          sizes);
    CHECK(std::vector<std::int64_t>(r.batch_max_seqlens.begin(),
                                    r.batch_max_seqlens.begin() + longest.size()) == longest);
  }
  CHECK(cases == 200);
  MESSAGE(cases, " reference cases, ", errors, " where DeepSpeed fails (", extended,
          " of them packed once the final group is kept)");
}
