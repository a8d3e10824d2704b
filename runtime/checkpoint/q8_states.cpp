// Checkpoint conversions of 8-bit optimizer states (load.hpp: fill_q8_tensor).
//
// Note [Q8 checkpoints]
// A q8 state (precision.states q8, Note [Q8 state chunks] in
// runtime/src/pipeline/q8_states.cpp) is saved as it is held: the tensor's codes
// (one byte each) followed by its block scales (fp32, one per 256 elements from
// the tensor's element 0), at the manifest's offset with dtype "q8";
// state_chunk_bytes gives the record's size. The bytes are the data file's like
// any other, so the file's CRC32C stripes cover the scales as they cover every
// byte, and a corrupted scale fails the load's verification (Corrupt).
// Loading converts when the dtypes differ, as for fp32 and bf16:
//  - q8 into q8: codes and scales copied, bit for bit;
//  - q8 into an fp32 or bf16 run: each state dequantized (map[code] x its block's
//    scale: the values the q8 run computed with), then stored as the run's dtype;
//  - fp32 or bf16 into a q8 run: each tensor quantized alone, as step_q8
//    requantizes (kernels::q8_quantize): absmax scales per block from element 0,
//    nearest codes. m (state0) takes the signed map, v (state1) the unsigned one. A
//    value no 8-bit state holds (Inf, NaN, a negative v, which a run only gets
//    from write_tensor) fails the load with InvalidArgument naming the tensor;
//    families applied before it keep what was loaded, as after a failed read.
// A q8 record is read whole even when the loading run holds only a shard of the
// tensor (an fp32 data-parallel run): its blocks are the whole tensor's.
#include <cstring>
#include <vector>

#include "load.hpp"
#include "strata/kernels/q8.hpp"

namespace strata::checkpoint::detail {

namespace {

kernels::Q8Map map_of(StateKind k) {
  return k == StateKind::kState0 ? kernels::Q8Map::kSigned : kernels::Q8Map::kUnsigned;
}

}  // namespace

Status fill_q8_tensor(const LoadPlan& p, FamilyId f, StateKind k, TensorId id, std::byte* base,
                      std::vector<std::byte>& staging) {
  const FamilyEntry& fam = p.desc.families[f];
  const TensorEntry& ts = p.desc.tensors[id];
  const Saved& s = p.saved[id];
  const auto sk = static_cast<std::size_t>(k);
  const DType to = p.desc.kind_dtype[sk], from = s.dtype[sk];
  const ShardPart part = ts.shard;  // (q8 states and their conversions are of optimizer kinds)
  if (part.count == 0) return Status::Ok();
  if (k != StateKind::kState0 && k != StateKind::kState1) {
    return corrupt("load_checkpoint: {}: tensor \"{}\" {} is q8, which only optimizer states are", p.mpath,
                   ts.name, state_kind_name(k));
  }
  // The run's q8 chunk: codes at the element, scales after the chunk's codes.
  auto codes_at = [&](std::uint64_t at) { return reinterpret_cast<std::uint8_t*>(base) + at; };
  auto scales_at = [&](std::uint64_t at) {
    return reinterpret_cast<float*>(base + fam.shard_elems) + at / runtime::kQ8BlockElems;
  };
  const int fd = p.fds[s.file].get();
  const fs::path& path = p.file_paths[s.file];
  if (from == DType::kQ8 && to == DType::kQ8) {  // as saved (one rank: the whole tensor)
    STRATA_RETURN_IF_ERROR(
        read_all(fd, reinterpret_cast<std::byte*>(codes_at(part.at)), ts.numel, s.offset[sk], path));
    return read_all(fd, reinterpret_cast<std::byte*>(scales_at(part.at)), 4 * kernels::q8_blocks(ts.numel),
                    s.offset[sk] + ts.numel, path);
  }
  std::vector<float> values(from == DType::kQ8 ? ts.numel : part.count);
  if (from == DType::kQ8) {  // the whole tensor's record, dequantized
    staging.resize(runtime::state_chunk_bytes(DType::kQ8, ts.numel));
    STRATA_RETURN_IF_ERROR(read_all(fd, staging.data(), staging.size(), s.offset[sk], path));
    std::vector<float> scales(kernels::q8_blocks(ts.numel));
    std::memcpy(scales.data(), staging.data() + ts.numel, scales.size() * 4);
    kernels::q8_dequantize(reinterpret_cast<const std::uint8_t*>(staging.data()), scales.data(), map_of(k),
                           values);
    const std::span<const float> mine(values.data() + part.first, part.count);
    convert(reinterpret_cast<const std::byte*>(mine.data()), DType::kF32, base + part.at * dtype_bytes(to),
            to, part.count);
    return Status::Ok();
  }
  // fp32 or bf16 into q8: this run is one rank, so the part is the whole tensor.
  const std::uint64_t fsize = dtype_bytes(from);
  staging.resize(part.count * fsize);
  STRATA_RETURN_IF_ERROR(
      read_all(fd, staging.data(), staging.size(), s.offset[sk] + part.first * fsize, path));
  convert(staging.data(), from, reinterpret_cast<std::byte*>(values.data()), DType::kF32, part.count);
  Status st = kernels::q8_quantize(values, map_of(k), codes_at(part.at), scales_at(part.at));
  if (!st.ok()) {
    return st.with_context(fmt::format("load_checkpoint: {}: tensor \"{}\" {} ({}) into q8 states", p.mpath,
                                       ts.name, state_kind_name(k), runtime::dtype_name(from)));
  }
  return Status::Ok();
}

}  // namespace strata::checkpoint::detail
