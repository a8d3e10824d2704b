// strata-bench io's passes over the bench's file (io_passes.hpp).
//
// Note [Fair comparison with fio]
// - One file, DIR/strata-bench-io.dat, of exactly --bytes, preallocated with
//   fallocate and written once in full before anything is timed, so every
//   engine overwrites (and reads) the same written extents of the same file.
// - Both sides keep --qd blocks of --block bytes in flight with O_DIRECT. fio:
//   bs=block, iodepth=qd, fixedbufs and registerfiles for io_uring (what strata
//   uses). strata: qd requests in flight, each split into --request pieces,
//   engine queue depth qd * block / request, so the kernel sees the same bytes
//   in flight. Buffers are page-aligned mmap memory registered as fixed buffers,
//   touched once in order at start, with MADV_HUGEPAGE as the pinned host pool
//   will have them (--no-huge-pages: plain 4 KiB pages, like fio's malloc'd
//   buffers). This matters on the development machine's virtio disk: with
//   huge pages a 4 MiB read is a few physically contiguous segments, without
//   them up to 1024, and the device's 254-segment limit splits it into more,
//   smaller device requests. So fio runs twice per engine: with its default
//   malloc'd 4 KiB-page buffers and with huge-page buffers (--iomem=mmaphuge:
//   anonymous MAP_HUGETLB, 2 MiB pages from the hugetlb pool; fio has no option
//   for transparent huge pages). The ratios on equal buffers are strata (THP,
//   checked in /proc/self/smaps: strata_buffer_huge_bytes) vs fio mmaphuge, and
//   strata --no-huge-pages vs fio malloc. fio's huge pages need free hugetlb
//   pages (/proc/sys/vm/nr_hugepages); without them those columns are null and
//   fio_huge_note says what to set.
// - Both sides hand the kernel one block per io_uring_enter: fio with its
//   default iodepth_batch_submit=1, strata's engine always (Note [One piece per
//   submission] in offload/src/uring_engine.cpp). Submitted together, adjacent
//   blocks are merged by the block layer's plug into one device request, which
//   is not the queue depth fio measures (/proc/diskstats shows the merges).
// - The page cache plays no part (O_DIRECT). Runs interleave the engines so
//   drift in the device's speed hits all of them alike, and each run starts
//   with a different engine; medians are reported. The disk's speed drifts by
//   tens of percent between runs, so the *_paired keys also give the median of
//   each run's own strata / fio ratio, and --engines uring,fio_uring_huge runs
//   only the pair the target compares (more pairs in the same time).
// - Before every timed pass the device's write cache is flushed (syncfs) and
//   the bench pauses 200 ms: fio's passes are separate processes with such a
#include "io_passes.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "strata/common/log.hpp"

