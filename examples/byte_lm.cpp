// strata-example-lm: a byte-level language model trained through the C++ API
// (strata.hpp) on text the repository ships. An MLP over a window of bytes:
// embed (256 x E) -> concat (C*E) -> `depth` ReLU layers of width H -> 256 logits,
// softmax cross-entropy on the next byte. Every weight is a strata tensor reached
// through leases; the math runs on the compute stream with BLAS (cblas_sgemm).
//
// Note [Example sizes]
// The defaults put the model state (fp32 AdamW: 16 B a parameter) at more than 4x
// the sim device's chunk budget (budgets.gpu), and the host budget below the
// rest, so params and grads stream through the GPU, params and some optimizer
// states live in pinned host memory, and the remaining optimizer states live on
// NVMe (a temporary directory unless --nvme is given). The first progress line
// prints the plan, so the three tiers can be seen.
//
// Note [Example NVMe budget]
// budgets.nvme is a cap, not a size (Note [Growing swap files] in
// offload/src/swap_store.cpp): the swap files hold what the plan puts on NVMe
// and grow on demand. The example's default cap is what its model can ever put
// there: the fp32 AdamW state (16 B a parameter) twice over (a state is written
// to fresh slots before its old ones are freed), plus 64 MiB for rounding to
// slots. --nvme-budget (or budgets.nvme in --config) sets another.
//
// Note [Example precision]
// The math is fp32 BLAS straight on the lease pointers, so the params and grads
// must be fp32: precision.compute bf16 or fp16 (from --config) is refused at
// start, naming the key. Reading a bf16 chunk as floats read past its end
// (SIGSEGV) or trained on garbage (a loss stuck at ln 256 with exit 0).
//
// Note [Example device]
// The math calls the host BLAS on the lease pointers, which are host-addressable
// on the sim device only. A cuBLAS path is not built, so the example runs on the
// sim device and says so when asked for cuda.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "byte_lm_model.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/common/scratch_dir.hpp"
#include "strata/runtime/options.hpp"
#include "strata/strata.hpp"

