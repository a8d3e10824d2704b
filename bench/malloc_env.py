"""glibc's handling of freed memory for the benches, set before torch loads (Note [Freed memory on these VMs]).

Note [Freed memory on these VMs]
This project's machines are virtual machines whose memory balloon reports free pages to the host
(virtio-balloon, feature bit 5 FREE_PAGE_REPORTING in /sys/bus/virtio/devices/*/features, device
0x0005). A page the guest frees goes back to the host; touching it again is a fault in the guest and
one in the host, which zeroes a page it may first have to find. glibc's malloc gives large blocks
back as soon as they are freed (mmap above its threshold, heap trimming above another), so a step
that allocates and frees its buffers faults them in again each time. torch.optim.AdamW(foreach=True)
is such a step: it allocates a temporary per parameter list, 190,000 minor faults (0.75 GB) a step
at 100 M params.

What that costs is the host's business, not the process's, and it drifts: in three invocations of
bench/torch_gpt.py --sizes 100M in a row (sixteenth session), the plain step's AdamW took 0.66 s,
0.94 s and 1.19 s (medians of 40 steps each), so fit_overhead moved 0.74, 0.70, 0.60 (±10 %)
while the work was the same. Alone in a process the same AdamW took 0.55 s in three invocations,
and 0.35-0.40 s with freed memory kept (bench/torch_plain_scatter.py, seventeenth session).

So a bench that compares torch with strata keeps glibc from giving memory back
(M_MMAP_THRESHOLD 1 GiB, M_TRIM_THRESHOLD 2 GiB), before torch loads and for every variant alike,
as it sets OMP_WAIT_POLICY (Note [OpenMP waits in the bench] in torch_gpt.py) and
OPENBLAS_CORETYPE (Note [OpenBLAS core type] in blas_env.py), and reports that it did. Where the
environment sets MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ (glibc reads them at start) it
is left alone. A user of torch on such a machine can do the same with those two variables, or use
jemalloc or tcmalloc, as PyTorch's CPU performance guide advises. strata's own host memory is its
pinned arena, which keeps what it maps, so this changes torch's allocations on both sides, not
strata's.
"""
import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
ENV_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory(enabled=True):
    """Keeps glibc's freed memory in the process unless the environment chose (Note [Freed memory on
    these VMs]). Returns what is in effect: "kept", "environment" or "returned" (glibc's default)."""
    if any(k in os.environ for k in ENV_KNOBS):
        return "environment"
    if not enabled:
        return "returned"
    libc = ctypes.CDLL("libc.so.6")
    if not (libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1)):
        raise SystemExit("bench: glibc's mallopt refused the thresholds (Note [Freed memory on these VMs]); "
                         "run with --malloc-returns-memory to leave glibc's defaults")
    return "kept"
