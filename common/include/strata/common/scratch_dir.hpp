#pragma once
// ScratchDir: the directory a tool keeps its files in (an NVMe tier's swap
// files) for one run.
//
// Note [Stable scratch layout]
// A tool's scratch directory is either the directory the user named (borrowed:
// used as it is, never created, never removed) or, when none was named, a
// stable subdirectory of the temp dir, the same for every run of that tool
// (`$TMPDIR/strata-example-lm`), never one per process, so nothing accumulates
// in directories nobody looks at again. The swap files themselves have no name
// while in use (Note [Unlinked swap files]), so no death leaves them; a named
// one an older strata left is found there by the next run and reclaimed (Note
// [Swap file header]). The stable subdirectory is removed when the run ends and
// it is empty (never with contents: another run may be using it); a killed run
// leaves it, empty, for the next.

#include <filesystem>
#include <string_view>
#include <utility>

#include "strata/common/status.hpp"

namespace strata {

class ScratchDir {
 public:
  //! Uses `parent`/`name`, creating it when missing; `parent` must exist (NotFound
  //! naming it otherwise: strata never creates a directory it was told to use) and
  //! be a directory. Fails with the errno Status, naming the path, when the
  //! subdirectory cannot be created. Removed at destruction when empty.
  static Result<ScratchDir> create(const std::filesystem::path& parent, std::string_view name);
  //! Uses `path` as it is: nothing is created or removed.
  static ScratchDir borrow(std::filesystem::path path) { return ScratchDir(std::move(path), false); }
  ScratchDir() = default;
  ScratchDir(ScratchDir&& other) noexcept
      : path_(std::move(other.path_)), owned_(std::exchange(other.owned_, false)) {
    other.path_.clear();
  }
  ScratchDir& operator=(ScratchDir&& other) noexcept;
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  //! Removes the directory when this created-or-found it and it is empty (errors
  //! are ignored: a non-empty directory belongs to a run still using it).
  ~ScratchDir();

  const std::filesystem::path& path() const { return path_; }

 private:
  ScratchDir(std::filesystem::path path, bool owned) : path_(std::move(path)), owned_(owned) {}
  void remove();
  std::filesystem::path path_;
  bool owned_ = false;
};

}  // namespace strata
