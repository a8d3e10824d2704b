// strata-crash: kills a checkpointing trainer with SIGKILL at random moments and
// checks that every resume ends bit-identical to an uninterrupted run.
//
// Note [Crash harness]
// The parent never creates a runtime (it stays single-threaded, so fork is safe);
// every trainer, loader and benchmark runs in a forked child. A trainer is an MLP
// (tests/runtime/mlp.hpp) on the sim device, AdamW, its optimizer states on host
// and NVMe, that checkpoints every --every steps and marks in shared memory
// which phase it is in: a step() (optimizer, bookkeeping), a forward/backward with
// the previous step's NVMe write-backs in flight, or an overlapped save
// (begin_checkpoint, the next training step, finish_checkpoint). For each
// run the parent picks a phase (round robin) and a step, waits until the trainer
// is there, waits a random few hundred microseconds more and sends SIGKILL, then
// restarts the trainer, which resumes from the last published checkpoint, until
// it finishes. Then it checks:
//  - the final params, masters, states and step counters equal (bit for bit) an
//    uninterrupted run's;
//  - no checkpoint was lost: a restarted trainer resumes at least from the step
//    of the last save that returned before the kill;
//  - a full disk during a save (RLIMIT_FSIZE in the child, with SIGXFSZ ignored:
//    write() fails with EFBIG, which strata reports as NoSpace) fails that save
//    and the previous checkpoint still loads and holds the same state (every
//    third run);
//  - a corruption injected into the finished checkpoint (in turn: a flipped byte
//    in a data file, a truncated data file, a deleted manifest) is refused by a
//    fresh runtime, whose state stays unchanged;
//  - the killed trainer left nothing in its NVMe directory (its swap files are
//    unlinked at creation, Note [Unlinked swap files]): files_left_by_kills.
// At the end it saves and loads a larger model (--bench-mib) on host and NVMe to
// measure seconds per GiB, and runs fio in the same directory for comparison: the
// same bytes written and read, and the same I/O as the save and the load do (Note
// [Checkpoint I/O baselines]). The checkpoint files are dropped from the page cache
// (fadvise) before the load, so both read from the disk.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "mlp.hpp"
#include "strata/common/bytes.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/planner.hpp"
#include "strata/runtime/runtime.hpp"

