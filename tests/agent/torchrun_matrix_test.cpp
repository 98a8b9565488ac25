// torchrun command lines as torch's docs, torchtitan and Hugging Face give
// them, each run under torchrun and under `ductile agent` with the program
// name changed and nothing else: the workers get the same environment
// (launchers.hpp). Values that stand for a cluster's (GPU counts, node
// counts, hosts) are this machine's: 2 workers a node, 2 nodes at most,
// 127.0.0.1; each launcher gets its own port and log directory, as two
// jobs on one host need. No etcd: torchrun's etcd backends need the
// python-etcd package (they are compared in torchrun_contract_test.cpp).
#include <doctest/doctest.h>

#include <algorithm>

#include "launchers.hpp"
#include "temp_dir.hpp"

using namespace ductile::test;

namespace {

const std::string kScript = DUCTILE_AGENT_WORKERS "/torchrun_contract.py";
const std::string kShellScript = DUCTILE_AGENT_WORKERS "/torchrun_contract.sh";

// One command line: `args` after the program, with {script}, {sh},
// {endpoint} (a c10d HOST:PORT), {port}, {logdir} and {node} (the node's
// index) replaced for each launcher and node.
struct CommandLine {
  const char* source;
  int nodes;
  std::vector<std::string> args;
};

std::vector<std::string> expand(const std::vector<std::string>& args, int node,
                                const std::map<std::string, std::string>& values) {
  std::vector<std::string> out;
  for (std::string a : args) {
    for (const auto& [name, value] : values)
      for (auto at = a.find(name); at != std::string::npos; at = a.find(name, at + value.size()))
        a.replace(at, name.size(), value);
    for (auto at = a.find("{node}"); at != std::string::npos; at = a.find("{node}"))
      a.replace(at, 6, std::to_string(node));
    out.push_back(a);
  }
  return out;
}

// The log files under `logs` (<job>_XXXXXX/attempt_N/<local rank>/...),
// named without the run's directory and attempt, with their contents.
std::map<std::string, std::string> log_files(const std::filesystem::path& logs) {
  std::map<std::string, std::string> out;
  if (!std::filesystem::exists(logs)) return out;
  for (const auto& f : std::filesystem::recursive_directory_iterator(logs)) {
    if (!f.is_regular_file() || f.path().extension() != ".log") continue;
    out[f.path().parent_path().filename().string() + "/" + f.path().filename().string()] =
        read_text(f.path());
  }
  return out;
}

// The workers' lines on a launcher's console, byte for byte with their
// prefixes (none, or a teed stream's "[<role><local rank>]:"), sorted:
// workers write at once, in no set order. The launchers' own lines (with
// their timestamps) are left out. One string, a line each: a failed check
// prints both sides.
std::string worker_lines(const std::string& console) {
  std::vector<std::string> lines;
  std::size_t from = 0;
  while (from < console.size()) {
    auto eol = std::min(console.find('\n', from), console.size());
    std::string text = console.substr(from, eol - from);
    if (text.find("dumped rank ") != std::string::npos ||
        text.find("noted rank ") != std::string::npos)
      lines.push_back(std::move(text));
    from = eol + 1;
  }
  std::sort(lines.begin(), lines.end());
  std::string joined;
  for (const auto& text : lines) joined += text + "\n";
  return joined;
}

SideBySide run_line(const CommandLine& line) {
  TempDir dir;
  INFO(line.source);
  std::map<std::string, std::string> values[2];
  for (bool ductile : {false, true}) {
    const std::string port = std::to_string(free_tcp_port());
    values[ductile] = {{"{script}", kScript},
                       {"{sh}", kShellScript},
                       {"{endpoint}", "127.0.0.1:" + port},
                       {"{port}", port},
                       {"{logdir}", (dir / (ductile ? "ductile-logs" : "torchrun-logs")).string()}};
  }
  const int world = 2 * line.nodes;
  auto s = run_side_by_side(
      dir.path(), new_marker(), line.nodes, world,
      [&](int node, bool ductile) { return expand(line.args, node, values[ductile]); });
  // The variables whose values the launchers choose alike.
  for (int rank = 0; rank < world; ++rank) {
    INFO("rank " << rank);
    auto& d = s.ductile[rank];
    auto& t = s.torchrun[rank];
    auto normalized = [&](std::string v, bool ductile) {
      for (const auto& [name, value] : values[ductile])
        if (name != "{script}" && name != "{sh}")
          for (auto at = v.find(value); at != std::string::npos; at = v.find(value))
            v.replace(at, value.size(), name);
      return v;
    };
    CHECK(normalized(d["MASTER_ADDR"], true) == normalized(t["MASTER_ADDR"], false));
    if (is_uuid4(t["TORCHELASTIC_RUN_ID"]))
      CHECK(is_uuid4(d["TORCHELASTIC_RUN_ID"]));
    else
      CHECK(d["TORCHELASTIC_RUN_ID"] == t["TORCHELASTIC_RUN_ID"]);
    // A port the command line gave is the master's port under both.
    if (normalized(t["MASTER_PORT"], false) == "{port}")
      CHECK(normalized(d["MASTER_PORT"], true) == "{port}");
    // Error files under the log directory when there is one.
    CHECK(normalized(d["TORCHELASTIC_ERROR_FILE"], true).starts_with("{logdir}") ==
          normalized(t["TORCHELASTIC_ERROR_FILE"], false).starts_with("{logdir}"));
  }
  // The same log files with the same lines.
  CHECK(log_files(values[true].at("{logdir}")) == log_files(values[false].at("{logdir}")));
  // The same workers' lines on the console.
  for (int rank = 0; rank < world; ++rank)
    for (const std::string line_text : {"dumped rank ", "noted rank "}) {
      const std::string text = line_text + std::to_string(rank);
      INFO(text);
      CHECK((s.ductile_output.find(text) != std::string::npos) ==
            (s.torchrun_output.find(text) != std::string::npos));
    }
  // The same console lines, prefixes included.
  CHECK(worker_lines(s.ductile_output) == worker_lines(s.torchrun_output));
  return s;
}

}  // namespace

