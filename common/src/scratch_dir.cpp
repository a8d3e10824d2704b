#include "strata/common/scratch_dir.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <system_error>

namespace strata {

Result<ScratchDir> ScratchDir::create(const std::filesystem::path& parent, std::string_view name) {
  std::error_code ec;
  if (!std::filesystem::exists(parent, ec)) {
    return not_found("{}: no such directory; create it (strata never does) or name another", parent.string());
  }
  if (!std::filesystem::is_directory(parent, ec)) {
    return invalid_argument("{}: not a directory; name a directory", parent.string());
  }
  std::filesystem::path path = parent / name;
  std::filesystem::create_directory(path,
                                    ec);  // false, no error, when it exists (Note [Stable scratch layout])
  if (ec) return errno_status(ec.value(), fmt::format("creating {}", path.string()));
  if (!std::filesystem::is_directory(path, ec)) {
    return invalid_argument("{} exists and is not a directory; remove it or name another directory",
                            path.string());
  }
  return ScratchDir(std::move(path), true);
}

ScratchDir& ScratchDir::operator=(ScratchDir&& other) noexcept {
  if (this != &other) {
    remove();
    path_ = std::move(other.path_);
    owned_ = std::exchange(other.owned_, false);
    other.path_.clear();
  }
  return *this;
}

ScratchDir::~ScratchDir() {
  remove();
}

void ScratchDir::remove() {
  if (path_.empty()) return;
  if (owned_) {
    std::error_code ec;
    std::filesystem::remove(path_, ec);  // only when empty
  }
  path_.clear();
  owned_ = false;
}

}  // namespace strata
