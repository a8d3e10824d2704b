#pragma once
// The two tables every part of the runtime reads under Core::mu (Note [Lock
// discipline]): the registered tensors, and the chunks with their families' sizes.
// Core owns both and alone writes them (Note [Table writes] in core.cpp); the other
// parts see them const. Tensors are only added, at registration, and the name index
// follows every add. The chunk table is laid out once, when the layout is fixed
// (Core::lay_out_chunks, from Runtime::Impl::finalize), with each chunk's family,
// kind and size set there and never again. After that a chunk's copies follow the
// chunk state machine (chunk.hpp), a tensor's flags follow the step (Note [Gradient
// completion]), each through an operation Core names.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/chunk.hpp"
#include "strata/runtime/planner.hpp"

namespace strata::runtime {

class TensorTable {
 public:
  //! Registers a tensor; its name must not be registered yet (the caller checked).
  TensorId add(TensorSpec spec, std::uint64_t numel) {
    auto id = static_cast<TensorId>(tensors_.size());
    by_name_.emplace(spec.name, id);
    tensors_.push_back(TensorInfo{.spec = std::move(spec), .numel = numel});
    return id;
  }
  //! The tensor named `name`, if one is registered.
  std::optional<TensorId> find(const std::string& name) const {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) return std::nullopt;
    return it->second;
  }
  bool contains(const std::string& name) const { return by_name_.contains(name); }

  TensorInfo& operator[](TensorId t) { return tensors_[t]; }
  const TensorInfo& operator[](TensorId t) const { return tensors_[t]; }
  std::size_t size() const { return tensors_.size(); }
  bool empty() const { return tensors_.empty(); }
  auto begin() const { return tensors_.begin(); }
  auto end() const { return tensors_.end(); }

  //! A micro-batch ended (or was discarded): no tensor is written in the next one yet.
  void end_micro_batch() {
    for (TensorInfo& t : tensors_) t.written_in_micro_batch = false;
  }
  //! An optimizer step consumed (or a discard dropped) every gradient.
  void clear_grads_written() {
    for (TensorInfo& t : tensors_) t.grad_written = false;
  }
  bool any_grad_written() const {
    for (const TensorInfo& t : tensors_)
      if (t.grad_written) return true;
    return false;
  }

 private:
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, TensorId> by_name_;
};

class ChunkTable {
 public:
  //! Lays out `families` families of kStateKindCount chunks each, their sizes zero:
  //! once, when the layout is fixed. Each chunk's family and kind are set here.
  void lay_out(std::size_t families) {
    chunks_.clear();
    chunks_.resize(families * kStateKindCount);
    family_bytes_.assign(families, FamilyBytes{});
    for (std::size_t i = 0; i < chunks_.size(); ++i) {
      chunks_[i].family = static_cast<FamilyId>(i / kStateKindCount);
      chunks_[i].kind = static_cast<StateKind>(i % kStateKindCount);
    }
  }
  std::size_t families() const { return family_bytes_.size(); }
  //! Chunks: family * kStateKindCount + kind (what DeviceSlot::chunk and leases hold).
  static std::int32_t index(FamilyId f, StateKind k) {
    return static_cast<std::int32_t>(f * kStateKindCount + static_cast<std::size_t>(k));
  }
  Chunk& at(FamilyId f, StateKind k) { return chunks_[static_cast<std::size_t>(index(f, k))]; }
  const Chunk& at(FamilyId f, StateKind k) const { return chunks_[static_cast<std::size_t>(index(f, k))]; }
  Chunk& at(std::int32_t i) { return chunks_[static_cast<std::size_t>(i)]; }
  const Chunk& at(std::int32_t i) const { return chunks_[static_cast<std::size_t>(i)]; }
  std::size_t size() const { return chunks_.size(); }
  std::span<Chunk> all() { return chunks_; }
  auto begin() const { return chunks_.begin(); }
  auto end() const { return chunks_.end(); }

  //! Family f's sizes, what the planner plans with (set at lay-out, and the NVMe
  //! bytes once the store's slot is known).
  FamilyBytes& bytes(FamilyId f) { return family_bytes_[f]; }
  std::span<const FamilyBytes> family_bytes() const { return family_bytes_; }

 private:
  std::vector<Chunk> chunks_;
  std::vector<FamilyBytes> family_bytes_;
};

}  // namespace strata::runtime
