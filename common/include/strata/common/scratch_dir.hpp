#pragma once
// ScratchDir: a directory a run creates for its files (an NVMe tier in a
// temporary place) and removes, with everything in it, when it is destroyed.

#include <filesystem>
#include <string_view>

#include "strata/common/status.hpp"

namespace strata {

class ScratchDir {
 public:
  //! Creates `parent`/`prefix`-<pid> (and `parent` when missing). Fails with the
  //! errno Status, naming the path, when it cannot be created.
  static Result<ScratchDir> create(const std::filesystem::path& parent, std::string_view prefix);
  ScratchDir() = default;
  ScratchDir(ScratchDir&& other) noexcept : path_(std::move(other.path_)) { other.path_.clear(); }
  ScratchDir& operator=(ScratchDir&& other) noexcept;
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  //! Removes the directory and its contents (errors are ignored: nothing to do about them here).
  ~ScratchDir();

  const std::filesystem::path& path() const { return path_; }

 private:
  explicit ScratchDir(std::filesystem::path path) : path_(std::move(path)) {}
  void remove();
  std::filesystem::path path_;
};

}  // namespace strata
