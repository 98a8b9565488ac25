// Benchmark of the batching samplers on real length distributions: the
// Wikipedia BERT-512 histogram expanded to its 16.28 M sequences and the
// Azure LLM inference traces. Prints, per case, the median packing time over
// the repetitions, sequences per second, token efficiency, and for bfd the
// L1 and Martello-Toth L2 lower bounds on the number of micro-batches.
// Throughput is quoted against the packing target: the 16.28 M Wikipedia
// sequences packed in at most 1.0 s on one core (1.63e7 sequences/s); the
// "x target" column is sequences/s divided by that. "cpu s" is the median
// CPU time of the packing thread (page faults included), which a loaded
// machine inflates less than the wall time.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ductile/batch_sampler.hpp"
#include "ductile/core/runtime.hpp"
#include "ductile/pipeline/lengths.hpp"
#include "ductile_batching/packing.hpp"
#include "ductile_batching/python_random.hpp"

namespace {

using ductile::Params;

struct Case {
  std::string data;
  const std::vector<std::int64_t>* lengths;
  std::string sampler;
  std::int64_t max_tokens;
  std::int64_t max_batch_size = 0;
  std::string order = "dataloader";
};

// CPU time of this thread: on a busy machine closer to what the packing
// costs on a free core than wall time.
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::max(1, std::atoi(argv[1])) : 5;
  const std::string shared = DUCTILE_TEST_DATA_DIR;
  ductile::core::RuntimeOptions options;
  options.extra_plugin_dirs.emplace_back(DUCTILE_PLUGIN_DIR);
  auto runtime = ductile::core::Runtime::from_string("", "bench", options);

  ductile::pipeline::LengthReadOptions hist;
  hist.column = "length";
  hist.count_column = "count";
  // Expanded in length order; dataloader order gets a fixed shuffle so that
  // greedy sees a realistic, unsorted stream.
  auto wiki = ductile::pipeline::read_lengths(shared + "/lengths/wikipedia_bert512_hist.csv", hist);
  ductile::batching::PythonRandom rng(7);
  rng.shuffle(std::span<std::int64_t>(wiki));
  ductile::pipeline::LengthReadOptions context_tokens;
  context_tokens.column = "ContextTokens";
  const auto conv = ductile::pipeline::read_lengths(
      shared + "/lengths/AzureLLMInferenceTrace_conv.csv", context_tokens);
  const auto code = ductile::pipeline::read_lengths(
      shared + "/lengths/AzureLLMInferenceTrace_code.csv", context_tokens);

  const std::vector<Case> cases = {
      {"wikipedia", &wiki, "greedy", 512},
      {"wikipedia", &wiki, "greedy", 512, 0, "seqlen"},
      {"wikipedia", &wiki, "greedy", 512, 0, "random"},
      {"wikipedia", &wiki, "greedy", 4096},
      {"azure-conv", &conv, "greedy", 4096},
      {"azure-code", &code, "greedy", 4096},
      {"wikipedia", &wiki, "bfd", 512},
      {"wikipedia", &wiki, "bfd", 512, 3},
      {"wikipedia", &wiki, "bfd", 4096},
      {"azure-conv", &conv, "bfd", 4096},
      {"azure-conv", &conv, "bfd", 8192},
      {"azure-code", &code, "bfd", 4096},
  };
  const double target_per_second = static_cast<double>(wiki.size()) / 1.0;
  std::cout << fmt::format("batching benchmark: median of {} runs per case, one core\n", reps);
  std::cout << fmt::format(
      "target: the {} Wikipedia sequences in <= 1.0 s, i.e. >= {:.3e} sequences/s (x target "
      ">= 1)\n",
      wiki.size(), target_per_second);
  std::cout << fmt::format(
      "{:<11} {:<7} {:<10} {:>6} {:>4} {:>11} {:>9} {:>8} {:>12} {:>8} {:>10} {:>9} {:>9} {:>9}\n",
      "data", "sampler", "order", "tokens", "max", "sequences", "median s", "cpu s", "sequences/s",
      "x target", "micro-b.", "effic. %", "L2 eff %", "gap %");
  for (const auto& c : cases) {
    Params p;
    p.set("max_tokens", c.max_tokens);
    p.set("max_batch_size", c.max_batch_size);
    if (c.sampler == "greedy") p.set("order", c.order);
    auto sampler = runtime.create<ductile::BatchSampler>(c.sampler, p);
    std::vector<double> seconds, cpu_seconds;
    ductile::PackResult result;
    // Short traces are packed repeatedly per timing so that times are measurable.
    const int inner = c.lengths->size() < 100000 ? 50 : 1;
    for (int r = 0; r < reps; ++r) {
      const auto start = std::chrono::steady_clock::now();
      const double cpu_start = thread_cpu_seconds();
      for (int i = 0; i < inner; ++i) result = sampler->pack({*c.lengths, std::nullopt});
      cpu_seconds.push_back((thread_cpu_seconds() - cpu_start) / inner);
      seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / inner);
    }
    std::int64_t tokens = 0;
    std::vector<std::int64_t> histogram(static_cast<std::size_t>(c.max_tokens) + 1, 0);
    for (auto v : *c.lengths)
      if (v <= c.max_tokens) {
        tokens += v;
        ++histogram[static_cast<std::size_t>(v)];
      }
    const double mbs = static_cast<double>(result.microbatch_count());
    const double efficiency =
        100.0 * static_cast<double>(tokens) / (mbs * static_cast<double>(c.max_tokens));
    std::string bound = "-", gap = "-";
    if (c.sampler == "bfd" && c.max_batch_size == 0) {
      std::int64_t l1 = 0;
      const std::int64_t l2 = ductile::batching::l2_lower_bound(histogram, c.max_tokens, &l1);
      const double bound_eff = 100.0 * static_cast<double>(tokens) /
                               (static_cast<double>(l2) * static_cast<double>(c.max_tokens));
      bound = fmt::format("{:.4f}", bound_eff);
      gap = fmt::format("{:.4f}", bound_eff - efficiency);
    }
    const double t = median(seconds);
    std::cout << fmt::format(
        "{:<11} {:<7} {:<10} {:>6} {:>4} {:>11} {:>9.4f} {:>8.4f} {:>12.3e} {:>8.2f} {:>10} "
        "{:>9.4f} {:>9} "
        "{:>9}\n",
        c.data, c.sampler, c.sampler == "greedy" ? c.order : "-", c.max_tokens,
        c.max_batch_size ? std::to_string(c.max_batch_size) : "-", c.lengths->size(), t,
        median(cpu_seconds), static_cast<double>(c.lengths->size()) / t,
        static_cast<double>(c.lengths->size()) / t / target_per_second, result.microbatch_count(),
        efficiency, bound, gap);
  }
  return 0;
}
