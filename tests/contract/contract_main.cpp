// strata-contract: the randomized contract test of issue #24 (item 3). A plan
// strata accepts is a promise kept: each run draws a random model and
// configuration from its seed and must either be refused at creation with a
// message, or train K steps without an error, hang or crash, within every tier's
// budget and its plan, bit-identical to the all-resident run of the same model
// (Note [Contract run] in contract_train.cpp).
//
//   strata-contract --runs 200 --seed 1 --json
//   strata-contract --runs 200 --seed random --json         (a fresh campaign seed, printed first)
//   strata-contract --seeds 123,456 --json --describe      (replay runs, print what they drew)
//   strata-contract --regressions tests/contract/regression_seeds.txt --runs 200
//
// Note [Contract harness]
// The parent never creates a runtime: it stays single-threaded, so fork is safe.
// Every run is a forked child that reports its phase and then its result as lines
// on a pipe, so a crash (a signal, no result) and a hang (no result within
// --timeout-s) are caught and named with the last phase the child entered; a hung
// child gets a gdb backtrace (the child allows the parent's gdb to attach with
// PR_SET_PTRACER) before it is killed. Each run's NVMe directory is its own, under
// a temporary directory the parent creates (after checking free space) and
// removes, whatever happened to the child. Under ThreadSanitizer run it with
// --no-fork: a forked child's first allocation from the pinned pool (jemalloc)
// trips TSan's double-lock check on jemalloc's tsd lock, held across fork, and
// exits 66 in every run that allocates (seen in the sixteenth session; in one
// process, 277 runs gave no report).

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "contract_draw.hpp"
#include "contract_train.hpp"
#include "strata/common/bytes.hpp"
#include "strata/offload/io_engine.hpp"

namespace fs = std::filesystem;
using namespace strata;
using namespace strata::contract;

namespace {

struct Options {
  std::uint64_t runs = 20;
  std::uint64_t seed = 1;
  std::string seed_text = "1";  // --seed as given: a number, or "random"
  bool fresh_seed = false;      // drawn from std::random_device
  std::string seeds;
  std::string regressions;
  int steps = 4;
  bool json = false;
  bool describe = false;
  bool verbose = false;
  bool backtrace = true;
  bool no_fork = false;
  bool draw_only = false;
  double timeout_s = 60.0;
  int jobs = 1;
  std::string tmp;
  std::string artifacts;
  std::string inject = "none";
  std::uint64_t min_states_on_nvme = 0;
};

//! One run to make: its seed and whether it came from the regression file.
struct Job {
  std::uint64_t seed = 0;
  std::string note;  // the regression file's line, or ""
};

struct Child {
  pid_t pid = -1;
  int fd = -1;
  Job job;
  fs::path dir;
  std::string buffer, phase, result;
  std::chrono::steady_clock::time_point deadline;
};

volatile std::sig_atomic_t g_stop = 0;

bool uring_works() {
  // In a child: the engine's threads must never exist in the parent that forks.
  const pid_t pid = ::fork();
  if (pid == 0) {
    auto e = offload::make_io_engine({.kind = offload::EngineKind::kUring});
    if (e.ok()) (*e)->shutdown(offload::ShutdownMode::kDrain);
    ::_exit(e.ok() ? 0 : 1);
  }
  int ws = 0;
  if (pid < 0 || ::waitpid(pid, &ws, 0) != pid) return false;
  return WIFEXITED(ws) && WEXITSTATUS(ws) == 0;
}

Inject parse_inject(const std::string& s) {
  if (s == "inexact") return Inject::kInexact;
  if (s == "hang") return Inject::kHang;
  if (s == "crash") return Inject::kCrash;
  if (s == "above-plan") return Inject::kAbovePlan;
  if (s == "overrun") return Inject::kOverrun;
  return Inject::kNone;
}

void write_all(int fd, const std::string& s) {
  std::size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n <= 0) return;
    off += static_cast<std::size_t>(n);
  }
}

