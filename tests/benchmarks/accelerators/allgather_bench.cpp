// All-gather through the cpu accelerator's communicator against plain
// MPI_Allgather in the same run, and how much of a posted gather hides
// behind computation. Run with 2 ranks under mpirun; prints two tables of
// medians.
//
// Table 1: size is the gathered (output) size, as in nccl-tests; bus
// bandwidth = size / time * (n - 1) / n. Each iteration starts after a
// barrier and takes the slowest rank's time; the two variants alternate.
// Table 2: per iteration, G = the gather alone, C = computation alone for
// G, T = post the gather, compute for G, wait. Hidden = the median over
// iterations of (G + C - T) / G; the table also shows the medians of G, C
// and T. Two kinds of computation, in separate loops: the host waiting for work done elsewhere, as
// while a GPU computes ("idle": the thread sleeps), and arithmetic on the host's own core ("cpu").
// Run with --bind-to core: each rank then owns one core, which its helper threads share. With the
// cpu kind that core has no time left for the transfer (a memory copy the CPU itself does), so
// there nothing can hide; the column shows that limit.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "ductile/accelerator.hpp"
#include "ductile/core/runtime.hpp"

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double slowest(double seconds) {
  double max = 0;
  MPI_Allreduce(&seconds, &max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return max;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Arithmetic on a small array in cache: computation that does not compete
// for memory bandwidth with the transfer.
volatile double g_sink;
void compute(long units) {
  double a = 1.0, b = 0.999999, c = 1e-9;
  for (long i = 0; i < units; ++i) {
    for (int k = 0; k < 64; ++k) a = a * b + c;
  }
  g_sink = a;
}

long calibrate_units(double seconds) {
  long units = 1000;
  for (;;) {
    double t0 = now();
    compute(units);
    double t = now() - t0;
    if (t > 0.02 || units > (1L << 40)) return std::max(1L, static_cast<long>(units * seconds / t));
    units *= 4;
  }
}

int iterations_for(std::size_t bytes) {
  if (bytes <= (256u << 10)) return 400;
  if (bytes <= (4u << 20)) return 150;
  return 21;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  {
    auto runtime = ductile::core::Runtime::from_string(
        std::string("[plugins]\npath = [\"") + DUCTILE_PLUGIN_DIR +
            "\"]\n[log]\nlevel = \"warn\"\n[accelerator]\nbackend = \"cpu\"\n",
        "bench.toml");
    auto accel = runtime.get<ductile::Accelerator>();
    auto world = accel->world();
    auto stream = accel->create_stream();
    if (rank == 0)
      std::printf(
          "all-gather, %d ranks (medians; size = gathered bytes; busbw = size/t*(n-1)/n)\n"
          "%10s %12s %12s %12s %12s %8s\n",
          size, "size", "plain us", "plain GB/s", "ductile us", "ductile GB/s", "ratio");
    std::vector<std::size_t> sizes;
    for (std::size_t s = 1024; s <= (64u << 20); s *= 2) sizes.push_back(s);
    for (std::size_t total : sizes) {
      std::size_t per_rank = total / static_cast<std::size_t>(size);
      std::vector<char> send(per_rank, static_cast<char>(rank + 1)), recv(per_rank * size);
      std::vector<double> plain, ours;
      int iterations = iterations_for(total);
      auto time_plain = [&] {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = now();
        MPI_Allgather(send.data(), static_cast<int>(per_rank), MPI_BYTE, recv.data(),
                      static_cast<int>(per_rank), MPI_BYTE, MPI_COMM_WORLD);
        return slowest(now() - t0);
      };
      auto time_ours = [&] {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = now();
        world->all_gather(send.data(), recv.data(), per_rank, ductile::DataType::u8, *stream)
            ->wait();
        return slowest(now() - t0);
      };
      for (int i = -2; i < iterations; ++i) {  // two warm-up rounds
        // Alternating which goes first removes any bias of the order.
        double t_plain, t_ours;
        if (i % 2 == 0) {
          t_plain = time_plain();
          t_ours = time_ours();
        } else {
          t_ours = time_ours();
          t_plain = time_plain();
        }
        if (i >= 0) {
          plain.push_back(t_plain);
          ours.push_back(t_ours);
        }
      }
      double p = median(plain), o = median(ours);
      double factor = static_cast<double>(size - 1) / size;
      if (rank == 0)
        std::printf("%10zu %12.1f %12.3f %12.1f %12.3f %7.1f%%\n", total, p * 1e6,
                    total / p * factor / 1e9, o * 1e6, total / o * factor / 1e9, 100.0 * p / o);
    }

    if (rank == 0)
      std::printf(
          "\noverlap: gather posted, then computation for as long as the gather takes\n"
          "%10s | %10s %10s %10s %9s | %10s %10s %10s %9s\n",
          "size", "gather us", "idle us", "both us", "hidden", "gather us", "cpu us", "both us",
          "hidden");
    for (std::size_t total : {std::size_t{1} << 20, std::size_t{4} << 20, std::size_t{16} << 20,
                              std::size_t{64} << 20}) {
      std::size_t per_rank = total / static_cast<std::size_t>(size);
      std::vector<char> send(per_rank, static_cast<char>(rank + 1)), recv(per_rank * size);
      auto gather = [&] {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = now();
        world->all_gather(send.data(), recv.data(), per_rank, ductile::DataType::u8, *stream)
            ->wait();
        return slowest(now() - t0);
      };
      // Each iteration measures the gather alone (G), then computes for
      // that long alone (C) and with the gather posted (T): the computation
      // always lasts as long as the gather takes at that moment (gathers
      // right after a sleep or after arithmetic on both cores are slower
      // than back-to-back ones). Hidden = median over iterations of
      // (G + C - T) / G; the table shows the medians of G, C and T.
      int iterations = std::max(51, iterations_for(total) / 2);
      auto run = [&](auto&& work_for, double& mg, double& mw, double& mb) {
        std::vector<double> g, w, b, hidden;
        for (int i = -1; i < iterations; ++i) {
          double tg = gather();
          MPI_Barrier(MPI_COMM_WORLD);
          double t0 = now();
          work_for(tg);
          double tw = slowest(now() - t0);
          MPI_Barrier(MPI_COMM_WORLD);
          t0 = now();
          auto handle =
              world->all_gather(send.data(), recv.data(), per_rank, ductile::DataType::u8, *stream);
          work_for(tg);
          handle->wait();
          double tb = slowest(now() - t0);
          if (i >= 0) {
            g.push_back(tg);
            w.push_back(tw);
            b.push_back(tb);
            hidden.push_back((tg + tw - tb) / tg);
          }
        }
        mg = median(g);
        mw = median(w);
        mb = median(b);
        return std::clamp(median(hidden), 0.0, 1.0);
      };
      double gi, mi, mib;
      double hidden_idle = run(
          [](double seconds) {
            std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
          },
          gi, mi, mib);
      // Same work on every rank: rank 0's calibration (units per second) is
      // broadcast, and every rank scales it by the same (slowest-rank) G.
      double units_per_second = static_cast<double>(calibrate_units(1.0));
      MPI_Bcast(&units_per_second, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
      double gc, mc, mb;
      double hidden_cpu = run(
          [&](double seconds) {
            compute(std::max(1L, static_cast<long>(units_per_second * seconds)));
          },
          gc, mc, mb);
      if (rank == 0)
        std::printf("%10zu | %10.1f %10.1f %10.1f %8.1f%% | %10.1f %10.1f %10.1f %8.1f%%\n", total,
                    gi * 1e6, mi * 1e6, mib * 1e6, 100 * hidden_idle, gc * 1e6, mc * 1e6, mb * 1e6,
                    100 * hidden_cpu);
    }
  }
  MPI_Finalize();
  return 0;
}
