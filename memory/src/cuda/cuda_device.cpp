#include "cuda/cuda_device.hpp"

#include "backends.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/cuda_check.hpp"
#include "strata/common/log.hpp"

namespace strata::memory {
namespace cuda {
namespace {

cudaStream_t as_stream(std::uintptr_t native) {
  return reinterpret_cast<cudaStream_t>(native);
}
cudaEvent_t as_event(std::uintptr_t native) {
  return reinterpret_cast<cudaEvent_t>(native);
}

cudaMemcpyKind memcpy_kind(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return cudaMemcpyHostToDevice;
    case CopyKind::kDeviceToHost:
      return cudaMemcpyDeviceToHost;
    case CopyKind::kDeviceToDevice:
      return cudaMemcpyDeviceToDevice;
  }
  return cudaMemcpyDefault;
}

// Why the runtime has no usable GPU, in words a user can act on.
std::string no_gpu_reason(cudaError_t err) {
  int runtime_version = 0;
  cudaRuntimeGetVersion(&runtime_version);
  const std::string runtime =
      fmt::format("CUDA runtime {}.{}", runtime_version / 1000, (runtime_version % 1000) / 10);
  switch (err) {
    case cudaErrorInsufficientDriver:
      return fmt::format("no CUDA driver, or one older than the {}: {} ({})", runtime, cudaGetErrorName(err),
                         cudaGetErrorString(err));
    case cudaErrorNoDevice:
      return fmt::format("the CUDA driver sees no GPU: {} ({})", cudaGetErrorName(err),
                         cudaGetErrorString(err));
    default:
      return fmt::format("the CUDA runtime failed to start ({}): {} ({})", runtime, cudaGetErrorName(err),
                         cudaGetErrorString(err));
  }
}

}  // namespace

Result<std::unique_ptr<Device>> CudaDevice::open(const DeviceOptions& options) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later probes start clean
    return unavailable("{}", no_gpu_reason(err));
  }
  if (count == 0) return unavailable("the CUDA driver sees no GPU (cudaGetDeviceCount = 0)");
  if (options.cuda_ordinal >= count) {
    return unavailable("device.cuda_ordinal = {} but this machine has {} GPU{}; use 0..{}",
                       options.cuda_ordinal, count, count == 1 ? "" : "s", count - 1);
  }
  STRATA_CUDA_TRY(cudaSetDevice(options.cuda_ordinal));
  cudaDeviceProp prop{};
  STRATA_CUDA_TRY(cudaGetDeviceProperties(&prop, options.cuda_ordinal));
  char bus_id[32] = {};
  STRATA_CUDA_TRY(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), options.cuda_ordinal));
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  STRATA_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (options.budget_bytes > free_bytes) {
    return invalid_argument(
        "device.budget = {}: more than the {} free on cuda:{} {} ({} total); set device.budget to at most {}",
        format_bytes(options.budget_bytes), format_bytes(free_bytes), options.cuda_ordinal, prop.name,
        format_bytes(total_bytes), format_bytes(free_bytes));
  }
  std::string name = fmt::format("cuda:{} {} (sm_{}{}, {} total, budget {}, PCI {})", options.cuda_ordinal,
                                 prop.name, prop.major, prop.minor, format_bytes(total_bytes),
                                 format_bytes(options.budget_bytes), bus_id);
  return std::unique_ptr<Device>(new CudaDevice(options, std::move(name), bus_id));
}

CudaDevice::CudaDevice(const DeviceOptions& options, std::string name, std::string pci_bus_id)
    : Device(options.budget_bytes),
      options_(options),
      name_(std::move(name)),
      pci_bus_id_(std::move(pci_bus_id)) {}

CudaDevice::~CudaDevice() {
  STRATA_CHECK_MSG(live_handles() == 0, "a Stream, Event or DeviceAllocation outlived its cuda Device");
  STRATA_CUDA_CHECK(cudaSetDevice(options_.cuda_ordinal));
  STRATA_CUDA_CHECK(cudaDeviceSynchronize());
  std::lock_guard lock(timing_mutex_);
  harvest_locked(false).ignore();
  for (TimedCopy& pair : pending_) spare_pairs_.push_back(pair);
  for (TimedCopy& pair : spare_pairs_) {
    STRATA_CUDA_CHECK(cudaEventDestroy(pair.start));
    STRATA_CUDA_CHECK(cudaEventDestroy(pair.end));
  }
}