[[noreturn]] void child_main(const Options& o, const Job& job, const fs::path& dir, int fd, bool uring) {
  ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);  // a hang's backtrace (Note [Contract harness])
  const Draw d = draw_run(job.seed, uring, o.steps);
  const PhaseFn phase = [fd](const std::string& p) { write_all(fd, "P " + p + "\n"); };
  const RunReport r = execute_run(d, dir.string(), phase, parse_inject(o.inject));
  nlohmann::json j = to_json(r);
  if (o.describe) j["draw"] = to_json(d);
  write_all(fd, "R " + j.dump() + "\n");
  ::_exit(0);
}

//! The gdb backtrace of every thread of `pid`, and a one-line summary of it.
std::pair<std::string, std::string> backtrace_of(pid_t pid) {
  const std::string cmd = fmt::format("timeout 60 gdb -p {} -batch -nx -ex 'thread apply all bt' 2>&1", pid);
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[4096];
    std::size_t n = 0;
    while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    ::pclose(p);
  }
  // Summary: per thread, the innermost strata frame that waits or locks (else the
  // first thread's innermost strata frame).
  std::string summary, first;
  std::istringstream in(out);
  std::string line, thread;
  bool taken = false;
  while (std::getline(in, line)) {
    if (line.rfind("Thread ", 0) == 0) {
      thread = line.substr(0, line.find(' ', 7));
      taken = false;
      continue;
    }
    const auto at = line.find("strata::");
    if (taken || at == std::string::npos || line[0] != '#') continue;
    if (first.empty()) first = thread + " in " + line.substr(at, line.find('(', at) - at);
    if (line.find("wait") == std::string::npos && line.find("lock") == std::string::npos &&
        line.find("step") == std::string::npos)
      continue;
    std::string fn = line.substr(at, line.find('(', at) - at);
    summary += fmt::format("{}{} in {}", summary.empty() ? "" : "; ", thread, fn);
    taken = true;
  }
  if (summary.empty()) summary = first;
  return {out, summary.empty() ? "no strata frame found (gdb could not attach?)" : summary};
}

//! The command that replays one run, printed beside every failure.
std::string replay_command(std::uint64_t seed, int steps) {
  return fmt::format("strata-contract --seeds {}{} --describe", seed,
                     steps == 4 ? std::string() : fmt::format(" --steps {}", steps));
}

class Campaign {
 public:
  Campaign(const Options& o, fs::path base, bool uring) : o_(o), base_(std::move(base)), uring_(uring) {}

  void run(const std::vector<Job>& jobs) {
    if (o_.no_fork) {  // for a debugger: no watchdog, a crash ends the campaign
      for (const Job& job : jobs) {
        const fs::path dir = base_ / fmt::format("run-{}", job.seed);
        fs::create_directories(dir);
        const Draw d = draw_run(job.seed, uring_, o_.steps);
        const PhaseFn phase = [this](const std::string& p) {
          if (o_.verbose) std::fprintf(stderr, "phase: %s\n", p.c_str());
        };
        nlohmann::json j = to_json(execute_run(d, dir.string(), phase, parse_inject(o_.inject)));
        if (o_.describe) j["draw"] = to_json(d);
        record(job, j);
        fs::remove_all(dir);
      }
      return;
    }
    std::size_t next = 0;
    while ((next < jobs.size() || !children_.empty()) && g_stop == 0) {
      while (next < jobs.size() && children_.size() < static_cast<std::size_t>(o_.jobs)) start(jobs[next++]);
      wait_some();
    }
    for (Child& c : children_) {  // interrupted
      ::kill(c.pid, SIGKILL);
      ::waitpid(c.pid, nullptr, 0);
      ::close(c.fd);
      fs::remove_all(c.dir);
    }
  }

  nlohmann::json summary(double seconds) const;
  int failures() const { return static_cast<int>(failures_.size()); }

 private:
  void start(const Job& job);
  void wait_some();
  void finish(Child& c, bool hung);
  void record(const Job& job, const nlohmann::json& r);
  void fail(const Job& job, const std::string& kind, const std::string& reason, const std::string& phase);

  const Options& o_;
  fs::path base_;
  bool uring_;
  std::vector<Child> children_;
  std::map<std::string, std::uint64_t> counts_;
  std::map<std::string, std::uint64_t> refused_by_;
  nlohmann::json failures_ = nlohmann::json::array();
  nlohmann::json results_ = nlohmann::json::array();
};

