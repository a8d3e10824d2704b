#include "swap_file.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>

#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/offload/crc32c.hpp"

namespace strata::offload::detail {

// Note [Swap file header]
// The first 4 KiB of every swap file hold a header: magic "STRATASW", version,
// the run id (random per SwapStore), pid, creation time, slot and stripe sizes,
// and a CRC32C of the header. Slot metadata (which slot holds which chunk, each
// stripe's CRC) lives only in memory, so a swap file is never trusted across
// runs: at start, any `strata-swap-*.swp` whose flock is free belongs to a run
// that is gone. It is reported (with its header's run id and pid when the
// header is valid) and removed before the new files are created, so stale bytes
// can never be read back as a chunk. The flock, held for the store's lifetime,
// tells a live store's file (another process, or another store in this one)
// from a stale one.

// Note [Unlinked swap files]
// A swap file has no name while it is in use, so no death of the process —
// SIGKILL, OOM kill, power loss aside — leaves one behind: the kernel frees its
// blocks when the last descriptor (ours, or an io_uring ring's) closes. It is
// opened with O_TMPFILE (it never has a name) where the file system supports
// that (ext4, xfs, btrfs, tmpfs), else created under a name unique to the run
// (strata-swap-<i>.<run id>.swp) and unlinked as soon as its header is written.
// Everything after creation goes through the descriptor: the engines register
// the fd (io_uring fixed files and O_DIRECT work on unlinked files as on named
// ones), growth is fallocate on the fd. What the names are still for:
// - messages name dir/strata-swap-<i>.<run id>.swp, the file as it would be;
// - the reclaim at start (Note [Swap file header]) still removes a file that a
//   run killed in the microseconds between creating and unlinking it left, or
//   one an older strata (which kept its files named) left;
// - two stores may share a directory: their files never meet.
// Tests reach a store's bytes through /proc/self/fd (SwapStore::reopen_paths()).
// No signal handler is needed, and none is installed: a handler that unlinks
// would cover SIGTERM and SIGINT only, and would race the store's own cleanup.

namespace {

constexpr char kMagic[8] = {'S', 'T', 'R', 'A', 'T', 'A', 'S', 'W'};
constexpr std::uint32_t kVersion = 1;
constexpr std::string_view kPrefix = "strata-swap-";
constexpr std::string_view kSuffix = ".swp";

struct HeaderRecord {
  char magic[8];
  std::uint32_t version;
  std::uint32_t header_bytes;
  std::uint64_t run_id;
  std::uint64_t slot_bytes;
  std::uint64_t stripe_bytes;
  std::uint32_t slots;
  std::uint32_t dir_index;
  std::uint32_t dir_count;
  std::uint32_t pid;
  std::uint64_t created_unix_s;
  std::uint32_t crc;  // CRC32C of the bytes before it
};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using BlockPtr = std::unique_ptr<std::byte, FreeDeleter>;

BlockPtr header_block() {
  void* p = std::aligned_alloc(kSwapHeaderBytes, kSwapHeaderBytes);
  STRATA_CHECK(p != nullptr);
  std::memset(p, 0, kSwapHeaderBytes);
  return BlockPtr(static_cast<std::byte*>(p));
}

std::uint32_t record_crc(const HeaderRecord& r) {
  return crc32c({reinterpret_cast<const std::byte*>(&r), offsetof(HeaderRecord, crc)});
}

bool is_swap_file_name(const std::string& name) {
  return name.size() > kPrefix.size() + kSuffix.size() && name.starts_with(kPrefix) &&
         name.ends_with(kSuffix);
}

// Describes a stale file from its header, for the log.
std::string describe_stale(int fd) {
  HeaderRecord r{};
  ssize_t n = ::pread(fd, &r, sizeof(r), 0);
  if (n != static_cast<ssize_t>(sizeof(r)) || std::memcmp(r.magic, kMagic, sizeof(kMagic)) != 0) {
    return "no strata swap header (not written by strata, or cut short)";
  }
  if (r.version != kVersion || r.crc != record_crc(r))
    return "a damaged or foreign-version strata swap header";
  return fmt::format("left by run {:016x} (pid {}, created at unix time {}, {} slots of {})", r.run_id, r.pid,
                     r.created_unix_s, r.slots, format_bytes(r.slot_bytes));
}

// The pid in a valid header, or 0.
std::uint32_t header_pid(int fd) {
  HeaderRecord r{};
  ssize_t n = ::pread(fd, &r, sizeof(r), 0);
  if (n != static_cast<ssize_t>(sizeof(r)) || std::memcmp(r.magic, kMagic, sizeof(kMagic)) != 0 ||
      r.version != kVersion || r.crc != record_crc(r)) {
    return 0;
  }
  return r.pid;
}

// True when process `pid` has exited (gone, or a zombie not yet reaped).
bool process_exited(std::uint32_t pid) {
  if (pid == 0 || pid == static_cast<std::uint32_t>(::getpid())) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  std::string line;
  std::getline(stat, line);
  const auto close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() &&
         (line[close + 2] == 'Z' || line[close + 2] == 'X');
}

// Note [Lock of a killed run]
// A process killed with SIGKILL while its io_uring held the swap file (registered
// or in flight) keeps the file open until the kernel has torn the ring down, which
// happens asynchronously after the process is gone: for a few milliseconds its
// flock outlives it. A restart right after the kill (a crash-and-resume loop) then
// sees a locked file whose header names a process that has exited. Such a lock is
// waited for (up to kDeadHolderWaitMs) instead of being taken for a live store's.
constexpr int kDeadHolderWaitMs = 10000;

// Takes fd's flock when it is free, or when its holder has exited and the kernel
// releases it within kDeadHolderWaitMs. True when taken.
bool lock_unless_live(int fd, const std::filesystem::path& path) {
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return true;
  const std::uint32_t pid = header_pid(fd);
  if (!process_exited(pid)) return false;
  STRATA_LOG_INFO(
      "swap: {} is still locked by pid {}, which has exited (its io_uring is being torn down); waiting",
      path.string(), pid);
  for (int waited = 0; waited < kDeadHolderWaitMs; waited += 5) {
    ::usleep(5000);
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return true;
  }
  return false;
}

}  // namespace

std::string swap_file_name(std::uint32_t dir_index) {
  return fmt::format("{}{}{}", kPrefix, dir_index, kSuffix);
}

std::string swap_file_name(std::uint32_t dir_index, std::uint64_t run_id) {
  return fmt::format("{}{}.{:016x}{}", kPrefix, dir_index, run_id, kSuffix);
}

Status check_swap_dir(const std::filesystem::path& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    int err = errno;
    if (err == ENOENT) {
      return not_found(
          "swap directory {} does not exist: create it or list another directory in the swap setting",
          dir.string());
    }
    return errno_status(err, fmt::format("stat of swap directory {}", dir.string()));
  }
  if (!S_ISDIR(st.st_mode)) {
    return invalid_argument("swap directory {} is not a directory: list a directory in the swap setting",
                            dir.string());
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return permission_denied(
        "swap directory {} is not writable by this process (uid {}): fix its permissions or "
        "choose another directory",
        dir.string(), ::getuid());
  }
  return Status::Ok();
}