Status CudaDevice::make_current() const {
  STRATA_CUDA_TRY(cudaSetDevice(options_.cuda_ordinal));
  return Status::Ok();
}

Result<void*> CudaDevice::do_allocate(std::size_t bytes) {
  STRATA_RETURN_IF_ERROR(make_current());
  void* data = nullptr;
  const cudaError_t err = cudaMalloc(&data, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return out_of_memory("{}: cudaMalloc of {} failed (out of GPU memory); lower device.budget", name_,
                         format_bytes(bytes));
  }
  STRATA_CUDA_TRY(err);
  return data;
}

void CudaDevice::do_free(void* data, std::size_t /*bytes*/) {
  STRATA_CUDA_CHECK(cudaSetDevice(options_.cuda_ordinal));
  STRATA_CUDA_CHECK(cudaFree(data));
}

Result<std::uintptr_t> CudaDevice::do_create_stream() {
  if (streams_.fetch_add(1) >= options_.streams_max) {
    streams_.fetch_sub(1);
    return out_of_budget(
        "{}: the limit device.streams_max = {} streams is reached; destroy a stream or raise it", name_,
        options_.streams_max);
  }
  STRATA_RETURN_IF_ERROR(make_current());
  cudaStream_t stream = nullptr;
  const cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (err != cudaSuccess) streams_.fetch_sub(1);
  STRATA_CUDA_TRY(err);
  return reinterpret_cast<std::uintptr_t>(stream);
}

void CudaDevice::do_destroy_stream(std::uintptr_t stream) {
  // Stream handles drain on destruction (Note [Stream and event handles]).
  STRATA_CUDA_CHECK(cudaSetDevice(options_.cuda_ordinal));
  STRATA_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  STRATA_CUDA_CHECK(cudaStreamDestroy(as_stream(stream)));
  streams_.fetch_sub(1);
}

Result<std::uintptr_t> CudaDevice::do_create_event() {
  STRATA_RETURN_IF_ERROR(make_current());
  cudaEvent_t event = nullptr;
  STRATA_CUDA_TRY(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return reinterpret_cast<std::uintptr_t>(event);
}

void CudaDevice::do_destroy_event(std::uintptr_t event) {
  // CUDA defers the release until work recording or waiting on the event is done.
  STRATA_CUDA_CHECK(cudaEventDestroy(as_event(event)));
}

Status CudaDevice::do_record(std::uintptr_t event, std::uintptr_t stream) {
  STRATA_RETURN_IF_ERROR(make_current());
  STRATA_CUDA_TRY(cudaEventRecord(as_event(event), as_stream(stream)));
  return Status::Ok();
}

Status CudaDevice::do_wait(std::uintptr_t stream, std::uintptr_t event) {
  STRATA_RETURN_IF_ERROR(make_current());
  STRATA_CUDA_TRY(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0));
  return Status::Ok();
}

Status CudaDevice::do_synchronize_event(std::uintptr_t event) {
  STRATA_CUDA_TRY(cudaEventSynchronize(as_event(event)));
  return Status::Ok();
}

Result<bool> CudaDevice::do_query(std::uintptr_t event) {
  const cudaError_t err = cudaEventQuery(as_event(event));
  if (err == cudaErrorNotReady) return false;
  STRATA_CUDA_TRY(err);
  return true;
}

Result<CudaDevice::TimedCopy> CudaDevice::take_pair_locked() {
  if (!spare_pairs_.empty()) {
    TimedCopy pair = spare_pairs_.back();
    spare_pairs_.pop_back();
    return pair;
  }
  TimedCopy pair;
  STRATA_CUDA_TRY(cudaEventCreate(&pair.start));
  const cudaError_t err = cudaEventCreate(&pair.end);
  if (err != cudaSuccess) cudaEventDestroy(pair.start);
  STRATA_CUDA_TRY(err);
  return pair;
}