void Campaign::start(const Job& job) {
  Child c;
  c.job = job;
  c.dir = base_ / fmt::format("run-{}", job.seed);
  std::error_code ec;
  fs::remove_all(c.dir, ec);
  fs::create_directories(c.dir);
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    std::perror("strata-contract: pipe");
    std::exit(2);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  c.pid = ::fork();
  if (c.pid < 0) {
    std::perror("strata-contract: fork");
    std::exit(2);
  }
  if (c.pid == 0) {
    ::close(fds[0]);
    child_main(o_, job, c.dir, fds[1], uring_);
  }
  ::close(fds[1]);
  c.fd = fds[0];
  c.deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<long>(o_.timeout_s * 1000));
  children_.push_back(std::move(c));
}

void Campaign::wait_some() {
  std::vector<pollfd> pfds;
  for (const Child& c : children_) pfds.push_back({.fd = c.fd, .events = POLLIN, .revents = 0});
  ::poll(pfds.data(), pfds.size(), 100);
  const auto now = std::chrono::steady_clock::now();
  for (std::size_t i = children_.size(); i-- > 0;) {
    Child& c = children_[i];
    bool eof = false;
    if (pfds[i].revents != 0) {
      char buf[65536];
      const ssize_t n = ::read(c.fd, buf, sizeof buf);
      if (n <= 0)
        eof = true;
      else
        c.buffer.append(buf, static_cast<std::size_t>(n));
      for (std::size_t nl; (nl = c.buffer.find('\n')) != std::string::npos; c.buffer.erase(0, nl + 1)) {
        const std::string line = c.buffer.substr(0, nl);
        if (line.rfind("P ", 0) == 0) c.phase = line.substr(2);
        if (line.rfind("R ", 0) == 0) c.result = line.substr(2);
      }
    }
    if (eof || now > c.deadline) {
      finish(c, !eof);
      children_.erase(children_.begin() + static_cast<long>(i));
    }
  }
}

//! Whether a run that hung or crashed in `phase` had been accepted (Note [Contract run]).
bool past_creation(const std::string& phase) {
  for (const char* p : {"sizing", ": create", ": register", ": init_tensor"})
    if (phase.find(p) != std::string::npos) return false;
  return !phase.empty();
}

void Campaign::finish(Child& c, bool hung) {
  int ws = 0;
  if ((hung || c.result.empty()) && past_creation(c.phase)) ++counts_["accepted"];
  if (hung) {
    std::string reason = fmt::format("no result within {} s; last phase: {}", o_.timeout_s, c.phase);
    if (o_.backtrace) {
      auto [full, brief] = backtrace_of(c.pid);
      reason += "; " + brief;
      if (!o_.artifacts.empty()) {
        const fs::path file = fs::path(o_.artifacts) / fmt::format("hang-{}.txt", c.job.seed);
        std::ofstream(file) << "phase: " << c.phase << "\n" << full;
        reason += "; backtrace in " + file.string();
      }
    }
    ::kill(c.pid, SIGKILL);
    ::waitpid(c.pid, &ws, 0);
    fail(c.job, "hangs", reason, c.phase);
    results_.push_back({{"seed", c.job.seed}, {"outcome", "hang"}, {"reason", reason}});
  } else {
    ::waitpid(c.pid, &ws, 0);
    if (!c.result.empty()) {
      record(c.job, nlohmann::json::parse(c.result, nullptr, false));
    } else {
      const std::string how =
          WIFSIGNALED(ws) ? fmt::format("killed by signal {} ({})", WTERMSIG(ws), ::strsignal(WTERMSIG(ws)))
                          : fmt::format("exited with status {} without a result", WEXITSTATUS(ws));
      fail(c.job, "failed_after_accept", "crash: " + how + " in phase " + c.phase, c.phase);
      results_.push_back({{"seed", c.job.seed}, {"outcome", "crash"}, {"reason", how}, {"phase", c.phase}});
    }
  }
  ::close(c.fd);
  std::error_code ec;
  fs::remove_all(c.dir, ec);
}