Status reclaim_stale_swap_files(const std::filesystem::path& dir) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    if (!is_swap_file_name(name)) continue;
    int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;                       // vanished meanwhile
    if (!lock_unless_live(fd, entry.path())) {  // a live store's (Note [Unlinked swap files])
      ::close(fd);
      continue;
    }
    STRATA_LOG_WARN(
        "swap: found stale swap file {}, {}; a previous run did not shut down cleanly. Reclaiming it "
        "(its contents are never read)",
        entry.path().string(), describe_stale(fd));
    if (::unlink(entry.path().c_str()) != 0) {
      int err = errno;
      ::close(fd);
      return errno_status(err, fmt::format("removing stale swap file {}", entry.path().string()));
    }
    ::close(fd);
  }
  if (ec) return errno_status(ec.value(), fmt::format("listing swap directory {}", dir.string()));
  return Status::Ok();
}

Status check_free_space(const std::vector<std::filesystem::path>& dirs, std::uint64_t file_bytes) {
  struct Need {
    std::uint64_t needed = 0;
    std::uint64_t available = 0;
    std::string dirs;
  };
  std::map<unsigned long, Need> by_fs;
  for (const auto& dir : dirs) {
    struct statvfs vfs {};
    if (::statvfs(dir.c_str(), &vfs) != 0)
      return errno_status(errno, fmt::format("statvfs of {}", dir.string()));
    Need& need = by_fs[vfs.f_fsid];
    need.needed += file_bytes;
    need.available = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    need.dirs += (need.dirs.empty() ? "" : ", ") + dir.string();
  }
  for (const auto& [fsid, need] : by_fs) {
    if (need.needed > need.available) {
      return no_space(
          "swap needs {} on the file system of {} but only {} is available: free space, lower the swap "
          "size, or add a directory on another device",
          format_bytes(need.needed), need.dirs, format_bytes(need.available));
    }
  }
  return Status::Ok();
}

