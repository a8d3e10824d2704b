"""What bench/torch_scale.py measures its step against: the disk as the kernel saw it (Note [Disk seen
by the kernel]), one resident Block's compute before the build and between the training steps (Note
[Compute paired with the steps]), strata-bench io's rates, strata-probe's prediction and the activations'
bytes. torch_scale.py imports it after it sets OPENBLAS_CORETYPE (Note [OpenBLAS core type] in
bench/blas_env.py): this module imports torch."""

import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from torch_gpt import Block  # noqa: E402

import strata.torch.functional as stf  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BLOCK_RUNS = 7  # timed runs of the resident block after one warm-up (their median is scaled)
PAIRED_IO_BYTES = 1 << 30  # each way, in each burst: strata-bench io's rates beside the steps
BURST_RUNS = 3  # timed runs of the paired block between two training steps (Note [Compute paired with the steps])


class DiskSampler:
    """The block device under a directory, read from /proc/diskstats (Note [Disk seen by the kernel]).

    Note [Disk seen by the kernel]
    strata's own counts say how many bytes a step moved; the kernel's say when the disk had them in
    flight. A snapshot at each phase boundary of a step gives, per phase, the sectors read and written
    and io_ticks: the milliseconds the device had at least one request in flight. busy_fraction =
    io_ticks / the phase's wall time says whether the disk idled during the phase (a fraction below 1
    is time the disk waited for work); it does not say the device was saturated (it serves several
    requests at once). The counts are the device's, every process's: on a shared disk another job's I/O
    shows here. Where the directory's device has no line (overlay or tmpfs), `device` is None and
    nothing is reported."""

    def __init__(self, path):
        st_dev = os.stat(path).st_dev
        self.key = (os.major(st_dev), os.minor(st_dev))
        self.device = None
        for parts in self._lines():
            if (int(parts[0]), int(parts[1])) == self.key:
                self.device = parts[2]

    @staticmethod
    def _lines():
        try:
            with open("/proc/diskstats") as f:
                return [line.split() for line in f if len(line.split()) >= 13]
        except OSError:
            return []

    def snapshot(self):
        """(bytes read, bytes written, io_ticks ms) so far, or None."""
        if self.device is None:
            return None
        for parts in self._lines():
            if (int(parts[0]), int(parts[1])) == self.key:
                return (int(parts[5]) * 512, int(parts[9]) * 512, int(parts[12]))
        return None

    @staticmethod
    def phase(a, b, seconds):
        """One phase's figures between snapshots a and b over `seconds` of wall time."""
        if a is None or b is None or seconds <= 0:
            return None
        return {"read_bytes": b[0] - a[0], "write_bytes": b[1] - a[1],
                "busy_fraction": round(min(1.0, (b[2] - a[2]) / 1000 / seconds), 3),
                "read_gb_s": round((b[0] - a[0]) / seconds / 1e9, 3),
                "write_gb_s": round((b[1] - a[1]) / seconds / 1e9, 3)}


def compute_bound(d, layers, args):
    """(forward + backward, torch AdamW, strata's AdamW) seconds of one step's compute: one resident Block,
    median of BLOCK_RUNS after a warm-up, times the number of blocks. strata's AdamW is the runtime's fused kernel
    (strata.torch.functional, --threads threads) on the block's parameters with fp32 states."""
    torch.manual_seed(0)
    block = Block(d, max(1, d // 64), args.seq).to(DTYPES[args.dtype])
    opt = torch.optim.AdamW(block.parameters(), lr=3e-4)
    x = torch.randn(args.batch, args.seq, d, dtype=DTYPES[args.dtype], requires_grad=True)
    # strata's kernel steps copies (param, exp_avg, exp_avg_sq), so torch's AdamW keeps its own.
    copies = [(p.detach().float(), torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32))
              for p in block.parameters()]
    fwd_bwd, adamw, fused = [], [], []
    for i in range(1 + BLOCK_RUNS):
        t0 = time.perf_counter()
        block(x).square().mean().backward()
        t1 = time.perf_counter()
        t2 = time.perf_counter()
        for (p, m, v), q in zip(copies, block.parameters()):
            stf.step_("adamw", p, q.grad.float(), [m, v], i + 1, threads=args.threads, lr=3e-4, weight_decay=0.01)
        fused.append(time.perf_counter() - t2)
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)  # as a plain torch step would (torch 2.x's default): fresh gradients
        fwd_bwd.append(t1 - t0)
        adamw.append(time.perf_counter() - t3)
    timed = fwd_bwd[1:]
    return (statistics.median(timed) * layers, statistics.median(adamw[1:]) * layers,
            statistics.median(fused[1:]) * layers, (min(timed) * layers, max(timed) * layers))


