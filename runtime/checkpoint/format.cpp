// Checkpoint format: the manifest, the data files' layout, CRC32C stripes, and
// publishing (fsync, rename, removing stale files), Note [Checkpoint format],
// Note [Checkpoint publish], Note [Sharded checkpoint]. It reads the save's
// description and the source's NVMe directories only; the save and the load
// (save.cpp, load.cpp) call it through checkpoint.hpp.
//
// Note [Checkpoint format]
// A checkpoint directory holds one data file per chunk family and a JSON manifest:
//
//   manifest.json          {"format": "strata-checkpoint", "version": 1, "generation": g,
//                           "stripe_bytes", "compute_dtype", "state_dtype", "state_count",
//                           "optimizer", "files": [{name, bytes, crc32c: [per stripe]}],
//                           "tensors": [{name, shape, frozen, steps, group, file,
//                                        states: {param|master|state0|state1: {dtype, offset}}}],
//                           "groups": [{group, lr, weight_decay}]}
//   family-<f>.g<g>.bin    the family's tensors, kind after kind (param, master, states),
//                          each tensor's elements contiguous in its kind's dtype
//
// The layout is per tensor (name, dtype, shape, byte offset), not per chunk, so a
// checkpoint loads into a runtime with another chunk size, other budgets or another
// placement. Every stripe of `stripe_bytes` of a data file carries a CRC32C (the swap
// code's) in the manifest; a load checks every stripe of every file, the shapes and the
// format version before it changes any state, so a bad checkpoint is refused whole.
//
// Note [Checkpoint publish]
// A save writes every `<name>.tmp` (starting each stripe's writeback as it goes), then
// fsyncs each and renames it to a name that carries the new generation (one more than the published
// manifest's), fsyncs the directory, then writes, fsyncs and renames the manifest last and fsyncs the
// directory again. Until that rename the published manifest and its files are untouched, so a crash (or a
// full disk) at any point leaves the previous checkpoint loadable. After publishing, files no manifest names
// (older generations, temporaries of a crashed save) are removed in the background (Note [Stale checkpoint
// files]). States are streamed chunk by chunk (an NVMe chunk is read from its slots into a host buffer, never
// through the device, up to 32 MiB of such reads ahead of the writer: Note [Save read-ahead] in
// save_thread.cpp), so a save needs that and the stripe buffers beyond what the runtime holds.
//
// Note [Stale checkpoint files]
// Removing the previous generation's files took 0.09-0.10 s of a 0.27 s save of 256
// MiB here (ext4 mounted with `discard`: each unlink trims the freed extents), a third
// of the save, after the new checkpoint was already durable. So publish_manifest lists
// them and the Checkpointer's FileRemover removes them on a thread of its own;
// a save returns once the manifest is durable. One batch at a time (the next
// publish waits for the last); Checkpointer::wait_stale_removed (the runtime's
// flush()) and the destructor wait for it, so a caller
// that lists the directory after flush() sees only the published files. A crash
// before they are gone leaves them, and the next publish removes them (it lists the
// directory, not the batch). The list is fixed when published: a later save's files
// carry a later generation, so none of them is on it.
//
// Note [Sharded checkpoint]
// With W > 1 data-parallel ranks (Note [Sharded step]) save_checkpoint and
// load_checkpoint are collective: every rank calls them on the same directory.
// A save: each rank does every check that can fail on it alone (begin_save's
// prepare), then the ranks agree (DataParallel::all_ok: every rank's error text
// reaches every rank) and take the largest generation any found (DataParallel::max). Each
// rank holds a shard of every family's masters and states, so first the ranks
// all-gather them, family by family (assemble_shards in shards.cpp,
// after finishing the last step's param gathers in issue order), and rank
// f mod W keeps family f's whole chunks as its captured pieces; each rank then
// writes, fsyncs and renames the files of its families f mod W (run_save: the
// same files as one rank's) and fsyncs the directory; they agree
// again; rank 0 gathers every rank's file entries and tensor entries
// (DataParallel::exchange_text), publishes the manifest (publish_manifest: the same
// format as one rank's, plus "ranks": W) and removes stale files; a last
// agreement hands rank 0's outcome to every rank once the manifest is durable.
// Until rank 0's rename the previous manifest is the published one, so the
// rules of Note [Checkpoint publish] hold for every crash point. The generation
// scan skips ".tmp" names (another rank's probe may be one). begin_checkpoint
// is refused with W > 1: its agreement would run on the save thread, among the
// step's collectives. A load: every rank finishes the last step's param
// all-gathers, checks the manifest and every file (all hold params, which every
// rank needs), and the ranks agree before any applies; each applies params of
// every family and, of each tensor's masters and states, the part in its shard
// (TensorEntry::shard), so a checkpoint saved at W loads at any W' (the layout is
// per tensor). Every rank reads its shard from every file.

