#include "strata/runtime/trace.hpp"

#include <algorithm>

#include "strata/common/assert.hpp"

namespace strata::runtime {

double StepTrace::compute_total_s() const {
  double total = 0.0;
  for (const FamilyUse& use : uses) total += use.compute_s;
  return total;
}

void Tracer::record(FamilyId family, Phase phase, bool writes_grad) {
  if (!trace_.uses.empty() && trace_.uses.back().family == family && trace_.uses.back().phase == phase) {
    trace_.uses.back().writes_grad |= writes_grad;
    return;
  }
  trace_.uses.push_back(FamilyUse{.family = family, .phase = phase, .writes_grad = writes_grad});
}

StepTrace Tracer::take() {
  StepTrace out = std::move(trace_);
  // The next step records into the room of the trace handed back last time
  // (give_back), so a steady step allocates nothing here.
  trace_ = std::move(spare_);
  trace_.uses.clear();
  trace_.uses.reserve(out.uses.size());
  spare_ = StepTrace{};
  return out;
}

std::vector<long> last_backward_use(const StepTrace& trace, std::size_t family_count) {
  std::vector<long> last(family_count, -1);
  for (std::size_t i = 0; i < trace.uses.size(); ++i) {
    const FamilyUse& use = trace.uses[i];
    if (use.phase == Phase::kBackward && use.family < family_count) last[use.family] = static_cast<long>(i);
  }
  return last;
}

NextUse::NextUse(const std::vector<FamilyUse>& uses, std::size_t family_count)
    : length_(uses.size()), positions_(family_count) {
  for (std::size_t i = 0; i < uses.size(); ++i) {
    STRATA_CHECK(uses[i].family < family_count);
    positions_[uses[i].family].push_back(static_cast<std::uint32_t>(i));
  }
}

std::uint64_t NextUse::distance(FamilyId family, std::size_t pos) const {
  STRATA_ASSERT(family < positions_.size());
  const auto& p = positions_[family];
  if (p.empty()) return kNever;
  auto it = std::upper_bound(p.begin(), p.end(), static_cast<std::uint32_t>(pos));
  if (it != p.end()) return *it - pos;
  return length_ - pos + p.front();  // wraps to the next step
}

}  // namespace strata::runtime