std::string refusal_class(const std::string& reason) {
  if (reason.find("came") != std::string::npos || reason.find("CAME") != std::string::npos) return "came";
  for (const char* b : {"gpu", "host", "nvme"}) {  // the budget the message says to raise
    if (reason.find(fmt::format("raise {}_budget", b)) != std::string::npos ||
        reason.find(fmt::format("raise budgets.{}", b)) != std::string::npos)
      return fmt::format("{}_budget", b);
  }
  for (const char* b : {"gpu", "host", "nvme"}) {  // else the first budget it names
    if (reason.find(fmt::format("{}_budget", b)) != std::string::npos ||
        reason.find(fmt::format("budgets.{}", b)) != std::string::npos)
      return fmt::format("{}_budget", b);
  }
  return "other";
}

void Campaign::record(const Job& job, const nlohmann::json& r) {
  if (r.is_discarded()) {
    fail(job, "failed_after_accept", "the child's result line is not JSON", "");
    return;
  }
  if (o_.verbose || o_.describe) std::fprintf(stderr, "%s\n", r.dump().c_str());
  results_.push_back(r);
  const std::string outcome = r.value("outcome", "");
  const std::string reason = r.value("reason", "");
  const std::string phase = r.value("phase", "");
  if (outcome == "refused") {
    ++counts_["refused"];
    ++refused_by_[refusal_class(reason)];
  } else if (outcome == "bad_refusal") {
    fail(job, "bad_refusals", reason, phase);
  } else if (outcome == "failed") {
    ++counts_["accepted"];
    fail(job, "failed_after_accept", reason, phase);
  } else {
    ++counts_["accepted"];
    // Trained and compared with the reference: the runs whose every check had a chance to fail.
    if (!r.value("budget_overrun", false) && !r.value("above_plan", false) && !r.value("inexact", false)) {
      ++counts_["passed"];
      // Passed with gradients kept back (late ones, Note [Gradients in pieces]): the order was tested.
      const nlohmann::json run = r.contains("details") ? r["details"].value("run", nlohmann::json::object())
                                                       : nlohmann::json::object();
      if (run.value("kept_gradients", std::uint64_t{0}) > 0) ++counts_["passed_keeping_gradients"];
      if (run.value("late", false)) ++counts_["passed_late"];
      // Passed with unused tensors declared at backward's end (Runtime::no_gradient).
      if (run.value("declared_no_gradient", std::uint64_t{0}) > 0) ++counts_["passed_declaring_unused"];
      // Passed with updates run in the next forward (Note [Deferred updates]).
      if (run.value("updates_deferred", std::uint64_t{0}) > 0) ++counts_["passed_deferring_updates"];
      // Passed with optimizer states (or params) homed on NVMe (Note [Widened for NVMe]).
      if (run.value("nvme_state_families", std::uint64_t{0}) > 0) ++counts_["passed_states_on_nvme"];
      if (run.value("nvme_param_families", std::uint64_t{0}) > 0) ++counts_["passed_params_on_nvme"];
    }
    if (r.value("budget_overrun", false)) fail(job, "budget_overruns", r.value("overrun_reason", ""), "");
    if (r.value("above_plan", false)) fail(job, "above_plan", r.value("above_plan_reason", ""), "");
    if (r.value("inexact", false)) fail(job, "inexact", r.value("inexact_reason", ""), "");
  }
}

void Campaign::fail(const Job& job, const std::string& kind, const std::string& reason,
                    const std::string& phase) {
  ++counts_[kind];
  nlohmann::json f = {
      {"seed", job.seed}, {"kind", kind}, {"reason", reason}, {"replay", replay_command(job.seed, o_.steps)}};
  if (!phase.empty()) f["phase"] = phase;
  if (!job.note.empty()) f["regression"] = job.note;
  failures_.push_back(std::move(f));
}

