// GradPieces (Note [Gradients in pieces] in grad_pieces.hpp).
#include "grad_pieces.hpp"

#include <algorithm>
#include <utility>

#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"

namespace strata::torch_binding {

void GradPieces::set_families(std::vector<std::uint32_t> family_of, const std::vector<bool>& trainable) {
  family_of_ = std::move(family_of);
  std::uint32_t families = 0;
  for (std::uint32_t f : family_of_) families = std::max(families, f + 1);
  expected_.assign(families, 0);
  for (std::size_t i = 0; i < family_of_.size(); ++i) expected_[family_of_[i]] += trainable[i] ? 1 : 0;
  handed_.assign(families, 0);
  kept_.assign(families, {});
  kept_order_.clear();
  open_ = 0;
  kept_bytes_ = 0;
}

void GradPieces::begin_micro_batch() {
  std::fill(handed_.begin(), handed_.end(), 0);
  open_ = 0;
  limit_ = 0;
}

void GradPieces::note_handed(std::uint32_t family, std::size_t pieces) {
  const bool was_open = handed_[family] > 0 && handed_[family] < expected_[family];
  handed_[family] += static_cast<std::uint32_t>(pieces);
  const bool is_open = handed_[family] < expected_[family];
  open_ = open_ + (is_open ? 1 : 0) - (was_open ? 1 : 0);
}

void GradPieces::hand_family(std::uint32_t family, const Hand& hand) {
  std::vector<Piece> pieces = std::exchange(kept_[family], {});
  kept_order_.erase(std::find(kept_order_.begin(), kept_order_.end(), family));
  for (const Piece& p : pieces) kept_bytes_ -= p.grad.nbytes();
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    try {
      hand(pieces[i]);
    } catch (...) {
      note_handed(family, i);  // (the step is discarded: drop() follows)
      throw;
    }
  }
  note_handed(family, pieces.size());
}

void GradPieces::open_kept(const Hand& hand) {
  while (open_ < limit_ && !kept_order_.empty()) hand_family(kept_order_.front(), hand);
}

void GradPieces::offer(Piece piece, const Hand& hand) {
  if (family_of_.empty() || piece.param >= family_of_.size()) {
    hand(piece);  // (no layout yet: nothing to count against)
    return;
  }
  const std::uint32_t f = family_of_[piece.param];
  const std::size_t with_kept = kept_[f].size() + 1;
  const bool open = handed_[f] > 0 && handed_[f] < expected_[f];
  const bool completes = handed_[f] + with_kept >= expected_[f];
  if (open || completes || open_ < limit_ || limit_ == 0) {
    if (!kept_[f].empty()) hand_family(f, hand);
    hand(piece);
    note_handed(f, 1);
    if (completes) open_kept(hand);  // a place is free again
    return;
  }
  if (kept_[f].empty()) kept_order_.push_back(f);
  kept_bytes_ += piece.grad.nbytes();
  kept_bytes_peak_ = std::max(kept_bytes_peak_, kept_bytes_);
  ++kept_total_;
  if (!logged_) {
    logged_ = true;
    STRATA_LOG_INFO(
        "strata.torch: gradients arrive in another order than the plan's (e.g. one torch.autocast region "
        "around several steps): {} families are incomplete at once, as many as the host room holds; the "
        "gradients that would open more stay torch tensors until their families complete (Note [Gradients "
        "in pieces] in python/src/grad_pieces.hpp; the bytes kept: engine.counters()['kept_bytes_peak'])",
        open_);
  }
  kept_[f].push_back(std::move(piece));
}

void GradPieces::hand_kept(const Hand& hand) {
  while (!kept_order_.empty()) hand_family(kept_order_.front(), hand);
}

void GradPieces::drop() {
  for (std::uint32_t f : kept_order_) kept_[f].clear();
  kept_order_.clear();
  kept_bytes_ = 0;
}

}  // namespace strata::torch_binding
