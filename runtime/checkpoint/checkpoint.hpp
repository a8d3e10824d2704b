#pragma once
// Checkpoint (private to runtime/checkpoint/; README.md there): what the checkpoint
// files share. The format side (format.cpp: manifest, data file layout, CRC32C
// stripes, fsync/rename publishing, Note [Checkpoint format], Note [Checkpoint
// publish], Note [Sharded checkpoint]), the capture side (capture.cpp: the save's
// buffers and its hold on optimizer updates, Note [Overlapped save]), the save
// (prepare.cpp: a save's checks and description; save.cpp: the Checkpointer's
// save, begin and finish, starting the save thread, Note [Save I/O priority];
// save_thread.cpp: the save thread's work; shards.cpp: data-parallel assembly) and
// the load (load.cpp: the check pass, then the apply pass; shadow.cpp, load.hpp).
// They reach the state they save only through checkpoint::Source (source.hpp) and
// each other through this header; nothing outside the library includes it. Test
// hooks are in strata/checkpoint/test_hooks.hpp, not here. Every function expecting
// the source's lock held says so (Note [Snapshot lock]).

#include <fcntl.h>
#include <fmt/ranges.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "file_remover.hpp"
#include "strata/checkpoint/checkpointer.hpp"
#include "strata/checkpoint/source.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/log.hpp"
#include "strata/offload/crc32c.hpp"
#include "strata/offload/file_io.hpp"

namespace strata::checkpoint {

namespace detail {

namespace fs = std::filesystem;
using nlohmann::json;
using runtime::dtype_bytes;
using runtime::is_optim_kind;
using runtime::state_kind_name;

constexpr int kFormatVersion = 1;
//! Data files written before they are fsynced together (bounds open descriptors).
constexpr std::size_t kWritersOpenMax = 256;
//! Threads that fsync a save's files, or verify a load's, at once.
constexpr std::size_t kIoThreads = 8;
//! The save's buffers (outside the host store) hold at most host budget / this, or one
//! family when that is larger (Note [Overlapped save]).
constexpr std::uint64_t kSaveRoomDivisor = 4;
//! Families of an overlapped save whose NVMe pieces may wait while host copies are
//! written first (each holds an open file and a part-filled stripe).
constexpr std::size_t kDeferredMax = 64;
//! Freed save buffers kept for reuse.
constexpr std::size_t kSaveSpares = 4;
//! NVMe reads a save keeps in flight ahead of its writer (Note [Save read-ahead]).
constexpr std::uint64_t kSaveReadAheadBytes = std::uint64_t{32} << 20;
constexpr const char* kManifestName = "manifest.json";
//! What a save that cannot create its files says to do.
constexpr std::string_view kWritableHint = "the checkpoint directory must be writable by this process";
constexpr const char* kFormatName = "strata-checkpoint";

//! The kinds a checkpoint stores, in file order.
constexpr StateKind kSavedKinds[] = {StateKind::kParam, StateKind::kMaster, StateKind::kState0,
                                     StateKind::kState1};

//! The saved kind called `name` ("param", "master", "state0", "state1").
std::optional<StateKind> kind_from_name(std::string_view name);

using offload::Fd;
using offload::fsync_dir;
using offload::kStripeBytes;
using offload::StripedWriter;
using offload::StripeSink;
//! Reads n bytes at offset of a checkpoint file; a file that ends first is Corrupt
//! (the data the manifest describes is not all there).
inline Status read_all(int fd, std::byte* p, std::size_t n, std::uint64_t offset, const fs::path& path) {
  Status s = offload::read_exact(fd, p, n, offset, path);
  if (s.code() == StatusCode::kCorrupt)
    s.with_context("reading the data the checkpoint's manifest describes");
  return s;
}
//! Creates (or truncates) StripedWriter::tmp_path(final_path) for writing (the test
//! hook test_hooks::before_create may fail it first).
Result<Fd> create_tmp(const fs::path& final_path);
//! A StripedWriter of a new create_tmp(final_path).
Result<StripedWriter> open_writer(fs::path final_path, StripeSink& sink);

//! Runs fn(i, thread) for i in [0, n) on up to kIoThreads threads.
void parallel_for(std::size_t n, const std::function<void(std::size_t, std::size_t)>& fn);
//! Publishes `writers`: drains the sink, fsyncs them together, renames them in order.
Status publish_all(StripeSink& sink, std::vector<StripedWriter>& writers);
//! `dir` (made absolute) when it is neither one of the NVMe swap directories nor inside one.
Result<fs::path> checkpoint_dir(const Source& src, const std::string& dir, std::string_view what);
//! The published manifest of `dir`, its format and version checked.
Result<json> read_manifest(const fs::path& dir);
//! Opens every data file the manifest names and checks its size; `fds` and `stats`
//! get each file's descriptor and its stat before any read.
Status open_files(const fs::path& dir, const json& files, std::vector<Fd>* fds,
                  std::vector<struct stat>* stats);
//! Checks every stripe's CRC32C of the files open_files opened, kIoThreads at once.
Status verify_files(const fs::path& dir, const json& files, std::uint64_t stripe_bytes,
                    const std::vector<Fd>& fds);
//! Converts n elements between float dtypes (f32, bf16, f16).
void convert(const std::byte* src, DType from, std::byte* dst, DType to, std::uint64_t n);
//! The kinds family f holds a chunk of, in file order.
std::vector<StateKind> family_kinds(const Description& d, FamilyId f);

}  // namespace detail

//! A save in flight (Note [Overlapped save]).
struct SaveState {
  using json = detail::json;
  //! One captured chunk: a host copy (buf) or the pinned NVMe slots it lives in.
  struct Piece {
    StateKind kind = StateKind::kParam;
    std::uint64_t bytes = 0;
    std::byte* buf = nullptr;
    bool borrowed = false;  //!< buf is the chunk's own host copy (a blocking save)
    std::vector<std::uint32_t> slots;
  };
  enum class Stage : std::uint8_t { kPending, kCaptured, kWritten };

