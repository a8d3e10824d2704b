#pragma once
// Test fixtures of the runtime tests: a temporary directory, the sim device, an
// MLP on its own runtime, and NVMe stores that fail or slow down on command.

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "mlp.hpp"
#include "offload/test_util.hpp"
#include "sim_device.hpp"
#include "strata/common/bytes.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/stores.hpp"

namespace strata::runtime::testing {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / fmt::format("strata-rt-{}-{}", ::getpid(), counter()++);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  static int& counter() {
    static int c = 0;
    return c;
  }
};

//! Settings of the I/O faults an engine-level filter injects (NvmeStoreOptions::io_result_filter):
//! the real engine turns them into its errors, which name the file and the offset.
struct IoFaults {
  std::atomic<bool> eio_reads{false};
  std::atomic<bool> eio_writes{false};
  std::atomic<bool> enospc_writes{false};
  std::atomic<int> injected{0};

  //! Reads at file `offset` fail with EIO the next `times` times (-1: always).
  void fail_reads_at(std::uint64_t offset, int times) {
    std::lock_guard lock(mu);
    bad_reads[offset] = times;
  }
  //! Whether a read at `offset` is to fail now (counts it down).
  bool take_bad_read(std::uint64_t offset) {
    std::lock_guard lock(mu);
    auto it = bad_reads.find(offset);
    if (it == bad_reads.end() || it->second == 0) return false;
    if (it->second > 0) --it->second;
    return true;
  }
  void clear_bad_reads() {
    std::lock_guard lock(mu);
    bad_reads.clear();
  }

 private:
  std::mutex mu;
  std::map<std::uint64_t, int> bad_reads;  //!< file offset -> reads left to fail (-1: all)
};

// An NVMe store that fails on command: EIO on a chosen write, or a full disk.
class FaultyNvme final : public NvmeStore {
 public:
  explicit FaultyNvme(std::unique_ptr<NvmeStore> inner) : inner_(std::move(inner)) {}
  std::uint64_t slot_bytes() const override { return inner_->slot_bytes(); }
  Result<std::uint32_t> allocate_slot() override {
    if (full_) return no_space("NVMe directory is full (injected)");
    return inner_->allocate_slot();
  }
  void free_slot(std::uint32_t s) override { inner_->free_slot(s); }
  Status write(std::uint32_t s, std::span<const std::byte> d, IoDone done) override {
    if (fail_writes_) {
      done(io_error("write: Input/output error (injected EIO)"));
      return Status::Ok();
    }
    return inner_->write(s, d, std::move(done));
  }
  Status read(std::uint32_t s, std::span<std::byte> d, IoDone done) override {
    if (corrupt_next_read_.exchange(false)) corrupt_slot(s);
    return inner_->read(s, d, std::move(done));
  }
  //! The fault-injection point of prefetches (Note [Prefetch errors] in
  //! runtime/src/residency/eviction.cpp): the next `fail_read_aheads_` reads ahead of use
  //! fail with the engine's EIO (naming the file and offset) through `faults_`
  //! (the inner store's engine filter; one directory). With `persistent_` their
  //! slots fail every later read too (a bad sector), else only that read.
  Status read_ahead(std::uint32_t s, std::span<std::byte> d, IoDone done) override {
    ++read_aheads_;
    if (faults_ != nullptr && fail_read_aheads_.fetch_sub(1) > 0) {
      faults_->fail_reads_at(4096 + std::uint64_t{s} * slot_bytes(), persistent_ ? -1 : 1);
    }
    return inner_->read(s, d, std::move(done));
  }
  std::uint64_t used_bytes() const override { return inner_->used_bytes(); }
  std::string describe() const override { return "faulty(" + inner_->describe() + ")"; }
  std::atomic<bool> fail_writes_{false};
  std::atomic<bool> full_{false};
  //! The next read's slot gets one byte flipped in its swap file first (one
  //! directory: the slot's bytes start after the file's 4 KiB header).
  std::atomic<bool> corrupt_next_read_{false};
  fs::path swap_dir_;
  std::atomic<std::int64_t> corrupted_offset_{-1};
  IoFaults* faults_ = nullptr;
  std::atomic<int> fail_read_aheads_{0};
  std::atomic<bool> persistent_{false};
  std::atomic<int> read_aheads_{0};

