// Runtime::save_checkpoint / load_checkpoint: bit-exact resume from every tier,
// loading into another chunk size and placement, and each bad input refused whole
// with an error naming the file (Note [Checkpoint format], Note [Checkpoint publish]).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "mlp.hpp"
#include "offload/test_util.hpp"
#include "strata/checkpoint/test_hooks.hpp"
#include "strata/common/bytes.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/runtime.hpp"
#include "strata/runtime/stores.hpp"

namespace strata::runtime {
namespace {

namespace fs = std::filesystem;
using testing::Mlp;

constexpr std::size_t kLayers = 6;
constexpr std::size_t kWidth = 128;
constexpr std::uint64_t kChunkElems = 20480;  // one family per layer (W + b = 16512)
constexpr std::uint64_t kModelStateBytes = kLayers * 4 * kChunkElems * 4;

//! Where a runtime keeps its states.
enum class Placement { kResident, kNvme, kBigChunks };

RuntimeOptions options(Placement placement, const fs::path& nvme_dir) {
  RuntimeOptions o;
  o.hyper.optimizer = kernels::Optimizer::kAdamW;
  o.hyper.lr = 1e-2f;
  o.hyper.weight_decay = 0.01f;
  o.layout.chunk_elems = kChunkElems;
  o.threads = 2;
  o.budgets = {.gpu_bytes = 64 * kMiB, .host_bytes = 64 * kMiB};
  if (placement == Placement::kNvme) {
    // GPU <= 1/4 and host <= 1/2 of the model state: every tier holds states.
    o.budgets = {
        .gpu_bytes = kModelStateBytes / 4, .host_bytes = kModelStateBytes / 2, .nvme_bytes = 64 * kMiB};
    // Note [Host room]: host copies of one gradient per GPU slot, one NVMe chunk's copy (two states).
    o.budgets.host_bytes += o.budgets.gpu_bytes + 8 * kChunkElems;
    o.nvme_dirs = {nvme_dir.string()};
    o.plan.nvme_families_in_flight = 1;
    o.plan.grad_staging_slots = 1;
  }
  if (placement == Placement::kBigChunks) o.layout.chunk_elems = 3 * kChunkElems;  // two layers a family
  return o;
}

//! Every tensor's param, master, states and step counter.
struct State {
  std::vector<std::vector<float>> values;
  std::vector<std::int64_t> steps;
  bool operator==(const State&) const = default;
};

State read_state(Runtime& rt) {
  State s;
  for (TensorId t = 0; t < rt.tensor_count(); ++t) {
    for (StateKind k : {StateKind::kParam, StateKind::kMaster, StateKind::kState0, StateKind::kState1}) {
      std::vector<float> v(rt.layout().slots[t].numel);
      EXPECT_TRUE(rt.read_tensor(t, k, v).ok());
      s.values.push_back(std::move(v));
    }
    s.steps.push_back(*rt.tensor_steps(t));
  }
  return s;
}

//! An MLP on its own sim device and AdamW runtime.
struct Trainer {
  Mlp mlp;  // outlives the device: queued kernels use it
  std::unique_ptr<memory::Device> device;
  std::unique_ptr<Runtime> rt;
  Trainer(Placement placement, const fs::path& nvme_dir, std::size_t width = kWidth,
          std::size_t layers = kLayers, std::shared_ptr<NvmeStore> store = nullptr) {
    memory::DeviceOptions d;
    d.kind = memory::DeviceChoice::kSim;
    d.budget_bytes = 256 * kMiB;
    device = std::move(memory::make_device(d)).value();
    RuntimeOptions o = options(placement, nvme_dir);
    if (store != nullptr) o.nvme_store = std::move(store);
    auto made = Runtime::create(*device, o);
    EXPECT_TRUE(made.ok()) << made.status();
    rt = std::move(made).value();
    mlp.layers = layers;
    mlp.width = width;
    EXPECT_TRUE(mlp.build(*rt).ok());
  }
  ~Trainer() { rt.reset(); }
  void train(int steps) {
    for (int s = 0; s < steps; ++s) {
      ASSERT_TRUE(mlp.train_step(*rt).ok());
      auto st = rt->step();
      ASSERT_TRUE(st.ok()) << st.status();
    }
  }
};

//! A fresh directory under the temp dir, removed with everything in it.
class TempDir {
 public:
  explicit TempDir(const char* prefix) {
    std::string templ = (fs::temp_directory_path() / (std::string(prefix) + "-XXXXXX")).string();
    EXPECT_NE(::mkdtemp(templ.data()), nullptr);
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

struct Dirs {
  TempDir nvme_a{"strata-ckpt-nvme-a"};
  TempDir nvme_b{"strata-ckpt-nvme-b"};
  TempDir ckpt{"strata-ckpt"};
};

TEST(Checkpoint, ResumesBitExactInEveryPlacementPair) {
  const std::pair<Placement, Placement> pairs[] = {{Placement::kResident, Placement::kResident},
                                                   {Placement::kNvme, Placement::kNvme},
                                                   {Placement::kNvme, Placement::kBigChunks},
                                                   {Placement::kBigChunks, Placement::kNvme}};
  for (auto [from, to] : pairs) {
    SCOPED_TRACE(
        fmt::format("saved in placement {}, loaded in {}", static_cast<int>(from), static_cast<int>(to)));
    Dirs dirs;
    Trainer a(from, dirs.nvme_a.path());
    a.train(2);
    ASSERT_TRUE(a.rt->save_checkpoint(dirs.ckpt.path().string()).ok());
    const State at2 = read_state(*a.rt);
    a.train(3);
    const State straight = read_state(*a.rt);

    Trainer b(to, dirs.nvme_b.path());
    const State fresh = read_state(*b.rt);
    ASSERT_NE(fresh, at2);
    Status loaded = b.rt->load_checkpoint(dirs.ckpt.path().string());
    ASSERT_TRUE(loaded.ok()) << loaded;
    EXPECT_TRUE(read_state(*b.rt) == at2) << "the loaded state differs from the saved one";
    b.train(3);
    EXPECT_TRUE(read_state(*b.rt) == straight) << "a resumed run differs from the straight run";
    EXPECT_EQ(*b.rt->tensor_steps(0), 5);
  }
}

//! Every file of a checkpoint directory, by name (the manifest without its generation).
std::map<std::string, std::string> checkpoint_bytes(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::ifstream in(e.path(), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (e.path().filename() == "manifest.json") {
      nlohmann::json m = nlohmann::json::parse(bytes);
      m.erase("generation");
      bytes = m.dump();
    }
    std::string name = e.path().filename().string();
    const auto g = name.find(".g");
    if (g != std::string::npos) name = name.substr(0, g);  // family-<f>
    out[name] = std::move(bytes);
  }
  return out;
}

// Note [Overlapped save]: a save begun before step k, with training going on while
// it runs, writes exactly what a blocking save at the same point writes, and the
// training it overlaps is unchanged by it.
TEST(Checkpoint, AnOverlappedSaveEqualsABlockingSaveAtTheSamePoint) {
  for (Placement placement : {Placement::kResident, Placement::kNvme, Placement::kBigChunks}) {
    SCOPED_TRACE(fmt::format("placement {}", static_cast<int>(placement)));
    Dirs dirs;
    TempDir blocking_dir("strata-ckpt-blocking");
    Trainer a(placement, dirs.nvme_a.path());
    Trainer b(placement, dirs.nvme_b.path());
    a.train(2);
    b.train(2);
    ASSERT_TRUE(b.rt->save_checkpoint(blocking_dir.path().string()).ok());
    Status begun = a.rt->begin_checkpoint(dirs.ckpt.path().string());
    ASSERT_TRUE(begun.ok()) << begun;
    a.train(3);  // steps 3-5 run while the save is in flight (their updates wait for its captures)
    Status finished = a.rt->finish_checkpoint();
    ASSERT_TRUE(finished.ok()) << finished;
    auto in_flight = a.rt->checkpoint_in_flight();
    ASSERT_TRUE(in_flight.ok() && !*in_flight);
    b.train(3);
    EXPECT_TRUE(read_state(*a.rt) == read_state(*b.rt)) << "the overlapped save changed the training";
    const auto overlapped = checkpoint_bytes(dirs.ckpt.path());
    const auto blocking = checkpoint_bytes(blocking_dir.path());
    ASSERT_EQ(overlapped.size(), a.rt->layout().families.size() + 1);
    EXPECT_TRUE(overlapped == blocking) << "the overlapped checkpoint differs from a blocking save's";
    // And it loads into the state at step 2.
    TempDir nvme_c("strata-ckpt-nvme-c"), nvme_d("strata-ckpt-nvme-d");
    Trainer c(Placement::kResident, nvme_c.path());
    ASSERT_TRUE(c.rt->load_checkpoint(dirs.ckpt.path().string()).ok());
    Trainer d(placement, nvme_d.path());
    ASSERT_TRUE(d.rt->load_checkpoint(blocking_dir.path().string()).ok());
    EXPECT_TRUE(read_state(*c.rt) == read_state(*d.rt));
  }
}

//! An NVMe store whose writes, while its gate is closed, wait on threads of their own
//! until it opens or kGateMax passes (a family keeps its NVMe place until its
//! write-back ends, so a step whose writes all waited for the gate would never end).
class GatedWritesNvme final : public NvmeStore {
 public:
  explicit GatedWritesNvme(std::unique_ptr<NvmeStore> inner) : inner_(std::move(inner)) {}
  ~GatedWritesNvme() override {
    open();
    for (std::thread& t : threads_) t.join();
  }
  void close() {
    std::lock_guard lock(mu_);
    closed_ = true;
  }
  void open() {
    {
      std::lock_guard lock(mu_);
      closed_ = false;
    }
    cv_.notify_all();
  }
  //! Writes waiting at the gate.
  int held() {
    std::lock_guard lock(mu_);
    return held_;
  }
  std::uint64_t slot_bytes() const override { return inner_->slot_bytes(); }
  Result<std::uint32_t> allocate_slot() override { return inner_->allocate_slot(); }
  void free_slot(std::uint32_t s) override { inner_->free_slot(s); }
  Status write(std::uint32_t s, std::span<const std::byte> d, IoDone done) override {
    std::lock_guard lock(mu_);
    if (!closed_) return inner_->write(s, d, std::move(done));
    ++held_;
    threads_.emplace_back([this, s, d, done = std::move(done)]() mutable {
      {
        std::unique_lock gate(mu_);
        cv_.wait_for(gate, kGateMax, [&] { return !closed_; });
        --held_;
      }
      Status st = inner_->write(s, d, done);
      if (!st.ok()) done(st);
    });
    return Status::Ok();
  }
  Status read(std::uint32_t s, std::span<std::byte> d, IoDone done) override {
    return inner_->read(s, d, std::move(done));
  }
  std::uint64_t used_bytes() const override { return inner_->used_bytes(); }
  std::string describe() const override { return "gated-writes(" + inner_->describe() + ")"; }

 private:
  static constexpr std::chrono::milliseconds kGateMax{600};
  std::unique_ptr<NvmeStore> inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool closed_ = false;
  int held_ = 0;
  std::vector<std::thread> threads_;
};

// #13: begin_checkpoint does not wait for the last step's NVMe write-backs; a family
// still writing back is captured once its write-back ends (its old slots hold the
// states before the step), so the files are still a blocking save's at that point.
TEST(Checkpoint, AnOverlappedSaveBegunWhileWriteBacksRunHoldsTheStateAfterTheStep) {
  Dirs dirs;
  TempDir blocking_dir("strata-ckpt-blocking");
  auto store = make_nvme_store(
      {.dirs = {dirs.nvme_a.path().string()}, .slot_bytes = kChunkElems * 4, .capacity_bytes = 64 * kMiB});
  ASSERT_TRUE(store.ok()) << store.status();
  auto gated = std::make_shared<GatedWritesNvme>(std::move(store).value());
  Trainer a(Placement::kNvme, dirs.nvme_a.path(), kWidth, kLayers, gated);
  Trainer b(Placement::kNvme, dirs.nvme_b.path());
  a.train(1);
  gated->close();  // step 2's write-backs wait at the gate (each up to kGateMax)
  a.train(1);
  b.train(2);
  if (gated->held() == 0) GTEST_SKIP() << "this machine ran step 2 slower than the gate holds a write";
  const auto t0 = std::chrono::steady_clock::now();
  Status st = a.rt->begin_checkpoint(dirs.ckpt.path().string());
  const double begin_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(begin_s, 0.3) << "begin_checkpoint waited for the write-backs";
  // The save thread gets to the families still writing back before they end.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  gated->open();
  ASSERT_TRUE(st.ok()) << st;
  a.train(2);
  ASSERT_TRUE(a.rt->finish_checkpoint().ok());
  ASSERT_TRUE(b.rt->save_checkpoint(blocking_dir.path().string()).ok());
  b.train(2);
  EXPECT_TRUE(read_state(*a.rt) == read_state(*b.rt)) << "the overlapped save changed the training";
  EXPECT_TRUE(checkpoint_bytes(dirs.ckpt.path()) == checkpoint_bytes(blocking_dir.path()))
      << "the overlapped checkpoint is not the state after step 2";
}

TEST(Checkpoint, AnOverlappedSaveFailsInFinishAndKeepsThePreviousCheckpoint) {
  Dirs dirs;
  Trainer a(Placement::kNvme, dirs.nvme_a.path());
  a.train(1);
  ASSERT_TRUE(a.rt->save_checkpoint(dirs.ckpt.path().string()).ok());
  const auto first = checkpoint_bytes(dirs.ckpt.path());
  // A second begin while one is in flight waits for the first; a failing save (its
  // directory is replaced by a file under it) reports in finish, nothing else changes.
  a.train(1);
  const fs::path gone = dirs.ckpt.path() / "sub";
  ASSERT_TRUE(a.rt->begin_checkpoint(gone.string()).ok());
  fs::remove_all(gone);
  std::ofstream(gone) << "not a directory";
  a.train(1);
  Status st = a.rt->finish_checkpoint();
  // The save may have finished before the directory went away; then it succeeded.
  if (!st.ok()) {
    EXPECT_NE(st.message().find(gone.string()), std::string::npos) << st;
  }
  EXPECT_TRUE(a.rt->finish_checkpoint().ok()) << "finish collects the outcome once";
  fs::remove(gone);
  EXPECT_TRUE(checkpoint_bytes(dirs.ckpt.path()) == first);
  a.train(1);  // training goes on after a failed save
}

// Note [Save read-ahead]: the save reads NVMe-held states ahead of its writer. When
// those reads fail (EIO), the save fails naming the swap file, waits for the reads
// still in flight before their buffers go (ASan would see a write into freed
// memory), keeps the previous checkpoint, and training and the next save go on.
TEST(Checkpoint, ASaveWhoseNvmeReadsFailKeepsThePreviousCheckpoint) {
  Dirs dirs;
  std::atomic<bool> eio_reads{false};
  std::atomic<int> injected{0};
  NvmeStoreOptions so{
      .dirs = {dirs.nvme_a.path().string()}, .slot_bytes = kChunkElems * 4, .capacity_bytes = 64 * kMiB};
  so.io_result_filter = [&](bool write, std::uint64_t, std::int64_t result) -> std::int64_t {
    if (write || result <= 0 || !eio_reads) return result;
    ++injected;
    return -EIO;
  };
  auto store = make_nvme_store(so);
  ASSERT_TRUE(store.ok()) << store.status();
  std::shared_ptr<NvmeStore> shared = std::move(store).value();
  Trainer a(Placement::kNvme, dirs.nvme_a.path(), kWidth, kLayers, shared);
  a.train(1);
  ASSERT_TRUE(a.rt->save_checkpoint(dirs.ckpt.path().string()).ok());
  ASSERT_TRUE(a.rt->flush().ok());
  const auto first = checkpoint_bytes(dirs.ckpt.path());
  a.train(1);
  ASSERT_TRUE(a.rt->flush().ok());  // the step's write-backs are done: only the save reads now
  eio_reads = true;
  const Status failed = a.rt->save_checkpoint(dirs.ckpt.path().string());
  eio_reads = false;
  ASSERT_FALSE(failed.ok()) << "the injected EIO went unnoticed";
  EXPECT_GT(injected.load(), 0);
  EXPECT_EQ(failed.code(), StatusCode::kIoError) << failed;
  EXPECT_NE(failed.message().find(dirs.nvme_a.path().string()), std::string::npos) << failed;
  ASSERT_TRUE(a.rt->flush().ok());
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dirs.ckpt.path()))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names.size(), a.rt->layout().families.size() + 1) << ::testing::PrintToString(names);
  EXPECT_TRUE(checkpoint_bytes(dirs.ckpt.path()) == first) << ::testing::PrintToString(names);
  a.train(1);
  ASSERT_TRUE(a.rt->save_checkpoint(dirs.ckpt.path().string()).ok());
  const State at3 = read_state(*a.rt);
  Trainer b(Placement::kResident, dirs.nvme_b.path());
  ASSERT_TRUE(b.rt->load_checkpoint(dirs.ckpt.path().string()).ok());
  EXPECT_TRUE(read_state(*b.rt) == at3);
}

TEST(Checkpoint, SecondSaveReplacesTheFirstAndLeavesNoStaleFiles) {
  Dirs dirs;
  Trainer a(Placement::kNvme, dirs.nvme_a.path());
  a.train(1);
  ASSERT_TRUE(a.rt->save_checkpoint(dirs.ckpt.path().string()).ok());
  a.train(1);
  ASSERT_TRUE(a.rt->save_checkpoint(dirs.ckpt.path().string()).ok());
  const State at2 = read_state(*a.rt);
  // The first save's files go in the background (Note [Stale checkpoint files]); flush waits.
  ASSERT_TRUE(a.rt->flush().ok());
  std::size_t files = 0;
  for (const auto& e : fs::directory_iterator(dirs.ckpt.path())) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name == "manifest.json" || name.find(".g2.bin") != std::string::npos) << name;
    ++files;
  }
  EXPECT_EQ(files, a.rt->layout().families.size() + 1);
  Trainer b(Placement::kResident, dirs.nvme_b.path());
  ASSERT_TRUE(b.rt->load_checkpoint(dirs.ckpt.path().string()).ok());
  EXPECT_TRUE(read_state(*b.rt) == at2);
}