#include "checkpoint.hpp"
#include "strata/checkpoint/test_hooks.hpp"
#include "strata/common/half.hpp"

namespace strata::checkpoint::detail {

Result<Fd> create_tmp(const fs::path& final_path) {
  const fs::path tmp = StripedWriter::tmp_path(final_path);
  if (test_hooks::before_create) STRATA_RETURN_IF_ERROR(test_hooks::before_create(tmp.string()));
  return offload::open_file(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644, "save_checkpoint: creating",
                            kWritableHint);
}

Result<StripedWriter> open_writer(fs::path final_path, StripeSink& sink) {
  STRATA_ASSIGN_OR_RETURN(Fd fd, create_tmp(final_path));
  return StripedWriter::adopt(std::move(final_path), std::move(fd), sink);
}

std::optional<StateKind> kind_from_name(std::string_view name) {
  for (StateKind k : kSavedKinds) {
    if (state_kind_name(k) == name) return k;
  }
  return std::nullopt;
}

//! Runs fn(i, thread) for i in [0, n) on up to kIoThreads threads.
void parallel_for(std::size_t n, const std::function<void(std::size_t, std::size_t)>& fn) {
  std::atomic<std::size_t> next{0};
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < std::min(kIoThreads, n); ++t) {
    threads.emplace_back([&, t] {
      for (std::size_t i = next++; i < n; i = next++) fn(i, t);
    });
  }
  for (std::thread& t : threads) t.join();
}

//! Publishes `writers` (the sink drained): their fsyncs run on several threads at
//! once, so the file system commits them together (one journal commit for many files
//! rather than one each), then they are renamed in order.
Status publish_all(StripeSink& sink, std::vector<StripedWriter>& writers) {
  STRATA_RETURN_IF_ERROR(sink.drain());
  std::vector<Status> synced(writers.size(), Status::Ok());
  parallel_for(writers.size(), [&](std::size_t i, std::size_t) { synced[i] = writers[i].sync(); });
  for (std::size_t i = 0; i < writers.size(); ++i) {
    STRATA_RETURN_IF_ERROR(synced[i]);
    STRATA_RETURN_IF_ERROR(writers[i].rename());
  }
  writers.clear();
  return Status::Ok();
}

//! `dir` (made absolute) when it is neither one of the NVMe swap directories nor inside one.
Result<fs::path> checkpoint_dir(const Source& src, const std::string& dir, std::string_view what) {
  if (dir.empty()) return invalid_argument("{}: the checkpoint directory is empty", what);
  std::error_code ec;
  const fs::path abs = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  if (ec) return errno_status(ec.value(), fmt::format("{}: resolving {}", what, dir));
  for (const std::string& swap : src.nvme_dirs()) {
    const fs::path s = fs::weakly_canonical(fs::absolute(swap, ec), ec);
    if (ec) continue;
    auto [sit, ait] = std::mismatch(s.begin(), s.end(), abs.begin(), abs.end());
    if (sit == s.end() || (std::next(sit) == s.end() && sit->empty())) {
      return invalid_argument(
          "{}: {} is inside the NVMe swap directory {}, whose files are scratch and reclaimed at start; "
          "put checkpoints in a directory of their own",
          what, abs.string(), s.string());
    }
  }
  return abs;
}

