// The parameter schema shared by the batching plugins, and its conversion to
// ductile::PackOptions.
#pragma once

#include "ductile/batch_sampler.hpp"
#include "ductile/params.hpp"

namespace ductile::batching {

inline constexpr const char* kBudgetValues[] = {"sum", "padded", nullptr};
inline constexpr const char* kOrderValues[] = {"dataloader", "seqlen", "random", nullptr};

// Schema entries shared by every batching plugin; a plugin lists them in
// its own kSchema (kCommonParams... then its own keys).
inline constexpr ParamSpec kMaxTokensParam{
    .key = "max_tokens",
    .type = ParamType::integer,
    .flags = param_required | param_has_min | param_has_max,
    .min_value = 1,
    .max_value = static_cast<double>(kMaxTokenBudget),
    .doc = "Token budget of one micro-batch; longer samples are dropped"};
inline constexpr ParamSpec kMinBatchSizeParam{
    .key = "min_batch_size",
    .type = ParamType::integer,
    .flags = param_has_min,
    .default_value = "1",
    .doc = "Fewest samples in a micro-batch (0: no minimum)"};
inline constexpr ParamSpec kMaxBatchSizeParam{
    .key = "max_batch_size",
    .type = ParamType::integer,
    .flags = param_has_min,
    .default_value = "0",
    .doc = "Most samples in a micro-batch (0: no maximum)"};
inline constexpr ParamSpec kEffectiveBatchSizeParam{
    .key = "effective_batch_size",
    .type = ParamType::integer,
    .flags = param_has_min,
    .default_value = "1",
    .min_value = 1,
    .doc = "Micro-batches per optimizer step (gradient accumulation x data loaders)"};
inline constexpr ParamSpec kSameSizeParam{
    .key = "same_size_microbatches",
    .type = ParamType::boolean,
    .default_value = "false",
    .doc = "All micro-batches of a step hold as many samples (pipeline parallelism)"};
inline constexpr ParamSpec kBudgetParam{
    .key = "budget",
    .type = ParamType::string,
    .default_value = "\"sum\"",
    .allowed_values = kBudgetValues,
    .doc = "sum: total tokens <= max_tokens (packed); padded: samples x longest <= max_tokens"};

// Reads the common keys (and "order"/"seed" when present) from validated
// parameters.
PackOptions options_from_params(const Params& params);

}  // namespace ductile::batching