// torch's docs: docs.pytorch.org/docs/stable/elastic/run.html (torch/distributed/run.py).
TEST_CASE("torchrun matrix: docs, single-node multi-worker (--standalone)") {
  run_line({"run.py: Single-node multi-worker",
            1,
            {"--standalone", "--nnodes=1", "--nproc-per-node=2", "{script}", "--arg1", "x"}});
}

TEST_CASE("torchrun matrix: docs, stacked single-node (c10d on localhost:0)") {
  run_line({"run.py: Stacked single-node multi-worker",
            1,
            {"--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--nnodes=1",
             "--nproc-per-node=2", "{script}"}});
}

TEST_CASE("torchrun matrix: docs, fault tolerant (c10d, 2 nodes, --max-restarts=3)") {
  run_line({"run.py: Fault tolerant",
            2,
            {"--nnodes=2", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-id=job",
             "--rdzv-backend=c10d", "--rdzv-endpoint={endpoint}", "{script}", "--arg1"}});
}

TEST_CASE("torchrun matrix: docs, elastic (--nnodes=1:2, c10d)") {
  run_line({"run.py: Elastic (min=1, max=4 there)",
            2,
            {"--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-id=job",
             "--rdzv-backend=c10d", "--rdzv-endpoint={endpoint}", "{script}"}});
}

TEST_CASE("torchrun matrix: DDP tutorial, elastic_ddp.py (underscore spellings)") {
  // docs.pytorch.org/tutorials/intermediate/ddp_tutorial.html
  run_line({"ddp_tutorial: torchrun --nnodes=2 --nproc_per_node=8 --rdzv_id=100 ...",
            2,
            {"--nnodes=2", "--nproc_per_node=2", "--rdzv_id=100", "--rdzv_backend=c10d",
             "--rdzv_endpoint={endpoint}", "{script}"}});
}

TEST_CASE("torchrun matrix: multinode tutorial (--node_rank with c10d, script arguments)") {
  // docs.pytorch.org/tutorials/intermediate/ddp_series_multinode.html
  run_line({"ddp_series_multinode: multinode.py 50 10",
            2,
            {"--nproc_per_node=2", "--nnodes=2", "--node_rank={node}", "--rdzv_id=456",
             "--rdzv_backend=c10d", "--rdzv_endpoint={endpoint}", "{script}", "50", "10"}});
}

TEST_CASE("torchrun matrix: fault-tolerance tutorial (--standalone, underscores)") {
  // docs.pytorch.org/tutorials/beginner/ddp_series_fault_tolerance.html
  run_line({"ddp_series_fault_tolerance: multigpu_torchrun.py 50 10",
            1,
            {"--standalone", "--nproc_per_node=2", "{script}", "50", "10"}});
}