TEST(Checkpoint, RestoresParameterGroupsAndTheirHyperparameters) {
  // Biases in group 1 with lr 0: after a load into a runtime that set no groups, they still do not move.
  Dirs dirs;
  Trainer a(Placement::kResident, dirs.nvme_a.path());
  for (TensorId b : a.mlp.b) ASSERT_TRUE(a.rt->set_tensor_group(b, 1).ok());
  ASSERT_TRUE(a.rt->set_group_hyper(1, 0.0f, 0.0f).ok());
  a.train(1);
  ASSERT_TRUE(a.rt->save_checkpoint(dirs.ckpt.path().string()).ok());
  Trainer b(Placement::kNvme, dirs.nvme_b.path());
  ASSERT_TRUE(b.rt->load_checkpoint(dirs.ckpt.path().string()).ok());
  std::vector<float> before(kWidth), after(kWidth), weight_before(kWidth * kWidth),
      weight_after(kWidth * kWidth);
  ASSERT_TRUE(b.rt->read_tensor(b.mlp.b[0], StateKind::kParam, before).ok());
  ASSERT_TRUE(b.rt->read_tensor(b.mlp.w[0], StateKind::kParam, weight_before).ok());
  b.train(2);
  ASSERT_TRUE(b.rt->read_tensor(b.mlp.b[0], StateKind::kParam, after).ok());
  ASSERT_TRUE(b.rt->read_tensor(b.mlp.w[0], StateKind::kParam, weight_after).ok());
  EXPECT_EQ(before, after) << "group 1's lr 0 was not restored";
  EXPECT_NE(weight_before, weight_after) << "group 0 trains";
}

