// strata-bench io: the NVMe tier against fio on the same file.
//
// Writes then reads --bytes in --block blocks with strata's io_uring engine and
// its posix engine, and runs fio (io_uring and libaio, O_DIRECT) with the same
// block size and blocks in flight on the same file, --runs times, interleaved.
// Prints medians and the ratios the NVMe issue sets as targets.//
// How the two sides are made comparable: Note [Fair comparison with fio] in
// io_passes.cpp, which also holds the passes themselves.
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "io_passes.hpp"
#include "registry.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/offload/io_engine.hpp"

namespace strata::bench {
namespace {

using io::Mapping;
using io::Samples;
using io::Settings;
using offload::EngineKind;

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

// The settings --bytes, --block, --request, --qd, --runs and --dir give, into s, and the
// engines --engines names, into engines; a refusal naming the flag.
Status parse_settings(const IoBenchOptions& o, Settings& s, std::vector<std::string>& engines) {
  auto bytes = parse_bytes(o.bytes, "--bytes");
  auto block = parse_bytes(o.block, "--block");
  if (!bytes.ok()) return bytes.status();
  if (!block.ok()) return block.status();
  s.bytes = *bytes;
  s.block = *block;
  s.request = offload::IoEngineOptions{}.request_bytes;
  if (!o.request.empty()) {
    auto request = parse_bytes(o.request, "--request");
    if (!request.ok()) return request.status();
    s.request = *request;
  }
  s.qd = o.qd;
  if (s.block == 0 || s.block % 4096 != 0 || s.bytes % s.block != 0 || s.request == 0 ||
      s.request % 4096 != 0 || s.qd == 0 || s.qd > 1024 || o.runs <= 0 || o.runs > 100 || s.bytes == 0) {
    return invalid_argument(
        "--block ({}) and --request ({}) must be multiples of 4096, --bytes ({}) a multiple "
        "of --block, --qd 1 .. 1024 and --runs 1 .. 100",
        s.block, s.request, s.bytes);
  }
  if (const std::uint64_t ram = memory::physical_memory_bytes(); ram != 0 && s.qd * s.block > ram / 4) {
    return invalid_argument("--qd {} x --block {}: the buffers would take more than a quarter of RAM", s.qd,
                            o.block);
  }
  auto parsed_engines = parse_engines(o.engines);
  if (!parsed_engines.ok()) return parsed_engines.status();
  engines = std::move(parsed_engines).value();
  s.request = std::min(s.request, s.block);
  s.engine_depth = static_cast<std::uint32_t>(s.qd * div_ceil(s.block, s.request));
  if (!std::filesystem::is_directory(o.dir)) return not_found("--dir {} is not a directory", o.dir);
  s.file = std::filesystem::path(o.dir) / "strata-bench-io.dat";
  return check_free_space(s, o.dir);
}

// Why the fio columns, and fio's huge-page columns, are null; nullopt while they run.
struct FioNotes {
  std::optional<std::string> fio, huge;
};

FioNotes fio_notes(const IoBenchOptions& o, const Settings& s) {
  FioNotes notes;
  if (o.skip_fio) {
    notes.fio = "fio skipped (--skip-fio)";
  } else if (std::system("fio --version >/dev/null 2>&1") != 0) {
    notes.fio =
        "fio is not installed (Debian package fio; `scripts/install-deps --bench`): the fio columns are null";
  }
  notes.huge = notes.fio ? notes.fio : io::fio_huge_unavailable(s);
  if (!notes.huge && o.no_huge_pages)
    notes.huge = "fio on huge pages not run: strata's buffers are 4 KiB pages";
  return notes;
}

// --runs runs of the engines, interleaved, into samples; a failed fio job nulls its
// columns (and those of its buffer kind) with a note, a failed strata run fails the bench.
Status run_engines(const IoBenchOptions& o, const Settings& s, const std::vector<std::string>& order,
                   Mapping& buffers, FioNotes& notes, std::map<std::string, Samples>& samples) {
  // fio engines: name -> (ioengine, iomem); "huge" ones on huge-page buffers (Note [Fair comparison with
  // fio]).
  const std::map<std::string, std::pair<std::string, std::string>> fio_jobs = {
      {"fio_uring", {"io_uring", ""}},
      {"fio_libaio", {"libaio", ""}},
      {"fio_uring_huge", {"io_uring", "mmaphuge"}},
      {"fio_libaio_huge", {"libaio", "mmaphuge"}}};
  // Each run starts with a different engine (rotation), so a device that warms
  // up or slows down within a run favours none of them.
  for (int r = 0; r < o.runs; ++r) {
    for (std::size_t k = 0; k < order.size(); ++k) {
      const std::string& name = order[(k + static_cast<std::size_t>(r)) % order.size()];
      if (name == "uring" || name == "posix") {
        STRATA_RETURN_IF_ERROR(io::strata_run(name == "uring" ? EngineKind::kUring : EngineKind::kPosix, s,
                                              buffers, samples[name]));
        continue;
      }
      const bool huge = name.ends_with("_huge");
      std::optional<std::string>& note = huge ? notes.huge : notes.fio;
      if (note) continue;
      const auto& [ioengine, iomem] = fio_jobs.at(name);
      Status st = io::fio_pair(ioengine, iomem, s, samples[name]);
      if (!st.ok()) {
        note = "fio failed: " + st.message();
        for (const auto& [job, unused] : fio_jobs) {
          if (job.ends_with("_huge") == huge) samples.erase(job);
        }
      }
    }
  }
  return Status::Ok();
}

// The bench's JSON object: settings, medians per engine, ratios, notes and samples.
nlohmann::json report(const IoBenchOptions& o, const Settings& s,
                      const std::map<std::string, Samples>& samples, const FioNotes& notes,
                      std::size_t buffer_bytes, std::uint64_t huge_bytes) {
  auto m = [&](const std::string& name, bool write) { return median_of(samples, name, write); };
  auto uw = m("uring", true), ur = m("uring", false);
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
                   {"strata_buffer_bytes", buffer_bytes},
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
  j["fio_note"] = notes.fio ? nlohmann::json(*notes.fio) : nlohmann::json(nullptr);
  j["fio_huge_note"] = notes.huge ? nlohmann::json(*notes.huge) : nlohmann::json(nullptr);
  for (const auto& [name, v] : samples) {
    j["samples"][name] = {{"write_gib_s", v.write}, {"read_gib_s", v.read}};
    if (v.pieces > 0) j["samples"][name]["fixed_buffer_share"] = double(v.fixed_pieces) / double(v.pieces);
  }
  return j;
}

// The bench's text: settings, a table of medians and the ratios against their targets.
void print_text(const IoBenchOptions& o, const Settings& s, const std::map<std::string, Samples>& samples,
                const FioNotes& notes, std::size_t buffer_bytes, std::uint64_t huge_bytes) {
  auto m = [&](const std::string& name, bool write) { return median_of(samples, name, write); };
  auto uw = m("uring", true), ur = m("uring", false);
  // Equal buffers: strata's huge pages vs fio's, or 4 KiB pages on both sides.
  const std::string eq = o.no_huge_pages ? "" : "_huge";
  fmt::print("strata-bench io: {} in {} blocks, {} blocks in flight, O_DIRECT, median of {} runs\n",
             format_bytes(s.bytes), format_bytes(s.block), s.qd, o.runs);
  fmt::print("  file {} (preallocated, written once before timing; every engine uses it)\n", s.file.string());
  fmt::print("  strata: {} pieces, engine queue depth {}, buffers {} ({} of {} in huge pages)\n",
             format_bytes(s.request), s.engine_depth,
             o.no_huge_pages ? "mmap, 4 KiB pages" : "mmap + MADV_HUGEPAGE (THP)", format_bytes(huge_bytes),
             format_bytes(buffer_bytes));
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
  if (notes.fio) fmt::print("  {}\n", *notes.fio);
  if (notes.huge && notes.huge != notes.fio) fmt::print("  {}\n", *notes.huge);
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
}

int run_io(const IoBenchOptions& o) {
  auto fail = [](const Status& status) {
    fmt::print(stderr, "strata-bench io: {}\n", status.to_string());
    return 1;
  };
  Settings s;
  std::vector<std::string> engines;
  if (Status st = parse_settings(o, s, engines); !st.ok()) return fail(st);
  Mapping buffers(s.qd * s.block, !o.no_huge_pages);
  if (buffers.data == nullptr)
    return fail(out_of_memory("mmap of {} for buffers", format_bytes(s.qd * s.block)));
  const FileRemover remover{s.file};
  if (Status st = io::prepare_file(s, buffers); !st.ok()) return fail(st);
  FioNotes notes = fio_notes(o, s);
  std::map<std::string, Samples> samples;
  if (Status st = run_engines(o, s, engines, buffers, notes, samples); !st.ok()) return fail(st);
  const std::uint64_t huge_bytes = io::anon_huge_bytes(buffers.data, buffers.size);
  std::filesystem::remove(s.file);
  if (o.json) {
    fmt::print("{}\n", report(o, s, samples, notes, buffers.size, huge_bytes).dump(2));
    return 0;
  }
  print_text(o, s, samples, notes, buffers.size, huge_bytes);
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