nlohmann::json Campaign::summary(double seconds) const {
  const auto count = [&](const char* k) {
    auto it = counts_.find(k);
    return it == counts_.end() ? std::uint64_t{0} : it->second;
  };
  const std::uint64_t runs = results_.size();
  nlohmann::json seeds = nlohmann::json::object();
  for (const auto& f : failures_) seeds[f["kind"].get<std::string>()].push_back(f["seed"]);
  nlohmann::json j = {{"runs", runs},
                      {"accepted", count("accepted")},
                      {"refused", count("refused")},
                      {"refused_by", refused_by_},
                      {"passed", count("passed")},
                      {"passed_late", count("passed_late")},
                      {"passed_keeping_gradients", count("passed_keeping_gradients")},
                      {"passed_declaring_unused", count("passed_declaring_unused")},
                      {"passed_deferring_updates", count("passed_deferring_updates")},
                      {"passed_states_on_nvme", count("passed_states_on_nvme")},
                      {"passed_params_on_nvme", count("passed_params_on_nvme")},
                      {"failed_after_accept", count("failed_after_accept")},
                      {"hangs", count("hangs")},
                      {"budget_overruns", count("budget_overruns")},
                      {"above_plan", count("above_plan")},
                      {"inexact", count("inexact")},
                      {"bad_refusals", count("bad_refusals")},
                      {"seconds", seconds},
                      {"seconds_per_run", runs == 0 ? 0.0 : seconds / static_cast<double>(runs)},
                      {"steps", o_.steps},
                      {"seed", o_.seed},
                      {"seed_fresh", o_.fresh_seed},
                      {"io_uring", uring_},
                      {"failure_seeds", seeds},
                      {"failures", failures_}};
  if (o_.describe) j["results"] = results_;
  return j;
}

Result<std::vector<Job>> regression_jobs(const std::string& path) {
  std::vector<Job> jobs;
  if (path.empty()) return jobs;
  std::ifstream in(path);
  if (!in) return not_found("--regressions {}: cannot open the file", path);
  std::string line;
  while (std::getline(in, line)) {
    const auto start = line.find_first_not_of(" \t");
    if (start == std::string::npos || line[start] == '#') continue;
    std::istringstream ls(line.substr(start));
    Job j;
    if (!(ls >> j.seed)) return invalid_argument("--regressions {}: not a seed: \"{}\"", path, line);
    std::getline(ls, j.note);
    j.note = j.note.substr(std::min(j.note.size(), j.note.find_first_not_of(" \t#")));
    jobs.push_back(std::move(j));
  }
  return jobs;
}

Result<std::vector<Job>> make_jobs(const Options& o) {
  STRATA_ASSIGN_OR_RETURN(std::vector<Job> jobs, regression_jobs(o.regressions));
  if (!o.seeds.empty()) {
    std::istringstream in(o.seeds);
    std::string item;
    while (std::getline(in, item, ',')) {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(item.c_str(), &end, 10);
      if (item.empty() || *end != '\0') return invalid_argument("--seeds: \"{}\" is not a seed", item);
      jobs.push_back({.seed = v});
    }
    return jobs;
  }
  for (std::uint64_t i = 0; i < o.runs; ++i) jobs.push_back({.seed = run_seed(o.seed, i)});
  return jobs;
}

//! The parent's temporary directory for the runs' NVMe files, after a free-space check.
Result<fs::path> make_base(const Options& o) {
  const fs::path tmp = o.tmp.empty() ? fs::temp_directory_path() : fs::path(o.tmp);
  struct statvfs sv {};
  if (::statvfs(tmp.c_str(), &sv) != 0) return not_found("--tmp {}: cannot stat it", tmp.string());
  const std::uint64_t free_bytes = std::uint64_t{sv.f_bavail} * sv.f_frsize;
  const std::uint64_t need = 256 * kMiB * static_cast<std::uint64_t>(o.jobs);
  if (free_bytes < need) {
    return no_space("--tmp {}: {} free, the runs' NVMe files need up to {}; free some space or choose --tmp",
                    tmp.string(), format_bytes(free_bytes), format_bytes(need));
  }
  fs::path base = tmp / fmt::format("strata-contract-{}", ::getpid());
  std::error_code ec;
  fs::create_directories(base, ec);
  if (ec)
    return permission_denied("--tmp {}: cannot create {}: {}", tmp.string(), base.string(), ec.message());
  return base;
}