//! Saves a 2-step checkpoint, damages it with `damage`, and checks that a fresh
//! runtime refuses it with `code`, a message containing `needle`, and no state changed.
void expect_refused(const std::function<void(const fs::path& dir)>& damage, StatusCode code,
                    const std::string& needle, std::size_t width = kWidth, std::size_t layers = kLayers) {
  Dirs dirs;
  {
    Trainer a(Placement::kNvme, dirs.nvme_a.path());
    a.train(2);
    ASSERT_TRUE(a.rt->save_checkpoint(dirs.ckpt.path().string()).ok());
  }
  damage(dirs.ckpt.path());
  Trainer b(Placement::kNvme, dirs.nvme_b.path(), width, layers);
  const State before = read_state(*b.rt);
  Status st = b.rt->load_checkpoint(dirs.ckpt.path().string());
  EXPECT_EQ(st.code(), code) << st;
  EXPECT_NE(st.message().find(needle), std::string::npos) << st;
  EXPECT_TRUE(read_state(*b.rt) == before) << "a refused checkpoint changed the state";
}

fs::path family_file(const fs::path& dir, int family) {
  return dir / fmt::format("family-{}.g1.bin", family);
}

TEST(Checkpoint, RefusesAFlippedByte) {
  expect_refused([](const fs::path& dir) { offload::testing::flip_byte(family_file(dir, 3), 70000); },
                 StatusCode::kCorrupt, "family-3.g1.bin bytes [0, ");
}