  explicit SaveState(Source& source) : src(source) {}
  Source& src;
  //! The tensors and families as of the call (read without the lock: it does not change).
  Description desc;
  //! Where the save's files go, and the file remover that deletes what they replace.
  std::filesystem::path root;
  FileRemover* stale = nullptr;
  std::int64_t generation = 0;
  json tensors_meta;  //!< per tensor: name, shape, frozen, steps, group, file (taken at the call)
  json groups = json::array();
  std::int64_t step_index = 0;
  std::chrono::steady_clock::time_point t0;
  std::shared_ptr<NvmeStore> nvme;
  std::vector<std::vector<StateKind>> kinds;  //!< per family
  std::vector<Stage> stage;
  std::vector<bool> held;  //!< the family's update waits for its capture
  //! Captured, its host copies written, its NVMe pieces not yet (Note [Save I/O priority]).
  std::vector<bool> deferred;
  std::vector<std::vector<Piece>> pieces;
  std::uint64_t room = 0;        //!< host bytes the training thread may capture into
  std::uint64_t held_bytes = 0;  //!< bytes of the save's buffers
  std::uint64_t high_water = 0;  //!< the most held_bytes
  std::vector<std::pair<std::uint64_t, std::byte*>> spares;  //!< freed buffers kept for reuse (in held_bytes)
  //! save(): nothing runs beside it, so host copies are written in place
  //! (borrowed), and families are captured ahead only for the read-ahead (Note
  //! [Save read-ahead]).
  bool blocking = false;
  //! Every buffer save_allocate made and save_free has not freed, spares included.
  //! The destructor frees what is left, and warns: nothing should be. (The asan build's
  //! leak check once found a buffer lost in about two runs in three of
  //! Checkpoint.AnOverlappedSaveBegunWhileWriteBacksRun...: the save thread, after
  //! waiting for a family's write-back with the lock dropped, captured it again although
  //! the training thread had captured it meanwhile. Fixed in next_family; capture_family
  //! now checks that a family is captured once.)
  std::unordered_set<std::byte*> allocated;
  ~SaveState();
  std::size_t held_count = 0;
  std::size_t uncaptured = 0;
  //! Data parallelism (Note [Sharded checkpoint]): this rank writes families f mod W =
  //! its rank only (`owned` of them; assemble_shards gathered their state shards), and
  //! run_save leaves their file and tensor entries here
  //! for rank 0's manifest instead of publishing one.
  bool sharded = false;
  std::size_t owned = 0;
  json shard_files = json::array();    //!< {family, name, bytes, crc32c}
  json shard_tensors = json::array();  //!< {id, entry}
  bool done = false;
  Status status = Status::Ok();
  std::thread thread;
};

namespace detail {

// The capture side (capture.cpp); the source's lock held.
//! A buffer of the save's own (4096-aligned, outside the host store): within its
//! room, or past it with `force`; null otherwise.
std::byte* save_allocate(SaveState& s, std::uint64_t bytes, bool force);
//! Frees (or keeps as a spare) a buffer of save_allocate.
void save_free(SaveState& s, std::byte* p, std::uint64_t bytes);
//! Frees a save's captured pieces of one family (buffers back, NVMe slots unpinned).
void release_pieces(SaveState& s, std::vector<SaveState::Piece>& pieces);
//! Captures family f (Note [Overlapped save]). `force` (the save thread): past the
//! save's room, in ordinary memory; else false when the copies do not fit the room.
Result<bool> capture_family(SaveState& s, FamilyId f, bool force);
//! Ends the save's hold on every update (after an error): they launch now.
void release_all_holds(SaveState& s);

// The format side (format.cpp); the lock not needed.
//! Writes, fsyncs and renames the manifest (the data files are published), then
//! removes what no manifest names (Note [Checkpoint publish]).
Status publish_manifest(SaveState& s, json files, json tensors, std::uint64_t total);

//! With W > 1: all-gathers every family's optimizer shards so that rank f mod W
//! holds family f's whole pieces as captured (shards.cpp). The lock held.
Status assemble_shards(std::unique_lock<std::mutex>& lock, SaveState& s);
//! Everything of a save that can fail on one rank alone (prepare.cpp):
//! after this, only collectives and the save thread. The lock held.
Status prepare_save(std::unique_lock<std::mutex>& lock, SaveState& s, const std::string& dir,
                    bool wait_write_backs);
//! The save's metadata as of the call (step counters, groups, the step index) and its
//! per-family progress: another rank's families are done already. The lock held.
void describe_save(SaveState& s);

// The save thread (save_thread.cpp); takes the lock itself.
//! Writes every family this rank owns and, on rank 0 or alone, the manifest
//! (Note [Save read-ahead], Note [Save file creation]). Blocks until done.
Status run_save(SaveState& s);
//! Removes a failed save's temporary files, written or not.
void remove_temporaries(const SaveState& s);

}  // namespace detail

}  // namespace strata::checkpoint