void print_text(const nlohmann::json& s, bool campaign) {
  const std::string of = campaign ? fmt::format("campaign seed {}: ", s["seed"].get<std::uint64_t>()) : "";
  std::printf(
      "strata-contract: %s%llu runs in %.1f s: %llu accepted (%llu passed every check), %llu refused\n",
      of.c_str(), s["runs"].get<unsigned long long>(), s["seconds"].get<double>(),
      s["accepted"].get<unsigned long long>(), s["passed"].get<unsigned long long>(),
      s["refused"].get<unsigned long long>());
  std::printf(
      "  passed with optimizer states on NVMe %llu, with params on NVMe %llu, deferring updates %llu\n",
      s["passed_states_on_nvme"].get<unsigned long long>(),
      s["passed_params_on_nvme"].get<unsigned long long>(),
      s["passed_deferring_updates"].get<unsigned long long>());
  std::printf(
      "  failed_after_accept %llu, hangs %llu, budget_overruns %llu, above_plan %llu, inexact %llu, "
      "bad_refusals %llu\n",
      s["failed_after_accept"].get<unsigned long long>(), s["hangs"].get<unsigned long long>(),
      s["budget_overruns"].get<unsigned long long>(), s["above_plan"].get<unsigned long long>(),
      s["inexact"].get<unsigned long long>(), s["bad_refusals"].get<unsigned long long>());
  for (const auto& f : s["failures"]) {
    std::printf("  seed %llu: %s: %s%s; replay: %s\n", f["seed"].get<unsigned long long>(),
                f["kind"].get<std::string>().c_str(), f["reason"].get<std::string>().c_str(),
                f.contains("phase") ? (" (" + f["phase"].get<std::string>() + ")").c_str() : "",
                f["replay"].get<std::string>().c_str());
  }
}

//! Resolves --seed: a number, or "random" (drawn from std::random_device: a campaign
//! nobody chose, issue #47), and prints it first, so that any failure can be replayed.
Status resolve_campaign_seed(Options& o) {
  if (o.seed_text == "random") {
    std::random_device rd;
    o.seed = (std::uint64_t{rd()} << 32) | std::uint64_t{rd()};
    o.fresh_seed = true;
  } else {
    char* end = nullptr;
    errno = 0;
    o.seed = std::strtoull(o.seed_text.c_str(), &end, 10);
    if (o.seed_text.empty() || *end != '\0' || errno != 0 || o.seed_text[0] == '-')
      return invalid_argument("--seed: \"{}\" is neither a seed (0 to 2^64-1) nor random", o.seed_text);
  }
  if (o.seeds.empty() && o.runs > 0) {
    std::fprintf(stderr, "strata-contract: campaign seed %llu (%s); run it again with --seed %llu\n",
                 static_cast<unsigned long long>(o.seed),
                 o.fresh_seed ? "fresh, from std::random_device" : "given",
                 static_cast<unsigned long long>(o.seed));
  }
  return Status::Ok();
}

