// CPUID-based choice of the CPU kernels: the one factory of Note [ISA translation units].
#include <cstdlib>
#include <mutex>

#include "cpu/table.hpp"
#include "strata/common/log.hpp"

namespace strata::kernels {

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "?";
}

Result<Isa> parse_isa(std::string_view name) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (name == isa_name(isa)) return isa;
  }
  return invalid_argument("unknown kernel ISA '{}': use scalar, avx2 or avx512", name);
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
             isa_supported(Isa::kAvx2);
  }
  return false;
}

Isa default_isa() {
  static std::once_flag once;
  static Isa chosen = Isa::kScalar;
  std::call_once(once, [] {
    Isa best =
        isa_supported(Isa::kAvx512) ? Isa::kAvx512 : (isa_supported(Isa::kAvx2) ? Isa::kAvx2 : Isa::kScalar);
    chosen = best;
    const char* env = std::getenv("STRATA_KERNELS_ISA");
    if (env != nullptr && *env != '\0') {
      Result<Isa> forced = parse_isa(env);
      if (!forced.ok()) {
        STRATA_LOG_WARN("STRATA_KERNELS_ISA: {}; using {}", forced.status().message(), isa_name(best));
      } else if (!isa_supported(*forced)) {
        STRATA_LOG_WARN("STRATA_KERNELS_ISA={} is not supported by this CPU; using {}", env, isa_name(best));
      } else {
        chosen = *forced;
      }
    }
    STRATA_LOG_INFO("optimizer kernels: {} (best on this CPU: {})", isa_name(chosen), isa_name(best));
  });
  return chosen;
}

namespace cpu {

PieceFn piece_fn(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return &run_piece_scalar;
    case Isa::kAvx2:
      return &run_piece_avx2;
    case Isa::kAvx512:
      return &run_piece_avx512;
  }
  STRATA_UNREACHABLE();
}

Q8PieceFn q8_piece_fn(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return &q8_piece_scalar;
    case Isa::kAvx2:
      return &q8_piece_avx2;
    case Isa::kAvx512:
      return &q8_piece_avx512;
  }
  STRATA_UNREACHABLE();
}

}  // namespace cpu
}  // namespace strata::kernels