namespace strata::bench::io {

using offload::EngineKind;
using offload::IoEngine;
using offload::IoOp;

Mapping::Mapping(std::size_t n, bool huge_pages) : size(huge_pages ? align_up(n, kHuge) : n) {
  reserved = huge_pages ? size + kHuge : size;
  void* p = ::mmap(nullptr, reserved, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return;
  base = static_cast<std::byte*>(p);
  data = huge_pages ? base + (align_up(reinterpret_cast<std::uintptr_t>(p), kHuge) -
                              reinterpret_cast<std::uintptr_t>(p))
                    : base;
  if (huge_pages) ::madvise(data, size, MADV_HUGEPAGE);
  std::memset(data, 0, size);  // touched in order: Note [Fair comparison with fio]
}

Mapping::~Mapping() {
  if (base != nullptr) ::munmap(base, reserved);
}

namespace {

// Moves the whole file once in `op` direction with `engine`; GiB/s or a failure.
// The first qd blocks are submitted from here; each completion submits the next
// block into the buffer it just freed, from the callback (Note [Completion
// contract]), so qd blocks stay in flight without a thread in between — as
// fio's single loop keeps its iodepth.
Result<double> pass(IoEngine& engine, offload::FileId file, IoOp op, const Settings& s, Mapping& buffers) {
  struct Shared {
    std::mutex mutex;
    std::condition_variable cv;
    std::uint64_t next_offset = 0;
    std::uint64_t outstanding = 0;
    Status failure;
  } shared;
  // Submits the next block into buffer `slot`; false when none is left or it failed.
  std::function<bool(std::uint32_t)> submit_next = [&](std::uint32_t slot) {
    std::uint64_t offset;
    {
      std::lock_guard lock(shared.mutex);
      if (shared.next_offset >= s.bytes || !shared.failure.ok()) return false;
      offset = shared.next_offset;
      shared.next_offset += s.block;
      ++shared.outstanding;
    }
    std::uint64_t length = std::min(s.block, s.bytes - offset);
    offload::IoRequest request{
        op, file, offset, {buffers.data + slot * s.block, length}, [&, slot](Status st) {
          if (st.ok()) submit_next(slot);
          std::lock_guard lock(shared.mutex);
          if (!st.ok() && shared.failure.ok()) shared.failure = std::move(st);
          // Only the last completion wakes the waiting thread: a wake per block
          // cost strata a context switch per I/O that fio's one loop does not pay.
          if (--shared.outstanding == 0) shared.cv.notify_all();
        }};
    Status submitted = engine.submit_one(std::move(request));
    if (!submitted.ok()) {
      std::lock_guard lock(shared.mutex);
      if (shared.failure.ok()) shared.failure = std::move(submitted);
      if (--shared.outstanding == 0) shared.cv.notify_all();
      return false;
    }
    return true;
  };
  auto start = std::chrono::steady_clock::now();
  for (std::uint32_t slot = 0; slot < s.qd && submit_next(slot); ++slot) {
  }
  std::unique_lock lock(shared.mutex);
  shared.cv.wait(lock, [&] { return shared.outstanding == 0; });
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!shared.failure.ok()) return shared.failure;
  return static_cast<double>(s.bytes) / seconds / static_cast<double>(kGiB);
}

// Between timed passes: flush the device's write cache (syncfs) and pause, so
// every pass — strata's in one process, fio's in another — starts from the same
// quiet device (Note [Fair comparison with fio]).
void settle(const Settings& s) {
  int fd = ::open(s.file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ::syncfs(fd);
    ::close(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
}

}  // namespace

// One write pass and one read pass with a strata engine of `kind`.
Status strata_run(EngineKind kind, const Settings& s, Mapping& buffers, Samples& out) {
  offload::IoEngineOptions options{.kind = kind,
                                   .queue_depth = s.engine_depth,
                                   .request_bytes = static_cast<std::uint32_t>(s.request),
                                   .requests_in_flight_max = s.qd,
                                   .fixed_buffer_regions = {{buffers.data, buffers.size}}};
  STRATA_ASSIGN_OR_RETURN(auto engine, offload::make_io_engine(std::move(options)));
  int fd = ::open(s.file.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
  if (fd < 0) return errno_status(errno, "opening " + s.file.string() + " with O_DIRECT");
  auto file = engine->register_file(fd, s.file.string());
  Status status = file.status();
  if (status.ok()) {
    settle(s);
    auto write = pass(*engine, *file, IoOp::kWrite, s, buffers);
    settle(s);
    auto read = write.ok() ? pass(*engine, *file, IoOp::kRead, s, buffers) : write;
    if (write.ok() && read.ok()) {
      out.write.push_back(*write);
      out.read.push_back(*read);
    } else {
      status = write.ok() ? read.status() : write.status();
    }
    engine->shutdown(offload::ShutdownMode::kDrain);
    offload::IoEngineStats stats = engine->stats();
    out.fixed_pieces += stats.fixed_buffer_pieces;
    out.pieces += stats.pieces_submitted;
  }
  ::close(fd);
  return status;
}

namespace {

// fio's bandwidth for one job, or why there is none.
// iomem: "" for fio's default (malloc) buffers, else its --iomem value.
Result<double> fio_run(const std::string& ioengine, const std::string& iomem, const char* rw,
                       const Settings& s) {
  std::filesystem::path json = s.file.parent_path() / "strata-bench-fio.json";
  std::string extra = ioengine == "io_uring" ? " --fixedbufs=1 --registerfiles=1" : "";
  if (!iomem.empty()) extra += " --iomem=" + iomem;
  std::string command = fmt::format(
      "fio --name=strata --filename={} --size={} --bs={} --iodepth={} --direct=1 --rw={} --ioengine={}{} "
      "--numjobs=1 --group_reporting --output-format=json --output={} >/dev/null 2>&1",
      s.file.string(), s.bytes, s.block, s.qd, rw, ioengine, extra, json.string());
  int rc = std::system(command.c_str());
  if (rc != 0) return unavailable("fio exited with status {} for: {}", rc, command);
  std::ifstream in(json);
  nlohmann::json doc = nlohmann::json::parse(in, nullptr, false);
  std::filesystem::remove(json);
  if (doc.is_discarded() || !doc.contains("jobs") || doc["jobs"].empty()) {
    return internal_error("fio's JSON output could not be parsed ({})", command);
  }
  double bw = doc["jobs"][0][std::string(rw) == "write" ? "write" : "read"]["bw_bytes"].get<double>();
  return bw / static_cast<double>(kGiB);
}

}  // namespace

// One fio write pass and one read pass with `ioengine` and buffers `iomem`.
Status fio_pair(const std::string& ioengine, const std::string& iomem, const Settings& s, Samples& out) {
  settle(s);
  STRATA_ASSIGN_OR_RETURN(double write, fio_run(ioengine, iomem, "write", s));
  settle(s);
  STRATA_ASSIGN_OR_RETURN(double read, fio_run(ioengine, iomem, "read", s));
  out.write.push_back(write);
  out.read.push_back(read);
  return Status::Ok();
}

// NoSpace naming the free bytes and the flag when --dir cannot hold --bytes.
Status check_free_space(const Settings& s, const std::string& dir) {
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return errno_status(errno, fmt::format("--dir {}: statvfs", dir));
  const std::uint64_t free_bytes = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  if (s.bytes <= free_bytes) return Status::Ok();
  return no_space(
      "--bytes {} ({} bytes): the file system of --dir {} has only {} ({} bytes) free; lower --bytes or "
      "name a --dir with more free space",
      format_bytes(s.bytes), s.bytes, dir, format_bytes(free_bytes), free_bytes);
}

// Creates the file, preallocates it and writes it once in full (untimed).
Status prepare_file(const Settings& s, Mapping& buffers) {
  int fd = ::open(s.file.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return errno_status(errno, "creating " + s.file.string());
  int rc = ::fallocate(fd, 0, 0, static_cast<off_t>(s.bytes));
  int err = errno;
  ::close(fd);
  if (rc != 0)
    return errno_status(err, fmt::format("preallocating {} for {}", format_bytes(s.bytes), s.file.string()));
  std::mt19937_64 rng(7);
  for (std::size_t i = 0; i + 8 <= buffers.size; i += 8) {
    std::uint64_t v = rng();
    std::memcpy(buffers.data + i, &v, 8);
  }
  Samples ignored;
  return strata_run(EngineKind::kPosix, s, buffers, ignored);
}

namespace {

// A value in kB from /proc/meminfo ("HugePages_Free" is a count), or 0.
std::uint64_t meminfo(const std::string& key) {
  std::ifstream in("/proc/meminfo");
  std::string name;
  std::uint64_t value = 0;
  while (in >> name >> value) {
    if (name == key + ":") return value;
    in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return 0;
}

}  // namespace

// Why fio cannot have huge-page buffers of qd x block here, or nullopt when it can.
std::optional<std::string> fio_huge_unavailable(const Settings& s) {
  const std::uint64_t page = meminfo("Hugepagesize") * kKiB, free_pages = meminfo("HugePages_Free");
  if (page == 0) return "this kernel has no hugetlb pages (no Hugepagesize in /proc/meminfo)";
  const std::uint64_t needed = div_ceil(s.qd * s.block, page) + 1;  // fio rounds up
  if (free_pages >= needed) return std::nullopt;
  return fmt::format(
      "fio's huge-page buffers (--iomem=mmaphuge) need {} free hugetlb pages of {}, {} are free: as root, "
      "echo {} > /proc/sys/vm/nr_hugepages (fio cannot use transparent huge pages)",
      needed, format_bytes(page), free_pages, needed);
}

// Bytes of [data, data + size) backed by transparent huge pages (/proc/self/smaps).
std::uint64_t anon_huge_bytes(const void* data, std::size_t size) {
  std::ifstream in("/proc/self/smaps");
  std::string line;
  const auto lo = reinterpret_cast<std::uintptr_t>(data), hi = lo + size;
  bool inside = false;
  std::uint64_t total = 0;
  while (std::getline(in, line)) {
    unsigned long start = 0, end = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &start, &end) == 2 && line.find('-') < line.find(' ')) {
      inside = start < hi && end > lo;
    } else if (inside && line.rfind("AnonHugePages:", 0) == 0) {
      total += std::stoull(line.substr(14)) * kKiB;
    }
  }
  return total;
}

}  // namespace strata::bench::io
