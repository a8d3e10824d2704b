#pragma once
// FileRemover: removes a batch of files on a thread of its own (Note [Stale
// checkpoint files] in format.cpp). Private to the checkpoint library; the
// Checkpointer owns one.

#include <filesystem>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace strata::checkpoint {

//! Removes files in the background, one batch at a time. Thread-safe. A file that
//! is gone already, or cannot be removed, is skipped: the next save's publish lists
//! the directory again and removes what no manifest names.
class FileRemover {
 public:
  FileRemover() = default;
  FileRemover(const FileRemover&) = delete;
  FileRemover& operator=(const FileRemover&) = delete;
  ~FileRemover() { wait(); }

  //! Starts removing `paths` once the previous batch is removed.
  void remove(std::vector<std::filesystem::path> paths) {
    std::lock_guard lock(mu_);
    if (thread_.joinable()) thread_.join();
    thread_ = std::thread([paths = std::move(paths)] {
      for (const std::filesystem::path& p : paths) {
        std::error_code ec;
        std::filesystem::remove(p, ec);
      }
    });
  }

  //! Waits until every batch is removed.
  void wait() {
    std::lock_guard lock(mu_);
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::mutex mu_;
  std::thread thread_;
};

}  // namespace strata::checkpoint
