// strata-probe's model side: shapes, counts, placements and the plan input; see
// model.hpp (Note [Probe placements], Note [Probe activations]). Estimates are in estimate.cpp.
#include "model.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <optional>

#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"

namespace strata::probe {
namespace {

constexpr std::uint64_t kCountMax = std::uint64_t{1} << 62;
constexpr std::uint64_t kChunkAlignElems = 4096;  // the runtime's LayoutOptions::chunk_align_elems

// a * b, or nullopt past kCountMax.
std::optional<std::uint64_t> mul(std::uint64_t a, std::uint64_t b) {
  if (a != 0 && b > kCountMax / a) return std::nullopt;
  return a * b;
}

std::optional<std::uint64_t> add(std::uint64_t a, std::uint64_t b) {
  if (a > kCountMax - b) return std::nullopt;
  return a + b;
}

// Optimizer states per element as the runtime keeps them; the probe assumes SGD
// with momentum.
std::uint64_t optimizer_states(kernels::Optimizer optimizer) {
  return kernels::optimizer_state_count({.optimizer = optimizer, .momentum = 0.9f});
}

//! The elements of a family of `numel` whose master and states one rank holds: the
//! whole chunk for one rank; with W ranks its shard, 1/W of the chunk padded to a
//! multiple of W x kShardAlignElems (Note [Sharded step]).
std::uint64_t shard_elems(const TrainSpec& spec, std::uint64_t numel) {
  const std::uint64_t cap = align_up(numel, kChunkAlignElems);
  if (spec.ranks <= 1) return cap;
  const std::uint64_t unit = std::uint64_t{spec.ranks} * runtime::kShardAlignElems;
  return (cap + unit - 1) / unit * unit / spec.ranks;
}

runtime::FamilyBytes family_bytes(const TrainSpec& spec, std::uint64_t numel) {
  const std::uint64_t cap = align_up(numel, kChunkAlignElems);
  const std::uint64_t shard = shard_elems(spec, numel);
  const std::uint64_t cb = runtime::dtype_bytes(spec.compute_dtype);
  runtime::FamilyBytes f;
  f.numel = std::min(numel, shard);  // the elements this rank's optimizer updates
  f.param_bytes = cap * cb;
  f.grad_bytes = cap * cb;
  f.optim_bytes = (spec.compute_dtype != runtime::DType::kF32 ? shard * 4 : 0) +
                  optimizer_states(spec.optimizer) * runtime::state_chunk_bytes(spec.state_dtype, shard);
  return f;
}

// Note [Probe activations].
std::optional<std::uint64_t> activation_bytes(const TrainSpec& spec, std::uint64_t layers) {
  const ModelShape& m = spec.shape;
  const std::uint64_t e = runtime::dtype_bytes(spec.compute_dtype);
  auto tokens = mul(m.seq, m.batch);
  auto sbh = tokens ? mul(*tokens, m.hidden) : std::nullopt;
  if (!sbh) return std::nullopt;
  auto checkpoints = mul(*sbh, layers);  // each layer's input
  auto working = mul(*sbh, 17 * e);      // 34 s*b*h bytes at 2 bytes a value
  auto logits = mul(*tokens, m.vocab);
  if (!checkpoints || !working || !logits) return std::nullopt;
  auto a = mul(*checkpoints, e);
  auto c = mul(*logits, 4);
  if (!a || !c) return std::nullopt;
  auto ab = add(*a, *working);
  return ab ? add(*ab, *c) : std::nullopt;
}

}  // namespace

Result<std::uint64_t> parse_count(std::string_view text, std::string_view setting) {
  auto bad = [&](std::string_view why) {
    return invalid_argument(
        "{} = \"{}\": {}; give a positive count like 125000, 350M, 1.3B or 2T (K, M, B, T = powers of 1000)",
        setting, text, why);
  };
  std::string s(text);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  if (s.empty()) return bad("empty");
  double scale = 1;
  const char last = static_cast<char>(std::toupper(static_cast<unsigned char>(s.back())));
  if (std::isalpha(static_cast<unsigned char>(last))) {
    switch (last) {
      case 'K':
        scale = 1e3;
        break;
      case 'M':
        scale = 1e6;
        break;
      case 'B':
      case 'G':
        scale = 1e9;
        break;
      case 'T':
        scale = 1e12;
        break;
      default:
        return bad(fmt::format("unknown suffix '{}'", s.back()));
    }
    s.pop_back();
  }
  if (s.empty() || !(std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '.'))
    return bad(s.empty() ? "no number" : "not a positive number");
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(s, &used);
  } catch (...) {
    return bad("not a number");
  }
  if (used != s.size()) return bad(fmt::format("unknown suffix \"{}\"", s.substr(used)));
  const double count = value * scale;
  if (!std::isfinite(count) || count >= static_cast<double>(kCountMax)) return bad("too large (max 2^62)");
  if (count < 1) return bad("must be at least 1");
  return static_cast<std::uint64_t>(std::llround(count));
}