//! The published manifest of `dir`, parsed and checked for format and version.
Result<json> read_manifest(const fs::path& dir) {
  const fs::path path = dir / kManifestName;
  Result<Fd> opened = offload::open_file(path, O_RDONLY, 0, "load_checkpoint: opening");
  if (!opened.ok()) {
    if (opened.status().code() == StatusCode::kNotFound) {
      return not_found("load_checkpoint: {} does not exist: {} holds no published checkpoint", path.string(),
                       dir.string());
    }
    return opened.status();
  }
  Fd fd = std::move(*opened);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_status(errno, fmt::format("stat of {}", path.string()));
  std::string text(static_cast<std::size_t>(st.st_size), '\0');
  STRATA_RETURN_IF_ERROR(read_all(fd.get(), reinterpret_cast<std::byte*>(text.data()), text.size(), 0, path));
  json m = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (m.is_discarded() || !m.is_object())
    return corrupt("load_checkpoint: {} is not valid JSON", path.string());
  if (m.value("format", std::string()) != kFormatName)
    return corrupt("load_checkpoint: {} is not a strata checkpoint manifest (no \"format\": \"{}\")",
                   path.string(), kFormatName);
  const int version = m.value("version", 0);
  if (version > kFormatVersion) {
    return failed_precondition(
        "load_checkpoint: {} has format version {}, newer than this build reads ({}); load it with a newer "
        "strata",
        path.string(), version, kFormatVersion);
  }
  if (version < 1) return corrupt("load_checkpoint: {} has no valid format version", path.string());
  return m;
}

//! Opens one data file the manifest names and checks its size. `*opened` is the
//! descriptor the load reads (not whatever has the name later) and `*as_opened` its
//! stat before any read (the load checks it did not change).
Status open_file(const fs::path& dir, const json& f, Fd* opened, struct stat* as_opened) {
  const fs::path path = dir / f.at("name").get<std::string>();
  const auto want = f.at("bytes").get<std::uint64_t>();
  STRATA_ASSIGN_OR_RETURN(Fd fd,
                          offload::open_file(path, O_RDONLY, 0, "load_checkpoint: opening",
                                             fmt::format("named by {}", (dir / kManifestName).string())));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_status(errno, fmt::format("stat of {}", path.string()));
  *as_opened = st;
  if (static_cast<std::uint64_t>(st.st_size) != want) {
    return corrupt("load_checkpoint: {} is {} bytes, the manifest says {} (truncated or overwritten)",
                   path.string(), st.st_size, want);
  }
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  *opened = std::move(fd);
  return Status::Ok();
}

//! Checks every stripe's CRC32C of one opened data file.
Status verify_stripes(const fs::path& dir, const json& f, std::uint64_t stripe_bytes, const Fd& fd,
                      std::vector<std::byte>& buf) {
  const fs::path path = dir / f.at("name").get<std::string>();
  const auto want = f.at("bytes").get<std::uint64_t>();
  const auto& crcs = f.at("crc32c");
  const std::uint64_t stripes = (want + stripe_bytes - 1) / stripe_bytes;
  if (crcs.size() != stripes)
    return corrupt("load_checkpoint: the manifest has {} CRCs for {} stripes of {}", crcs.size(), stripes,
                   path.string());
  buf.resize(stripe_bytes);
  for (std::uint64_t i = 0; i < stripes; ++i) {
    const std::uint64_t off = i * stripe_bytes;
    const std::size_t n = static_cast<std::size_t>(std::min(stripe_bytes, want - off));
    STRATA_RETURN_IF_ERROR(read_all(fd.get(), buf.data(), n, off, path));
    const std::uint32_t crc = offload::crc32c(std::span<const std::byte>(buf.data(), n));
    if (crc != crcs[i].get<std::uint32_t>()) {
      return corrupt("load_checkpoint: {} bytes [{}, {}) fail their CRC32C ({:08x}, the manifest has {:08x})",
                     path.string(), off, off + n, crc, crcs[i].get<std::uint32_t>());
    }
  }
  return Status::Ok();
}

//! Runs fn(i, buffer of its thread) for every file, kIoThreads at once (the disk serves
//! several sequential readers better than one); the first failure in file order.
static Status for_each_file(const fs::path& dir, const json& files,
                            const std::function<Status(std::size_t, std::vector<std::byte>&)>& fn) {
  std::vector<Status> checked(files.size(), Status::Ok());
  std::vector<std::vector<std::byte>> bufs(kIoThreads);
  parallel_for(files.size(), [&](std::size_t i, std::size_t thread) {
    try {
      checked[i] = fn(i, bufs[thread]);
    } catch (const json::exception& e) {
      checked[i] = corrupt("load_checkpoint: {} is malformed: {}", (dir / kManifestName).string(), e.what());
    }
  });
  for (Status& st : checked) STRATA_RETURN_IF_ERROR(st);
  return Status::Ok();
}