namespace {

using namespace strata;
using example::Model;
namespace fs = std::filesystem;

struct Settings {
  std::vector<std::string> text;
  std::string nvme;
  std::string trace;
  std::string config;  // a JSON config applied over the example's settings
  int steps = 300;
  std::size_t context = 32, embed = 32, width = 512, depth = 5, batch = 128;
  float lr = 2e-3f;
  std::string gpu_budget = "6MiB", host_budget = "40MiB", link = "12GiB";
  std::string nvme_budget;  // empty: Note [Example NVMe budget]
  std::uint64_t seed = 1;
  bool check_loss = false;
};

// Parameters of the model `s` describes (the embedding and every layer's weight and bias).
std::uint64_t param_count(const Settings& s) {
  std::uint64_t params = 256 * s.embed;
  for (std::size_t l = 0; l <= s.depth; ++l) {
    const std::uint64_t in = l == 0 ? s.context * s.embed : s.width, out = l == s.depth ? 256 : s.width;
    params += (in + 1) * out;
  }
  return params;
}

// Note [Example NVMe budget]: --nvme-budget, or what the model can ever put on NVMe.
std::string nvme_budget_of(const Settings& s) {
  if (!s.nvme_budget.empty()) return s.nvme_budget;
  return fmt::format("{}", 2 * 16 * param_count(s) + 64 * kMiB);
}

// Note [Example precision]: the math is fp32 over the leases.
Status check_precision(const Config& config) {
  if (config.runtime.compute_dtype == runtime::DType::kF32) return Status::Ok();
  return invalid_argument(
      "precision.compute = {}: this example's math is fp32 BLAS on the lease pointers, so it trains fp32 "
      "params only; drop precision.compute from --config (strata itself trains bf16 and fp16 through "
      "strata.torch or kernels that read those types)",
      runtime::dtype_name(config.runtime.compute_dtype));
}

// The files, concatenated.
Result<std::string> read_text(const std::vector<std::string>& paths) {
  std::stringstream s;
  for (const std::string& path : paths) {
    std::error_code ec;
    if (fs::exists(path, ec) && (!fs::is_regular_file(path, ec) || fs::file_size(path, ec) > 256 * kMiB)) {
      return invalid_argument("--text {}: not a regular file of at most 256 MiB", path);
    }
    std::ifstream in(path, std::ios::binary);
    if (!in)
      return not_found("--text {}: cannot be read; name text files (the repository's README.md works)", path);
    s << in.rdbuf() << "\n";
  }
  return s.str();
}

// The flags, checked before anything runs (Note [One validation per input kind]
// in runtime/options.hpp; the budgets and the NVMe directory go through the
// runtime's own checks when it is created). Bounds keep every BLAS dimension an
// int and the activations a few GiB at most.
Status check_flags(const Settings& s) {
  if (s.steps < 1 || s.steps > 1'000'000) return invalid_argument("--steps = {}: use 1 .. 1000000", s.steps);
  const std::pair<const char*, std::size_t> dims[] = {
      {"--context", s.context}, {"--width", s.width}, {"--batch", s.batch}};
  for (const auto& [flag, v] : dims) {
    if (v < 1 || v > 65536) return invalid_argument("{} = {}: use 1 .. 65536", flag, v);
  }
  if (s.depth > 64) return invalid_argument("--depth = {}: use 0 .. 64 hidden layers", s.depth);
  const double in = static_cast<double>(s.context) * static_cast<double>(s.embed);
  const double acts = static_cast<double>(s.batch) * (in + static_cast<double>(s.depth + 1) * s.width + 256);
  const double weights = in * static_cast<double>(s.width) + static_cast<double>(s.depth) * s.width * s.width;
  // About 6 FLOPs a weight a position: bound a step at ~2^35 FLOPs (seconds here).
  const double work = static_cast<double>(s.batch) * weights;
  if (in > 1 << 20 || acts > 1 << 28 || weights > 1 << 28 || work > 4.0 * (1u << 30)) {
    return invalid_argument(
        "--context {} --embed {} --width {} --depth {} --batch {}: too large for this example (at most 2^20 "
        "inputs, 2^28 weights, 2^28 activation values and 2^32 weights x batch a step)",
        s.context, s.embed, s.width, s.depth, s.batch);
  }
  if (!(std::isfinite(s.lr) && s.lr > 0 && s.lr <= 10))
    return invalid_argument("--lr = {}: use (0, 10]", s.lr);
  return Status::Ok();
}

// The training text (--text), checked with the flags; 0, or 2 having said why not.
int load_text(const Settings& s, std::string& text) {
  if (Status st = check_flags(s); !st.ok()) {
    std::fprintf(stderr, "strata-example-lm: %s\n", st.to_string().c_str());
    return 2;
  }
  auto read = read_text(s.text);
  if (!read.ok()) {
    std::fprintf(stderr, "strata-example-lm: %s\n", read.status().to_string().c_str());
    return 2;
  }
  text = std::move(read).value();
  if (text.size() < s.context + 2) {
    std::fprintf(stderr,
                 "strata-example-lm: --text has only %zu bytes; it needs more than the %zu-byte context\n",
                 text.size(), s.context);
    return 2;
  }
  return 0;
}

// The runtime's config: the example's settings, then --config over them; 0, or 2 having said why not.
int make_config(const Settings& s, const fs::path& dir, Config& config) {
  for (auto [key, value] : {std::pair<std::string, std::string>{"device.kind", "sim"},
                            {"device.h2d_bandwidth", s.link},
                            {"device.d2h_bandwidth", s.link},
                            {"budgets.gpu", s.gpu_budget},
                            {"budgets.host", s.host_budget},
                            {"budgets.nvme", nvme_budget_of(s)},
                            {"nvme.dirs", dir.string()},
                            {"optimizer.name", "adamw"},
                            {"optimizer.lr", fmt::format("{}", s.lr)},
                            {"layout.chunk_elems", "524288"},
                            {"plan.host_reserve", "8MiB"}}) {
    if (Status st = config.set(key, value); !st.ok()) {
      std::fprintf(stderr, "strata-example-lm: %s\n", st.to_string().c_str());
      return 2;
    }
  }
  config.device.budget_bytes = config.runtime.budgets.gpu_bytes + 64 * kMiB;
  if (s.config.empty()) return 0;
  if (Status st = config.update_from_json_file(s.config); !st.ok()) {
    std::fprintf(stderr, "strata-example-lm: --config: %s\n", st.to_string().c_str());
    return 2;
  }
  if (config.device.kind != memory::DeviceChoice::kSim) {  // Note [Example device]
    std::fprintf(stderr,
                 "strata-example-lm: --config: device.kind must be sim for this example (its math "
                 "needs host-addressable leases)\n");
    return 2;
  }
  if (Status st = check_precision(config); !st.ok()) {
    std::fprintf(stderr, "strata-example-lm: --config: %s\n", st.to_string().c_str());
    return 2;
  }
  return 0;
}

// The first lines: the model, its state against the budgets (Note [Example sizes]) and the text.
void print_header(const Settings& s, const Model& m, const Config& config, const fs::path& dir,
                  std::size_t text_bytes) {
  const std::uint64_t params = param_count(s);
  const std::uint64_t state = params * 16;
  std::printf(
      "strata-example-lm: byte-level MLP, context %zu, %zu layers of %zu, %llu params; fp32 AdamW state %s "
      "= %.1fx the sim device's chunk budget (%s); host budget %s; NVMe in %s (at most %s)\n",
      m.C, m.D, m.H, static_cast<unsigned long long>(params), format_bytes(state).c_str(),
      static_cast<double>(state) / static_cast<double>(config.runtime.budgets.gpu_bytes),
      s.gpu_budget.c_str(), s.host_budget.c_str(), dir.c_str(),
      format_bytes(config.runtime.budgets.nvme_bytes).c_str());
  std::printf(
      "device: sim (Note [Example device]: the BLAS math needs host-addressable leases); text: %zu files, "
      "%zu bytes\n",
      s.text.size(), text_bytes);
}

// --steps steps on random windows of the text, a progress line each, into losses; 0, or 1 having said why.
int train(Runtime& rt, Model& m, const Settings& s, const std::string& text, std::vector<float>& losses) {
  std::mt19937_64 rng(s.seed);
  std::uniform_int_distribution<std::size_t> pick(0, text.size() - s.context - 1);
  m.ctx.resize(m.B * m.C);
  m.next.resize(m.B);
  for (int step = 1; step <= s.steps; ++step) {
    for (std::size_t r = 0; r < m.B; ++r) {
      const std::size_t at = pick(rng);
      for (std::size_t c = 0; c < m.C; ++c) m.ctx[r * m.C + c] = static_cast<unsigned char>(text[at + c]);
      m.next[r] = static_cast<unsigned char>(text[at + m.C]);
    }
    Status st = example::train_step(rt, m);
    auto stats = st.ok() ? rt.step() : Result<StepStats>(st);
    if (!stats.ok()) {
      std::fprintf(stderr, "strata-example-lm: step %d: %s\n", step, stats.status().to_string().c_str());
      return 1;
    }
    if (step == 2) std::printf("plan: %s\n", rt.describe().c_str());
    losses.push_back(m.loss);
    const double tokens_per_s = static_cast<double>(m.B) / std::max(stats->step_s, 1e-9);
    std::printf("step %4d  loss %.4f  %7.0f tok/s  h2d %9s  d2h %9s  disk r %9s  w %9s  stall %.3f s\n", step,
                m.loss, tokens_per_s, format_bytes(stats->bytes_h2d).c_str(),
                format_bytes(stats->bytes_d2h).c_str(), format_bytes(stats->bytes_disk_read).c_str(),
                format_bytes(stats->bytes_disk_write).c_str(), stats->stall_s);
    std::fflush(stdout);
  }
  return 0;
}

// --check-loss: the loss fell and every tier was used; 0, or 1 having said so.
int check_loss(const std::vector<float>& losses, const Stats& t) {
  const std::size_t k = std::min<std::size_t>(5, losses.size() / 2);
  double first = 0, last = 0;
  for (std::size_t i = 0; i < k; ++i) {
    first += losses[i] / static_cast<double>(k);
    last += losses[losses.size() - 1 - i] / static_cast<double>(k);
  }
  const bool tiers = t.bytes_h2d > 0 && t.bytes_disk_write > 0 && t.nvme_bytes > 0;
  std::printf(
      "check: mean loss of the first %zu steps %.4f, of the last %zu %.4f; all three tiers used: %s\n", k,
      first, k, last, tiers ? "yes" : "no");
  if (!(last < first - 0.3) || !tiers) {
    std::fprintf(stderr, "strata-example-lm: check failed\n");
    return 1;
  }
  return 0;
}

int run(const Settings& s) {
  std::string text;
  if (int rc = load_text(s, text); rc != 0) return rc;
  // Swap files go straight into --nvme, or the stable $TMPDIR/strata-example-lm
  // (Note [Stable scratch layout]); a crashed run's are reported and reclaimed.
  auto scratch = runtime::open_tool_nvme_dir(s.nvme, "--nvme", "strata-example-lm");
  if (!scratch.ok()) {
    std::fprintf(stderr, "strata-example-lm: %s\n", scratch.status().to_string().c_str());
    return 2;
  }
  const fs::path dir = scratch->path();
  Config config;
  if (int rc = make_config(s, dir, config); rc != 0) return rc;
  // The model outlives the runtime: the runtime drains its streams before it goes,
  // and a failed call drains what was launched before it returns (Note [Failed
  // steps] in runtime/src/step_abort.cpp), so no queued launch reads a freed model.
  Model m{.C = s.context, .E = s.embed, .H = s.width, .D = s.depth, .B = s.batch};
  auto created = Runtime::create(config);
  if (!created.ok()) {
    std::fprintf(stderr, "strata-example-lm: %s\n", created.status().to_string().c_str());
    return 2;
  }
  Runtime& rt = **created;
  if (Status st = example::build(rt, m, s.seed); !st.ok()) {
    std::fprintf(stderr, "strata-example-lm: %s\n", st.to_string().c_str());
    return 2;
  }
  print_header(s, m, config, dir, text.size());
  std::vector<float> losses;
  const auto start = std::chrono::steady_clock::now();
  if (int rc = train(rt, m, s, text, losses); rc != 0) return rc;
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const Stats& t = rt.stats();
  std::printf(
      "done: %d steps in %.1f s; moved h2d %s, d2h %s, disk read %s, write %s; stall %.2f s; high water gpu "
      "%s / %s, host %s / %s, nvme %s\n",
      s.steps, total_s, format_bytes(t.bytes_h2d).c_str(), format_bytes(t.bytes_d2h).c_str(),
      format_bytes(t.bytes_disk_read).c_str(), format_bytes(t.bytes_disk_write).c_str(), t.stall_s,
      format_bytes(t.gpu_high_water_bytes).c_str(), s.gpu_budget.c_str(),
      format_bytes(t.host_high_water_bytes).c_str(), s.host_budget.c_str(),
      format_bytes(t.nvme_bytes).c_str());
  if (!s.trace.empty()) {
    if (Status st = rt.write_chrome_trace(s.trace); !st.ok()) {
      std::fprintf(stderr, "strata-example-lm: %s\n", st.to_string().c_str());
      return 1;
    }
    std::printf("trace: %s (open in chrome://tracing or ui.perfetto.dev)\n", s.trace.c_str());
  }
  return s.check_loss ? check_loss(losses, t) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"strata-example-lm: a byte-level language model trained through strata's C++ API"};
  Settings s;
  for (const char* f : {"README.md", "docs/probe.md", "docs/config.md"}) {
    s.text.push_back(std::string(STRATA_SOURCE_DIR) + "/" + f);
  }
  app.add_option("--text", s.text, "training text files (default: the README and docs/)")
      ->capture_default_str();
  app.add_option("--steps", s.steps, "training steps")->capture_default_str();
  app.add_option("--nvme", s.nvme, "directory for the NVMe tier (default: the temp dir)");
  app.add_option("--trace", s.trace, "write the Chrome trace here");
  app.add_option("--config", s.config,
                 "JSON config (docs/config.md) applied over the example's settings; keys it names win");
  app.add_option("--context", s.context, "context bytes")->capture_default_str();
  app.add_option("--width", s.width, "hidden width")->capture_default_str();
  app.add_option("--depth", s.depth, "hidden layers")->capture_default_str();
  app.add_option("--batch", s.batch, "positions per step")->capture_default_str();
  app.add_option("--lr", s.lr, "AdamW learning rate")->capture_default_str();
  app.add_option("--gpu-budget", s.gpu_budget, "sim device chunk budget")->capture_default_str();
  app.add_option("--host-budget", s.host_budget, "host budget")->capture_default_str();
  app.add_option("--link", s.link, "sim copy throttle per direction, per second")->capture_default_str();
  app.add_option("--nvme-budget", s.nvme_budget,
                 "NVMe cap (the swap files hold only what the plan puts there; default: twice the model's "
                 "fp32 AdamW state + 64 MiB)");
  app.add_option("--seed", s.seed, "seed")->capture_default_str();
  app.add_flag("--check-loss", s.check_loss,
               "exit 1 unless the loss fell and every tier was used (for tests)");
  // One line on a bad command line, as every other refusal (the CLI fuzz test checks it).
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return fmt::format("strata-example-lm: {} (see --help)\n", e.what());
  });
  CLI11_PARSE(app, argc, argv);
  if (std::getenv("STRATA_LOG_LEVEL") == nullptr) set_log_level("warn");
  return run(s);
}
