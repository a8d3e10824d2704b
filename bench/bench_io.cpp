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
//   smaller device requests. Both figures go in the README, so the comparison
//   with fio can be read with and without that advantage.
// - The page cache plays no part (O_DIRECT). Runs interleave the engines so
//   drift in the device's speed hits all of them alike, and each run starts
//   with a different engine; medians are reported.
// - Before every timed pass the device's write cache is flushed (syncfs) and
//   the bench pauses 200 ms: fio's passes are separate processes with such a
//   gap anyway, and a read must not race the flush of the write before it.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
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
};

struct Settings {
  std::filesystem::path file;
  std::uint64_t bytes = 0;
  std::uint64_t block = 0;
  std::uint64_t request = 0;
  std::uint32_t qd = 0;
  std::uint32_t engine_depth = 0;
};

// Page-aligned memory for the blocks in flight.
struct Mapping {
  Mapping(std::size_t n, bool huge_pages) : size(n) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data = p == MAP_FAILED ? nullptr : static_cast<std::byte*>(p);
    if (data != nullptr && huge_pages) ::madvise(p, n, MADV_HUGEPAGE);
    if (data != nullptr) std::memset(p, 0, n);  // touched in order: Note [Fair comparison with fio]
  }
  ~Mapping() {
    if (data != nullptr) ::munmap(data, size);
  }
  std::byte* data;
  std::size_t size;
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
          --shared.outstanding;
          shared.cv.notify_all();
        }};
    Status submitted = engine.submit_one(std::move(request));
    if (!submitted.ok()) {
      std::lock_guard lock(shared.mutex);
      if (shared.failure.ok()) shared.failure = std::move(submitted);
      --shared.outstanding;
      shared.cv.notify_all();
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
Result<double> fio_run(const std::string& ioengine, const char* rw, const Settings& s) {
  std::filesystem::path json = s.file.parent_path() / "strata-bench-fio.json";
  std::string extra = ioengine == "io_uring" ? " --fixedbufs=1 --registerfiles=1" : "";
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

// One fio write pass and one read pass with `ioengine`.
Status fio_pair(const std::string& ioengine, const Settings& s, Samples& out) {
  settle(s);
  STRATA_ASSIGN_OR_RETURN(double write, fio_run(ioengine, "write", s));
  settle(s);
  STRATA_ASSIGN_OR_RETURN(double read, fio_run(ioengine, "read", s));
  out.write.push_back(write);
  out.read.push_back(read);
  return Status::Ok();
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
  s.request = std::min(s.request, s.block);
  s.engine_depth = static_cast<std::uint32_t>(s.qd * div_ceil(s.block, s.request));
  if (!std::filesystem::is_directory(o.dir)) return fail(not_found("--dir {} is not a directory", o.dir));
  s.file = std::filesystem::path(o.dir) / "strata-bench-io.dat";

  Mapping buffers(s.qd * s.block, !o.no_huge_pages);
  if (buffers.data == nullptr)
    return fail(out_of_memory("mmap of {} for buffers", format_bytes(s.qd * s.block)));
  if (Status st = prepare_file(s, buffers); !st.ok()) return fail(st);

  std::optional<std::string> fio_note;
  if (o.skip_fio) {
    fio_note = "fio skipped (--skip-fio)";
  } else if (std::system("fio --version >/dev/null 2>&1") != 0) {
    fio_note =
        "fio is not installed (Debian package fio; `scripts/install-deps --bench`): the fio columns are null";
  }
  std::map<std::string, Samples> samples;
  // Each run starts with a different engine (rotation), so a device that warms
  // up or slows down within a run favours none of them.
  const std::vector<std::string> order = {"uring", "posix", "fio_uring", "fio_libaio"};
  for (int r = 0; r < o.runs; ++r) {
    for (std::size_t k = 0; k < order.size(); ++k) {
      const std::string& name = order[(k + static_cast<std::size_t>(r)) % order.size()];
      Status st;
      if (name == "uring" || name == "posix") {
        st = strata_run(name == "uring" ? EngineKind::kUring : EngineKind::kPosix, s, buffers, samples[name]);
        if (!st.ok()) return fail(st);
      } else if (!fio_note) {
        st = fio_pair(name == "fio_uring" ? "io_uring" : "libaio", s, samples[name]);
        if (!st.ok()) {
          fio_note = "fio failed: " + st.message();
          samples.erase("fio_uring");
          samples.erase("fio_libaio");
        }
      }
    }
  }
  std::filesystem::remove(s.file);

  auto uw = median_of(samples, "uring", true), ur = median_of(samples, "uring", false);
  auto pw = median_of(samples, "posix", true), pr = median_of(samples, "posix", false);
  auto fw = median_of(samples, "fio_uring", true), fr = median_of(samples, "fio_uring", false);
  auto lw = median_of(samples, "fio_libaio", true), lr = median_of(samples, "fio_libaio", false);
  nlohmann::json j{{"bytes", s.bytes},
                   {"block_bytes", s.block},
                   {"queue_depth", s.qd},
                   {"request_bytes", s.request},
                   {"engine_queue_depth", s.engine_depth},
                   {"runs", o.runs},
                   {"strata_huge_pages", !o.no_huge_pages},
                   {"file", s.file.string()},
                   {"uring_write_gib_s", number_or_null(uw)},
                   {"uring_read_gib_s", number_or_null(ur)},
                   {"posix_write_gib_s", number_or_null(pw)},
                   {"posix_read_gib_s", number_or_null(pr)},
                   {"fio_uring_write_gib_s", number_or_null(fw)},
                   {"fio_uring_read_gib_s", number_or_null(fr)},
                   {"fio_libaio_write_gib_s", number_or_null(lw)},
                   {"fio_libaio_read_gib_s", number_or_null(lr)},
                   {"write_ratio_vs_fio", number_or_null(ratio(uw, fw))},
                   {"read_ratio_vs_fio", number_or_null(ratio(ur, fr))},
                   {"read_ratio_vs_fio_libaio", number_or_null(ratio(ur, lr))},
                   {"write_ratio_vs_fio_libaio", number_or_null(ratio(uw, lw))},
                   {"fio_note", fio_note ? nlohmann::json(*fio_note) : nlohmann::json(nullptr)}};
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
  fmt::print(
      "  strata: {} pieces, engine queue depth {}, buffers in {}; fio: bs={}, iodepth={}, its own "
      "buffers\n\n",
      format_bytes(s.request), s.engine_depth, o.no_huge_pages ? "4 KiB pages" : "transparent huge pages",
      s.block, s.qd);
  fmt::print("  {:<16} {:>12} {:>12}\n", "engine", "write GiB/s", "read GiB/s");
  fmt::print("  {:<16} {:>12} {:>12}\n", "strata uring", cell(uw), cell(ur));
  fmt::print("  {:<16} {:>12} {:>12}\n", "strata posix", cell(pw), cell(pr));
  fmt::print("  {:<16} {:>12} {:>12}\n", "fio io_uring", cell(fw), cell(fr));
  fmt::print("  {:<16} {:>12} {:>12}\n\n", "fio libaio", cell(lw), cell(lr));
  if (fio_note) fmt::print("  {}\n", *fio_note);
  fmt::print("  uring / fio io_uring: write {} read {}   (target >= 0.95)\n", cell(ratio(uw, fw)),
             cell(ratio(ur, fr)));
  fmt::print("  uring / fio libaio:   write {} read {}   (target >= 1.00)\n", cell(ratio(uw, lw)),
             cell(ratio(ur, lr)));
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
                app.add_flag("--skip-fio", o->skip_fio, "do not run fio (its keys are null)");
                app.add_flag("--no-huge-pages", o->no_huge_pages,
                             "strata buffers in 4 KiB pages (as fio's) instead of transparent huge pages");
                return [o] { return run_io(*o); };
              }};

}  // namespace
}  // namespace strata::bench
