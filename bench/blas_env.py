"""OpenBLAS's kernel choice for the benches, made before torch loads (Note [OpenBLAS core type]).

Note [OpenBLAS core type]
Debian's torch 1.13 runs its fp32 matmuls in the system OpenBLAS (0.3.21, built for every x86
core and choosing one at load). On this project's machines (an "Intel(R) Xeon(R) Processor"
with AVX-512 and AVX512_BF16) its detection picks Prescott, the SSE3 kernels:
`OPENBLAS_VERBOSE=2 python3 -c "import torch"` prints "Core: Prescott", and a
2048 x 2048 fp32 matmul runs at 64 GFLOP/s on one thread against 287 GFLOP/s with
OPENBLAS_CORETYPE=COOPERLAKE. A profile of the 3.2 B fp32 step (perf, cpu-clock) had 48 % of
its samples in sgemm_*_PRESCOTT. That is torch's compute, not strata's: the bench measures its
compute bound with the same torch in the same process, so both sides of bound_ratio change
together, but a step on two cores that torch's compute shares with strata's copies,
checksums and optimizer is slower than the machine allows.

So a bench that times torch sets OPENBLAS_CORETYPE from the CPU's flags before torch loads,
unless the environment already sets it (the value in effect is reported), as torch_gpt.py
sets OMP_WAIT_POLICY (Note [OpenMP waits in the bench]). A user of torch on such a machine
can set it the same way; it changes which kernels run, not what they compute beyond the
rounding of a different summation order (fp32 runs compared bit for bit are compared within
one process, under one setting).
"""
import os


def cpu_flags(path="/proc/cpuinfo"):
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def openblas_coretype_for(flags):
    """The OpenBLAS core type for these CPU flags, or None to leave OpenBLAS's own choice."""
    if {"avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512_bf16"} <= flags:
        return "COOPERLAKE"
    if {"avx512f", "avx512vl", "avx512bw", "avx512dq"} <= flags:
        return "SKYLAKEX"
    if {"avx2", "fma"} <= flags:
        return "HASWELL"
    return None


def set_openblas_coretype():
    """Sets OPENBLAS_CORETYPE unless it is set; returns the value in effect ("" for OpenBLAS's own)."""
    if "OPENBLAS_CORETYPE" not in os.environ:
        chosen = openblas_coretype_for(cpu_flags())
        if chosen is not None:
            os.environ["OPENBLAS_CORETYPE"] = chosen
    return os.environ.get("OPENBLAS_CORETYPE", "")