namespace {

namespace fs = std::filesystem;
using strata::Status;
using strata::StatusCode;
using namespace strata::runtime;
using Clock = std::chrono::steady_clock;

enum Phase : int { kIdle = 0, kStep = 1, kWriteBack = 2, kSave = 3 };
constexpr const char* kPhaseNames[] = {"idle", "step", "write_back", "save"};

//! What the trainer tells the parent (MAP_SHARED, so visible across fork).
struct Shared {
  std::atomic<int> phase{kIdle};
  std::atomic<int> step{0};        //!< steps completed
  std::atomic<int> published{-1};  //!< step of the last save that returned
  std::atomic<int> loaded{-1};     //!< step the trainer resumed from (0: fresh)
};

struct Settings {
  int runs = 10;
  int steps = 12;
  int every = 3;
  int layers = 8;
  std::size_t width = 256;
  std::uint64_t seed = 0;
  std::uint64_t bench_mib = 256;
  std::uint64_t bench_chunk_elems = 0;  //!< the benchmark's chunk size; 0: the runtime's search
  std::string work_dir;
  bool json = false;
};

std::uint64_t family_elems(const Settings& s) {
  const std::uint64_t used = s.width * s.width + s.width;
  return (used + 4095) / 4096 * 4096;
}

RuntimeOptions trainer_options(const Settings& s, const fs::path& nvme_dir) {
  RuntimeOptions o;
  o.hyper.optimizer = strata::kernels::Optimizer::kAdamW;
  o.hyper.lr = 1e-2f;
  o.hyper.weight_decay = 0.01f;
  o.layout.chunk_elems = family_elems(s);
  o.threads = 2;
  const std::uint64_t state_bytes = static_cast<std::uint64_t>(s.layers) * 4 * family_elems(s) * 4;
  // GPU 1/4 and host 2/3 of the model state: optimizer states on host and NVMe (the host
  // also holds the counted gradient copies and staging, Note [Host room]).
  o.budgets = {
      .gpu_bytes = state_bytes / 4, .host_bytes = state_bytes * 2 / 3, .nvme_bytes = 256 * strata::kMiB};
  o.nvme_dirs = {nvme_dir.string()};
  o.plan.nvme_families_in_flight = 1;
  o.plan.grad_staging_slots = 1;
  return o;
}

//! A trainer's runtime and model (the device outlives nothing it queued: the MLP is declared first).
struct Trainer {
  testing::Mlp mlp;
  std::unique_ptr<strata::memory::Device> device;
  std::unique_ptr<Runtime> rt;
  Status open(const Settings& s, const fs::path& nvme_dir) {
    strata::memory::DeviceOptions d;
    d.kind = strata::memory::DeviceChoice::kSim;
    d.budget_bytes = 256 * strata::kMiB;
    STRATA_ASSIGN_OR_RETURN(device, strata::memory::make_device(d));
    STRATA_ASSIGN_OR_RETURN(rt, Runtime::create(*device, trainer_options(s, nvme_dir)));
    mlp.layers = static_cast<std::size_t>(s.layers);
    mlp.width = s.width;
    return mlp.build(*rt);
  }
  ~Trainer() { rt.reset(); }
};

//! Every tensor's param, master, states and step counter, as bytes.
strata::Result<std::string> dump_state(Runtime& rt) {
  std::string out;
  for (TensorId t = 0; t < rt.tensor_count(); ++t) {
    for (StateKind k : {StateKind::kParam, StateKind::kMaster, StateKind::kState0, StateKind::kState1}) {
      std::vector<float> v(rt.layout().slots[t].numel);
      STRATA_RETURN_IF_ERROR(rt.read_tensor(t, k, v));
      out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
    }
    STRATA_ASSIGN_OR_RETURN(std::int64_t steps, rt.tensor_steps(t));
    out.append(reinterpret_cast<const char*>(&steps), sizeof steps);
  }
  return out;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const fs::path& p, const std::string& data) {
  const fs::path tmp = p.string() + ".tmp";
  std::ofstream(tmp, std::ios::binary) << data;
  fs::rename(tmp, p);
}

[[noreturn]] void child_fail(int code, const Status& st, const char* what) {
  std::fprintf(stderr, "strata-crash: child %s: %s\n", what, st.to_string().c_str());
  std::fflush(stderr);
  ::_exit(code);
}

//! The trainer (in a child): resumes from `ckpt` when it holds a checkpoint, trains
//! to s.steps saving every s.every steps, writes its final state to `dump`. Exits.
[[noreturn]] void trainer_child(const Settings& s, const fs::path& ckpt, const fs::path& nvme,
                                const fs::path& dump, Shared* sh) {
  Trainer tr;
  if (Status st = tr.open(s, nvme); !st.ok()) child_fail(20, st, "open");
  int step = 0;
  if (fs::exists(ckpt / "manifest.json")) {
    if (Status st = tr.rt->load_checkpoint(ckpt.string()); !st.ok()) child_fail(21, st, "load_checkpoint");
    step = static_cast<int>(*tr.rt->tensor_steps(tr.mlp.w[0]));
  }
  sh->loaded = step;
  sh->step = step;
  auto train_one = [&] {
    if (Status st = tr.mlp.train_step(*tr.rt); !st.ok()) child_fail(22, st, "train_step");
    if (auto st = tr.rt->step(); !st.ok()) child_fail(23, st.status(), "step");
    ++step;
  };
  while (step < s.steps) {
    sh->phase = kWriteBack;  // the last step's NVMe write-backs overlap this forward/backward
    if (Status st = tr.mlp.train_step(*tr.rt); !st.ok()) child_fail(22, st, "train_step");
    sh->phase = kStep;
    if (auto st = tr.rt->step(); !st.ok()) child_fail(23, st.status(), "step");
    sh->step = ++step;
    if (step % s.every == 0) {
      // An overlapped save (Note [Overlapped save]): the next step trains while it is
      // written; it is published once finish_checkpoint returns.
      sh->phase = kSave;
      const int saved = step;
      if (Status st = tr.rt->begin_checkpoint(ckpt.string()); !st.ok())
        child_fail(24, st, "begin_checkpoint");
      if (step < s.steps) train_one();
      if (Status st = tr.rt->finish_checkpoint(); !st.ok()) child_fail(24, st, "finish_checkpoint");
      sh->published = saved;
      sh->step = step;
    }
  }
  sh->phase = kIdle;
  auto state = dump_state(*tr.rt);
  if (!state.ok()) child_fail(25, state.status(), "read state");
  write_file(dump, *state);
  tr.rt.reset();
  ::_exit(0);
}

//! Forks `fn` (which must _exit) and returns its pid.
template <typename Fn>
pid_t spawn(Fn&& fn) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) {
    std::perror("strata-crash: fork");
    std::exit(2);
  }
  if (pid == 0) fn();
  return pid;
}

