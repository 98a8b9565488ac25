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
    "max_tokens",
    ParamType::integer,
    param_required | param_has_min | param_has_max,
    nullptr,
    1,
    static_cast<double>(kMaxTokenBudget),
    nullptr,
    "Token budget of one micro-batch; longer samples are dropped"};
inline constexpr ParamSpec kMinBatchSizeParam{"min_batch_size",
                                              ParamType::integer,
                                              param_has_min,
                                              "1",
                                              0,
                                              0,
                                              nullptr,
                                              "Fewest samples in a micro-batch (0: no minimum)"};
inline constexpr ParamSpec kMaxBatchSizeParam{"max_batch_size",
                                              ParamType::integer,
                                              param_has_min,
                                              "0",
                                              0,
                                              0,
                                              nullptr,
                                              "Most samples in a micro-batch (0: no maximum)"};
inline constexpr ParamSpec kEffectiveBatchSizeParam{
    "effective_batch_size",
    ParamType::integer,
    param_has_min,
    "1",
    1,
    0,
    nullptr,
    "Micro-batches per optimizer step (gradient accumulation x data loaders)"};
inline constexpr ParamSpec kSameSizeParam{
    "same_size_microbatches",
    ParamType::boolean,
    0,
    "false",
    0,
    0,
    nullptr,
    "All micro-batches of a step hold as many samples (pipeline parallelism)"};
inline constexpr ParamSpec kBudgetParam{
    "budget",
    ParamType::string,
    0,
    "\"sum\"",
    0,
    0,
    kBudgetValues,
    "sum: total tokens <= max_tokens (packed); padded: samples x longest <= max_tokens"};

// Reads the common keys (and "order"/"seed" when present) from validated
// parameters.
PackOptions options_from_params(const Params& params);

}  // namespace ductile::batching