//! One line per failure on stderr, whatever the output format: its run seed, what
//! failed and the command that replays it (with --json the summary has them too).
void print_failures(const nlohmann::json& s, bool campaign) {
  const std::string of = campaign ? fmt::format(", campaign seed {}", s["seed"].get<std::uint64_t>()) : "";
  for (const auto& f : s["failures"]) {
    std::fprintf(stderr, "strata-contract: FAILED run seed %llu (%s%s): replay with %s\n",
                 f["seed"].get<unsigned long long>(), f["kind"].get<std::string>().c_str(), of.c_str(),
                 f["replay"].get<std::string>().c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "strata-contract: random models and budgets; every accepted plan must train exactly (issue #24)"};
  app.add_option("--runs", o.runs, "random runs (after the regression seeds)")->check(CLI::Range(0, 1000000));
  app.add_option("--seed", o.seed_text,
                 "campaign seed: run i draws from a seed derived from it; \"random\" draws a fresh one "
                 "(printed first)");
  app.add_option("--seeds", o.seeds, "replay these run seeds (comma-separated) instead of --runs");
  app.add_option("--regressions", o.regressions,
                 "file of run seeds replayed first (seed, then what it found)");
  app.add_option("--steps", o.steps, "training steps per run")->check(CLI::Range(1, 100));
  app.add_flag("--json", o.json, "print the summary as JSON");
  app.add_flag("--describe", o.describe, "print each run's draw and result (stderr, and in the JSON)");
  app.add_flag("--verbose", o.verbose, "print each run's result line on stderr, and the runtime's log");
  app.add_flag("!--no-backtrace", o.backtrace, "no gdb backtrace of a hung run");
  app.add_flag("--no-fork", o.no_fork, "run in this process (for a debugger; no hang or crash detection)");
  app.add_flag("--draw-only", o.draw_only, "print what each run draws (model and config) and run nothing");
  app.add_option("--timeout-s", o.timeout_s, "a run without a result after this long is a hang")
      ->check(CLI::Range(1.0, 3600.0));
  app.add_option("--jobs", o.jobs, "runs at once")->check(CLI::Range(1, 64));
  app.add_option("--tmp", o.tmp, "directory for the runs' NVMe files (default: the temp directory)");
  app.add_option("--artifacts", o.artifacts, "directory for hung runs' full backtraces");
  app.add_option("--inject", o.inject, "make every run fail on purpose, to test the checks")
      ->check(CLI::IsMember({"none", "inexact", "hang", "crash", "above-plan", "overrun"}));
  app.add_option("--min-states-on-nvme", o.min_states_on_nvme,
                 "fail unless at least this many runs passed with optimizer states on NVMe (the "
                 "campaign's reach: Note [Widened for NVMe])");
  CLI11_PARSE(app, argc, argv);
  if (!o.verbose) ::setenv("STRATA_LOG_LEVEL", "critical", 0);  // errors are in the results
  if (Status st = resolve_campaign_seed(o); !st.ok()) {
    std::fprintf(stderr, "strata-contract: %s\n", st.to_string().c_str());
    return 2;
  }
  auto jobs = make_jobs(o);
  if (!jobs.ok()) {
    std::fprintf(stderr, "strata-contract: %s\n", jobs.status().to_string().c_str());
    return 2;
  }
  if (o.draw_only) {  // (engines as drawn where io_uring works)
    for (const Job& job : *jobs)
      std::printf("%s\n", to_json(draw_run(job.seed, true, o.steps)).dump().c_str());
    return 0;
  }
  auto base = make_base(o);
  if (!base.ok()) {
    std::fprintf(stderr, "strata-contract: %s\n", base.status().to_string().c_str());
    return 2;
  }
  std::signal(SIGINT, [](int) { g_stop = 1; });
  std::signal(SIGTERM, [](int) { g_stop = 1; });
  std::signal(SIGHUP, [](int) { g_stop = 1; });
  std::signal(SIGPIPE, SIG_IGN);  // a closed stdout (| head) must not kill the parent before it cleans up
  const auto t0 = std::chrono::steady_clock::now();
  Campaign campaign(o, *base, uring_works());
  campaign.run(*jobs);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::error_code ec;
  fs::remove_all(*base, ec);
  const nlohmann::json s = campaign.summary(seconds);
  if (o.json) {
    std::printf("%s\n", s.dump(2).c_str());
  } else {
    print_text(s, o.seeds.empty());
  }
  print_failures(s, o.seeds.empty());
  if (g_stop != 0) return 130;
  const auto on_nvme = s["passed_states_on_nvme"].get<std::uint64_t>();
  if (on_nvme < o.min_states_on_nvme) {
    std::fprintf(stderr,
                 "strata-contract: %llu passed runs trained with optimizer states on NVMe, fewer than "
                 "--min-states-on-nvme %llu: the campaign no longer reaches the NVMe paths; widen the "
                 "draws (Note [Widened for NVMe] in contract_draw.cpp)\n",
                 static_cast<unsigned long long>(on_nvme),
                 static_cast<unsigned long long>(o.min_states_on_nvme));
    return 1;
  }
  return campaign.failures() > 0 ? 1 : 0;
}