//! Waits for `pid`; returns its exit code, or 128 + signal.
int reap(pid_t pid) {
  int ws = 0;
  while (::waitpid(pid, &ws, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(ws)) return WEXITSTATUS(ws);
  return 128 + WTERMSIG(ws);
}

template <typename Fn>
int run_child(Fn&& fn) {
  return reap(spawn(std::forward<Fn>(fn)));
}

struct Figures {
  int runs = 0, exact_resumes = 0, kills = 0;
  int kills_in[4] = {};
  int corruptions_injected = 0, corruptions_detected = 0, lost_checkpoints = 0;
  int disk_full_saves = 0, disk_full_refused = 0, failures = 0;
  int files_left_by_kills = 0;  //!< kills after which the NVMe directory was not empty
  nlohmann::json bench;         //!< the save/load benchmark's figures (bench())
};

//! Injects corruption `kind` (0 flipped byte, 1 truncated file, 2 missing manifest) into `ckpt`.
std::string corrupt_checkpoint(const fs::path& ckpt, int kind, std::mt19937_64& rng) {
  std::vector<fs::path> data;
  for (const auto& e : fs::directory_iterator(ckpt)) {
    if (e.path().extension() == ".bin") data.push_back(e.path());
  }
  std::sort(data.begin(), data.end());
  const fs::path victim = data[rng() % data.size()];
  const std::uint64_t size = fs::file_size(victim);
  if (kind == 0) {
    const std::uint64_t off = rng() % size;
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(off));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ (1 << (rng() % 8)));
    f.seekp(static_cast<std::streamoff>(off));
    f.write(&c, 1);
    return fmt::format("flipped a bit of byte {} of {}", off, victim.filename().string());
  }
  if (kind == 1) {
    const std::uint64_t to = rng() % size;
    fs::resize_file(victim, to);
    return fmt::format("truncated {} from {} to {} bytes", victim.filename().string(), size, to);
  }
  fs::remove(ckpt / "manifest.json");
  return "deleted manifest.json";
}

