#include "strata/memory/device_factory.hpp"

#include <unistd.h>

#include "backends.hpp"
#include "settings.hpp"
#include "sim/sim_device.hpp"
#include "strata/common/log.hpp"

namespace strata::memory {
namespace {

constexpr std::size_t kCountMax = std::size_t{1} << 20;

Status check_count(std::string_view key, std::size_t value) {
  if (value == 0 || value > kCountMax) {
    return invalid_argument("device.{} = {}: must be between 1 and {}; pick a value in that range", key,
                            value, kCountMax);
  }
  return Status::Ok();
}

}  // namespace

std::uint64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_bytes = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_bytes <= 0) return 0;
  return static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page_bytes);
}

Result<DeviceChoice> parse_device_choice(std::string_view text) {
  if (text == "auto") return DeviceChoice::kAuto;
  if (text == "sim") return DeviceChoice::kSim;
  if (text == "cuda") return DeviceChoice::kCuda;
  return invalid_argument("device.kind = \"{}\": unknown device; use auto, sim or cuda", text);
}

Status DeviceOptions::set(std::string_view key, std::string_view value) {
  const std::string setting = fmt::format("device.{}", key);
  if (key == "kind") {
    STRATA_ASSIGN_OR_RETURN(kind, parse_device_choice(value));
  } else if (key == "budget") {
    STRATA_ASSIGN_OR_RETURN(budget_bytes, parse_bytes(value, setting));
  } else if (key == "h2d_bandwidth") {
    STRATA_ASSIGN_OR_RETURN(h2d_bytes_per_s, parse_bytes(value, setting));
  } else if (key == "d2h_bandwidth") {
    STRATA_ASSIGN_OR_RETURN(d2h_bytes_per_s, parse_bytes(value, setting));
  } else if (key == "d2d_bandwidth") {
    STRATA_ASSIGN_OR_RETURN(d2d_bytes_per_s, parse_bytes(value, setting));
  } else if (key == "stream_queue_depth") {
    STRATA_ASSIGN_OR_RETURN(stream_queue_depth, detail::parse_count(setting, value));
  } else if (key == "streams_max") {
    STRATA_ASSIGN_OR_RETURN(streams_max, detail::parse_count(setting, value));
  } else if (key == "cuda_ordinal") {
    STRATA_ASSIGN_OR_RETURN(std::uint64_t ordinal, detail::parse_count(setting, value));
    if (ordinal > 1024)
      return invalid_argument("device.cuda_ordinal = {}: no machine has that many GPUs", ordinal);
    cuda_ordinal = static_cast<int>(ordinal);
  } else {
    return invalid_argument(
        "unknown setting device.{} (= \"{}\"); known: kind, budget, h2d_bandwidth, d2h_bandwidth, "
        "d2d_bandwidth, stream_queue_depth, streams_max, cuda_ordinal",
        key, value);
  }
  return Status::Ok();
}

Status DeviceOptions::validate() const {
  if (budget_bytes == 0) {
    return invalid_argument(
        "device.budget = 0: the device needs a memory budget; set e.g. device.budget=4GiB");
  }
  const std::uint64_t ram = physical_memory_bytes();
  if (kind == DeviceChoice::kSim && ram != 0 && budget_bytes > ram) {
    return invalid_argument(
        "device.budget = {}: larger than this machine's RAM ({}), which holds the sim device's memory; "
        "set device.budget to at most {}",
        format_bytes(budget_bytes), format_bytes(ram), format_bytes(ram));
  }
  for (const auto& [key, rate] : {std::pair<const char*, std::uint64_t>{"h2d_bandwidth", h2d_bytes_per_s},
                                  {"d2h_bandwidth", d2h_bytes_per_s},
                                  {"d2d_bandwidth", d2d_bytes_per_s}}) {
    if (rate != 0 && rate < kSimBandwidthMinBytesPerS) {
      return invalid_argument(
          "device.{} = {}/s: a sim copy throttle below {}/s makes one chunk's copy take seconds; use 0 "
          "(memcpy speed) or at least {}",
          key, format_bytes(rate), format_bytes(kSimBandwidthMinBytesPerS),
          format_bytes(kSimBandwidthMinBytesPerS));
    }
  }
  STRATA_RETURN_IF_ERROR(check_count("stream_queue_depth", stream_queue_depth));
  STRATA_RETURN_IF_ERROR(check_count("streams_max", streams_max));
  if (cuda_ordinal < 0) return invalid_argument("device.cuda_ordinal = {}: must be >= 0", cuda_ordinal);
  return Status::Ok();
}

namespace detail {
Result<std::unique_ptr<Device>> make_sim_device(const DeviceOptions& options) {
  return std::unique_ptr<Device>(std::make_unique<sim::SimDevice>(options));
}
}  // namespace detail

Result<std::unique_ptr<Device>> make_device(const DeviceOptions& options, std::string* why) {
  STRATA_RETURN_IF_ERROR(options.validate());
  std::string reason;
  std::unique_ptr<Device> device;
  if (options.kind == DeviceChoice::kSim) {
    STRATA_ASSIGN_OR_RETURN(device, detail::make_sim_device(options));
    reason = "device.kind=sim was asked for";
  } else {
    Result<std::unique_ptr<Device>> cuda = detail::make_cuda_device(options);
    if (cuda.ok()) {
      device = std::move(cuda).value();
      reason =
          options.kind == DeviceChoice::kCuda ? "device.kind=cuda was asked for" : "auto found a usable GPU";
    } else if (options.kind == DeviceChoice::kCuda) {
      return unavailable(
          "device.kind=cuda was asked for but no usable GPU exists: {}; use device.kind=sim (or auto), or "
          "install the NVIDIA driver on a machine with a GPU",
          cuda.status().message());
    } else if (cuda.status().code() != StatusCode::kUnavailable) {
      return cuda.status();  // a GPU exists but the settings do not fit it: say so, do not hide it
    } else {
      // auto, and cuda is unavailable: the sim device, with the reason in the log.
      DeviceOptions sim_options = options;
      sim_options.kind = DeviceChoice::kSim;
      STRATA_RETURN_IF_ERROR(sim_options.validate());  // the RAM bound applies now
      STRATA_ASSIGN_OR_RETURN(device, detail::make_sim_device(sim_options));
      reason = fmt::format("no usable GPU: {}", cuda.status().message());
    }
  }
  STRATA_LOG_INFO("device: {} ({}); {}", device_kind_name(device->kind()), reason, device->name());
  if (why != nullptr) *why = std::move(reason);
  return device;
}

}  // namespace strata::memory
