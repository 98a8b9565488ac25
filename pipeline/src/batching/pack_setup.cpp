// Packing options from a configuration: a TOML file's [batching] and [lr]
// sections (a DeepSpeed JSON config's are mapped onto them: deepspeed_batching.hpp).
#include "ductile/pipeline/pack_plan.hpp"

namespace ductile::pipeline {

PackSetup pack_setup_from_config(const core::Config& config) {
  PackSetup setup;
  setup.origin = config.source_name();
  auto& o = setup.options;
  if (const auto* b = config.section(PluginKind::batching)) {
    o.sampler = b->plugin;
    o.sampler_params = b->params;
    const auto& host = b->host_params;
    if (host.has("lengths")) {
      std::filesystem::path file = host.get_string("lengths");
      if (file.is_relative()) file = config.base_dir() / file;
      setup.lengths = file;
    }
    setup.read.column = host.get_string_or("column", "");
    setup.read.count_column = host.get_string_or("count_column", "");
    setup.read.format = parse_length_format(host.get_string("format"));
  }
  if (const auto* l = config.section(PluginKind::lr)) {
    o.lr_rule = l->plugin;
    o.lr_params = l->params;
    const auto& host = l->host_params;
    if (host.has("base_batch_size")) o.base_batch_size = host.get_double("base_batch_size");
    o.schedule.base_lr = host.get_double("base_lr");
    o.schedule.min_lr = host.get_double("min_lr");
    o.schedule.kind = parse_lr_schedule_kind(host.get_string("schedule"));
    o.schedule.warmup_steps = host.get_int("warmup_steps");
    o.schedule.total_steps = host.get_int("total_steps");
  }
  return setup;
}

}  // namespace ductile::pipeline