TEST(Checkpoint, RefusesATruncatedFile) {
  expect_refused([](const fs::path& dir) { fs::resize_file(family_file(dir, 5), 4096); },
                 StatusCode::kCorrupt, "family-5.g1.bin is 4096 bytes");
}

TEST(Checkpoint, RefusesAMissingManifest) {
  expect_refused([](const fs::path& dir) { fs::remove(dir / "manifest.json"); }, StatusCode::kNotFound,
                 "manifest.json does not exist");
}

TEST(Checkpoint, RefusesAFileWrittenBetweenItsCheckAndItsLoad) {
  // The apply pass reads the descriptors the CRC32C pass verified, and refuses one
  // whose file was written in between (size or mtime moved), before applying anything.
  struct Reset {
    ~Reset() { checkpoint::test_hooks::after_verify = nullptr; }
  } reset;
  checkpoint::test_hooks::after_verify = [](const std::string& dir) {
    std::fstream f(family_file(dir, 2), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.write("x", 1);
    f.close();
    // A coarse clock may give the write the check's mtime: make it differ.
    const struct timespec times[2] = {{0, UTIME_OMIT}, {1, 0}};
    ::utimensat(AT_FDCWD, family_file(dir, 2).c_str(), times, 0);
  };
  expect_refused([](const fs::path&) {}, StatusCode::kCorrupt,
                 "family-2.g1.bin was written while it was being loaded");
}

//! Writes a byte into `file` and moves its mtime (a coarse clock may give the write the
//! check's mtime).
void write_into(const fs::path& file) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(100);
  f.write("x", 1);
  f.close();
  const struct timespec times[2] = {{0, UTIME_OMIT}, {1, 0}};
  ::utimensat(AT_FDCWD, file.c_str(), times, 0);
}