//! One run: kill the trainer once in `target` phase, resume until done, compare; then
//! (every third run) a full disk during a save, then one corruption. Returns false on a failure.
void one_run(const Settings& s, int run, const fs::path& root, const std::string& reference, Shared* sh,
             std::mt19937_64& rng, Figures& fig) {
  const fs::path dir = root / fmt::format("run-{}", run);
  const fs::path ckpt = dir / "ckpt", nvme = dir / "nvme", dump = dir / "final.bin";
  fs::remove_all(dir);
  fs::create_directories(ckpt);
  fs::create_directories(nvme);
  const Phase target = static_cast<Phase>(1 + run % 3);
  bool killed = false;
  int last_published_at_kill = -1;
  for (int attempt = 0; attempt < 50; ++attempt) {
    sh->phase = kIdle;
    sh->loaded = -1;
    sh->published = -1;
    const pid_t pid = spawn([&] { trainer_child(s, ckpt, nvme, dump, sh); });
    if (!killed) {
      // A save happens after steps every, 2*every, ...; other phases at any step.
      const int max_step = target == kSave ? s.steps / s.every : s.steps - 1;
      const int at = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(std::max(1, max_step)));
      const int at_step = target == kSave ? at * s.every : at;
      // A forward/backward with write-backs in flight is short here: kill within it.
      const auto delay = std::chrono::microseconds(rng() % (target == kWriteBack ? 50 : 400));
      int status = -1;
      while (true) {
        int ws = 0;
        if (::waitpid(pid, &ws, WNOHANG) == pid) {
          status = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
          break;
        }
        const int step = sh->step.load(), phase = sh->phase.load();
        // The save of step n runs after step n completed; the others during step n's step (sh->step = n - 1).
        const bool there = phase == target && (target == kSave ? step == at_step : step + 1 >= at_step);
        if (there) {
          std::this_thread::sleep_for(delay);
          last_published_at_kill = sh->published.load();
          const int phase_at_kill = sh->phase.load();
          ::kill(pid, SIGKILL);
          reap(pid);
          if (!fs::is_empty(nvme)) {
            std::fprintf(stderr, "strata-crash: run %d: the killed trainer left files in %s\n", run,
                         nvme.c_str());
            ++fig.files_left_by_kills;
          }
          killed = true;
          ++fig.kills;
          ++fig.kills_in[phase_at_kill];
          break;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      if (status >= 0) {  // finished before the kill came: start the run again
        if (status != 0) {
          std::fprintf(stderr, "strata-crash: run %d: trainer exited with %d\n", run, status);
          ++fig.failures;
          return;
        }
        fs::remove_all(ckpt);
        fs::create_directories(ckpt);
        fs::remove(dump);
      }
      continue;
    }
    const int status = reap(pid);
    if (sh->loaded.load() < last_published_at_kill) {
      std::fprintf(stderr, "strata-crash: run %d: resumed from step %d, but step %d had been published\n",
                   run, sh->loaded.load(), last_published_at_kill);
      ++fig.lost_checkpoints;
    }
    if (status != 0) {
      std::fprintf(stderr, "strata-crash: run %d: resumed trainer exited with %d\n", run, status);
      ++fig.failures;
      return;
    }
    break;
  }
  ++fig.runs;
  if (!killed) {
    std::fprintf(stderr, "strata-crash: run %d: no kill landed in 50 attempts\n", run);
    ++fig.failures;
    return;
  }
  if (read_file(dump) == reference) {
    ++fig.exact_resumes;
  } else {
    std::fprintf(
        stderr, "strata-crash: run %d: the resumed run's final state differs from the straight run's\n", run);
  }

  // The finished run's last checkpoint (step s.steps) is the reference state.
  if (run % 3 == 0) {
    ++fig.disk_full_saves;
    const int rc = run_child([&] {
      Trainer tr;
      if (Status st = tr.open(s, nvme); !st.ok()) child_fail(30, st, "open");
      if (Status st = tr.rt->load_checkpoint(ckpt.string()); !st.ok()) child_fail(31, st, "load");
      if (Status st = tr.mlp.train_step(*tr.rt); !st.ok()) child_fail(32, st, "train_step");
      if (auto st = tr.rt->step(); !st.ok()) child_fail(33, st.status(), "step");
      ::signal(SIGXFSZ, SIG_IGN);
      const rlimit lim{256 * 1024, 256 * 1024};  // files may grow to 256 KiB: the first family file fails
      ::setrlimit(RLIMIT_FSIZE, &lim);
      const Status st = tr.rt->save_checkpoint(ckpt.string());
      if (st.code() != StatusCode::kNoSpace) child_fail(34, st, "save on a full disk was not NoSpace");
      ::_exit(0);
    });
    if (rc == 0) ++fig.disk_full_refused;
    // The previous checkpoint must load and hold the finished run's state.
    const fs::path again = dir / "after-disk-full.bin";
    const int rc2 = run_child([&] {
      Trainer tr;
      if (Status st = tr.open(s, nvme); !st.ok()) child_fail(40, st, "open");
      if (Status st = tr.rt->load_checkpoint(ckpt.string()); !st.ok())
        child_fail(41, st, "load after disk full");
      auto state = dump_state(*tr.rt);
      if (!state.ok()) child_fail(42, state.status(), "read state");
      write_file(again, *state);
      ::_exit(0);
    });
    if (rc2 != 0 || read_file(again) != reference) {
      std::fprintf(stderr, "strata-crash: run %d: the checkpoint before a full-disk save was lost\n", run);
      ++fig.lost_checkpoints;
    }
  }

  const std::string what = corrupt_checkpoint(ckpt, run % 3, rng);
  ++fig.corruptions_injected;
  const int rc = run_child([&] {
    Trainer tr;
    if (Status st = tr.open(s, nvme); !st.ok()) child_fail(50, st, "open");
    auto before = dump_state(*tr.rt);
    const Status st = tr.rt->load_checkpoint(ckpt.string());
    if (st.ok()) ::_exit(51);
    auto after = dump_state(*tr.rt);
    if (!before.ok() || !after.ok() || *before != *after) ::_exit(52);  // loaded partly
    if (!s.json)
      std::fprintf(stderr, "strata-crash: run %d: refused as expected: %s\n", run, st.to_string().c_str());
    ::_exit(0);
  });
  if (rc == 0) {
    ++fig.corruptions_detected;
  } else {
    std::fprintf(stderr, "strata-crash: run %d: %s was %s\n", run, what.c_str(),
                 rc == 51 ? "loaded as if valid" : "refused, but the state changed");
  }
  fs::remove_all(dir);
}

//! One job of a fio run: its name and its options (after --name).
struct FioJob {
  std::string name, options;
  bool end_fsync = false;  //!< its time includes its final fsync (fio's "sync" latency)
};

//! Runs `jobs` at once in one fio run in `dir`; the seconds until the last one is
//! done, or nullopt (`note` says why).
std::optional<double> fio_seconds(const fs::path& dir, const std::vector<FioJob>& jobs, std::string& note) {
  const fs::path out = dir / "fio.json";
  std::string cmd = fmt::format("cd {} && fio --output-format=json --output={}", dir.string(), out.string());
  for (const FioJob& job : jobs) cmd += fmt::format(" --name={} {}", job.name, job.options);
  if (std::system((cmd + " > /dev/null 2>&1").c_str()) != 0) {
    note = "fio failed or is not installed: " + cmd;
    return std::nullopt;
  }
  const nlohmann::json j = nlohmann::json::parse(read_file(out), nullptr, false);
  if (j.is_discarded() || !j.contains("jobs") || j["jobs"].size() != jobs.size()) {
    note = "fio's JSON could not be parsed: " + cmd;
    return std::nullopt;
  }
  double longest = 0;
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    const auto& job = j["jobs"][i];
    const double ms = std::max(job["read"].value("runtime", 0.0), job["write"].value("runtime", 0.0));
    if (ms <= 0) {
      note = "fio's job " + jobs[i].name + " did no I/O: " + cmd;
      return std::nullopt;
    }
    // fio's runtime for writes leaves out the final fsync; its job "sync" latency covers it.
    double seconds = ms * 1e-3;
    if (jobs[i].end_fsync) seconds += job["sync"]["lat_ns"].value("mean", 0.0) * 1e-9;
    longest = std::max(longest, seconds);
  }
  return longest;
}

