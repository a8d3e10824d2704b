// Checkpoint load, private: what the check pass finds (LoadPlan), the fill of a
// chunk's host image from the files, and the NVMe shadows of Note [Load in one
// read] (shadow.cpp). Used by load.cpp only.
#pragma once

#include <sys/stat.h>

#include "checkpoint.hpp"

namespace strata::checkpoint::detail {

//! Where a tensor's saved kinds lie: its file, each kind's offset and dtype.
struct Saved {
  std::uint32_t file = 0;
  std::uint64_t offset[kStateKindCount] = {};
  DType dtype[kStateKindCount] = {};
  bool has[kStateKindCount] = {};
  std::int64_t steps = 0;
  std::uint32_t group = 0;
};

//! What the check pass finds and the apply pass reads.
struct LoadPlan {
  explicit LoadPlan(Source& source) : src(source) {}
  Source& src;
  //! The tensors and families this load fills (taken after finalize).
  Description desc;
  std::unordered_map<std::string, TensorId> ids;  //!< the registered tensors by name
  fs::path root;
  json manifest;
  std::string mpath;
  std::vector<Saved> saved;  //!< by TensorId
  std::vector<bool> seen;
  std::vector<fs::path> file_paths;
  std::vector<std::uint64_t> file_bytes;
  std::vector<GroupEntry> groups;
  std::uint64_t stripe_bytes = 0;
  std::vector<Fd> fds;                // the verified files, read by the apply pass
  std::vector<struct stat> verified;  // as they were when opened, before any read
};

//! An NVMe-homed optimizer state chunk loaded into fresh swap slots while the files
//! are verified; it replaces the chunk's slots only once everything passed (Note
//! [Load in one read]).
struct Shadow {
  FamilyId family = 0;
  StateKind kind = StateKind::kState0;
  std::vector<std::uint32_t> slots;
};

//! Fills `base`, the host image of family f's `k` chunk, from the files: each
//! tensor's bytes (converted when the dtypes differ); a state the checkpoint lacks
//! (a frozen tensor's) is zeros. Padding is not written.
Status fill_chunk(const LoadPlan& p, FamilyId f, StateKind k, std::byte* base,
                  std::vector<std::byte>& staging);
//! fill_chunk for tensor `id` when its saved or its loaded `k` state is q8 (Note [Q8
//! checkpoints] in q8_states.cpp): copied, dequantized or quantized into `base`.
//! InvalidArgument (a value no 8-bit state holds), Corrupt, or a read's error.
Status fill_q8_tensor(const LoadPlan& p, FamilyId f, StateKind k, TensorId id, std::byte* base,
                      std::vector<std::byte>& staging);
//! True when family f's `k` chunk is loaded through a Shadow: an NVMe-homed
//! optimizer state whose value is on NVMe (or not yet written).
bool shadowed(const LoadPlan& p, FamilyId f, StateKind k);
//! Frees the fresh slots of shadows not committed.
void drop_shadows(Source& src, std::vector<Shadow>& shadows);
//! Every shadowed chunk, written to fresh slots (the lock held; unlocked while the
//! writes run).
Status write_shadows(std::unique_lock<std::mutex>& lock, const LoadPlan& p, std::vector<Shadow>& shadows);
//! The shadows replace their chunks' slots (the old ones are freed).
void commit_shadows(Source& src, std::vector<Shadow>& shadows);

}  // namespace strata::checkpoint::detail
