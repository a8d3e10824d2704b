// strata-bench io: the NVMe tier against fio on the same file.
//
// Writes then reads --bytes in --block blocks with strata's io_uring engine and
// its posix engine, and runs fio (io_uring and libaio, O_DIRECT) with the same
// block size and blocks in flight on the same file, --runs times, interleaved.
// Prints medians and the ratios the NVMe issue sets as targets.
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
//   gap anyway, and a read must not race the flush of the write before it.
#include <fcntl.h>
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "registry.hpp"
#include "strata/common/bytes.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/offload/io_engine.hpp"

namespace strata::bench {
namespace {

using offload::EngineKind;
using offload::IoEngine;
using offload::IoOp;

struct IoBenchOptions {
  std::string dir;
  std::string bytes = "2GiB";
  std::string block = "4MiB";
  std::string request;  // default: the engine's default request_bytes
  std::uint32_t qd = 8;
  int runs = 3;
  bool json = false;
  bool skip_fio = false;
  bool no_huge_pages = false;
  std::string engines;  // comma-separated subset of kEngines; empty: all
};

// Every engine the bench can run, in the order of a run's rotation.
const std::vector<std::string> kEngines = {"uring", "fio_uring",  "fio_uring_huge",
                                           "posix", "fio_libaio", "fio_libaio_huge"};

struct Settings {
  std::filesystem::path file;
  std::uint64_t bytes = 0;
  std::uint64_t block = 0;
  std::uint64_t request = 0;
  std::uint32_t qd = 0;
  std::uint32_t engine_depth = 0;
};

// Page-aligned memory for the blocks in flight. With huge pages it is a whole
// number of 2 MiB pages at a 2 MiB boundary, as inside the pinned host pool's
// region (and as fio's mmaphuge rounds up): a smaller or unaligned mapping
// would get no transparent huge page at all (e.g. 4 x 256 KiB).
struct Mapping {
  static constexpr std::size_t kHuge = 2 * kMiB;
  Mapping(std::size_t n, bool huge_pages) : size(huge_pages ? align_up(n, kHuge) : n) {
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
  ~Mapping() {
    if (base != nullptr) ::munmap(base, reserved);
  }
  std::byte* base = nullptr;
  std::byte* data = nullptr;
  std::size_t size;
  std::size_t reserved = 0;
};

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

struct Samples {
  std::vector<double> write, read;
  std::uint64_t pieces = 0, fixed_pieces = 0;  // strata engines: how many used fixed buffers
};

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

// Removes the bench's file (and fio's output beside it) however run_io returns:
// the bench leaves nothing in --dir, an error included.
struct FileRemover {
  std::filesystem::path file;
  ~FileRemover() {
    if (file.empty()) return;
    std::error_code ignored;
    std::filesystem::remove(file, ignored);
    std::filesystem::remove(file.parent_path() / "strata-bench-fio.json", ignored);
  }
};

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

// The engines --engines names (comma-separated, each in kEngines, no repeats), or all.
Result<std::vector<std::string>> parse_engines(const std::string& list) {
  if (list.empty()) return kEngines;
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at <= list.size()) {
    const std::size_t comma = std::min(list.find(',', at), list.size());
    std::string name = list.substr(at, comma - at);
    if (std::find(kEngines.begin(), kEngines.end(), name) == kEngines.end() ||
        std::find(out.begin(), out.end(), name) != out.end()) {
      return invalid_argument("--engines {}: '{}' is unknown or repeated; use a comma-separated subset of {}",
                              list, name, fmt::join(kEngines, ","));
    }
    out.push_back(std::move(name));
    at = comma + 1;
  }
  return out;
}

std::optional<double> median_of(const std::map<std::string, Samples>& samples, const std::string& key,
                                bool write) {
  auto it = samples.find(key);
  if (it == samples.end()) return std::nullopt;
  const auto& v = write ? it->second.write : it->second.read;
  if (v.empty()) return std::nullopt;
  return median(v);
}

nlohmann::json number_or_null(std::optional<double> v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

std::optional<double> ratio(std::optional<double> a, std::optional<double> b) {
  if (!a || !b || *b <= 0) return std::nullopt;
  return *a / *b;
}

// The median over runs of a's sample / b's sample in the same run: the two ran
// seconds apart, so drift of the shared disk's speed between runs cancels.
std::optional<double> paired_ratio(const std::map<std::string, Samples>& samples, const std::string& a,
                                   const std::string& b, bool write) {
  auto ia = samples.find(a), ib = samples.find(b);
  if (ia == samples.end() || ib == samples.end()) return std::nullopt;
  const auto& va = write ? ia->second.write : ia->second.read;
  const auto& vb = write ? ib->second.write : ib->second.read;
  std::vector<double> ratios;
  for (std::size_t r = 0; r < std::min(va.size(), vb.size()); ++r) {
    if (vb[r] > 0) ratios.push_back(va[r] / vb[r]);
  }
  if (ratios.empty()) return std::nullopt;
  return median(ratios);
}

std::string cell(std::optional<double> v) {
  return v ? fmt::format("{:8.3f}", *v) : fmt::format("{:>8}", "n/a");
}

int run_io(const IoBenchOptions& o) {
  Settings s;
  auto fail = [](const Status& status) {
    fmt::print(stderr, "strata-bench io: {}\n", status.to_string());
    return 1;
  };
  auto bytes = parse_bytes(o.bytes, "--bytes");
  auto block = parse_bytes(o.block, "--block");
  if (!bytes.ok()) return fail(bytes.status());
  if (!block.ok()) return fail(block.status());
  s.bytes = *bytes;
  s.block = *block;
  s.request = offload::IoEngineOptions{}.request_bytes;
  if (!o.request.empty()) {
    auto request = parse_bytes(o.request, "--request");
    if (!request.ok()) return fail(request.status());
    s.request = *request;
  }
  s.qd = o.qd;
  if (s.block == 0 || s.block % 4096 != 0 || s.bytes % s.block != 0 || s.request == 0 ||
      s.request % 4096 != 0 || s.qd == 0 || s.qd > 1024 || o.runs <= 0 || o.runs > 100 || s.bytes == 0) {
    return fail(
        invalid_argument("--block ({}) and --request ({}) must be multiples of 4096, --bytes ({}) a multiple "
                         "of --block, --qd 1 .. 1024 and --runs 1 .. 100",
                         s.block, s.request, s.bytes));
  }
  if (const std::uint64_t ram = memory::physical_memory_bytes(); ram != 0 && s.qd * s.block > ram / 4) {
    return fail(invalid_argument("--qd {} x --block {}: the buffers would take more than a quarter of RAM",
                                 s.qd, o.block));
  }
  auto parsed_engines = parse_engines(o.engines);
  if (!parsed_engines.ok()) return fail(parsed_engines.status());
  const std::vector<std::string> engines = std::move(parsed_engines).value();
  s.request = std::min(s.request, s.block);
  s.engine_depth = static_cast<std::uint32_t>(s.qd * div_ceil(s.block, s.request));
  if (!std::filesystem::is_directory(o.dir)) return fail(not_found("--dir {} is not a directory", o.dir));
  s.file = std::filesystem::path(o.dir) / "strata-bench-io.dat";
  if (Status st = check_free_space(s, o.dir); !st.ok()) return fail(st);

  Mapping buffers(s.qd * s.block, !o.no_huge_pages);
  if (buffers.data == nullptr)
    return fail(out_of_memory("mmap of {} for buffers", format_bytes(s.qd * s.block)));
  const FileRemover remover{s.file};
  if (Status st = prepare_file(s, buffers); !st.ok()) return fail(st);

  std::optional<std::string> fio_note, fio_huge_note;
  if (o.skip_fio) {
    fio_note = "fio skipped (--skip-fio)";
  } else if (std::system("fio --version >/dev/null 2>&1") != 0) {
    fio_note =
        "fio is not installed (Debian package fio; `scripts/install-deps --bench`): the fio columns are null";
  }
  fio_huge_note = fio_note ? fio_note : fio_huge_unavailable(s);
  if (!fio_huge_note && o.no_huge_pages)
    fio_huge_note = "fio on huge pages not run: strata's buffers are 4 KiB pages";
  // fio engines: name -> (ioengine, iomem); "huge" ones on huge-page buffers (Note [Fair comparison with
  // fio]).
  const std::map<std::string, std::pair<std::string, std::string>> fio_jobs = {
      {"fio_uring", {"io_uring", ""}},
      {"fio_libaio", {"libaio", ""}},
      {"fio_uring_huge", {"io_uring", "mmaphuge"}},
      {"fio_libaio_huge", {"libaio", "mmaphuge"}}};
  std::map<std::string, Samples> samples;
  // Each run starts with a different engine (rotation), so a device that warms
  // up or slows down within a run favours none of them.
  const std::vector<std::string>& order = engines;
  for (int r = 0; r < o.runs; ++r) {
    for (std::size_t k = 0; k < order.size(); ++k) {
      const std::string& name = order[(k + static_cast<std::size_t>(r)) % order.size()];
      if (name == "uring" || name == "posix") {
        Status st =
            strata_run(name == "uring" ? EngineKind::kUring : EngineKind::kPosix, s, buffers, samples[name]);
        if (!st.ok()) return fail(st);
        continue;
      }
      const bool huge = name.ends_with("_huge");
      std::optional<std::string>& note = huge ? fio_huge_note : fio_note;
      if (note) continue;
      const auto& [ioengine, iomem] = fio_jobs.at(name);
      Status st = fio_pair(ioengine, iomem, s, samples[name]);
      if (!st.ok()) {
        note = "fio failed: " + st.message();
        for (const auto& [job, unused] : fio_jobs) {
          if (job.ends_with("_huge") == huge) samples.erase(job);
        }
      }
    }
  }
  const std::uint64_t huge_bytes = anon_huge_bytes(buffers.data, buffers.size);
  std::filesystem::remove(s.file);

  auto m = [&](const std::string& name, bool write) { return median_of(samples, name, write); };
  auto uw = m("uring", true), ur = m("uring", false);
  // Equal buffers: strata's huge pages vs fio's, or 4 KiB pages on both sides.
  const std::string eq = o.no_huge_pages ? "" : "_huge";
  nlohmann::json j{{"bytes", s.bytes},
                   {"block_bytes", s.block},
                   {"queue_depth", s.qd},
                   {"request_bytes", s.request},
                   {"engine_queue_depth", s.engine_depth},
                   {"runs", o.runs},
                   {"timing", fmt::format("median of {} runs, engines interleaved", o.runs)},
                   {"load_average_1m", load_average_1m()},
                   {"strata_huge_pages", !o.no_huge_pages},
                   {"strata_buffers", o.no_huge_pages ? "mmap, 4 KiB pages" : "mmap + MADV_HUGEPAGE (THP)"},
                   {"strata_buffer_bytes", buffers.size},
                   {"strata_buffer_huge_bytes", huge_bytes},
                   {"fio_buffers", "malloc (4 KiB pages)"},
                   {"fio_huge_buffers", "--iomem=mmaphuge (MAP_HUGETLB, hugetlb pool pages)"},
                   {"file", s.file.string()}};
  for (const char* name :
       {"uring", "posix", "fio_uring", "fio_libaio", "fio_uring_huge", "fio_libaio_huge"}) {
    j[std::string(name) + "_write_gib_s"] = number_or_null(m(name, true));
    j[std::string(name) + "_read_gib_s"] = number_or_null(m(name, false));
  }
  // Ratios on equal buffers (the targets) and, as information, on unequal ones.
  j["write_ratio_vs_fio_huge"] = number_or_null(ratio(uw, m("fio_uring_huge", true)));
  j["read_ratio_vs_fio_huge"] = number_or_null(ratio(ur, m("fio_uring_huge", false)));
  j["write_ratio_vs_fio_libaio_huge"] = number_or_null(ratio(uw, m("fio_libaio_huge", true)));
  j["read_ratio_vs_fio_libaio_huge"] = number_or_null(ratio(ur, m("fio_libaio_huge", false)));
  // The same two, as the median of each run's own ratio (information).
  j["write_ratio_vs_fio_huge_paired"] =
      number_or_null(paired_ratio(samples, "uring", "fio_uring_huge", true));
  j["read_ratio_vs_fio_huge_paired"] =
      number_or_null(paired_ratio(samples, "uring", "fio_uring_huge", false));
  j["write_ratio_vs_fio"] = number_or_null(ratio(uw, m("fio_uring", true)));
  j["read_ratio_vs_fio"] = number_or_null(ratio(ur, m("fio_uring", false)));
  j["write_ratio_vs_fio_libaio"] = number_or_null(ratio(uw, m("fio_libaio", true)));
  j["read_ratio_vs_fio_libaio"] = number_or_null(ratio(ur, m("fio_libaio", false)));
  j["equal_buffer_ratios"] =
      o.no_huge_pages ? "*_ratio_vs_fio, *_ratio_vs_fio_libaio (4 KiB pages on both sides)"
                      : "*_ratio_vs_fio_huge, *_ratio_vs_fio_libaio_huge (huge pages on both sides)";
  j["fio_note"] = fio_note ? nlohmann::json(*fio_note) : nlohmann::json(nullptr);
  j["fio_huge_note"] = fio_huge_note ? nlohmann::json(*fio_huge_note) : nlohmann::json(nullptr);
  for (const auto& [name, v] : samples) {
    j["samples"][name] = {{"write_gib_s", v.write}, {"read_gib_s", v.read}};
    if (v.pieces > 0) j["samples"][name]["fixed_buffer_share"] = double(v.fixed_pieces) / double(v.pieces);
  }
  if (o.json) {
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  fmt::print("strata-bench io: {} in {} blocks, {} blocks in flight, O_DIRECT, median of {} runs\n",
             format_bytes(s.bytes), format_bytes(s.block), s.qd, o.runs);
  fmt::print("  file {} (preallocated, written once before timing; every engine uses it)\n", s.file.string());
  fmt::print("  strata: {} pieces, engine queue depth {}, buffers {} ({} of {} in huge pages)\n",
             format_bytes(s.request), s.engine_depth, j["strata_buffers"].get<std::string>(),
             format_bytes(huge_bytes), format_bytes(buffers.size));
  fmt::print("  fio: bs={}, iodepth={}; buffers malloc (4 KiB pages) or --iomem=mmaphuge (hugetlb)\n\n",
             s.block, s.qd);
  fmt::print("  {:<22} {:>12} {:>12}\n", "engine", "write GiB/s", "read GiB/s");
  for (const auto& [label, name] :
       std::vector<std::pair<std::string, std::string>>{{"strata uring", "uring"},
                                                        {"strata posix", "posix"},
                                                        {"fio io_uring", "fio_uring"},
                                                        {"fio libaio", "fio_libaio"},
                                                        {"fio io_uring mmaphuge", "fio_uring_huge"},
                                                        {"fio libaio mmaphuge", "fio_libaio_huge"}}) {
    fmt::print("  {:<22} {:>12} {:>12}\n", label, cell(m(name, true)), cell(m(name, false)));
  }
  fmt::print("\n");
  if (fio_note) fmt::print("  {}\n", *fio_note);
  if (fio_huge_note && fio_huge_note != fio_note) fmt::print("  {}\n", *fio_huge_note);
  const std::string pages = o.no_huge_pages ? "4 KiB pages" : "huge pages";
  fmt::print("  equal buffers ({} on both sides):\n", pages);
  fmt::print("    uring / fio io_uring: write {} read {}   (target >= 0.95)\n",
             cell(ratio(uw, m("fio_uring" + eq, true))), cell(ratio(ur, m("fio_uring" + eq, false))));
  fmt::print("    uring / fio libaio:   write {} read {}   (target >= 1.00)\n",
             cell(ratio(uw, m("fio_libaio" + eq, true))), cell(ratio(ur, m("fio_libaio" + eq, false))));
  if (!o.no_huge_pages) {
    fmt::print("  unequal buffers (information: strata huge pages, fio 4 KiB pages):\n");
    fmt::print("    uring / fio io_uring: write {} read {}\n", cell(ratio(uw, m("fio_uring", true))),
               cell(ratio(ur, m("fio_uring", false))));
  }
  return 0;
}

Registrar reg{"io", "NVMe tier: strata's io_uring and posix engines vs fio (io_uring, libaio) on one file",
              [](CLI::App& app) {
                auto o = std::make_shared<IoBenchOptions>();
                app.add_option("--dir", o->dir, "directory on the device to measure")->required();
                app.add_option("--bytes", o->bytes, "bytes to write then read")->capture_default_str();
                app.add_option("--block", o->block, "block (chunk) size")->capture_default_str();
                app.add_option("--request", o->request, "strata piece size (default: the engine default)");
                app.add_option("--qd", o->qd, "blocks in flight (fio iodepth)")->capture_default_str();
                app.add_option("--runs", o->runs, "runs; medians are reported")->capture_default_str();
                app.add_flag("--json", o->json, "print one JSON object");
                app.add_option("--engines", o->engines,
                               "comma-separated engines to run (default: all of uring,fio_uring,"
                               "fio_uring_huge,posix,fio_libaio,fio_libaio_huge)");
                app.add_flag("--skip-fio", o->skip_fio, "do not run fio (its keys are null)");
                app.add_flag("--no-huge-pages", o->no_huge_pages,
                             "strata buffers in 4 KiB pages (as fio's) instead of transparent huge pages");
                return [o] { return run_io(*o); };
              }};

}  // namespace
}  // namespace strata::bench
