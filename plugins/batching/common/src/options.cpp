#include "ductile_batching/options.hpp"

namespace ductile::batching {

PackOptions options_from_params(const Params& params) {
  PackOptions o;
  o.max_tokens = params.get_int("max_tokens");
  o.min_batch_size = params.get_int("min_batch_size");
  o.max_batch_size = params.get_int("max_batch_size");
  o.effective_batch_size = params.get_int("effective_batch_size");
  o.same_size_microbatches = params.get_bool("same_size_microbatches");
  o.budget = params.get_string("budget") == "padded" ? TokenBudget::padded : TokenBudget::sum;
  // Only the greedy samplers' schemas have an order (and its seed).
  if (params.has("order")) {
    const std::string& order = params.get_string("order");
    o.order = order == "seqlen"   ? PickingOrder::seqlen
              : order == "random" ? PickingOrder::random
                                  : PickingOrder::dataloader;
    o.seed = params.get_int("seed");
  }
  return o;
}

}  // namespace ductile::batching
