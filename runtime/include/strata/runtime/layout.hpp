#pragma once
// Packing tensors into chunk families, and the chunk-size search.
//
// Note [Chunk layout]
// Tensors are packed in a given order (first use, from the trace; registration
// order before there is one) into chunks of `chunk_elems` elements. Every state
// kind of a family (param, grad, master, optimizer states) uses the same element
// offsets, so one fused kernel updates a family in one pass. Offsets are aligned
// to `offset_align_elems` (vector width and cache line), chunk sizes to
// `chunk_align_elems` (so every dtype's chunk is a multiple of 4 KiB for O_DIRECT).
// A tensor larger than the chunk gets a family of its own, sized to it.
// The chunk size is searched over a bounded range for the least padding; ties go
// to the smaller chunk, which gives the planner finer-grained placement.

#include <cstdint>
#include <span>
#include <vector>

#include "strata/common/status.hpp"
#include "strata/runtime/tensor.hpp"

namespace strata::runtime {

//! Settings of the packing and the chunk-size search.
struct LayoutOptions {
  std::uint64_t chunk_elems = 0;               //!< fixed chunk size; 0 = search
  std::uint64_t chunk_elems_min = 1u << 20;    //!< search lower bound (elements)
  std::uint64_t chunk_elems_max = 1u << 26;    //!< search upper bound (elements)
  std::uint64_t search_candidates_max = 1024;  //!< bound on sizes tried
  std::uint64_t offset_align_elems = 64;       //!< tensor offset alignment (power of two)
  std::uint64_t chunk_align_elems = 4096;      //!< chunk size alignment (power of two)
};

//! Largest chunk, in elements (8 GiB of fp32): a chunk is one device slot, one
//! host allocation and one NVMe slot; a larger one fits no real budget.
inline constexpr std::uint64_t kChunkElemsLimit = std::uint64_t{1} << 31;

//! LayoutOptions: chunk_elems 0 (search) or a multiple of chunk_align_elems up to
//! kChunkElemsLimit; chunk_elems_min and chunk_elems_max powers of two with
//! chunk_align_elems <= min <= max <= kChunkElemsLimit; alignments powers of two.
Status validate_layout_options(const LayoutOptions& options);

//! Where a tensor lives: family and element offset within each of its chunks.
struct TensorSlot {
  FamilyId family = 0;
  std::uint64_t offset_elems = 0;
  std::uint64_t numel = 0;
};

//! One chunk family: the tensors it holds, in order, and its size.
struct FamilyLayout {
  std::uint64_t capacity_elems = 0;  //!< chunk_elems, or more for an oversized tensor
  std::uint64_t used_elems = 0;      //!< end of the last tensor (padding after it is zero)
  std::vector<TensorId> tensors;
  bool oversized = false;  //!< holds one tensor larger than chunk_elems
};

//! With W data-parallel ranks every chunk capacity is a multiple of W x this many
//! elements, and rank r holds elements [r C/W, (r+1) C/W) of each chunk's masters
//! and optimizer states (Note [Sharded step] in runtime/src/dp/data_parallel.cpp):
//! 64 B or more of any dtype, so every shard starts aligned for the kernels.
inline constexpr std::uint64_t kShardAlignElems = 64;
//! The shard alignment for a state dtype: q8 states' shards are whole scale
//! blocks (kQ8BlockElems; Note [Q8 state chunks] in runtime/src/pipeline/q8_states.cpp),
//! so that no shard boundary cuts a tensor's block.
constexpr std::uint64_t shard_align_elems(DType state_dtype) {
  return state_dtype == DType::kQ8 ? kQ8BlockElems : kShardAlignElems;
}

//! The result of packing. Immutable once built.
struct ChunkLayout {
  std::uint64_t chunk_elems = 0;
  std::vector<FamilyLayout> families;
  std::vector<TensorSlot> slots;  //!< indexed by TensorId
  std::uint64_t numel_total = 0;
  std::uint64_t capacity_total_elems = 0;

  //! Fraction of capacity that is padding, in [0, 1).
  double padding_fraction() const;
};

//! Packs tensors (numels indexed by TensorId) in `order` (a permutation of the
//! ids, or a subset: ids left out are not packed). Searches the chunk size unless
//! options.chunk_elems is set. Fails (InvalidArgument, naming the setting) on bad
//! options: bounds not powers of two, min > max, a fixed size not aligned; or a
//! zero numel.
Result<ChunkLayout> build_layout(std::span<const std::uint64_t> numels, std::span<const TensorId> order,
                                 const LayoutOptions& options);

//! Padding (elements) that packing with chunk size `chunk_elems` would leave.
//! Exposed for tests of the search.
std::uint64_t layout_padding(std::span<const std::uint64_t> numels, std::span<const TensorId> order,
                             std::uint64_t chunk_elems, std::uint64_t offset_align_elems,
                             std::uint64_t chunk_align_elems);

}  // namespace strata::runtime