Status CudaDevice::harvest_locked(bool wait_oldest) {
  if (wait_oldest && !pending_.empty()) STRATA_CUDA_TRY(cudaEventSynchronize(pending_.front().end));
  while (!pending_.empty()) {
    TimedCopy& oldest = pending_.front();
    const cudaError_t err = cudaEventQuery(oldest.end);
    if (err == cudaErrorNotReady) break;  // later copies may be on other streams; harvest them next time
    STRATA_CUDA_TRY(err);
    float ms = 0.0f;
    STRATA_CUDA_TRY(cudaEventElapsedTime(&ms, oldest.start, oldest.end));
    count_copy(oldest.kind, oldest.bytes, static_cast<double>(ms) * 1e-3);
    spare_pairs_.push_back(oldest);
    pending_.pop_front();
  }
  return Status::Ok();
}

Status CudaDevice::do_copy_async(std::uintptr_t stream, void* dst, const void* src, std::size_t bytes,
                                 CopyKind kind) {
  STRATA_RETURN_IF_ERROR(make_current());
  std::lock_guard lock(timing_mutex_);
  STRATA_RETURN_IF_ERROR(harvest_locked(pending_.size() >= kTimedCopiesMax));
  STRATA_ASSIGN_OR_RETURN(TimedCopy pair, take_pair_locked());
  pair.kind = kind;
  pair.bytes = bytes;
  spare_pairs_.push_back(pair);  // back to the spares if a call below fails
  STRATA_CUDA_TRY(cudaEventRecord(pair.start, as_stream(stream)));
  STRATA_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, memcpy_kind(kind), as_stream(stream)));
  STRATA_CUDA_TRY(cudaEventRecord(pair.end, as_stream(stream)));
  spare_pairs_.pop_back();
  pending_.push_back(pair);
  return Status::Ok();
}

// cudaLaunchHostFunc takes a C function and one pointer: the function travels in a
// pooled record (Note [Completion records] in strata/common/record_pool.hpp), which
// the trampoline gives back before it runs the function. So a launch allocates
// nothing once the host functions in flight stay below their high water
// (host_function_records()) and `fn` itself is kept in place (a capture of at most
// two words, as the runtime's launches are).
void CUDART_CB CudaDevice::run_host_function(void* user_data) {
  auto* record = static_cast<HostFunctionRecord*>(user_data);
  std::function<void()> fn = std::move(record->fn);  // moves the target: never allocates
  record->device->host_function_records_.give_back(record);
  fn();
}

Status CudaDevice::do_launch_host(std::uintptr_t stream, std::function<void()> fn) {
  STRATA_RETURN_IF_ERROR(make_current());
  HostFunctionRecord* record = host_function_records_.take();
  record->device = this;
  record->fn = std::move(fn);
  const cudaError_t err = cudaLaunchHostFunc(as_stream(stream), &run_host_function, record);
  if (err != cudaSuccess) {
    record->fn = nullptr;
    host_function_records_.give_back(record);
  }
  STRATA_CUDA_TRY(err);
  return Status::Ok();
}

std::uint64_t CudaDevice::host_function_records() const {
  return host_function_records_.created();
}

Status CudaDevice::do_synchronize_stream(std::uintptr_t stream) {
  STRATA_CUDA_TRY(cudaStreamSynchronize(as_stream(stream)));
  std::lock_guard lock(timing_mutex_);
  return harvest_locked(false);
}

Status CudaDevice::synchronize() {
  STRATA_RETURN_IF_ERROR(make_current());
  STRATA_CUDA_TRY(cudaDeviceSynchronize());
  std::lock_guard lock(timing_mutex_);
  return harvest_locked(false);
}

Result<HostRegistration> CudaDevice::register_host(void* ptr, std::size_t bytes) {
  STRATA_RETURN_IF_ERROR(make_current());
  STRATA_CUDA_TRY(cudaHostRegister(ptr, bytes, cudaHostRegisterDefault));
  return HostRegistration::kRegistered;
}

Status CudaDevice::unregister_host(void* ptr) {
  STRATA_RETURN_IF_ERROR(make_current());
  STRATA_CUDA_TRY(cudaHostUnregister(ptr));
  return Status::Ok();
}

}  // namespace cuda

namespace detail {
Result<std::unique_ptr<Device>> make_cuda_device(const DeviceOptions& options) {
  return cuda::CudaDevice::open(options);
}
}  // namespace detail

}  // namespace strata::memory