//! The fio runs a save and a load are compared with (Note [Checkpoint I/O baselines]).
struct FioFigures {
  double write = 1e30, read = 1e30, save_io = 1e30, load_io = 1e30;  // seconds, best of the runs
};

// Note [Checkpoint I/O baselines]
// fio runs beside the save and the load, on the same disk, in the same directory:
//   - write, read: the checkpoint's bytes in one file, 1 MiB psync through the page
//     cache (a save writes 1 MiB stripes so), the write ending with fsync, the read
//     from the disk (invalidate). The disk's best case: the write lands on blocks fio
//     allocated and wrote before.
//   - save_io: the I/O a save must do, at once: write the checkpoint's bytes to a
//     file created anew (a save never overwrites the published checkpoint; creating
//     and allocating is part of its cost), and read the NVMe-held states' bytes
//     O_DIRECT in swap-slot pieces, 16 in flight (the swap store's reads).
//   - load_io: the I/O a load must do, at once: read the checkpoint's bytes, and write
//     the NVMe-held states' bytes O_DIRECT to slots already allocated (a load writes
//     the states it restores to fresh swap slots, Note [Load in one read]).
// Every figure is seconds per GiB of the checkpoint's bytes.
void fio_best(FioFigures& best, const fs::path& dir, std::uint64_t bytes, std::uint64_t nvme_bytes,
              std::uint64_t slot_bytes, std::string& note, bool& ok) {
  const std::string file = fmt::format("--filename=fio.dat --size={} --bs=1M --ioengine=psync", bytes);
  const std::string nvme =
      fmt::format("--filename=fio-nvme.dat --size={} --bs={} --ioengine=io_uring --iodepth=16 --direct=1",
                  nvme_bytes, slot_bytes);
  const double gib = static_cast<double>(bytes) / static_cast<double>(strata::kGiB);
  auto run = [&](double& figure, const std::vector<FioJob>& jobs) {
    if (!ok) return;
    const auto s = fio_seconds(dir, jobs, note);
    ok = s.has_value();
    if (ok) figure = std::min(figure, *s / gib);
  };
  const FioJob read{"read", file + " --rw=read --invalidate=1"};
  run(best.write, {{"write", file + " --rw=write --end_fsync=1", true}});
  run(best.read, {read});
  std::error_code ec;
  fs::remove(dir / "fio.dat", ec);
  ::sync();  // the removal done before the timed write, as a save's older files are
  std::vector<FioJob> save{{"write", file + " --rw=write --fallocate=none --end_fsync=1", true}};
  std::vector<FioJob> load{read};
  if (nvme_bytes > 0) {  // no NVMe-held states: the save only writes, the load only reads
    save.push_back({"nvme", nvme + " --rw=read"});
    load.push_back({"nvme", nvme + " --rw=write"});
  }
  run(best.save_io, save);
  run(best.load_io, load);
}