class PairedCompute:
    """A resident Block timed between the training steps (Note [Compute paired with the steps]).

    Note [Compute paired with the steps]
    This machine's speed moves by more than the effect the bound ratio reports: at 3.2 B fp32 one
    block's forward and backward scattered 27.6-46.6 s (scaled) over seven runs in half a minute, and
    the same code's step_s 43-54 s between runs minutes apart (docs/scale.md). A compute bound
    measured once, before the 3-minute build, was paired with steps it had not seen. So a resident
    Block of the same shape and dtype also runs between the training steps: strata's background work
    is flushed first (untimed, so the block shares the cores with nothing of strata's), then BURST_RUNS
    forward and backward passes, their median times the number of blocks. The bursts come after
    every second step, and only the second step of each pair is measured (steps 4, 6 and 8): the
    flush ends the updates deferred into the next forward (plan.deferred_updates, Note [Deferred
    updates] in runtime/src/pipeline/deferred_updates.cpp) and the write-backs that overlap it, so
    the step after a flush starts lighter than a step of a training loop does; the second of a pair
    starts with its predecessor's deferred work as in training. The first pair is not measured: its
    second step follows the warm-up step, whose re-plan runs every update before step() returns. A measured step's compute is the mean
    of the bursts just before and just after its pair. The block's gradient is freed after each
    pass, and its parameter and gradient bytes are in rss_bound_bytes (block_bytes).
    The disk moved as much: strata-bench io's read rate on --nvme-dir was 1.68 GB/s in one 3.2 B run
    and 2.20 GB/s in the next (fifteenth session), which moved disk_s by 24 % between runs whose steps
    moved 5 %. So each burst also runs strata-bench io once (PAIRED_IO_BYTES each way, 4 MiB pieces,
    32 in flight), and a measured step's disk seconds are its own bytes at the mean of the rates
    before and after its pair (disk_s_per_step; disk_s their median). The old figure, 5 runs after
    the model is closed, is disk_s_after_close."""

    def __init__(self, d, layers, args, nvme_dir=None):
        self.io = (args, nvme_dir) if nvme_dir is not None else None
        self.rates = []  # (read, write) bytes/s of PAIRED_IO_BYTES each way after each burst
        torch.manual_seed(1)
        dtype = DTYPES[args.dtype]
        self.block = Block(d, max(1, d // 64), args.seq).to(dtype)
        self.x = torch.randn(args.batch, args.seq, d, dtype=dtype, requires_grad=True)
        self.layers = layers
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.block.parameters())
        self.bursts = []

    def burst(self, model=None):
        if model is not None:
            model.strata.engine.flush()
        times = []
        for i in range(BURST_RUNS + (1 if not self.bursts else 0)):  # the first burst warms up once
            t0 = time.perf_counter()
            self.block(self.x).square().mean().backward()
            times.append(time.perf_counter() - t0)
            self.block.zero_grad(set_to_none=True)
            self.x.grad = None
        self.bursts.append(statistics.median(times[-BURST_RUNS:]) * self.layers)
        if self.io is not None:  # the disk's rates beside it (Note [Compute paired with the steps])
            io, _ = io_rates(*self.io, PAIRED_IO_BYTES, runs=1)
            self.rates.append((io_rate(io, "read"), io_rate(io, "write")))

    def around(self, i):
        """The compute seconds of step i (0-based): the mean of the bursts before and after its pair."""
        return (self.bursts[i // 2] + self.bursts[i // 2 + 1]) / 2

    def disk_around(self, i, read_bytes, write_bytes):
        """The disk seconds of step i's bytes at the mean of the rates measured before and after its pair."""
        (r0, w0), (r1, w1) = self.rates[i // 2], self.rates[i // 2 + 1]
        return read_bytes / ((r0 + r1) / 2) + write_bytes / ((w0 + w1) / 2)


def io_rates(args, nvme_dir, io_bytes, runs=5):
    """(strata-bench io's JSON, its command): uring, 4 MiB pieces, 32 in flight, on nvme_dir."""
    if not args.strata_bench or not os.path.exists(args.strata_bench):
        raise SystemExit(f"torch_scale: --strata-bench {args.strata_bench!r} not found; build the strata-bench "
                         "target (cmake --build --preset release --target strata-bench) and pass its path")
    cmd = [args.strata_bench, "io", "--dir", nvme_dir, "--bytes", str(io_bytes), "--block", "4MiB",
           "--request", "4MiB", "--qd", "32", "--runs", str(runs), "--engines", "uring", "--skip-fio", "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    r = json.loads(out.stdout[out.stdout.index("{"):])
    return r, cmd


def io_rate(io, what):
    """Bytes/s of strata's uring engine for `what` (read or write) in strata-bench io's JSON."""
    value = io.get(f"uring_{what}_gib_s")
    if not isinstance(value, (int, float)) or value <= 0:
        raise SystemExit(f"torch_scale: no uring_{what}_gib_s in strata-bench io's output: {sorted(io)}")
    return value * (1 << 30)


def probe_prediction(args, nvme_dir, d, layers, chunk_elems, cfg, host, compute_s):
    """strata-probe's prediction of this run's step (#28 item 6): the same shape, chunk size, budgets and
    precision, its compute rate set so that its compute term is the compute_s measured here. A dict of
    probe_step_s (None where it cannot say: the probe's reason in probe_error), probe_placement and the
    command."""
    if not args.strata_probe or not os.path.exists(args.strata_probe):
        return {"probe_step_s": None, "probe_error": f"--strata-probe {args.strata_probe!r} not found"}
    tokens = args.batch * args.seq
    flops = 6 * (12 * d * d * layers + 256 * d) * tokens  # the probe's forward + backward (runtime::forward_flops)
    tflops = flops / compute_s / 1e12
    cmd = [args.strata_probe, "--json", "--layers", str(layers), "--hidden", str(d), "--seq", str(args.seq),
           "--batch", str(args.batch), "--vocab", "256", "--chunk-elems", str(chunk_elems),
           "--precision", args.dtype, "--nvme", nvme_dir, "--nvme-bytes", "256MiB", "--nvme-seconds", "1",
           "--device", "sim", "--device-budget", str(cfg["device"]["budget"]), "--host-budget", str(host),
           "--tflops", f"{tflops:.6g}", "--link", "1000GiB"]
    deferred = dict(getattr(args, "set", [])).get("plan.deferred_updates")
    if deferred:  # the trainer's plan.deferred_updates (Note [Deferred updates])
        cmd += ["--deferred-updates", str(deferred)]
    result = {"probe_cmd": " ".join(cmd), "probe_step_s": None, "probe_placement": None}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # it takes seconds
    except subprocess.TimeoutExpired:
        result["probe_error"] = "strata-probe ran over 600 s"
        return result
    if out.returncode != 0:
        result["probe_error"] = out.stderr.strip() or f"exit code {out.returncode}"
        return result
    report = json.loads(out.stdout)
    model, machine = report["model"], report["machine"]
    # The host's rates the host-cores bound reads (Note [Host-cores bound] in torch_scale.py).
    result["probe_host_memory_bytes_s"] = machine["host_memory_gib_s"] * (1 << 30)
    result["probe_disk_cpu_s_per_byte"] = (machine.get("nvme") or {}).get("cpu_s_per_gib", 0.0) / (1 << 30)
    result["probe_cores"] = machine["cores"]
    result["probe_placement"] = model["fastest_placement"]
    if model["predicted_step_s"] is None:
        result["probe_error"] = "the probe fits this model to no placement at these budgets"
    else:
        result["probe_step_s"] = round(model["predicted_step_s"], 3)
    return result


def activations(d, layers, args):
    """Bytes of the activations autograd keeps for one step (generous: 40 floats per token and width per layer,
    plus the attention maps and the logits)."""
    tokens = args.batch * args.seq
    return 4 * layers * (40 * tokens * d + 4 * max(1, d // 64) * tokens * args.seq) + 4 * 3 * tokens * 256
