#pragma once
// Swap files on disk: directory checks, the header that marks a file as ours,
// reclaiming files a crashed run left, the up-front free-space check, creation
// (unlinked at once, Note [Unlinked swap files] in swap_file.cpp) and growth
// with fallocate. Used by SwapStore only.

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

//! An open, preallocated swap file; close_and_remove() ends it. Nameless once
//! created (Note [Unlinked swap files]): `path` is the name it had, for messages.
struct SwapFile {
  std::filesystem::path path;
  int fd = -1;
  bool direct = false;
  bool named = false;  //!< still has its name (the keep_names test hook only)
};

//! "strata-swap-<index>.swp", or "strata-swap-<index>.<run id>.swp" for a run's
//! own file (unique, so two stores in one directory never meet).
std::string swap_file_name(std::uint32_t dir_index);
std::string swap_file_name(std::uint32_t dir_index, std::uint64_t run_id);

//! NotFound (missing), InvalidArgument (not a directory), PermissionDenied
//! (not writable), each naming the directory and what to do.
Status check_swap_dir(const std::filesystem::path& dir);

//! Finds swap files in `dir` that no live process holds (their flock is free):
//! logs each one with what its header says (or that it has none) and removes it.
//! Files a live store holds are left alone.
Status reclaim_stale_swap_files(const std::filesystem::path& dir);

//! NoSpace when the file systems of `dirs` cannot hold `file_bytes` each
//! (summed per file system), naming the needed and available sizes.
Status check_free_space(const std::vector<std::filesystem::path>& dirs, std::uint64_t file_bytes);

//! How create_swap_file opens a file.
struct SwapOpenMode {
  bool direct = true;             //!< O_DIRECT, buffered with a warning where refused
  bool simulate_refused = false;  //!< test hook: as if O_DIRECT were refused
  bool keep_name = false;         //!< test hook: leave the file named (as a kill before the unlink would)
};

//! Creates a swap file in `dir` (O_TMPFILE, else named and unlinked once its
//! header is written: Note [Unlinked swap files]), locks it, preallocates
//! `file_bytes` and writes the header. Errors name the path and, for
//! ENOSPC/EFBIG, the sizes; nothing is left in `dir` on any error.
Result<SwapFile> create_swap_file(const std::filesystem::path& dir, const SwapHeaderInfo& info,
                                  std::uint64_t file_bytes, SwapOpenMode mode);

//! Preallocates [from_bytes, to_bytes) of `file`. NoSpace naming the file, the
//! bytes and the free space on ENOSPC/EFBIG; the file's data is unchanged.
Status grow_swap_file(const SwapFile& file, std::uint64_t from_bytes, std::uint64_t to_bytes);

//! Closes (and unlinks, when still named); logs (does not fail) when the unlink fails.
void close_and_remove(SwapFile& file);

}  // namespace strata::offload::detail