// #13: a load writes NVMe-homed states to fresh slots while it checks the files
// (Note [Load in one read]); a refused load must leave trained NVMe states, and the
// slots they live in, as they were.
TEST(Checkpoint, ARefusedLoadLeavesTrainedNvmeStatesAsTheyWere) {
  Dirs dirs;
  {
    Trainer a(Placement::kNvme, dirs.nvme_a.path());
    a.train(2);
    ASSERT_TRUE(a.rt->save_checkpoint(dirs.ckpt.path().string()).ok());
  }
  {  // the last family's file: the shadows of the others are written before it fails
    std::fstream f(family_file(dirs.ckpt.path(), kLayers - 1),
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(70000);
    f.write("\x5a\xa5", 2);
  }
  Trainer b(Placement::kNvme, dirs.nvme_b.path());
  TempDir nvme_c("strata-ckpt-nvme-c");
  Trainer c(Placement::kNvme, nvme_c.path());
  b.train(1);
  c.train(1);
  bool nvme_states = false;
  for (const auto& fam : b.rt->plan().families) nvme_states = nvme_states || fam.optim_home == Tier::kNvme;
  ASSERT_TRUE(nvme_states) << "the placement must keep optimizer states on NVMe";
  const State before = read_state(*b.rt);
  Status st = b.rt->load_checkpoint(dirs.ckpt.path().string());
  EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st;
  EXPECT_TRUE(read_state(*b.rt) == before) << "a refused load changed the state";
  // Training goes on exactly as in a runtime that never tried the load.
  b.train(2);
  c.train(2);
  EXPECT_TRUE(read_state(*b.rt) == read_state(*c.rt));
}

// #13: a file written after the host-held values were applied is refused, and the
// NVMe-held states and step counters are not loaded (Note [Load in one read]).
TEST(Checkpoint, AFileWrittenWhileHostValuesAreAppliedIsRefusedAndNvmeStatesStay) {
  struct Reset {
    ~Reset() { checkpoint::test_hooks::after_host_apply = nullptr; }
  } reset;
  checkpoint::test_hooks::after_host_apply = [](const std::string& dir) { write_into(family_file(dir, 2)); };
  Dirs dirs;
  {
    Trainer a(Placement::kNvme, dirs.nvme_a.path());
    a.train(2);
    ASSERT_TRUE(a.rt->save_checkpoint(dirs.ckpt.path().string()).ok());
  }
  Trainer b(Placement::kNvme, dirs.nvme_b.path());
  b.train(1);
  const State before = read_state(*b.rt);
  Status st = b.rt->load_checkpoint(dirs.ckpt.path().string());
  EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st;
  EXPECT_NE(st.message().find("family-2.g1.bin was written while it was being loaded"), std::string::npos)
      << st;
  EXPECT_NE(st.message().find("partly loaded"), std::string::npos) << st;
  const State after = read_state(*b.rt);
  std::size_t nvme_values = 0;
  for (TensorId t = 0; t < b.rt->tensor_count(); ++t) {
    EXPECT_EQ(after.steps[t], before.steps[t]) << "tensor " << t;
    if (b.rt->plan().families[b.rt->layout().slots[t].family].optim_home != Tier::kNvme) continue;
    for (std::size_t k : {2, 3}) {  // state0, state1 in read_state's order
      EXPECT_TRUE(after.values[4 * t + k] == before.values[4 * t + k])
          << "tensor " << t << " state " << k - 2;
      ++nvme_values;
    }
  }
  EXPECT_GT(nvme_values, 0u);
}

TEST(Checkpoint, RefusesANewerFormatVersion) {
  expect_refused(
      [](const fs::path& dir) {
        std::ifstream in(dir / "manifest.json");
        nlohmann::json m = nlohmann::json::parse(in);
        m["version"] = 99;
        std::ofstream(dir / "manifest.json") << m.dump();
      },
      StatusCode::kFailedPrecondition, "format version 99, newer than this build reads (1)");
}

//! Rewrites every state's "dtype" in the manifest with `spell(old)`.
void respell_dtypes(const fs::path& dir, const std::function<std::string(const std::string&)>& spell) {
  std::ifstream in(dir / "manifest.json");
  nlohmann::json m = nlohmann::json::parse(in);
  int respelled = 0;
  for (auto& t : m["tensors"]) {
    for (auto& [kind, st] : t["states"].items()) {
      st["dtype"] = spell(st["dtype"].get<std::string>());
      ++respelled;
    }
  }
  EXPECT_GT(respelled, 0);
  std::ofstream(dir / "manifest.json") << m.dump();
}

// Note [DType names]: a manifest names dtypes "fp32"; one that spells them as the
// kernels did before issue #26 ("f32") or as torch does ("float32") loads the same.
TEST(Checkpoint, LoadsEveryDTypeSpellingOfTheManifest) {
  for (const std::string spelling : {"fp32", "f32", "float32"}) {
    SCOPED_TRACE(spelling);
    Dirs dirs;
    Trainer a(Placement::kNvme, dirs.nvme_a.path());
    a.train(2);
    ASSERT_TRUE(a.rt->save_checkpoint(dirs.ckpt.path().string()).ok());
    const State saved = read_state(*a.rt);
    respell_dtypes(dirs.ckpt.path(), [&](const std::string& old) {
      EXPECT_EQ(old, "fp32") << "the manifest's spelling changed: checkpoints written before read it";
      return spelling;
    });
    Trainer b(Placement::kNvme, dirs.nvme_b.path());
    Status loaded = b.rt->load_checkpoint(dirs.ckpt.path().string());
    ASSERT_TRUE(loaded.ok()) << loaded;
    EXPECT_TRUE(read_state(*b.rt) == saved);
  }
}

TEST(Checkpoint, RefusesAnUnknownDTypeNamingTheTensor) {
  expect_refused([](const fs::path& dir) { respell_dtypes(dir, [](const std::string&) { return "fp8"; }); },
                 StatusCode::kCorrupt,
                 "dtype \"fp8\" is not known; use fp32, bf16, fp16 (or q8 for optimizer states)");
}

TEST(Checkpoint, RefusesAnotherModel) {
  expect_refused([](const fs::path&) {}, StatusCode::kFailedPrecondition,
                 "tensor \"l0.w\" has shape [128, 128]",
                 /*width=*/64);
  expect_refused([](const fs::path&) {}, StatusCode::kFailedPrecondition, "it is another model's checkpoint",
                 kWidth, /*layers=*/5);
}

TEST(Checkpoint, RefusesADirectoryInsideTheSwapDirectory) {
  Dirs dirs;
  Trainer a(Placement::kNvme, dirs.nvme_a.path());
  a.train(1);
  const std::string inside = (dirs.nvme_a.path() / "ckpt").string();
  Status st = a.rt->save_checkpoint(inside);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("inside the NVMe swap directory"), std::string::npos) << st;
  EXPECT_FALSE(fs::exists(inside));
  EXPECT_EQ(a.rt->load_checkpoint(dirs.nvme_a.path().string()).code(), StatusCode::kInvalidArgument);
}

