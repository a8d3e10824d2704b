#include "strata/runtime/layout.hpp"

#include <algorithm>
#include <limits>

#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"

namespace strata::runtime {
namespace {

// Walks the greedy packing for one chunk size; calls on_family(first, last_excl,
// capacity, used, oversized) per family. Shared by the search and the build so
// both see the same packing.
template <typename OnFamily>
void pack(std::span<const std::uint64_t> numels, std::span<const TensorId> order, std::uint64_t chunk_elems,
          std::uint64_t offset_align, std::uint64_t chunk_align, OnFamily&& on_family) {
  std::size_t first = 0;
  std::uint64_t pos = 0;
  bool open = false;
  for (std::size_t i = 0; i < order.size(); ++i) {
    std::uint64_t n = numels[order[i]];
    if (n > chunk_elems) {
      if (open) on_family(first, i, chunk_elems, pos, false);
      on_family(i, i + 1, align_up(n, chunk_align), n, true);
      open = false;
      pos = 0;
      first = i + 1;
      continue;
    }
    std::uint64_t start = align_up(pos, offset_align);
    if (!open) {
      open = true;
      first = i;
      start = 0;
    } else if (start + n > chunk_elems) {
      on_family(first, i, chunk_elems, pos, false);
      first = i;
      start = 0;
    }
    pos = start + n;
  }
  if (open) on_family(first, order.size(), chunk_elems, pos, false);
}

std::uint64_t search(std::span<const std::uint64_t> numels, std::span<const TensorId> order,
                     const LayoutOptions& o) {
  std::uint64_t largest = 0;
  for (TensorId id : order) largest = std::max(largest, numels[id]);
  // A chunk that holds the largest tensor avoids an oversized family, so start there
  // when the range allows it.
  std::uint64_t lo =
      align_up(std::max(o.chunk_elems_min, std::min(largest, o.chunk_elems_max)), o.chunk_align_elems);
  std::uint64_t hi = std::max(lo, align_down(o.chunk_elems_max, o.chunk_align_elems));
  std::uint64_t span = hi - lo;
  std::uint64_t step = std::max(o.chunk_align_elems,
                                align_up(div_ceil(span + 1, o.search_candidates_max), o.chunk_align_elems));
  std::uint64_t best = lo;
  std::uint64_t best_padding = std::numeric_limits<std::uint64_t>::max();
  for (std::uint64_t c = lo; c <= hi; c += step) {
    std::uint64_t padding = layout_padding(numels, order, c, o.offset_align_elems, o.chunk_align_elems);
    if (padding < best_padding) {
      best_padding = padding;
      best = c;
    }
  }
  return best;
}

}  // namespace

double ChunkLayout::padding_fraction() const {
  if (capacity_total_elems == 0) return 0.0;
  return static_cast<double>(capacity_total_elems - numel_total) / static_cast<double>(capacity_total_elems);
}

std::uint64_t layout_padding(std::span<const std::uint64_t> numels, std::span<const TensorId> order,
                             std::uint64_t chunk_elems, std::uint64_t offset_align_elems,
                             std::uint64_t chunk_align_elems) {
  std::uint64_t capacity = 0;
  std::uint64_t numel = 0;
  for (TensorId id : order) numel += numels[id];
  pack(numels, order, chunk_elems, offset_align_elems, chunk_align_elems,
       [&](std::size_t, std::size_t, std::uint64_t cap, std::uint64_t, bool) { capacity += cap; });
  return capacity - numel;
}

Status validate_layout_options(const LayoutOptions& o) {
  if (!is_pow2(o.offset_align_elems)) {
    return invalid_argument("layout offset_align_elems = {} must be a power of two", o.offset_align_elems);
  }
  if (!is_pow2(o.chunk_align_elems) || o.chunk_align_elems < o.offset_align_elems) {
    return invalid_argument(
        "layout chunk_align_elems = {} must be a power of two and >= offset_align_elems = {}",
        o.chunk_align_elems, o.offset_align_elems);
  }
  if (o.chunk_elems != 0 && (o.chunk_elems % o.chunk_align_elems != 0 || o.chunk_elems > kChunkElemsLimit)) {
    return invalid_argument(
        "layout.chunk_elems = {}: use 0 (search for the size) or a multiple of {} up to {} (2^31)",
        o.chunk_elems, o.chunk_align_elems, kChunkElemsLimit);
  }
  for (const auto& [name, value] :
       {std::pair<const char*, std::uint64_t>{"chunk_elems_min", o.chunk_elems_min},
        {"chunk_elems_max", o.chunk_elems_max}}) {
    if (!is_pow2(value) || value < o.chunk_align_elems || value > kChunkElemsLimit) {
      return invalid_argument("layout.{} = {}: use a power of two from {} to {} (2^31)", name, value,
                              o.chunk_align_elems, kChunkElemsLimit);
    }
  }
  if (o.chunk_elems_min > o.chunk_elems_max) {
    return invalid_argument(
        "layout.chunk_elems_min = {} is greater than layout.chunk_elems_max = {}: the search range is empty; "
        "set min <= max",
        o.chunk_elems_min, o.chunk_elems_max);
  }
  if (o.search_candidates_max == 0) return invalid_argument("layout search_candidates_max must be > 0");
  return Status::Ok();
}

Result<ChunkLayout> build_layout(std::span<const std::uint64_t> numels, std::span<const TensorId> order,
                                 const LayoutOptions& options) {
  STRATA_RETURN_IF_ERROR(validate_layout_options(options));
  for (TensorId id : order) {
    if (id >= numels.size())
      return invalid_argument("packing order names tensor {} of {}", id, numels.size());
    if (numels[id] == 0) return invalid_argument("tensor {} has zero elements", id);
  }
  ChunkLayout layout;
  layout.chunk_elems = options.chunk_elems != 0 ? options.chunk_elems : search(numels, order, options);
  layout.slots.assign(numels.size(), TensorSlot{});
  pack(numels, order, layout.chunk_elems, options.offset_align_elems, options.chunk_align_elems,
       [&](std::size_t first, std::size_t last, std::uint64_t cap, std::uint64_t used, bool oversized) {
         FamilyLayout family{.capacity_elems = cap, .used_elems = used, .oversized = oversized};
         auto id = static_cast<FamilyId>(layout.families.size());
         std::uint64_t pos = 0;
         for (std::size_t i = first; i < last; ++i) {
           TensorId t = order[i];
           std::uint64_t start = i == first ? 0 : align_up(pos, options.offset_align_elems);
           layout.slots[t] = TensorSlot{.family = id, .offset_elems = start, .numel = numels[t]};
           family.tensors.push_back(t);
           pos = start + numels[t];
         }
         STRATA_CHECK(pos == used);
         STRATA_CHECK(used <= cap);
         layout.capacity_total_elems += cap;
         layout.families.push_back(std::move(family));
       });
  for (TensorId id : order) layout.numel_total += numels[id];
  return layout;
}

}  // namespace strata::runtime
