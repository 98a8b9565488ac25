// ductile zero-to-fp32 CHECKPOINT_DIR OUTPUT_DIR [options]: a ZeRO-3
// checkpoint's whole fp32 weights as Hugging Face files. The checkpoint's
// format is read by the Python package (ductile.torch.zero3), so this
// command replaces itself with `PYTHON -m ductile.zero_to_fp32 ARGS` (the
// zero_to_fp32.py of each checkpoint folder runs the same): its output and
// exit status are the converter's.
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "cli_common.hpp"

namespace ductile::cli {
namespace {

// The interpreter of the training environment, and why: the one whose
// `ductile` console script ran this program; else an active virtual
// environment's; else python3 on PATH (found by execvp).
std::pair<std::string, std::string> converter_python() {
  if (const char* console = std::getenv("DUCTILE_CONSOLE_PYTHON"); console && *console)
    return {console, "the interpreter whose `ductile` console script ran this command"};
  if (const char* venv = std::getenv("VIRTUAL_ENV"); venv && *venv)
    return {(std::filesystem::path(venv) / "bin" / "python").string(),
            "the active virtual environment, $VIRTUAL_ENV"};
  return {"python3", "python3 on PATH"};
}

int run_zero_to_fp32(const std::vector<std::string>& args) {
  const auto [python, why] = converter_python();
  std::vector<std::string> words = {python, "-m", "ductile.zero_to_fp32"};
  words.insert(words.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& word : words) argv.push_back(word.data());
  argv.push_back(nullptr);
  std::cout.flush();
  ::execvp(python.c_str(), argv.data());
  const int error = errno;
  std::cerr << fmt::format(
      "ductile zero-to-fp32: error: cannot run the Python converter with '{}' ({}): {}; run "
      "this command through the `ductile` of the environment where ductile is installed, or "
      "activate that environment\n",
      python, why, std::strerror(error));
  return kExitUserError;
}

}  // namespace

void register_zero_to_fp32_command(CLI::App& app, CliContext& context) {
  auto args = std::make_shared<std::vector<std::string>>();
  auto* sub = app.add_subcommand(
      "zero-to-fp32",
      "Write a ZeRO-3 checkpoint's whole fp32 weights as Hugging Face files: CHECKPOINT_DIR "
      "OUTPUT_DIR [--tag TAG] [--safe_serialization] [--max_shard_size 5GB] "
      "[--exclude_frozen_parameters] (DeepSpeed's zero_to_fp32.py; --help lists them)");
  // Every word after the command is the converter's, --help included.
  sub->allow_extras();
  sub->prefix_command();
  sub->fallthrough(false);
  sub->set_help_flag();
  set_action(sub, context, [sub, args] {
    *args = sub->remaining();
    return run_zero_to_fp32(*args);
  });
}

}  // namespace ductile::cli