//! This process's bytes read from and written to the disk so far (/proc/self/io); 0, 0 where unreadable.
std::pair<std::uint64_t, std::uint64_t> disk_io() {
  std::ifstream in("/proc/self/io");
  std::string key;
  std::uint64_t value = 0, read = 0, written = 0;
  while (in >> key >> value) {
    if (key == "read_bytes:") read = value;
    if (key == "write_bytes:") written = value;
  }
  return {read, written};
}

//! Saves and loads a --bench-mib model with states on host and NVMe; fills fig's figures.
void bench(const Settings& s, const fs::path& root, Figures& fig) {
  const fs::path dir = root / "bench", ckpt = dir / "ckpt", nvme = dir / "nvme", out = dir / "figures.json";
  fs::create_directories(ckpt);
  fs::create_directories(nvme);
  const int rc = run_child([&] {
    // fp32 AdamW: param + 2 states = 12 bytes per element in the checkpoint.
    const std::uint64_t elems = s.bench_mib * strata::kMiB / 12;
    // Tensors of 512 KiB, packed into chunks as a user's default layout packs them
    // (--bench-chunk-elems 131072: a family each, 1.5 MiB files).
    const std::uint64_t per = 131072, tensors = std::max<std::uint64_t>(4, elems / per);
    RuntimeOptions o;
    o.hyper.optimizer = strata::kernels::Optimizer::kAdamW;
    o.layout.chunk_elems = s.bench_chunk_elems;
    o.threads = 2;
    const std::uint64_t state_bytes = tensors * per * 4 * 4;
    // As the trainer's: GPU 1/4 and host 2/3 of the model state, optimizer states on host and NVMe.
    o.budgets = {.gpu_bytes = state_bytes / 4, .host_bytes = state_bytes * 2 / 3, .nvme_bytes = state_bytes};
    o.plan.nvme_families_in_flight = 1;
    o.plan.grad_staging_slots = 1;
    o.nvme_dirs = {nvme.string()};
    strata::memory::DeviceOptions d;
    d.kind = strata::memory::DeviceChoice::kSim;
    d.budget_bytes = state_bytes / 2;
    auto device = strata::memory::make_device(d);
    if (!device.ok()) child_fail(60, device.status(), "device");
    auto rt = Runtime::create(**device, o);
    if (!rt.ok()) child_fail(61, rt.status(), "runtime");
    Runtime& r = **rt;
    std::vector<float> init(per);
    for (std::uint64_t i = 0; i < per; ++i) init[i] = 0.001f * static_cast<float>(i % 1000);
    for (std::uint64_t t = 0; t < tensors; ++t) {
      auto id = r.register_tensor({fmt::format("t{}", t), {static_cast<std::int64_t>(per)}});
      if (!id.ok()) child_fail(62, id.status(), "register");
    }
    for (TensorId t = 0; t < tensors; ++t) {
      if (Status st = r.init_tensor(t, init); !st.ok()) child_fail(63, st, "init");
    }
    // One step so that the states exist on their tiers.
    for (TensorId t = 0; t < tensors; ++t) {
      auto g = r.acquire(t, StateKind::kGrad, Access::kWrite);
      if (!g.ok()) child_fail(64, g.status(), "grad");
      float* p = g->as<float>();
      if (Status st = r.launch([p, per] { std::fill_n(p, per, 0.5f); }); !st.ok())
        child_fail(64, st, "launch");
    }
    auto stats = r.step();
    if (!stats.ok()) child_fail(65, stats.status(), "step");
    // The states the save reads from NVMe and the load writes there (Note [Checkpoint I/O baselines]).
    const std::uint64_t nvme_bytes = stats->nvme_bytes;
    if (Status st = r.flush(); !st.ok()) child_fail(65, st, "flush");
    // Best of 3 of each (the machine may be shared), interleaved with fio's passes on
    // as many bytes in the same directory.
    double save_s = 1e30, load_s = 1e30;
    std::uint64_t bytes = 0, save_read = 0, save_written = 0, load_read = 0, load_written = 0;
    std::string note;
    bool fio_ok = true;
    FioFigures fio;
    for (int rep = 0; rep < 3; ++rep) {
      const auto io0 = disk_io();
      const auto t0 = Clock::now();
      if (Status st = r.save_checkpoint(ckpt.string()); !st.ok()) child_fail(66, st, "save");
      save_s = std::min(save_s, std::chrono::duration<double>(Clock::now() - t0).count());
      const auto io1 = disk_io();
      // The save returned once published; the last one's files are removed in the
      // background (Note [Stale checkpoint files]): not timed, and not counted below.
      if (Status st = r.flush(); !st.ok()) child_fail(66, st, "flush after save");
      bytes = 0;
      for (const auto& e : fs::directory_iterator(ckpt)) {
        bytes += fs::file_size(e.path());
        const int fd = ::open(e.path().c_str(), O_RDONLY);
        if (fd >= 0) {
          ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);  // clean after the save's fsync: dropped
          ::close(fd);
        }
      }
      const auto io2 = disk_io();
      const auto t1 = Clock::now();
      if (Status st = r.load_checkpoint(ckpt.string()); !st.ok()) child_fail(67, st, "load");
      load_s = std::min(load_s, std::chrono::duration<double>(Clock::now() - t1).count());
      const auto io3 = disk_io();
      save_read = io1.first - io0.first;
      save_written = io1.second - io0.second;
      load_read = io3.first - io2.first;
      load_written = io3.second - io2.second;
      // The swap store's pieces: a slot each, as the planner sizes them (fp32 states).
      fio_best(fio, dir, bytes, nvme_bytes, strata::runtime::nvme_slot_bytes(r.layout().chunk_elems * 4),
               note, fio_ok);
    }
    const double gib = static_cast<double>(bytes) / static_cast<double>(strata::kGiB);
    nlohmann::json j = {{"bytes", bytes},
                        {"files", std::distance(fs::directory_iterator(ckpt), fs::directory_iterator())},
                        {"chunk_elems", r.layout().chunk_elems},
                        {"nvme_bytes", nvme_bytes},
                        {"save", save_s / gib},
                        {"load", load_s / gib},
                        {"save_disk_read", save_read},
                        {"save_disk_written", save_written},
                        {"load_disk_read", load_read},
                        {"load_disk_written", load_written},
                        {"fio_note", note}};
    if (fio_ok) {
      j["fio"] = {
          {"write", fio.write}, {"read", fio.read}, {"save_io", fio.save_io}, {"load_io", fio.load_io}};
    }
    rt->reset();
    write_file(out, j.dump());
    ::_exit(0);
  });
  if (rc != 0) {
    std::fprintf(stderr, "strata-crash: the save/load benchmark failed (%d)\n", rc);
    ++fig.failures;
    return;
  }
  fig.bench = nlohmann::json::parse(read_file(out));
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{
      "strata-crash: SIGKILL a checkpointing trainer at random moments; every resume must be bit-exact"};
  app.add_option("--runs", s.runs, "runs (one SIGKILL each)")->check(CLI::Range(1, 100000));
  app.add_option("--steps", s.steps, "steps per run")->check(CLI::Range(2, 100000));
  app.add_option("--every", s.every, "checkpoint every N steps")->check(CLI::Range(1, 100000));
  app.add_option("--layers", s.layers, "MLP layers (one chunk family each)")->check(CLI::Range(1, 64));
  app.add_option("--width", s.width, "MLP width")->check(CLI::Range(8, 4096));
  app.add_option("--seed", s.seed, "random seed (0: from the clock)");
  app.add_option("--bench-mib", s.bench_mib, "checkpoint size of the save/load benchmark (0: skip)");
  app.add_option("--bench-chunk-elems", s.bench_chunk_elems,
                 "the benchmark's chunk size in elements, a multiple of 4096 (0: the runtime's search, as a "
                 "user's default)")
      ->check(CLI::Range(std::uint64_t{0}, std::uint64_t{1} << 31));
  app.add_option("--work-dir", s.work_dir, "scratch directory (default: a new one under the temp dir)");
  app.add_flag("--json", s.json, "print the figures as JSON");
  CLI11_PARSE(app, argc, argv);
  if (s.every > s.steps) {
    std::fprintf(stderr, "strata-crash: --every %d must not exceed --steps %d\n", s.every, s.steps);
    return 2;
  }
  if (s.seed == 0) s.seed = static_cast<std::uint64_t>(Clock::now().time_since_epoch().count());
  ::setenv("STRATA_LOG_LEVEL", "error", 0);

  fs::path root;
  bool own_root = s.work_dir.empty();
  if (own_root) {
    std::string templ = (fs::temp_directory_path() / "strata-crash-XXXXXX").string();
    if (::mkdtemp(templ.data()) == nullptr) {
      std::perror("strata-crash: mkdtemp");
      return 2;
    }
    root = templ;
  } else {
    root = s.work_dir;
    fs::create_directories(root);
  }
  void* mem = ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    std::perror("strata-crash: mmap");
    return 2;
  }
  Shared* sh = new (mem) Shared;
  std::mt19937_64 rng(s.seed);
  const auto start = Clock::now();
  Figures fig;

  // The uninterrupted run.
  const fs::path ref_dir = root / "reference";
  fs::create_directories(ref_dir / "ckpt");
  fs::create_directories(ref_dir / "nvme");
  const int rc =
      run_child([&] { trainer_child(s, ref_dir / "ckpt", ref_dir / "nvme", ref_dir / "final.bin", sh); });
  if (rc != 0) {
    std::fprintf(stderr, "strata-crash: the uninterrupted run failed (%d)\n", rc);
    return 1;
  }
  const std::string reference = read_file(ref_dir / "final.bin");
  fs::remove_all(ref_dir);

  for (int run = 0; run < s.runs; ++run) one_run(s, run, root, reference, sh, rng, fig);
  if (s.bench_mib > 0) bench(s, root, fig);
  if (own_root) fs::remove_all(root);

  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  nlohmann::json j = {{"runs", fig.runs},
                      {"kills", fig.kills},
                      {"kills_in_step", fig.kills_in[kStep]},
                      {"kills_in_write_back", fig.kills_in[kWriteBack]},
                      {"kills_in_save", fig.kills_in[kSave]},
                      {"kills_after_finish", fig.kills_in[kIdle]},
                      {"exact_resumes", fig.exact_resumes},
                      {"corruptions_injected", fig.corruptions_injected},
                      {"corruptions_detected", fig.corruptions_detected},
                      {"lost_checkpoints", fig.lost_checkpoints},
                      {"disk_full_saves", fig.disk_full_saves},
                      {"disk_full_saves_refused", fig.disk_full_refused},
                      {"failures", fig.failures},
                      {"files_left_by_kills", fig.files_left_by_kills},
                      {"seed", s.seed},
                      {"seconds", seconds}};
  if (s.bench_mib > 0 && fig.bench.is_object()) {
    const nlohmann::json& b = fig.bench;
    const double save = b["save"].get<double>(), load = b["load"].get<double>();
    j["checkpoint_bytes"] = b["bytes"];
    j["checkpoint_files"] = b["files"];
    j["chunk_elems"] = b["chunk_elems"];
    j["nvme_state_bytes"] = b["nvme_bytes"];
    j["save_seconds_per_gib"] = save;
    j["load_seconds_per_gib"] = load;
    j["save_disk_read_bytes"] = b["save_disk_read"];
    j["save_disk_written_bytes"] = b["save_disk_written"];
    j["load_disk_read_bytes"] = b["load_disk_read"];
    j["load_disk_written_bytes"] = b["load_disk_written"];
    if (b.contains("fio")) {  // Note [Checkpoint I/O baselines]
      const nlohmann::json& f = b["fio"];
      j["fio_write_seconds_per_gib"] = f["write"];
      j["fio_read_seconds_per_gib"] = f["read"];
      j["fio_save_io_seconds_per_gib"] = f["save_io"];
      j["fio_load_io_seconds_per_gib"] = f["load_io"];
      j["save_vs_fio"] = save / f["write"].get<double>();
      j["load_vs_fio"] = load / f["read"].get<double>();
      j["save_vs_fio_same_io"] = save / f["save_io"].get<double>();
      j["load_vs_fio_same_io"] = load / f["load_io"].get<double>();
    } else {
      j["fio_note"] = b["fio_note"];
    }
  }
  if (s.json) {
    std::printf("%s\n", j.dump(1).c_str());
  } else {
    for (const auto& [k, v] : j.items()) std::printf("%-28s %s\n", k.c_str(), v.dump().c_str());
  }
  const bool ok = fig.failures == 0 && fig.runs == s.runs && fig.exact_resumes == fig.runs &&
                  fig.corruptions_detected == fig.corruptions_injected && fig.lost_checkpoints == 0 &&
                  fig.disk_full_refused == fig.disk_full_saves && fig.files_left_by_kills == 0;
  return ok ? 0 : 1;
}
