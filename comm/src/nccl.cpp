// The nccl backend (built only when CMake finds NCCL and CUDA; compiled, never
// linked, against comm/nccl_api/nccl.h wherever CUDA is found: comm/CMakeLists.txt).
#include "strata/comm/nccl.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#if defined(STRATA_NCCL_COMPILE_CHECK) && !defined(STRATA_NCCL_API_DECLARATIONS_H)
#error "the NCCL compile check must see comm/nccl_api/nccl.h, not a real nccl.h first on the include path"
#endif

#include <thread>

#include "strata/common/assert.hpp"

namespace strata::comm {
namespace {

constexpr std::size_t kScalarsMax = 4096;  // all_reduce's device staging buffer, in doubles

ncclDataType_t nccl_dtype(DType d) {
  switch (d) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
    case DType::kQ8:
    case DType::kNone:
      break;
  }
  // Communicator::reduce_scatter / all_gather refused any other dtype (check_chunk_dtype).
  STRATA_UNREACHABLE();
}

struct Shared {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  double* scalars = nullptr;  // device, kScalarsMax
  int rank = 0, size = 1;
  CommOptions options;
  Status broken;  // issuing thread and waits: the communicator's calls are from one thread at a time
};

Status nccl_status(ncclResult_t r, std::string_view what) {
  if (r == ncclSuccess || r == ncclInProgress) return Status::Ok();
  return unavailable("comm nccl: {} failed: {}", what, ncclGetErrorString(r));
}

Status cuda_status(cudaError_t e, std::string_view what) {
  if (e == cudaSuccess) return Status::Ok();
  return unavailable("comm nccl: {} failed: {}", what, cudaGetErrorString(e));
}

class NcclOp final : public PendingOp {
 public:
  //! `staging` (device memory, may be null) is freed once the op is done.
  NcclOp(std::shared_ptr<Shared> s, cudaEvent_t ev, std::string what, void* staging)
      : s_(std::move(s)), ev_(ev), what_(std::move(what)), staging_(staging) {}
  ~NcclOp() override {
    if (staging_ != nullptr) {
      cudaEventSynchronize(ev_);  // (done already unless the wait failed)
      cudaFree(staging_);
    }
    cudaEventDestroy(ev_);
  }
  bool done() override { return cudaEventQuery(ev_) == cudaSuccess; }
  Status wait() override {
    const auto deadline = std::chrono::steady_clock::now() + s_->options.timeout;
    for (;;) {
      const cudaError_t e = cudaEventQuery(ev_);
      if (e == cudaSuccess) return Status::Ok();
      if (e != cudaErrorNotReady) return s_->broken = cuda_status(e, what_);
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(s_->comm, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        ncclCommAbort(s_->comm);
        return s_->broken = nccl_status(async, what_);
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        ncclCommAbort(s_->comm);
        return s_->broken = unavailable(
                   "comm nccl rank {} of {}: {} did not complete within {} ms: a peer rank died or hangs; "
                   "the communicator was aborted",
                   s_->rank, s_->size, what_, s_->options.timeout.count());
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

 private:
  std::shared_ptr<Shared> s_;
  cudaEvent_t ev_;
  std::string what_;
  void* staging_;
};

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(std::shared_ptr<Shared> s)
      : Communicator(s->rank, s->size, s->options), s_(std::move(s)) {}
  ~NcclCommunicator() override {
    if (s_->broken.ok()) ncclCommDestroy(s_->comm);
    cudaFree(s_->scalars);
  }
  std::string_view backend() const override { return "nccl"; }
  bool device_buffers() const override { return true; }
  void abort(std::string_view reason) override {
    if (s_->broken.ok()) s_->broken = unavailable("comm nccl rank {}: aborted: {}", rank(), reason);
    ncclCommAbort(s_->comm);
  }

 protected:
  Result<std::unique_ptr<PendingOp>> start_reduce_scatter(const void* send, void* recv, std::size_t count,
                                                          DType dtype) override {
    STRATA_RETURN_IF_ERROR(s_->broken);
    stats_.reduce_scatter_bytes += peer_bytes(count * dtype_size(dtype));
    const std::string what = fmt::format("reduce_scatter #{} of {} x {}", seq_++, count, dtype_name(dtype));
    STRATA_RETURN_IF_ERROR(nccl_status(
        ncclReduceScatter(send, recv, count, nccl_dtype(dtype), ncclSum, s_->comm, s_->stream), what));
    return record(what);
  }
  Result<std::unique_ptr<PendingOp>> start_all_gather(const void* send, void* recv, std::size_t count,
                                                      DType dtype) override {
    STRATA_RETURN_IF_ERROR(s_->broken);
    stats_.all_gather_bytes += peer_bytes(count * dtype_size(dtype));
    const std::string what = fmt::format("all_gather #{} of {} x {}", seq_++, count, dtype_name(dtype));
    STRATA_RETURN_IF_ERROR(
        nccl_status(ncclAllGather(send, recv, count, nccl_dtype(dtype), s_->comm, s_->stream), what));
    return record(what);
  }
  Result<std::unique_ptr<PendingOp>> start_all_reduce(std::span<double> values, ReduceOp op) override {
    STRATA_RETURN_IF_ERROR(s_->broken);
    if (values.size() > kScalarsMax) {
      return invalid_argument("comm nccl: all_reduce of {} scalars exceeds its staging buffer ({})",
                              values.size(), kScalarsMax);
    }
    stats_.all_reduce_bytes += peer_bytes(values.size_bytes());
    const std::string what = fmt::format("all_reduce #{} of {} scalars", seq_++, values.size());
    STRATA_RETURN_IF_ERROR(cuda_status(
        cudaMemcpyAsync(s_->scalars, values.data(), values.size_bytes(), cudaMemcpyHostToDevice, s_->stream),
        what));
    STRATA_RETURN_IF_ERROR(
        nccl_status(ncclAllReduce(s_->scalars, s_->scalars, values.size(), ncclFloat64,
                                  op == ReduceOp::kSum ? ncclSum : ncclMax, s_->comm, s_->stream),
                    what));
    STRATA_RETURN_IF_ERROR(cuda_status(
        cudaMemcpyAsync(values.data(), s_->scalars, values.size_bytes(), cudaMemcpyDeviceToHost, s_->stream),
        what));
    return record(what);
  }
  Result<std::unique_ptr<PendingOp>> start_broadcast(void* data, std::size_t bytes, int root) override {
    STRATA_RETURN_IF_ERROR(s_->broken);
    if (rank() == root) stats_.broadcast_bytes += peer_bytes(bytes);
    const std::string what = fmt::format("broadcast #{} of {} bytes from rank {}", seq_++, bytes, root);
    // Host memory (start-up values, config text): staged through a device buffer
    // of its own, freed when the op is done.
    void* dev = nullptr;
    if (bytes > 0) STRATA_RETURN_IF_ERROR(cuda_status(cudaMalloc(&dev, bytes), what));
    Status st = cuda_status(cudaMemcpyAsync(dev, data, bytes, cudaMemcpyHostToDevice, s_->stream), what);
    if (st.ok())
      st = nccl_status(ncclBroadcast(dev, dev, bytes, ncclUint8, root, s_->comm, s_->stream), what);
    if (st.ok())
      st = cuda_status(cudaMemcpyAsync(data, dev, bytes, cudaMemcpyDeviceToHost, s_->stream), what);
    if (!st.ok()) {
      cudaStreamSynchronize(s_->stream);
      cudaFree(dev);
      return st;
    }
    return record(what, dev);
  }

 private:
  std::uint64_t peer_bytes(std::size_t bytes) const { return bytes * static_cast<std::uint64_t>(size() - 1); }
  //! The op's completion event; `staging` (device, may be null) is freed after it.
  Result<std::unique_ptr<PendingOp>> record(const std::string& what, void* staging = nullptr) {
    cudaEvent_t ev;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e == cudaSuccess) {
      e = cudaEventRecord(ev, s_->stream);
      if (e == cudaSuccess)
        return std::unique_ptr<PendingOp>(std::make_unique<NcclOp>(s_, ev, what, staging));
      cudaEventDestroy(ev);
    }
    if (staging != nullptr) {
      cudaStreamSynchronize(s_->stream);
      cudaFree(staging);
    }
    return cuda_status(e, what);
  }
  std::shared_ptr<Shared> s_;
  std::uint64_t seq_ = 0;
};

}  // namespace

bool nccl_compiled() {
  return true;
}

Result<std::unique_ptr<Communicator>> make_nccl_communicator(Communicator& bootstrap, void* cuda_stream,
                                                             CommOptions options) {
  if (options.deterministic) {
    return invalid_argument(
        "comm nccl: deterministic mode needs a rank-ordered sum, which NCCL does not offer; set "
        "deterministic = false or use the mpi backend (Note [Deterministic reduction])");
  }
  if (options.timeout.count() <= 0) return invalid_argument("comm nccl: timeout must be > 0");
  ncclUniqueId id{};
  if (bootstrap.rank() == 0) STRATA_RETURN_IF_ERROR(nccl_status(ncclGetUniqueId(&id), "ncclGetUniqueId"));
  STRATA_ASSIGN_OR_RETURN(Handle h, bootstrap.broadcast(&id, sizeof(id), 0));
  STRATA_RETURN_IF_ERROR(h.wait());
  auto s = std::make_shared<Shared>();
  s->rank = bootstrap.rank();
  s->size = bootstrap.size();
  s->options = options;
  s->stream = static_cast<cudaStream_t>(cuda_stream);
  STRATA_RETURN_IF_ERROR(cuda_status(
      cudaMalloc(reinterpret_cast<void**>(&s->scalars), kScalarsMax * sizeof(double)), "cudaMalloc"));
  const ncclResult_t r = ncclCommInitRank(&s->comm, s->size, id, s->rank);
  if (r != ncclSuccess) {
    cudaFree(s->scalars);
    return nccl_status(r, "ncclCommInitRank");
  }
  return std::unique_ptr<Communicator>(std::make_unique<NcclCommunicator>(std::move(s)));
}

}  // namespace strata::comm
