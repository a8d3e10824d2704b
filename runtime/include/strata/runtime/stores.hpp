#pragma once
// The runtime's view of the host and NVMe tiers: two small interfaces, so the
// chunk state machine does not depend on how a tier is built, and the
// model-based test can run it over in-memory fakes with injected faults.
// make_host_store() wraps memory::PinnedHostPool; make_nvme_store() wraps
// offload::SwapStore over an IoEngine (stores.cpp).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/common/status.hpp"
#include "strata/memory/device.hpp"

namespace strata::runtime {

//! Host memory for chunks and staging under a hard budget. Thread-safe.
class HostStore {
 public:
  virtual ~HostStore() = default;
  //! `bytes` (> 0), 4096-aligned. OutOfBudget names the host budget and the request.
  virtual Result<std::byte*> allocate(std::uint64_t bytes) = 0;
  //! Returns memory from allocate(). Never fails.
  virtual void free(std::byte* data, std::uint64_t bytes) = 0;
  virtual std::uint64_t used_bytes() const = 0;
  virtual std::uint64_t high_water_bytes() const = 0;
  virtual std::uint64_t budget_bytes() const = 0;
  //! Memory ranges I/O may register as fixed buffers (may be empty).
  virtual std::vector<std::span<std::byte>> regions() const = 0;
  //! One line for the log: how the memory is pinned.
  virtual std::string describe() const = 0;
};

//! Called once with the outcome of an asynchronous NVMe transfer; must not block.
//! The runtime's callbacks capture one pointer (std::function keeps them in
//! place, Note [Completion records]), so a store that moves `done` along
//! allocates nothing for it.
using IoDone = std::function<void(Status)>;

//! Chunk-sized slots on NVMe with checksums. Thread-safe.
class NvmeStore {
 public:
  virtual ~NvmeStore() = default;
  //! Bytes of one slot (a chunk larger than this uses several).
  virtual std::uint64_t slot_bytes() const = 0;
  //! A free slot. NoSpace (or OutOfBudget) when the store is full.
  virtual Result<std::uint32_t> allocate_slot() = 0;
  virtual void free_slot(std::uint32_t slot) = 0;
  //! Writes `data` (<= slot_bytes, 4096-aligned) to `slot`; `done` runs on an I/O thread.
  virtual Status write(std::uint32_t slot, std::span<const std::byte> data, IoDone done) = 0;
  //! Reads back what was last written to `slot` into `data`, verifying its checksum
  //! (Corrupt names the chunk, file and offset). Reading a never-written slot is an error.
  virtual Status read(std::uint32_t slot, std::span<std::byte> data, IoDone done) = 0;
  //! A read ahead of use (a prefetch): read() by default. Its failure is not
  //! fatal (the use reads the slot again), so a store may treat it apart; the
  //! tests inject faults into these reads alone.
  virtual Status read_ahead(std::uint32_t slot, std::span<std::byte> data, IoDone done) {
    return read(slot, data, std::move(done));
  }
  virtual std::uint64_t used_bytes() const = 0;
  virtual std::string describe() const = 0;
  //! Records the store keeps for its I/O in flight, created so far (the store
  //! over offload::SwapStore: its slot_op_records). A steady stream of reads and
  //! writes stops growing it (HotPathCounters::nvme_slot_op_records). 0 for a
  //! store that keeps none.
  virtual std::uint64_t io_records() const { return 0; }
};

//! Bytes of the pinned region make_host_store maps for a host budget: the budget and
//! what the arena needs on top (Note [Host store arena] in stores.cpp). What a caller
//! must have in RAM to create the host tier.
std::uint64_t host_store_region_bytes(std::uint64_t budget_bytes);

//! The largest host budget whose region (host_store_region_bytes) fits in `ram_bytes`.
std::uint64_t largest_host_budget(std::uint64_t ram_bytes);

//! Host store over a pinned host pool of `budget_bytes` (memory::PinnedHostPool, all
//! of it a jemalloc arena carved from the pinned region). `device` (may be null)
//! registers the region for fast copies (cudaHostRegister); else mlock or plain, logged.
//! InvalidArgument, naming largest_host_budget, when the region would not fit in RAM.
Result<std::unique_ptr<HostStore>> make_host_store(std::uint64_t budget_bytes, memory::Device* device);

//! Settings of the NVMe store.
struct NvmeStoreOptions {
  std::vector<std::string> dirs;
  std::uint64_t slot_bytes = 0;
  std::uint64_t capacity_bytes = 0;  //!< total, across dirs (the NVMe budget): a cap
  //! Bytes preallocated at creation and checked against free space (the plan's
  //! NVMe bytes); the files grow past them on demand up to capacity_bytes (Note
  //! [Growing swap files] in offload/src/swap_store.cpp).
  std::uint64_t initial_bytes = 0;
  std::string engine = "auto";                      //!< auto, uring, posix
  std::vector<std::span<std::byte>> fixed_buffers;  //!< host regions to register
  //! Test hook: sees each transfer's raw result (bytes moved, or -errno) with its
  //! direction and file offset, and returns the one the engine acts on (an
  //! injected -EIO becomes the engine's error naming the file and the offset).
  std::function<std::int64_t(bool write, std::uint64_t offset_bytes, std::int64_t result)> io_result_filter;
};

//! NVMe store over offload::SwapStore. Fails with the store's Status (missing or
//! unwritable directory, not enough space for initial_bytes: the message gives the sizes).
Result<std::unique_ptr<NvmeStore>> make_nvme_store(const NvmeStoreOptions& options);

}  // namespace strata::runtime