 private:
  //! The swap files are unlinked (Note [Unlinked swap files]): they are reached
  //! through this process's descriptors whose target lies in swap_dir_.
  static std::vector<fs::path> open_swap_files(const fs::path& dir) {
    std::vector<fs::path> found;
    const std::string prefix = fs::weakly_canonical(dir).string() + "/";
    std::error_code ec;
    for (const auto& fd : fs::directory_iterator("/proc/self/fd", ec)) {
      const fs::path target = fs::read_symlink(fd.path(), ec);
      if (!ec && target.string().rfind(prefix, 0) == 0) found.push_back(fd.path());
    }
    return found;
  }
  void corrupt_slot(std::uint32_t slot) {
    for (const fs::path& file : open_swap_files(swap_dir_)) {
      const std::int64_t at = 4096 + std::int64_t{slot} * static_cast<std::int64_t>(slot_bytes()) + 100;
      offload::testing::flip_byte(file, at, 0x5a);
      corrupted_offset_ = at;
    }
  }

 public:
 private:
  std::unique_ptr<NvmeStore> inner_;
};

// An NVMe store whose writes land `delay` after they are submitted, on their own
// thread, so write-backs are still in flight when step() returns.
class SlowWritesNvme final : public NvmeStore {
 public:
  SlowWritesNvme(std::unique_ptr<NvmeStore> inner, std::chrono::milliseconds delay)
      : inner_(std::move(inner)), delay_(delay) {}
  ~SlowWritesNvme() override {
    for (std::thread& t : threads_) t.join();
  }
  std::uint64_t slot_bytes() const override { return inner_->slot_bytes(); }
  Result<std::uint32_t> allocate_slot() override { return inner_->allocate_slot(); }
  void free_slot(std::uint32_t s) override { inner_->free_slot(s); }
  Status write(std::uint32_t s, std::span<const std::byte> d, IoDone done) override {
    ++pending_;
    std::lock_guard lock(mu_);
    threads_.emplace_back([this, s, d, done = std::move(done)]() mutable {
      std::this_thread::sleep_for(delay_);
      Status st = inner_->write(s, d, [this, done = std::move(done)](Status r) {
        --pending_;
        done(std::move(r));
      });
      if (!st.ok()) {
        --pending_;
        done(st);
      }
    });
    return Status::Ok();
  }
  Status read(std::uint32_t s, std::span<std::byte> d, IoDone done) override {
    return inner_->read(s, d, std::move(done));
  }
  std::uint64_t used_bytes() const override { return inner_->used_bytes(); }
  std::string describe() const override { return "slow-writes(" + inner_->describe() + ")"; }
  std::atomic<int> pending_{0};

 private:
  std::unique_ptr<NvmeStore> inner_;
  std::chrono::milliseconds delay_;
  std::mutex mu_;
  std::vector<std::thread> threads_;
};

// An MLP on its own runtime over the sim device; members are destroyed in
// reverse: the runtime, then the device, then the MLP its queued kernels use.
struct MlpRun {
  Mlp mlp;
  std::unique_ptr<memory::Device> device = sim_device();
  std::unique_ptr<Runtime> rt;
};

//! Creates run's runtime with `options` and registers and initialises the MLP.
inline void start_mlp(MlpRun& run, RuntimeOptions options, std::size_t layers, std::size_t width) {
  auto rt = Runtime::create(*run.device, std::move(options));
  ASSERT_TRUE(rt.ok()) << rt.status();
  run.rt = std::move(rt).value();
  run.mlp.layers = layers;
  run.mlp.width = width;
  const Status built = run.mlp.build(*run.rt);
  ASSERT_TRUE(built.ok()) << built;
}

//! An NVMe store over `dir` with `engine` ("posix" or "uring") whose I/O results
//! go through `faults` (may be null). Null (with the reason in *why) when the
//! engine cannot be created here.
inline std::unique_ptr<NvmeStore> store_with_engine(const fs::path& dir, const std::string& engine,
                                                    std::uint64_t slot_bytes, IoFaults* faults,
                                                    std::string* why) {
  NvmeStoreOptions o{
      .dirs = {dir.string()}, .slot_bytes = slot_bytes, .capacity_bytes = 32 * kMiB, .engine = engine};
  if (faults != nullptr) {
    o.io_result_filter = [faults](bool write, std::uint64_t offset, std::int64_t result) -> std::int64_t {
      if (result <= 0) return result;
      if (!write && (faults->eio_reads || faults->take_bad_read(offset))) return ++faults->injected, -EIO;
      if (write && faults->eio_writes) return ++faults->injected, -EIO;
      if (write && faults->enospc_writes) return ++faults->injected, -ENOSPC;
      return result;
    };
  }
  auto store = make_nvme_store(o);
  if (!store.ok()) {
    *why = store.status().to_string();
    return nullptr;
  }
  return std::move(store).value();
}

}  // namespace strata::runtime::testing
