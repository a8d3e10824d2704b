#include "strata/common/scratch_dir.hpp"

#include <fmt/format.h>
#include <unistd.h>

namespace strata {

Result<ScratchDir> ScratchDir::create(const std::filesystem::path& parent, std::string_view prefix) {
  std::filesystem::path path = parent / fmt::format("{}-{}", prefix, ::getpid());
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) return errno_status(ec.value(), fmt::format("creating {}", path.string()));
  return ScratchDir(std::move(path));
}

ScratchDir& ScratchDir::operator=(ScratchDir&& other) noexcept {
  if (this != &other) {
    remove();
    path_ = std::move(other.path_);
    other.path_.clear();
  }
  return *this;
}

ScratchDir::~ScratchDir() {
  remove();
}

void ScratchDir::remove() {
  if (path_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
  path_.clear();
}

}  // namespace strata