// The unprivileged half of the read-only directory test, run in a fresh process
// (posix_spawn of this binary) with STRATA_CKPT_RO_CHILD="<checkpoint dir>:<nvme dir>":
// as uid 65534 (nobody) a save into root's directory fails naming the file.
TEST(Checkpoint, ReadOnlyDirectoryChild) {
  const char* arg = std::getenv("STRATA_CKPT_RO_CHILD");
  if (arg == nullptr)
    GTEST_SKIP() << "the child of ReadOnlyDirectoryFailsNamingTheFileAndKeepsThePreviousCheckpoint";
  const std::string dirs = arg;
  const fs::path ckpt = dirs.substr(0, dirs.find(':')), nvme = dirs.substr(dirs.find(':') + 1);
  ASSERT_EQ(::setgid(65534), 0);
  ASSERT_EQ(::setuid(65534), 0);
  Trainer b(Placement::kResident, nvme);
  Status st = b.rt->save_checkpoint(ckpt.string());
  EXPECT_EQ(st.code(), StatusCode::kPermissionDenied) << st;
  EXPECT_NE(st.message().find((ckpt / "family-0.g2.bin.tmp").string()), std::string::npos) << st;
}

TEST(Checkpoint, ReadOnlyDirectoryFailsNamingTheFileAndKeepsThePreviousCheckpoint) {
  // As root every directory is writable: the save runs in a child as uid 65534 (nobody).
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to drop to uid 65534";
  Dirs dirs;
  {
    Trainer a(Placement::kResident, dirs.nvme_a.path());
    a.train(1);
    ASSERT_TRUE(a.rt->save_checkpoint(dirs.ckpt.path().string()).ok());
  }
  ::chmod(dirs.ckpt.path().c_str(), 0755);  // root's; nobody cannot write it
  ::chmod(dirs.nvme_b.path().c_str(), 0777);
  // posix_spawn of a fresh process, not fork(): fork runs jemalloc's prefork handler,
  // which locks every arena the earlier runtimes made, more mutexes than
  // ThreadSanitizer's deadlock detector holds at once.
  const std::string env_arg =
      "STRATA_CKPT_RO_CHILD=" + dirs.ckpt.path().string() + ":" + dirs.nvme_b.path().string();
  std::string exe = fs::read_symlink("/proc/self/exe").string();
  std::string filter = "--gtest_filter=Checkpoint.ReadOnlyDirectoryChild";
  char* argv[] = {exe.data(), filter.data(), nullptr};
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
  envp.push_back(const_cast<char*>(env_arg.c_str()));
  envp.push_back(nullptr);
  pid_t pid = 0;
  ASSERT_EQ(::posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data()), 0);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFEXITED(wstatus));
  EXPECT_EQ(WEXITSTATUS(wstatus), 0)
      << "the unprivileged save did not fail as expected (its output is above)";
  Trainer c(Placement::kResident, dirs.nvme_b.path());
  EXPECT_TRUE(c.rt->load_checkpoint(dirs.ckpt.path().string()).ok());
}

}  // namespace
}  // namespace strata::runtime
