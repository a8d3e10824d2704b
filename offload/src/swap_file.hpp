#pragma once
// Swap files on disk: directory checks, the header that marks a file as ours,
// reclaiming files a crashed run left, the up-front free-space check, and
// creation with fallocate. Used by SwapStore only.

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "strata/common/status.hpp"

namespace strata::offload::detail {

//! Bytes at the start of every swap file before slot data: the header block.
inline constexpr std::uint64_t kSwapHeaderBytes = 4096;

//! What a header records (Note [Swap file header] in swap_file.cpp).
struct SwapHeaderInfo {
  std::uint64_t run_id = 0;
  std::uint64_t slot_bytes = 0;
  std::uint64_t stripe_bytes = 0;
  std::uint32_t slots = 0;
  std::uint32_t dir_index = 0;
  std::uint32_t dir_count = 0;
};

//! An open, locked, preallocated swap file. Move-only; close_and_remove() ends it.
struct SwapFile {
  std::filesystem::path path;
  int fd = -1;
  bool direct = false;
};

//! "strata-swap-<index>.swp".
std::string swap_file_name(std::uint32_t dir_index);

//! NotFound (missing), InvalidArgument (not a directory), PermissionDenied
//! (not writable), each naming the directory and what to do.
Status check_swap_dir(const std::filesystem::path& dir);

//! Finds swap files in `dir` that no live process holds (their flock is free):
//! logs each one with what its header says (or that it has none) and removes it.
//! A file named `wanted` that a live process holds is FailedPrecondition.
Status reclaim_stale_swap_files(const std::filesystem::path& dir, const std::string& wanted);

//! NoSpace when the file systems of `dirs` cannot hold `file_bytes` each
//! (summed per file system), naming the needed and available sizes.
Status check_free_space(const std::vector<std::filesystem::path>& dirs, std::uint64_t file_bytes);

//! Creates `dir/swap_file_name(index)`, locks it, preallocates `file_bytes`
//! and writes the header. O_DIRECT when `direct` (buffered with a warning when
//! refused, or when `simulate_refused`). Errors name the path and, for
//! ENOSPC/EFBIG, the sizes.
Result<SwapFile> create_swap_file(const std::filesystem::path& dir, const SwapHeaderInfo& info,
                                  std::uint64_t file_bytes, bool direct, bool simulate_refused);

//! Closes and unlinks; logs (does not fail) when the unlink fails.
void close_and_remove(SwapFile& file);

}  // namespace strata::offload::detail
