// strata-selfcheck: a self-check of the device backend and the two memory pools, until the
// runtime and the example trainer land. It creates the device through the factory (auto:
// cuda when usable, else sim, with the reason), finds the topology, reserves the pinned
// host pool and the device pool, copies chunks host -> device -> host through them with
// the sim link throttle, verifies every byte, and prints what ran, budgets, high-water
// marks and the measured copy rates against the configured ones. Exit code 0 when every
// check passed, 1 when one failed, 2 on a setup error (the message says what to change).

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/common/thread_pool.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/memory/device_pool.hpp"
#include "strata/memory/pinned_host_pool.hpp"
#include "strata/memory/topology.hpp"

namespace {

using namespace strata;
using namespace strata::memory;
using Clock = std::chrono::steady_clock;

struct Settings {
  std::string device = "auto";
  std::string device_budget = "512MiB";
  std::string h2d = "2GiB";  // per second; what a 2-core sandbox's memcpy can honour
  std::string d2h = "1.5GiB";
  std::string pinned_budget = "256MiB";
  std::string arena = "64MiB";
  std::string slot = "64MiB";
  int copies = 3;
};

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("  [%s] %s\n", ok ? "ok" : "FAIL", what.c_str());
  if (!ok) ++failures;
}

std::string stats_text(const PoolStats& s) {
  return fmt::format("budget {}, in use {}, high-water {}", format_bytes(s.budget_bytes),
                     format_bytes(s.used_bytes), format_bytes(s.high_water_bytes));
}

int setup_error(const Status& status) {
  std::fprintf(stderr, "strata-selfcheck: %s\n", status.to_string().c_str());
  return 2;
}

// Copies `copies` chunks one way through the device; returns seconds, or -1 on error.
double timed_copies(Device& device, const Stream& stream, void* dst, const void* src, std::size_t bytes,
                    int copies, CopyKind kind) {
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < copies; ++i) {
    Status s = device.copy_async(stream, dst, src, bytes, kind);
    if (!s.ok()) {
      std::fprintf(stderr, "strata-selfcheck: %s\n", s.to_string().c_str());
      return -1.0;
    }
  }
  if (!device.synchronize(stream).ok()) return -1.0;
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void report_rate(const Device& device, CopyKind kind, std::uint64_t configured_bytes_per_s, double seconds,
                 std::size_t bytes) {
  const double measured = static_cast<double>(bytes) / seconds / static_cast<double>(kGiB);
  const CopyStats stats = device.copy_stats(kind);
  if (configured_bytes_per_s == 0 || device.kind() != DeviceKind::kSim) {
    std::printf("  %s: measured %.2f GiB/s (wall), %.2f GiB/s (device counters), unthrottled\n",
                std::string(copy_kind_name(kind)).c_str(), measured, stats.gib_per_s());
    return;
  }
  const double configured = static_cast<double>(configured_bytes_per_s) / static_cast<double>(kGiB);
  std::printf(
      "  %s: measured %.2f GiB/s (wall), %.2f GiB/s (device counters), configured %.2f GiB/s, ratio %.3f\n",
      std::string(copy_kind_name(kind)).c_str(), measured, stats.gib_per_s(), configured,
      measured / configured);
  check(measured / configured > 0.9 && measured / configured < 1.1,
        fmt::format("{} throttle within 10% of the configured rate", copy_kind_name(kind)));
}

//! The copy checks: a chunk host -> device -> host byte-exact, the pools' bounds and
//! the throttled copy rates; setup_error's code when a slot or stream cannot be had, else 0.
int check_copies(Device& dev, PinnedHostPool& host, DevicePool& device_pool,
                 const DeviceOptions& device_options, const Settings& settings, std::size_t chunk) {
  auto out = host.acquire_slot();
  auto in = host.acquire_slot();
  auto on_device = device_pool.acquire_slot();
  auto stream = dev.create_stream();
  if (!out.ok()) return setup_error(out.status());
  if (!in.ok()) return setup_error(in.status());
  if (!on_device.ok()) return setup_error(on_device.status());
  if (!stream.ok()) return setup_error(stream.status());
  for (std::size_t i = 0; i < chunk; ++i) out->data()[i] = static_cast<std::byte>((i * 131 + 7) & 0xff);
  std::memset(in->data(), 0, chunk);
  std::memset(on_device->data(), 0,
              dev.kind() == DeviceKind::kSim ? chunk : 0);  // fault sim pages in first

  const double h2d_s = timed_copies(dev, *stream, on_device->data(), out->data(), chunk, settings.copies,
                                    CopyKind::kHostToDevice);
  const double d2h_s = timed_copies(dev, *stream, in->data(), on_device->data(), chunk, settings.copies,
                                    CopyKind::kDeviceToHost);
  check(h2d_s > 0 && d2h_s > 0, "copies completed");
  check(std::memcmp(in->data(), out->data(), chunk) == 0,
        fmt::format("{} chunk byte-exact after host -> device -> host", format_bytes(chunk)));

  auto buffer = host.allocate(3 * kMiB + 17, 4096);
  check(buffer.ok() && host.contains(buffer->data(), buffer->size_bytes()),
        "jemalloc arena buffer lies inside the pinned region");
  auto extra_slot = device_pool.acquire_slot();
  auto over_budget = device_pool.acquire_slot();
  check(!over_budget.ok() && over_budget.status().code() == StatusCode::kOutOfBudget,
        "device pool refuses a slot past its budget: " + over_budget.status().message());

  std::printf("copy rates (%d x %s per direction)\n", settings.copies, format_bytes(chunk).c_str());
  if (h2d_s > 0)
    report_rate(dev, CopyKind::kHostToDevice, device_options.h2d_bytes_per_s, h2d_s, chunk * settings.copies);
  if (d2h_s > 0)
    report_rate(dev, CopyKind::kDeviceToHost, device_options.d2h_bytes_per_s, d2h_s, chunk * settings.copies);
  return 0;
}

