#include "ductile_batching/options.hpp"

namespace ductile::batching {

PackOptions options_from_params(const Params& params) {
  PackOptions o;
  o.max_tokens = params.get_int("max_tokens");
  o.min_batch_size = params.get_int_or("min_batch_size", 1);
  o.max_batch_size = params.get_int_or("max_batch_size", 0);
  o.effective_batch_size = params.get_int_or("effective_batch_size", 1);
  o.same_size_microbatches = params.get_bool_or("same_size_microbatches", false);
  o.budget =
      params.get_string_or("budget", "sum") == "padded" ? TokenBudget::padded : TokenBudget::sum;
  const std::string order = params.get_string_or("order", "dataloader");
  o.order = order == "seqlen"   ? PickingOrder::seqlen
            : order == "random" ? PickingOrder::random
                                : PickingOrder::dataloader;
  o.seed = params.get_int_or("seed", 1234);
  return o;
}

}  // namespace ductile::batching
