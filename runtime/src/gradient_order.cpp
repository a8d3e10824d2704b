// GradientOrder (Note [Gradients in pieces] in strata/runtime/gradient_order.hpp).
#include "strata/runtime/gradient_order.hpp"

#include <algorithm>
#include <utility>

namespace strata::runtime {

void GradientOrder::set_families(std::vector<std::uint32_t> family_of, const std::vector<bool>& trainable) {
  family_of_ = std::move(family_of);
  std::uint32_t families = 0;
  for (std::uint32_t f : family_of_) families = std::max(families, f + 1);
  expected_.assign(families, 0);
  members_.assign(families, {});
  for (std::size_t i = 0; i < family_of_.size(); ++i) {
    if (!trainable[i]) continue;
    ++expected_[family_of_[i]];
    members_[family_of_[i]].push_back(static_cast<std::uint32_t>(i));
  }
  seen_.assign(family_of_.size(), 0);
  handed_.assign(families, 0);
  kept_.assign(families, {});
  bytes_.assign(family_of_.size(), 0);
  kept_order_.clear();
  open_ = 0;
  kept_bytes_ = 0;
}

void GradientOrder::begin_micro_batch(std::size_t limit) {
  drop();
  std::fill(handed_.begin(), handed_.end(), 0);
  std::fill(seen_.begin(), seen_.end(), 0);
  open_ = 0;
  limit_ = limit;
}

void GradientOrder::note_handed(std::uint32_t family, std::size_t tensors) {
  const bool was_open = handed_[family] > 0 && handed_[family] < expected_[family];
  handed_[family] += static_cast<std::uint32_t>(tensors);
  const bool is_open = handed_[family] < expected_[family];
  open_ = open_ + (is_open ? 1 : 0) - (was_open ? 1 : 0);
}

void GradientOrder::take_family(std::uint32_t family, std::vector<std::uint32_t>* hand) {
  std::vector<std::uint32_t> kept = std::exchange(kept_[family], {});
  kept_order_.erase(std::find(kept_order_.begin(), kept_order_.end(), family));
  for (std::uint32_t t : kept) {
    kept_bytes_ -= bytes_[t];
    hand->push_back(t);
  }
  note_handed(family, kept.size());
}

void GradientOrder::offer(std::uint32_t t, std::uint64_t bytes, std::vector<std::uint32_t>* hand) {
  if (t >= family_of_.size()) {
    hand->push_back(t);  // (no layout known: nothing to count against)
    return;
  }
  const std::uint32_t f = family_of_[t];
  seen_[t] = 1;
  const bool open = handed_[f] > 0 && handed_[f] < expected_[f];
  const bool completes = handed_[f] + kept_[f].size() + 1 >= expected_[f];
  if (open || completes || open_ < limit_ || limit_ == 0) {
    if (!kept_[f].empty()) take_family(f, hand);
    hand->push_back(t);
    note_handed(f, 1);
    // A family completed: the oldest kept ones may open in its place.
    while (completes && open_ < limit_ && !kept_order_.empty()) take_family(kept_order_.front(), hand);
    return;
  }
  if (kept_[f].empty()) kept_order_.push_back(f);
  kept_[f].push_back(t);
  bytes_[t] = bytes;
  kept_bytes_ += bytes;
  kept_bytes_peak_ = std::max(kept_bytes_peak_, kept_bytes_);
  ++kept_total_;
}

void GradientOrder::take_kept(std::vector<std::uint32_t>* hand) {
  while (!kept_order_.empty()) take_family(kept_order_.front(), hand);
}

void GradientOrder::append_missing(std::uint32_t family, std::vector<Handing>* out) {
  std::size_t missing = 0;
  for (std::uint32_t t : members_[family]) {
    if (seen_[t] != 0) continue;
    seen_[t] = 1;
    out->push_back({t, false});
    ++missing;
  }
  note_handed(family, missing);
}

void GradientOrder::end_backward(std::vector<Handing>* out) {
  for (std::uint32_t f = 0; f < handed_.size(); ++f) {
    if (handed_[f] > 0 && handed_[f] < expected_[f] && kept_[f].empty()) append_missing(f, out);
  }
  std::vector<std::uint32_t> hand;
  while (!kept_order_.empty()) {
    const std::uint32_t f = kept_order_.front();
    hand.clear();
    take_family(f, &hand);
    for (std::uint32_t t : hand) out->push_back({t, true});
    append_missing(f, out);
  }
}

void GradientOrder::drop() {
  for (std::uint32_t f : kept_order_) kept_[f].clear();
  kept_order_.clear();
  kept_bytes_ = 0;
}

}  // namespace strata::runtime