//! The device's and the pools' budgets and high-water marks, each checked against its budget.
void check_budgets(const Device& dev, const PinnedHostPool& host, const DevicePool& device_pool) {
  const MemoryInfo info = dev.memory_info();
  std::printf("budgets and high-water\n");
  std::printf("  device:        budget %s, in use %s, high-water %s\n",
              format_bytes(info.budget_bytes).c_str(), format_bytes(info.used_bytes).c_str(),
              format_bytes(info.high_water_bytes).c_str());
  std::printf("  device pool:   %s\n", stats_text(device_pool.stats()).c_str());
  std::printf("  pinned slab:   %s\n", stats_text(host.slab_stats()).c_str());
  std::printf("  pinned arena:  %s\n", stats_text(host.arena_stats()).c_str());
  check(info.high_water_bytes <= info.budget_bytes, "device high-water within its budget");
  check(host.slab_stats().high_water_bytes <= host.slab_stats().budget_bytes,
        "slab high-water within budget");
  check(host.arena_stats().high_water_bytes <= host.arena_stats().budget_bytes,
        "arena high-water within budget");
}

int run(const Settings& settings) {
  std::printf("strata-selfcheck: a self-check of the device backend and the memory pools\n");
  std::printf("(the runtime and the example trainer are not built yet; this is what runs today)\n\n");

  DeviceOptions device_options;
  for (auto [key, value] : {std::pair<const char*, std::string>{"kind", settings.device},
                            {"budget", settings.device_budget},
                            {"h2d_bandwidth", settings.h2d},
                            {"d2h_bandwidth", settings.d2h}}) {
    Status s = device_options.set(key, value);
    if (!s.ok()) return setup_error(s);
  }
  std::string why;
  auto device = make_device(device_options, &why);
  if (!device.ok()) return setup_error(device.status());
  Device& dev = **device;
  std::printf("device\n  backend: %s\n  why: %s\n  name: %s\n",
              std::string(device_kind_name(dev.kind())).c_str(), why.c_str(), dev.name().c_str());

  auto topology = Topology::discover();
  if (!topology.ok()) return setup_error(topology.status());
  const Placement placement = (*topology)->place(&dev);
  std::printf("topology\n  %s\n  placement: NUMA node index %u, %zu worker threads (%s)\n",
              (*topology)->summary().c_str(), placement.numa_node, placement.worker_threads,
              placement.reason.c_str());
  auto pool = ThreadPool::create(
      {.threads = placement.worker_threads, .on_worker_start = (*topology)->worker_binder(placement)});
  if (!pool.ok()) return setup_error(pool.status());

  PinnedHostPoolOptions pinned_options;
  for (auto [key, value] : {std::pair<const char*, std::string>{"budget", settings.pinned_budget},
                            {"arena_size", settings.arena},
                            {"slot_size", settings.slot}}) {
    Status s = pinned_options.set(key, value);
    if (!s.ok()) return setup_error(s);
  }
  pinned_options.bind_memory = (*topology)->memory_binder(placement);
  auto host = PinnedHostPool::create(pinned_options, &dev);
  if (!host.ok()) return setup_error(host.status());
  std::printf(
      "pinned host pool\n  pages: %s (%s)\n  pinning: %s (%s)\n  %zu slots of %s, %zu region span(s)\n",
      std::string(huge_page_mode_name((*host)->huge_pages())).c_str(), (*host)->huge_pages_reason().c_str(),
      std::string(pinning_mode_name((*host)->pinning())).c_str(), (*host)->pinning_reason().c_str(),
      (*host)->slot_count(), format_bytes((*host)->slot_bytes()).c_str(), (*host)->regions().size());

  DevicePoolOptions device_pool_options;
  device_pool_options.budget_bytes = 2 * pinned_options.slot_bytes;
  device_pool_options.slot_bytes = pinned_options.slot_bytes;
  auto device_pool = DevicePool::create(dev, device_pool_options);
  if (!device_pool.ok()) return setup_error(device_pool.status());

  std::printf("checks\n");
  const std::size_t chunk = pinned_options.slot_bytes;
  if (int rc = check_copies(dev, **host, **device_pool, device_options, settings, chunk); rc != 0) return rc;

  check_budgets(dev, **host, **device_pool);

  std::printf("\nstrata-selfcheck: %s\n", failures == 0 ? "all checks passed" : "SOME CHECKS FAILED");
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"strata-selfcheck: self-check of the device backend and the memory pools"};
  Settings settings;
  app.add_option("--device", settings.device, "device.kind: auto, sim or cuda")->capture_default_str();
  app.add_option("--device-budget", settings.device_budget, "device.budget")->capture_default_str();
  app.add_option("--h2d", settings.h2d, "sim h2d link rate per second (0 = unthrottled)")
      ->capture_default_str();
  app.add_option("--d2h", settings.d2h, "sim d2h link rate per second (0 = unthrottled)")
      ->capture_default_str();
  app.add_option("--pinned-budget", settings.pinned_budget, "pinned.budget")->capture_default_str();
  app.add_option("--arena", settings.arena, "pinned.arena_size")->capture_default_str();
  app.add_option("--slot", settings.slot, "chunk slot size (pinned and device)")->capture_default_str();
  app.add_option("--copies", settings.copies, "chunks copied per direction")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  return run(settings);
}