TEST_CASE("torchrun matrix: static (--node-rank, --master-addr, --master-port)") {
  // docs.pytorch.org/docs/stable/distributed.html#launch-utility, as torchrun.
  run_line({"distributed.html: launch utility, node 0 and node 1",
            2,
            {"--nproc-per-node=2", "--nnodes=2", "--node-rank={node}", "--master-addr=127.0.0.1",
             "--master-port={port}", "{script}", "--arg1", "--arg2", "--arg3"}});
}

TEST_CASE("torchrun matrix: torchtitan run_train.sh (-m, --local-ranks-filter, --role, --tee)") {
  // github.com/pytorch/torchtitan run_train.sh
  run_line({"torchtitan run_train.sh",
            1,
            {"--nproc_per_node=2", "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0",
             "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "-m", "torchrun_contract",
             "--job.config_file", "llama3_debug.toml"}});
}

TEST_CASE("torchrun matrix: torchtitan multi-node (c10d, --rdzv_id, --local-ranks-filter)") {
  // github.com/pytorch/torchtitan run_8node.sh / multinode_trainer.slurm
  run_line({"torchtitan multinode",
            2,
            {"--nnodes", "2", "--nproc_per_node", "2", "--rdzv_id", "101", "--rdzv_backend", "c10d",
             "--rdzv_endpoint", "{endpoint}", "--local-ranks-filter", "0", "{script}",
             "--job.config_file", "./train_configs/llama2_70b.toml"}});
}

TEST_CASE("torchrun matrix: Hugging Face example script (its options after the script)") {
  // huggingface.co/docs/transformers/run_scripts: distributed training
  run_line({"transformers run_scripts",
            1,
            {"--nproc_per_node", "2", "{script}", "--fp16", "--model_name_or_path",
             "google-t5/t5-small", "--do_train", "--output_dir", "/tmp/tst-summarization",
             "--per_device_train_batch_size=4", "--overwrite_output_dir"}});
}

TEST_CASE("torchrun matrix: Hugging Face single node with --master_port") {
  // Hugging Face examples that run two jobs on one host give each its port.
  run_line({"transformers examples: --master_port",
            1,
            {"--nproc_per_node=2", "--nnodes=1", "--master_port={port}", "{script}",
             "--model_name_or_path", "gpt2"}});
}

TEST_CASE("torchrun matrix: Hugging Face accelerate multi-node (static, underscores)") {
  // huggingface.co/docs/accelerate: launching with torchrun on several nodes
  run_line({"accelerate multi-node torchrun",
            2,
            {"--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "{node}", "--master_addr",
             "127.0.0.1", "--master_port", "{port}", "{script}", "--mixed_precision", "fp16"}});
}

TEST_CASE("torchrun matrix: --run-path (an absolute script path)") {
  run_line({"run.py --help: --run-path", 1, {"--nproc-per-node=2", "--run-path", "{script}"}});
}

TEST_CASE("torchrun matrix: --no-python (a script that is not Python)") {
  run_line({"run.py --help: --no-python",
            1,
            {"--nproc-per-node=2", "--no-python", "{sh}", "--flag", "value"}});
}

TEST_CASE("torchrun matrix: --log-dir with -r 3 (every stream to the files)") {
  run_line({"run.py --help: [-r 3] redirects both stdout+stderr for all workers",
            1,
            {"--nproc-per-node=2", "--log-dir={logdir}", "-r", "3", "{script}"}});
}

TEST_CASE("torchrun matrix: --redirects and --tee per local rank") {
  run_line({"run.py --help: [-r 0:1,1:2]",
            1,
            {"--nproc-per-node=2", "--log-dir", "{logdir}", "--redirects", "0:1,1:2", "--tee",
             "0:2", "{script}"}});
}

TEST_CASE("torchrun matrix: --max-restarts, --monitor-interval, --start-method, --role") {
  run_line({"run.py options",
            1,
            {"--nnodes=1", "--nproc-per-node=2", "--max-restarts=2", "--monitor-interval=1",
             "--start-method=spawn", "--role=trainer", "{script}"}});
}

TEST_CASE("torchrun matrix: --standalone with -m (a module)") {
  run_line({"run.py: -m, --module",
            1,
            {"--standalone", "--nproc-per-node=2", "-m", "torchrun_contract", "--flag"}});
}
