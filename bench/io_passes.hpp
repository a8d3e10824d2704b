#pragma once
// strata-bench io's passes: the buffers, one strata or fio write + read pass over the
// bench's file, and what the machine offers fio (Note [Fair comparison with fio] in
// io_passes.cpp). bench_io.cpp runs them in rotation and reports the ratios.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "strata/common/bytes.hpp"
#include "strata/common/status.hpp"
#include "strata/offload/io_engine.hpp"

namespace strata::bench::io {

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
// would get no transparent huge page at all (e.g. 4 x 256 KiB). data is null
// when the mmap failed. Not copied.
struct Mapping {
  static constexpr std::size_t kHuge = 2 * kMiB;
  Mapping(std::size_t n, bool huge_pages);
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();
  std::byte* base = nullptr;
  std::byte* data = nullptr;
  std::size_t size;
  std::size_t reserved = 0;
};

struct Samples {
  std::vector<double> write, read;
  std::uint64_t pieces = 0, fixed_pieces = 0;  // strata engines: how many used fixed buffers
};

// One write pass and one read pass with a strata engine of `kind`, appended to out.
Status strata_run(offload::EngineKind kind, const Settings& s, Mapping& buffers, Samples& out);

// One fio write pass and one read pass with `ioengine` and buffers `iomem` ("": fio's
// default malloc), appended to out; a failure when fio fails or its JSON does not parse.
Status fio_pair(const std::string& ioengine, const std::string& iomem, const Settings& s, Samples& out);

// NoSpace naming the free bytes and the flag when --dir cannot hold --bytes.
Status check_free_space(const Settings& s, const std::string& dir);

// Creates the file, preallocates it and writes it once in full (untimed).
Status prepare_file(const Settings& s, Mapping& buffers);

// Why fio cannot have huge-page buffers of qd x block here, or nullopt when it can.
std::optional<std::string> fio_huge_unavailable(const Settings& s);

// Bytes of [data, data + size) backed by transparent huge pages (/proc/self/smaps).
std::uint64_t anon_huge_bytes(const void* data, std::size_t size);

}  // namespace strata::bench::io