namespace {

bool tmpfile_unsupported(int err) {
  return err == EOPNOTSUPP || err == EISDIR || err == EINVAL || err == ENOENT;
}

// Opens `file` (unnamed in its directory when `unnamed`, else created under
// file.path) with O_DIRECT when `direct`. Returns the fd or -1 with errno set.
int open_swap(const std::filesystem::path& dir, const SwapFile& file, bool unnamed, bool direct) {
  const int flags = O_RDWR | O_CLOEXEC | (direct ? O_DIRECT : 0);
  // No O_EXCL: the name holds the run's random id, and an O_DIRECT open refused
  // by an older tmpfs may already have created the file.
  return unnamed ? ::open(dir.c_str(), flags | O_TMPFILE, 0600)
                 : ::open(file.path.c_str(), flags | O_CREAT | O_TRUNC, 0600);
}

// Opens file.fd: O_TMPFILE when the file system has it (Note [Unlinked swap
// files]), O_DIRECT when asked and allowed (buffered with a warning where refused).
Status open_swap_file(const std::filesystem::path& dir, SwapFile& file, SwapOpenMode mode) {
  bool unnamed = !mode.keep_name;
  if (mode.direct && !mode.simulate_refused) {
    file.fd = open_swap(dir, file, unnamed, true);
    if (file.fd < 0 && unnamed && tmpfile_unsupported(errno)) {
      unnamed = false;
      file.fd = open_swap(dir, file, false, true);
    }
    file.direct = file.fd >= 0;
    if (file.fd < 0 && errno != EINVAL)
      return errno_status(errno, fmt::format("creating swap file {}", file.path.string()));
  }
  if (file.fd < 0) {
    if (mode.direct) {
      STRATA_LOG_WARN(
          "swap: the file system of {} refuses O_DIRECT{}; using buffered I/O there, which goes "
          "through the page cache (slower, and uses host memory). Put swap on a disk file system "
          "(ext4, xfs) for direct I/O",
          dir.string(), mode.simulate_refused ? " [simulated]" : "");
    }
    file.fd = open_swap(dir, file, unnamed, false);
    if (file.fd < 0 && unnamed && tmpfile_unsupported(errno)) {
      unnamed = false;
      file.fd = open_swap(dir, file, false, false);
    }
    if (file.fd < 0) {
      const int err = errno;
      if (!unnamed) ::unlink(file.path.c_str());  // a refused O_DIRECT open may have made it
      return errno_status(err, fmt::format("creating swap file {}", file.path.string()));
    }
  }
  file.named = !unnamed;
  return Status::Ok();
}

Status write_header(const SwapFile& file, const SwapHeaderInfo& info) {
  BlockPtr block = header_block();
  HeaderRecord r{};
  std::memcpy(r.magic, kMagic, sizeof(kMagic));
  r.version = kVersion;
  r.header_bytes = kSwapHeaderBytes;
  r.run_id = info.run_id;
  r.slot_bytes = info.slot_bytes;
  r.stripe_bytes = info.stripe_bytes;
  r.slots = info.slots;
  r.dir_index = info.dir_index;
  r.dir_count = info.dir_count;
  r.pid = static_cast<std::uint32_t>(::getpid());
  r.created_unix_s = static_cast<std::uint64_t>(std::time(nullptr));
  r.crc = record_crc(r);
  std::memcpy(block.get(), &r, sizeof(r));
  ssize_t n = ::pwrite(file.fd, block.get(), kSwapHeaderBytes, 0);
  if (n == static_cast<ssize_t>(kSwapHeaderBytes)) return Status::Ok();
  return errno_status(n < 0 ? errno : EIO,
                      fmt::format("writing the header of swap file {}", file.path.string()));
}

std::uint64_t free_bytes(int fd) {
  struct statvfs vfs {};
  if (::fstatvfs(fd, &vfs) != 0) return 0;
  return static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

}  // namespace

Result<SwapFile> create_swap_file(const std::filesystem::path& dir, const SwapHeaderInfo& info,
                                  std::uint64_t file_bytes, SwapOpenMode mode) {
  SwapFile file;
  file.path = dir / swap_file_name(info.dir_index, info.run_id);
  STRATA_RETURN_IF_ERROR(open_swap_file(dir, file, mode));
  auto fail = [&](Status status) {
    close_and_remove(file);
    return status;
  };
  if (::flock(file.fd, LOCK_EX | LOCK_NB) != 0) {
    return fail(failed_precondition("swap file {} was locked by another store while being created",
                                    file.path.string()));
  }
  if (Status grown = grow_swap_file(file, 0, file_bytes); !grown.ok()) return fail(std::move(grown));
  if (Status header = write_header(file, info); !header.ok()) return fail(std::move(header));
  if (file.named && !mode.keep_name) {
    // ENOENT: another run's reclaim took it meanwhile (harmless, we hold the fd).
    if (::unlink(file.path.c_str()) != 0 && errno != ENOENT) {
      return fail(errno_status(errno, fmt::format("unlinking swap file {} after creating it (Note [Unlinked "
                                                  "swap files])",
                                                  file.path.string())));
    }
    file.named = false;
  }
  return file;
}

Status grow_swap_file(const SwapFile& file, std::uint64_t from_bytes, std::uint64_t to_bytes) {
  STRATA_ASSERT(from_bytes <= to_bytes);
  if (from_bytes == to_bytes) return Status::Ok();
  const std::uint64_t bytes = to_bytes - from_bytes;
  if (::fallocate(file.fd, 0, static_cast<off_t>(from_bytes), static_cast<off_t>(bytes)) == 0)
    return Status::Ok();
  const int err = errno;
  if (err == ENOSPC || err == EFBIG) {
    return no_space(
        "preallocating {} for swap file {} (growing it from {} to {}) failed: {} (errno {}); its file "
        "system has {} free. Free space there, lower budgets.nvme, or add a directory on another drive "
        "(RLIMIT_FSIZE, `ulimit -f`, can also cause this)",
        format_bytes(bytes), file.path.string(), format_bytes(from_bytes), format_bytes(to_bytes),
        std::strerror(err), err, format_bytes(free_bytes(file.fd)));
  }
  return errno_status(
      err, fmt::format("fallocate of {} for swap file {}", format_bytes(bytes), file.path.string()));
}

void close_and_remove(SwapFile& file) {
  if (file.fd < 0) return;
  if (file.named && ::unlink(file.path.c_str()) != 0) {
    STRATA_LOG_WARN("swap: could not remove {}: {}", file.path.string(), std::strerror(errno));
  }
  ::close(file.fd);  // releases the flock after the unlink, so no one sees a stale file
  file.fd = -1;
}

}  // namespace strata::offload::detail