Status open_files(const fs::path& dir, const json& files, std::vector<Fd>* fds,
                  std::vector<struct stat>* stats) {
  fds->resize(files.size());
  stats->resize(files.size());
  return for_each_file(dir, files, [&](std::size_t i, std::vector<std::byte>&) {
    return open_file(dir, files[i], &(*fds)[i], &(*stats)[i]);
  });
}

Status verify_files(const fs::path& dir, const json& files, std::uint64_t stripe_bytes,
                    const std::vector<Fd>& fds) {
  return for_each_file(dir, files, [&](std::size_t i, std::vector<std::byte>& buf) {
    return verify_stripes(dir, files[i], stripe_bytes, fds[i], buf);
  });
}

void convert(const std::byte* src, DType from, std::byte* dst, DType to, std::uint64_t n) {
  for (std::uint64_t i = 0; i < n; ++i) {
    float v;
    if (from == DType::kF32) {
      std::memcpy(&v, src + 4 * i, 4);
    } else {
      std::uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      v = from == DType::kBF16 ? strata::bf16_to_float(h) : strata::f16_to_float(h);
    }
    if (to == DType::kF32) {
      std::memcpy(dst + 4 * i, &v, 4);
    } else {
      const std::uint16_t h = to == DType::kBF16 ? strata::float_to_bf16(v) : strata::float_to_f16(v);
      std::memcpy(dst + 2 * i, &h, 2);
    }
  }
}

//! The kinds family f holds a chunk of, in file order.
std::vector<StateKind> family_kinds(const Description& d, FamilyId f) {
  std::vector<StateKind> kinds;
  for (StateKind k : kSavedKinds) {
    if (k == StateKind::kMaster && !d.separate_master) continue;
    if (d.families[f].chunk_bytes[static_cast<std::size_t>(k)] > 0) kinds.push_back(k);
  }
  return kinds;
}

//! Writes, fsyncs and renames the manifest (the data files are published), then
//! removes what no manifest names (Note [Checkpoint publish]).
Status publish_manifest(SaveState& s, json files, json tensors, std::uint64_t total) {
  const Description& d = s.desc;
  StripeSink sink;
  const std::size_t families = files.size();
  const json manifest = {{"format", kFormatName},
                         {"version", kFormatVersion},
                         {"generation", s.generation},
                         {"step", s.step_index},
                         {"stripe_bytes", kStripeBytes},
                         {"compute_dtype", std::string(runtime::dtype_name(d.compute_dtype))},
                         {"state_dtype", std::string(runtime::dtype_name(d.state_dtype))},
                         {"state_count", d.state_count},
                         {"optimizer", d.optimizer},
                         {"ranks", s.src.ranks()},
                         {"files", std::move(files)},
                         {"tensors", std::move(tensors)},
                         {"groups", s.groups}};
  STRATA_RETURN_IF_ERROR(fsync_dir(s.root));
  {
    const std::string text = manifest.dump(1);
    STRATA_ASSIGN_OR_RETURN(StripedWriter w, open_writer(s.root / kManifestName, sink));
    w.append(reinterpret_cast<const std::byte*>(text.data()), text.size());
    w.finish();
    std::vector<StripedWriter> one;
    one.push_back(std::move(w));
    STRATA_RETURN_IF_ERROR(publish_all(sink, one));
  }
  STRATA_RETURN_IF_ERROR(fsync_dir(s.root));

  // Published: what no manifest names (older generations, a crashed save's
  // temporaries) is removed in the background (Note [Stale checkpoint files]).
  const std::string suffix = fmt::format(".g{}.bin", s.generation);
  std::vector<fs::path> stale;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(s.root, ec)) {
    const std::string fname = entry.path().filename().string();
    const bool ours = fname.starts_with("family-") || fname == std::string(kManifestName) + ".tmp";
    const bool current = fname.starts_with("family-") && fname.ends_with(suffix);
    if (ours && !current) stale.push_back(entry.path());
  }
  const std::size_t removed = stale.size();
  s.stale->remove(std::move(stale));
  STRATA_LOG_DEBUG(
      "checkpoint: {} generation {} ({} bytes, {} files) in {:.3f} s; {} stale files being removed; "
      "buffers held at most {} bytes",
      s.root.string(), s.generation, total, families,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - s.t0).count(), removed, s.high_water);
  return Status::Ok();
}

}  // namespace strata::checkpoint::detail