std::string format_count(std::uint64_t count) {
  const double c = static_cast<double>(count);
  if (count >= 1'000'000'000'000ull) return fmt::format("{:.2f}T", c / 1e12);
  if (count >= 1'000'000'000ull) return fmt::format("{:.2f}B", c / 1e9);
  if (count >= 1'000'000ull) return fmt::format("{:.1f}M", c / 1e6);
  if (count >= 1'000ull) return fmt::format("{:.1f}K", c / 1e3);
  return fmt::format("{}", count);
}

Result<std::uint64_t> shape_params(const ModelShape& m) {
  const std::pair<const char*, std::uint64_t> fields[] = {{"--layers", m.layers},
                                                          {"--hidden", m.hidden},
                                                          {"--seq", m.seq},
                                                          {"--batch", m.batch},
                                                          {"--vocab", m.vocab}};
  for (const auto& [name, v] : fields) {
    if (v == 0) return invalid_argument("{} = 0: every dimension of the model shape must be >= 1", name);
  }
  auto h2 = mul(m.hidden, m.hidden);
  auto per_layer = h2 ? mul(*h2, 12) : std::nullopt;
  auto layers = per_layer ? mul(*per_layer, m.layers) : std::nullopt;
  auto emb = mul(m.vocab, m.hidden);
  auto total = layers && emb ? add(*layers, *emb) : std::nullopt;
  auto tokens = mul(m.seq, m.batch);
  auto acts = tokens ? mul(*tokens, m.hidden) : std::nullopt;
  auto attn = tokens ? mul(*tokens, m.seq) : std::nullopt;
  if (!total || !acts || !attn || !mul(*acts, m.layers) || !mul(*attn, m.hidden)) {
    return invalid_argument(
        "model shape layers={} hidden={} seq={} batch={} vocab={} overflows 2^62 (parameters or "
        "activations); use smaller dimensions",
        m.layers, m.hidden, m.seq, m.batch, m.vocab);
  }
  return *total;
}

Result<ModelShape> shape_for_params(std::uint64_t params, std::uint64_t seq, std::uint64_t batch,
                                    std::uint64_t vocab) {
  ModelShape m{.layers = 1, .hidden = 64, .seq = seq, .batch = batch, .vocab = vocab};
  STRATA_ASSIGN_OR_RETURN(std::uint64_t smallest, shape_params(m));
  if (params < smallest) {
    return invalid_argument(
        "--params {}: smaller than the smallest model the probe shapes (1 layer, hidden 64, vocab {}: {} "
        "params); give a shape with --layers/--hidden or a smaller --vocab",
        params, vocab, smallest);
  }
  double h = std::cbrt(static_cast<double>(params) * 128.0 / 12.0);
  std::uint64_t hidden = std::max<std::uint64_t>(64, static_cast<std::uint64_t>(h / 64.0 + 0.5) * 64);
  // Keep the embedding at most half the model.
  while (hidden > 64 && vocab * hidden * 2 > params) hidden -= 64;
  m.hidden = hidden;
  const double rest = static_cast<double>(params) - static_cast<double>(vocab * hidden);
  const double per_layer = 12.0 * static_cast<double>(hidden) * static_cast<double>(hidden);
  m.layers =
      std::max<std::uint64_t>(1, static_cast<std::uint64_t>(std::llround(std::max(rest, 0.0) / per_layer)));
  STRATA_RETURN_IF_ERROR(shape_params(m).status());
  return m;
}

Result<ModelShape> shape_for_verify(std::uint64_t params, std::uint64_t seq, std::uint64_t batch) {
  constexpr std::uint64_t kLayers = 16;
  // 12 * L * h^2 + 12h * h = (12L + 12) h^2
  const double h = std::sqrt(static_cast<double>(params) / (12.0 * (kLayers + 1)));
  const auto hidden = static_cast<std::uint64_t>(std::llround(h / 64.0)) * 64;
  if (hidden == 0) {
    return invalid_argument(
        "--verify-params {}: too small for the verify model (16 layers of hidden 64 = {} params)", params,
        12 * (kLayers + 1) * 64 * 64);
  }
  ModelShape m{.layers = kLayers, .hidden = hidden, .seq = seq, .batch = batch, .vocab = 12 * hidden};
  STRATA_RETURN_IF_ERROR(shape_params(m).status());
  return m;
}

double state_bytes_per_param(const TrainSpec& spec) {
  const std::uint64_t cb = runtime::dtype_bytes(spec.compute_dtype);
  // q8: a code byte and 4 / 256 of a block scale (Note [Q8 state chunks]).
  const double state =
      static_cast<double>(runtime::state_chunk_bytes(spec.state_dtype, runtime::kQ8BlockElems)) /
      static_cast<double>(runtime::kQ8BlockElems);
  return static_cast<double>(2 * cb + (spec.compute_dtype != runtime::DType::kF32 ? 4 : 0)) +
         static_cast<double>(optimizer_states(spec.optimizer)) * state;
}

std::string_view placement_name(Placement placement) {
  switch (placement) {
    case Placement::kAllGpu:
      return "all-gpu";
    case Placement::kOptimHost:
      return "optim-host";
    case Placement::kParamsOptimHost:
      return "params-optim-host";
    case Placement::kOptimNvme:
      return "optim-nvme";
    case Placement::kAllNvme:
      return "all-nvme";
  }
  return "unknown";
}

Result<Placement> parse_placement(std::string_view text) {
  for (Placement p : kPlacements) {
    if (placement_name(p) == text) return p;
  }
  return invalid_argument(
      "placement \"{}\": use all-gpu, optim-host, params-optim-host, optim-nvme or all-nvme", text);
}

Result<runtime::PlanInput> plan_input(const TrainSpec& spec, std::uint64_t layers, Placement placement,
                                      const Capacity& capacity) {
  ModelShape shape = spec.shape;
  shape.layers = layers;
  STRATA_RETURN_IF_ERROR(shape_params(shape).status());
  auto acts = activation_bytes(spec, layers);
  if (!acts) return invalid_argument("activations of the model shape overflow 2^62; use smaller dimensions");

  runtime::PlanInput in;
  const std::uint64_t per_layer = 12 * shape.hidden * shape.hidden;
  const std::uint64_t embed = shape.vocab * shape.hidden;
  const double tokens = static_cast<double>(shape.seq) * static_cast<double>(shape.batch);
  // Each family's elements: the embedding's, then each layer's (Note [Probe chunk size]).
  std::vector<std::uint64_t> numels;
  auto add = [&](std::uint64_t numel) {
    const std::uint64_t k = families_of(spec, numel);
    for (std::uint64_t i = 0; i < k; ++i) numels.push_back(numel / k + (i < numel % k ? 1 : 0));
  };
  add(embed);
  for (std::uint64_t l = 0; l < layers; ++l) add(per_layer);
  for (std::uint64_t n : numels) in.families.push_back(family_bytes(spec, n));
  auto full_numel = [&](std::size_t f) { return numels[f]; };
  {
    // On NVMe each optimizer chunk takes whole slots sized by the largest one.
    const std::uint64_t master_elem = spec.compute_dtype != runtime::DType::kF32 ? 4 : 0;
    const std::uint64_t states = optimizer_states(spec.optimizer);
    auto cap = [&](std::uint64_t numel) { return shard_elems(spec, numel); };  // this rank's
    auto state_bytes = [&](std::uint64_t elems) {
      return runtime::state_chunk_bytes(spec.state_dtype, elems);
    };
    const std::uint64_t largest_cap = cap(*std::max_element(numels.begin(), numels.end()));
    const std::uint64_t largest =
        std::max(largest_cap * master_elem, states > 0 ? state_bytes(largest_cap) : 0);
    const std::uint64_t slot = runtime::nvme_slot_bytes(largest);
    for (std::size_t i = 0; i < in.families.size(); ++i) {
      runtime::FamilyBytes& f = in.families[i];
      const std::uint64_t c = cap(full_numel(i));
      f.optim_nvme_bytes = (master_elem > 0 ? runtime::nvme_chunk_bytes(c * master_elem, slot) : 0) +
                           states * runtime::nvme_chunk_bytes(state_bytes(c), slot);
      f.param_nvme_bytes = runtime::nvme_chunk_bytes(f.param_bytes, slot);
    }
  }
  auto fwd_s = [&](std::uint64_t numel) {
    return runtime::forward_flops(static_cast<double>(numel), tokens) / spec.device_flops_per_s;
  };
  const auto families = static_cast<runtime::FamilyId>(in.families.size());
  for (runtime::FamilyId f = 0; f < families; ++f) {
    in.trace.uses.push_back({f, runtime::Phase::kForward, false, fwd_s(full_numel(f))});
  }
  for (runtime::FamilyId f = families; f-- > 0;) {
    in.trace.uses.push_back({f, runtime::Phase::kBackward, true, 2 * fwd_s(full_numel(f))});
  }
  in.trace.non_chunk_peak_bytes = *acts;
  in.budgets = {.gpu_bytes = capacity.gpu_bytes, .host_bytes = capacity.host_bytes, .nvme_bytes = 0};
  in.options.allow_gpu_optimizer = placement == Placement::kAllGpu && spec.gpu_optimizer;
  // Only all-nvme lets params spill to NVMe (Note [Probe placements]).
  in.options.allow_nvme_params = placement == Placement::kAllNvme;
  in.options.deferred_updates = spec.deferred_updates;
  if (placement == Placement::kOptimNvme || placement == Placement::kAllNvme) {
    in.budgets.nvme_bytes = capacity.nvme_bytes;
  }
  return in;
}

// Note [Probe chunk size]
// The runtime packs tensors into chunks of its layout's size, and a trainer's search
// (strata.torch's, Note [Chunk search bounds]) may choose chunks smaller than a layer:
// 105 MB at d 2560 in bench/torch_scale.py, a third of a layer. One family per layer
// then overstates what a GPU slot must hold (the probe refused that run's 0.69 GB GPU
// budget: "1 layer exceeds the gpu budget") and understates how many families move.
// With --chunk-elems the probe splits each layer, and the embedding, evenly into
// ceil(numel / chunk_elems) families, each used once forward and once backward in
// order. It does not pack tensor by tensor: a layer's padding is not modelled. At most
// kFamiliesPerLayerMax families a layer, as the planner's work grows with the square
// of the family count (Note [Probe layer bound]).
std::uint64_t families_of(const TrainSpec& spec, std::uint64_t numel) {
  if (spec.chunk_elems == 0 || numel <= spec.chunk_elems) return 1;
  return (numel + spec.chunk_elems - 1) / spec.chunk_elems;
}

Capacity per_rank_capacity(Capacity node, std::uint32_t ranks_per_node) {
  const std::uint64_t k = std::max<std::uint32_t>(ranks_per_node, 1);
  return {.gpu_bytes = node.gpu_bytes, .host_bytes = node.host_bytes / k, .nvme_bytes = node.nvme_bytes / k};
}

Result<std::uint64_t> rank_state_bytes(const TrainSpec& spec) {
  STRATA_ASSIGN_OR_RETURN(runtime::PlanInput in,
                          plan_input(spec, spec.shape.layers, Placement::kParamsOptimHost, Capacity{}));
  std::uint64_t bytes = 0;
  for (const runtime::FamilyBytes& f : in.families) bytes += f.optim_bytes;
  return bytes;
}

Result<std::uint64_t> activation_peak_bytes(const TrainSpec& spec) {
  auto acts = activation_bytes(spec, spec.shape.layers);
  if (!acts) return invalid_argument("activations of the model shape overflow 2^62; use smaller dimensions");
  return *acts;
}

bool plan_matches(const runtime::Plan& plan, Placement placement) {
  auto all = [&](auto pred) { return std::all_of(plan.families.begin(), plan.families.end(), pred); };
  using runtime::Tier;
  switch (placement) {
    case Placement::kAllGpu:
      return plan.all_gpu;
    case Placement::kOptimHost:
      return !plan.all_gpu && all([](const runtime::FamilyPlan& f) {
        return f.param_resident_gpu && f.optim_home == Tier::kHost;
      });
    case Placement::kParamsOptimHost:
      return !plan.all_gpu && all([](const runtime::FamilyPlan& f) {
        return f.param_home == Tier::kHost && f.optim_home == Tier::kHost;
      });
    case Placement::kOptimNvme:
      return !plan.all_gpu && all([](const runtime::FamilyPlan& f) { return f.param_home == Tier::kHost; });
    case Placement::kAllNvme:
      return !plan.all_gpu;
  }
  return false;
}

}  // namespace strata::probe
