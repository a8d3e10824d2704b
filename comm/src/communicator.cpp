#include "strata/comm/communicator.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "strata/common/assert.hpp"
#include "strata/common/log.hpp"

namespace strata::comm {

namespace {

template <std::uint16_t (*To)(float), float (*From)(std::uint16_t)>
void sum_halves(std::span<const void* const> sources, void* out, std::size_t count) {
  auto* o = static_cast<std::uint16_t*>(out);
  const auto* first = static_cast<const std::uint16_t*>(sources[0]);
  if (o != first) std::memcpy(o, first, count * 2);
  for (std::size_t r = 1; r < sources.size(); ++r) {
    const auto* s = static_cast<const std::uint16_t*>(sources[r]);
    for (std::size_t i = 0; i < count; ++i) o[i] = To(From(o[i]) + From(s[i]));
  }
}

}  // namespace

void sum_in_rank_order(std::span<const void* const> sources, void* out, std::size_t count, DType dtype) {
  if (sources.empty() || count == 0) return;
  switch (dtype) {
    case DType::kF32: {
      auto* o = static_cast<float*>(out);
      const auto* first = static_cast<const float*>(sources[0]);
      if (o != first) std::memcpy(o, first, count * 4);
      for (std::size_t r = 1; r < sources.size(); ++r) {
        const auto* s = static_cast<const float*>(sources[r]);
        for (std::size_t i = 0; i < count; ++i) o[i] += s[i];
      }
      return;
    }
    case DType::kBF16:
      return sum_halves<to_bf16, from_bf16>(sources, out, count);
    case DType::kF16:
      return sum_halves<to_f16, from_f16>(sources, out, count);
    case DType::kQ8:
    case DType::kNone:
      break;
  }
  // reduce_scatter refused kNone and kQ8 (check_chunk_dtype) before any backend got here.
  STRATA_CHECK_MSG(false, "sum_in_rank_order: a buffer of DType::kNone or kQ8 has no elements to sum");
}

Handle::Handle(std::unique_ptr<PendingOp> op, std::atomic<std::uint64_t>* wait_ns)
    : op_(std::move(op)), wait_ns_(wait_ns) {}

Handle& Handle::operator=(Handle&& other) noexcept {
  if (this != &other) {
    if (op_) wait().ignore();
    op_ = std::move(other.op_);
    wait_ns_ = other.wait_ns_;
    waited_ = other.waited_;
    result_ = std::move(other.result_);
  }
  return *this;
}

Handle::~Handle() {
  if (!op_) return;
  Status s = wait();
  if (!s.ok()) STRATA_LOG_WARN("comm: a collective dropped without wait() failed: {}", s);
}

Status Handle::wait() {
  if (waited_) return result_;
  if (!op_) return failed_precondition("comm: wait() on an empty Handle (moved from or never started)");
  const auto t0 = std::chrono::steady_clock::now();
  result_ = op_->wait();
  if (wait_ns_ != nullptr) {
    const auto ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
    wait_ns_->fetch_add(static_cast<std::uint64_t>(ns.count()), std::memory_order_relaxed);
  }
  op_.reset();
  waited_ = true;
  return result_;
}

Result<Handle> Communicator::finish_start(Result<std::unique_ptr<PendingOp>> op) {
  if (!op.ok()) return op.status();
  ++stats_.collectives;
  return Handle(std::move(op).value(), &wait_ns_);
}

namespace {

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto* pa = static_cast<const std::byte*>(a);
  const auto* pb = static_cast<const std::byte*>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

// A chunk collective moves fp32, bf16 or fp16 elements; kNone (a kernel span's
// "absent") has no size and no reduction, and is refused rather than read as any
// of them.
Status check_chunk_dtype(std::string_view op, DType dtype) {
  if (dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16) return Status::Ok();
  return invalid_argument(
      "comm: {} of dtype {} (value {}): chunk collectives move fp32, bf16 or fp16 elements; pass the "
      "buffer's element type",
      op, dtype_name(dtype), static_cast<int>(dtype));
}

}  // namespace

Result<Handle> Communicator::reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype) {
  STRATA_RETURN_IF_ERROR(check_chunk_dtype("reduce_scatter", dtype));
  const std::size_t bytes = count * dtype_size(dtype);
  if (count > 0 && (send == nullptr || recv == nullptr)) {
    return invalid_argument("comm {}: reduce_scatter of {} x {} got a null buffer", backend(), count,
                            dtype_name(dtype));
  }
  const auto* own = static_cast<const std::byte*>(send) + bytes * static_cast<std::size_t>(rank_);
  if (count > 0 && recv != own && overlaps(send, bytes * static_cast<std::size_t>(size_), recv, bytes)) {
    return invalid_argument(
        "comm {}: reduce_scatter's recv buffer overlaps its send buffer other than at this rank's slice {}; "
        "give it its own, or pass send + rank * count for in place",
        backend(), rank_);
  }
  return finish_start(start_reduce_scatter(send, recv, count, dtype));
}

Result<Handle> Communicator::all_gather(const void* send, void* recv, std::size_t count, DType dtype) {
  STRATA_RETURN_IF_ERROR(check_chunk_dtype("all_gather", dtype));
  if (count > 0 && (send == nullptr || recv == nullptr)) {
    return invalid_argument("comm {}: all_gather of {} x {} got a null buffer", backend(), count,
                            dtype_name(dtype));
  }
  const std::size_t bytes = count * dtype_size(dtype);
  const auto* own = static_cast<const std::byte*>(recv) + bytes * static_cast<std::size_t>(rank_);
  if (count > 0 && send != own && overlaps(send, bytes, recv, bytes * static_cast<std::size_t>(size_))) {
    return invalid_argument(
        "comm {}: all_gather's send buffer overlaps recv other than at this rank's slice {}; pass recv + "
        "rank * count for in place",
        backend(), rank_);
  }
  return finish_start(start_all_gather(send, recv, count, dtype));
}

Result<Handle> Communicator::all_reduce(std::span<double> values, ReduceOp op) {
  if (!values.empty() && values.data() == nullptr) {
    return invalid_argument("comm {}: all_reduce got a null buffer", backend());
  }
  return finish_start(start_all_reduce(values, op));
}

Result<Handle> Communicator::broadcast(void* data, std::size_t bytes, int root) {
  if (root < 0 || root >= size_) {
    return invalid_argument("comm {}: broadcast root {} is not a rank of this group of {} (0..{})", backend(),
                            root, size_, size_ - 1);
  }
  if (bytes > 0 && data == nullptr)
    return invalid_argument("comm {}: broadcast got a null buffer", backend());
  return finish_start(start_broadcast(data, bytes, root));
}

}  // namespace strata::comm
