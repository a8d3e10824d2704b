#!/usr/bin/env python3
"""Trains a GPT of a given size through strata.torch with deferred init and compares its step
time with the machine's bound (issue #28; docs/scale.md).

    PYTHONPATH=build/release/python /usr/bin/python3 bench/torch_scale.py --params 50M --json \
        --nvme-dir /var/tmp --strata-bench build/release/bench/strata-bench

The model (examples/torch_gpt.py's Gpt, byte vocabulary, batch x seq tokens, --dtype fp32 or bf16)
is built inside strata.torch.init() and initialised straight into strata's chunks (Note [Deferred
init]). It trains `--steps` AdamW steps (8: the loss of each is reported; step_s is the median of
steps 4, 6 and 8, each the second of a pair: Note [Compute paired with the steps]), with a linear learning-rate warm-up over --warmup steps to --lr (default by width:
default_lr). Progress goes to stderr, one line per phase with the process's RSS.
The bound, measured in the same run:
  - compute_s: forward + backward of one Block of the same shape, resident in torch memory, times
    the number of blocks (embeddings and head are left out: < 1% here), measured between the training
    steps (Note [Compute paired with the steps]): each measured step's compute is the mean of the
    bursts before and after its pair of steps (compute_s_per_step), compute_s their median. compute_s_before_build
    (and its _range) is the median of BLOCK_RUNS runs before the model is built, as before.
    torch's AdamW (torch_adamw_s) and strata's fused AdamW (strata_adamw_s) on the block, scaled
    alike, are reported beside it;
  - disk_s: each measured step's disk read and write bytes (strata's own counts) at the read and
    write rates `strata-bench io` measures on --nvme-dir at the runtime's piece size (4 MiB) and
    queue depth (32 pieces) beside the compute bursts (Note [Compute paired with the steps]), the
    mean of those before and after the step's pair; disk_s is their median (disk_s_per_step each),
    disk_s_after_close the older figure (5 runs after the model is closed);
  - bound_s = max(compute_s, disk_s); bound_ratio = step_s / bound_s; bound_ratio_per_step: each
    measured step against its own compute and bytes;
  - shared_core_bound_s = max(compute_s + strata_adamw_s, disk_s): on the sim device forward,
    backward and strata's optimizer share the same cores;
  - probe_step_s, probe_ratio: strata-probe's prediction of this run (same shape, budgets and
    chunk size; its compute rate from compute_s), reported, not checked.
median_step_disk: that step's forward, backward and optimizer.step() as the kernel saw the disk under
--nvme-dir (/proc/diskstats: bytes, and the fraction of the phase it had I/O in flight; Note [Disk seen
by the kernel]); disk_device names it.
Peak RSS is compared with rss_bound_bytes: the process before the model, the host tier's pinned
region (host_region_bytes), the sim device's memory, activations, init scratch and 128 MiB.
exact_small_copy: a copy of --small-params (20M) trained 3 steps with its states on NVMe and again
all on host: losses and final parameters bit-identical.
OPENBLAS_CORETYPE is set from the CPU's flags before torch loads unless the environment sets it
(openblas_coretype reports it): Debian's OpenBLAS picks its SSE3 kernels on this project's machines
(Note [OpenBLAS core type] in bench/blas_env.py).
"""

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from blas_env import set_openblas_coretype  # noqa: E402

# Note [OpenBLAS core type] (bench/blas_env.py): before torch loads.
OPENBLAS_CORETYPE = set_openblas_coretype()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "examples"))
from torch_gpt import Block, Gpt, batches, corpus, init_weights  # noqa: E402

import strata.torch as st  # noqa: E402
import strata.torch.functional as stf  # noqa: E402


def parse_count(text):
    m = re.fullmatch(r"([0-9.]+)([kKmMbBgG]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: a parameter count such as 50M, 1.2B or 3B")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}[m.group(2).lower()])


def parse_setting(text):
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set {text!r}: give KEY=VALUE, e.g. plan.nvme_families_in_flight=3")
    return key, int(value) if value.isdigit() else value


def shape_for(params):
    """(d_model, layers) of a GPT with about `params` parameters (12 d^2 per block)."""
    d = 384 if params < 3e7 else 512 if params < 1e8 else 1024 if params < 6e8 else 2048 if params < 2e9 else 2560
    return d, max(1, round(params / (12 * d * d)))


T0 = time.perf_counter()


def proc_kib_field(path, key):
    """The value of `key` (a "Key:  N kB" line of a /proc file) in bytes, 0 where there is none."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_now():
    """The process's resident memory now (VmRSS), in bytes."""
    return proc_kib_field("/proc/self/status", "VmRSS")


def progress(what):
    """One line on stderr: seconds since start, the process's resident memory now, what is done."""
    rss = rss_now()
    print(f"torch_scale: {time.perf_counter() - T0:7.1f} s  rss {rss / 2**30:6.2f} GiB  {what}", file=sys.stderr,
          flush=True)


def default_lr(d):
    """AdamW's learning rate for a GPT of width d in this bench (batch 1 x 64 tokens, std-0.02 init): plain
    torch's loss rises after the first steps at d 2560 with lr 1e-4 or 2e-5 and falls with 5e-6 (docs/scale.md)."""
    return 3e-4 if d <= 512 else 1e-4 if d <= 1024 else 1e-5 if d <= 2048 else 5e-6


def mem_total():
    return proc_kib_field("/proc/meminfo", "MemTotal")


def swap_file_bytes(nvme_dir):
    """Disk blocks held by this process's (unlinked) swap files under nvme_dir."""
    total, root = 0, os.path.realpath(nvme_dir)
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(root) and target.endswith("(deleted)"):
                total += os.fstat(int(fd)).st_blocks * 512
        except OSError:
            pass
    return total


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


def build(d, layers, seq, cfg, lr, dtype=torch.float32):
    """The GPT on the meta device (in `dtype`: bf16 params and gradients keep fp32 masters and states in strata),
    wrapped; the optimizer's build runs deferred init."""
    with st.init():
        model = Gpt(d=d, layers=layers, heads=max(1, d // 64), seq=seq).to(dtype)
    model = st.wrap(model, cfg, init=init_weights)
    opt = st.AdamW(model.parameters(), lr=lr, weight_decay=0.1)  # builds: deferred init runs here
    return model, opt


def config(n, d, args, nvme_dir, host, all_host=False):
    largest = 4 * d * d
    gpu = 6 * largest * 4  # 3 slots of chunks up to twice the largest tensor
    cfg = {"device": {"kind": "sim", "budget": gpu + (64 << 20)},
           "budgets": {"gpu": gpu, "host": host}, "threads": args.threads,
           # Gradients go to strata during backward from the first step on: with "auto" the first step keeps
           # every gradient in torch memory (Note [Gradients in torch]), the model's size in RSS.
           "grad_reads": False}
    for key, value in getattr(args, "set", []):  # --set plan.nvme_families_in_flight=3: a knob of the runtime, for this run
        node = cfg
        *path, leaf = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    if not all_host:
        cfg["budgets"]["nvme"] = "1TiB"  # a cap: the swap files grow to what the plan needs (#28 item 2)
        cfg["nvme"] = {"dirs": [nvme_dir]}
    return cfg


def train(model, opt, data, args, steps, disk=None, paired=None):
    it = batches(data, args.batch, args.seq, seed=1)
    snap = disk.snapshot if disk is not None else (lambda: None)
    if paired is not None:
        paired.burst()
    losses, times, stats = [], [], []
    for i in range(steps):
        for g in opt.param_groups:  # linear warm-up: lr x (i + 1) / warmup for the first `warmup` steps
            g["lr"] = args.lr * min(1.0, (i + 1) / max(1, args.warmup))
        x, y = next(it)
        c0 = resource.getrusage(resource.RUSAGE_SELF)
        d0 = snap()
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        t1 = time.perf_counter()
        d1 = snap()
        loss.backward()
        t2 = time.perf_counter()
        d2 = snap()
        stats.append(dict(opt.step() or model.strata.last_stats))
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        d3 = snap()
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        stats[-1].update(forward_s=t1 - t0, backward_s=t2 - t1, step_call_s=times[-1] - (t2 - t0),
                         user_s=c1.ru_utime - c0.ru_utime, system_s=c1.ru_stime - c0.ru_stime,
                         minor_faults=c1.ru_minflt - c0.ru_minflt)
        # Note [Disk seen by the kernel]
        stats[-1]["disk_phases"] = {"forward": DiskSampler.phase(d0, d1, t1 - t0),
                                    "backward": DiskSampler.phase(d1, d2, t2 - t1),
                                    "step_call": DiskSampler.phase(d2, d3, times[-1] - (t2 - t0)),
                                    "step": DiskSampler.phase(d0, d3, times[-1])}
        losses.append(loss.item())
        if paired is not None and (i % 2 == 1 or i == steps - 1):
            # Note [Compute paired with the steps]: untimed, after each pair of steps
            paired.burst(model)
            for j in range(i - i % 2, i + 1):
                stats[j]["compute_s"] = paired.around(j)
        progress(f"step {len(losses)}: loss {losses[-1]:.4f}, {times[-1]:.2f} s"
                 + (f", compute {stats[-1]['compute_s']:.2f} s" if "compute_s" in stats[-1] else ""))
    return losses, times, stats


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


BLOCK_RUNS = 7  # timed runs of the resident block after one warm-up (their median is scaled)
PAIRED_IO_BYTES = 1 << 30  # each way, in each burst: strata-bench io's rates beside the steps
MEASURED_STEPS = (3, 5, 7)  # 0-based: the second step of each pair after the first (steps 4, 6 and 8)
BURST_RUNS = 3  # timed runs of the paired block between two training steps (Note [Compute paired with the steps])


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
    model = json.loads(out.stdout)["model"]
    result["probe_placement"] = model["fastest_placement"]
    if model["predicted_step_s"] is None:
        result["probe_error"] = "the probe fits this model to no placement at these budgets"
    else:
        result["probe_step_s"] = round(model["predicted_step_s"], 3)
    return result


def small_copy(args, data, nvme_dir):
    """exact_small_copy: the same code at --small-params, states on NVMe vs all on host."""
    d, layers = shape_for(args.small_params)
    results = []
    for all_host in (True, False):
        torch.manual_seed(0)
        n = 12 * layers * d * d
        model, opt = build(d, layers, args.seq, config(n, d, args, nvme_dir, 24 * n if all_host else 12 * n,
                                                        all_host), args.lr, DTYPES[args.dtype])
        losses, _, _ = train(model, opt, data, args, 3)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        results.append((losses, state))
        model.strata.close()
    (l0, s0), (l1, s1) = results
    return l0 == l1 and all(torch.equal(s0[k], s1[k]) for k in s0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=parse_count, default=parse_count("50M"))
    ap.add_argument("--small-params", type=parse_count, default=parse_count("20M"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--host-fraction", type=float, default=None,
                    help="host budget as a fraction of the state (default: min(0.5, 0.35 x RAM / state))")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                    help="the model's parameter dtype; bf16 halves the param traffic (fp32 masters and states)")
    ap.add_argument("--lr", type=float, default=None,
                    help="AdamW's learning rate after warm-up (default: by width, default_lr; docs/scale.md)")
    ap.add_argument("--warmup", type=int, default=5,
                    help="steps of linear learning-rate warm-up (lr x step / warmup); AdamW's first full-size "
                         "steps on a large model from std-0.02 init raise the loss without it")
    ap.add_argument("--nvme-dir", default=None, help="directory for the swap files (default: a temp dir)")
    ap.add_argument("--strata-bench", default=os.path.join(ROOT, "build", "release", "bench", "strata-bench"))
    ap.add_argument("--strata-probe", default=os.path.join(ROOT, "build", "release", "tools", "probe", "strata-probe"))
    ap.add_argument("--io-bytes", type=int, default=None, help="bytes for strata-bench io (default: 1 GiB max)")
    ap.add_argument("--no-small-copy", action="store_true")
    ap.add_argument("--set", type=parse_setting, action="append", default=[], metavar="KEY=VALUE",
                    help="a strata.torch config key for every model the run trains (the small copy too), e.g. "
                         "plan.nvme_families_in_flight=3; repeatable")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 unless the loss falls, exact_small_copy holds, peak RSS is within the host budget plus "
                         "the stated overhead and the swap files hold no more than the plan (docs/scale.md)")
    args = ap.parse_args()
    if args.steps < 8:
        raise SystemExit("torch_scale: --steps must be >= 8 (step_s is the median of steps 4, 6 and 8)")
    nvme_root = args.nvme_dir or tempfile.gettempdir()
    if not os.path.isdir(nvme_root):
        raise SystemExit(f"torch_scale: --nvme-dir {nvme_root} is not a directory; create it (mkdir -p) or "
                         "name another on the disk to measure")
    with tempfile.TemporaryDirectory(prefix="strata-scale-", dir=nvme_root) as nvme_dir:
        result = run(args, nvme_dir)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for k, v in result.items():
            print(f"{k:>24}: {v}")
    if args.check:
        missed = [what for what, ok in (
            ("the loss did not fall", result["loss_decreasing"]),
            ("exact_small_copy is false", result["exact_small_copy"] is not False),
            ("peak RSS above host budget + stated overhead", result["peak_rss_bytes"] <= result["rss_bound_bytes"]),
            ("swap files larger than the plan", result["nvme_bytes_allocated"] <= result["nvme_bytes_planned"] + (1 << 20)))
            if not ok]
        if missed:
            print("torch_scale: " + "; ".join(missed), file=sys.stderr)
            return 1
    return 0


def run(args, nvme_dir):
    data = corpus(fixed=True)
    d, layers = shape_for(args.params)
    if args.lr is None:
        args.lr = default_lr(d)
    n = 12 * layers * d * d
    state_bytes = 16 * n
    ram = mem_total()
    fraction = args.host_fraction if args.host_fraction is not None else min(0.5, 0.35 * ram / state_bytes)
    host = int(fraction * state_bytes)
    # The compute bound first, on a quiet heap (after the model is closed, the kernel is still taking back
    # its memory, and the block's times scatter more).
    alone_s, adamw_s, strata_adamw_s, alone_range = compute_bound(d, layers, args)
    progress("measured one resident block")
    paired = PairedCompute(d, layers, args, nvme_dir)  # held through training: its parameters are in rss_start
    torch.manual_seed(0)
    t0 = time.perf_counter()
    rss_start = rss_now()  # (not ru_maxrss: that holds the block's peak, which is gone)
    cfg = config(n, d, args, nvme_dir, host)
    model, opt = build(d, layers, args.seq, cfg, args.lr, DTYPES[args.dtype])
    init_s = time.perf_counter() - t0
    progress(f"built and initialised in {init_s:.1f} s")
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    layout = model.strata.engine.layout()
    disk = DiskSampler(nvme_dir)
    losses, times, stats = train(model, opt, data, args, args.steps, disk, paired)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    nvme_alloc = swap_file_bytes(nvme_dir)
    plan_nvme = model.strata.engine.layout()["plan_nvme_bytes"]
    measured = MEASURED_STEPS  # the second of each pair (Note [Compute paired with the steps])
    mid = sorted(measured, key=lambda i: times[i])[1]
    step_s = times[mid]
    compute_s = statistics.median(stats[i]["compute_s"] for i in measured)
    read_b, write_b = stats[mid]["bytes_disk_read"], stats[mid]["bytes_disk_write"]
    model.strata.close(restore=False)  # 4 B a parameter back in torch memory would not fit beside the host tier
    del model, opt
    progress("closed the model")
    io_bytes = args.io_bytes or max(256 << 20, min(1 << 30, (read_b + write_b) // 4 // (4 << 20) * (4 << 20)))
    io, io_cmd = io_rates(args, nvme_dir, io_bytes)
    read_rate, write_rate = io_rate(io, "read"), io_rate(io, "write")
    disk_s_after_close = read_b / read_rate + write_b / write_rate
    # Each measured step's bytes at the rates measured beside it (Note [Compute paired with the steps]).
    disk_s_per_step = [paired.disk_around(i, stats[i]["bytes_disk_read"], stats[i]["bytes_disk_write"])
                       for i in measured]
    disk_s = statistics.median(disk_s_per_step)
    probe = probe_prediction(args, nvme_dir, d, layers, layout["chunk_elems"], cfg, host, compute_s)
    if probe["probe_step_s"] is not None:
        probe["probe_ratio"] = round(step_s / probe["probe_step_s"], 3)
    bound_s = max(compute_s, disk_s)
    # Each measured step against its own paired compute and its own bytes (Note [Compute paired with the steps]).
    per_step_ratios = [times[i] / max(stats[i]["compute_s"], disk_s_per_step[k]) for k, i in enumerate(measured)]
    # On the sim device forward, backward and strata's optimizer run on the same cores: their sum is the
    # compute this machine must do each step (docs/scale.md, "Two bounds").
    shared_bound_s = max(compute_s + strata_adamw_s, disk_s)
    return {
        "params": params, "d_model": d, "layers": layers, "batch": args.batch, "seq": args.seq,
        "state_bytes": 16 * params, "state_over_ram": round(16 * params / ram, 3),
        "host_budget_bytes": host, "peak_rss_bytes": peak_rss,
        # Stated overhead (docs/scale.md): the process before the model (Python, torch, the corpus), the host
        # tier's pinned region (budgets.host and its allocator's room, 1/4 of it + 8 MiB), the sim device's
        # memory, activations of one step, 2 x (the largest module + one chunk) of init scratch and a fixed
        # 128 MiB (the allocator's retained free memory, the runtime's tables, torch's transient gradients
        # before they are handed over).
        "host_region_bytes": layout["host_region_bytes"],
        "rss_bound_bytes": rss_start + layout["host_region_bytes"] + cfg["device"]["budget"]
        + activations(d, layers, args) + 2 * 4 * (4 * d * d + layout["chunk_elems"]) + (128 << 20)
        + paired.param_bytes,  # the paired block's gradient (its parameters are in rss_start)
        "block_bytes": 2 * paired.param_bytes,  # its parameters and gradient
        "nvme_bytes_allocated": nvme_alloc, "nvme_bytes_planned": plan_nvme,
        "chunk_elems": layout["chunk_elems"], "padding_fraction": round(layout["padding_fraction"], 4),
        "init_s": round(init_s, 2), "step_times_s": [round(t, 3) for t in times], "step_s": round(step_s, 3),
        "disk_read_bytes_per_step": read_b, "disk_write_bytes_per_step": write_b,
        # Of the reads: NVMe-homed params read for forward and backward, and read again beside their states for
        # the optimizer (Note [NVMe-homed params] in runtime/src/residency/residency.hpp).
        "disk_read_param_uses_bytes_per_step": stats[mid]["bytes_disk_read_param_uses"],
        "disk_read_param_updates_bytes_per_step": stats[mid]["bytes_disk_read_param_updates"],
        "plan": layout.get("plan_summary"),
        # Where the median step's time went (item 4 of #28: what the bound leaves on the table).
        "median_step_split_s": {k: round(stats[mid][k], 3) for k in ("forward_s", "backward_s", "step_call_s",
                                                                     "stall_s", "user_s", "system_s",
                                                                     "minor_faults")},
        # The same step as the kernel saw the disk (Note [Disk seen by the kernel]).
        "disk_device": disk.device, "median_step_disk": stats[mid]["disk_phases"],
        "io_read_bytes_s": read_rate, "io_write_bytes_s": write_rate, "io_bench": " ".join(io_cmd),
        "disk_s_after_close": round(disk_s_after_close, 3),
        "disk_s_per_step": [round(t, 3) for t in disk_s_per_step],
        "paired_io_rates_bytes_s": [[round(r), round(w)] for r, w in paired.rates],
        "compute_s": round(compute_s, 3),
        "compute_s_per_step": [round(stats[i]["compute_s"], 3) for i in measured],
        "compute_bursts_s": [round(t, 3) for t in paired.bursts],
        "compute_s_before_build": round(alone_s, 3), "compute_s_before_build_range": [round(t, 3) for t in alone_range],
        "torch_adamw_s": round(adamw_s, 3),
        "strata_adamw_s": round(strata_adamw_s, 3), "disk_s": round(disk_s, 3),
        "bound_s": round(bound_s, 3), "bound_ratio": round(step_s / bound_s, 3),
        "bound_ratio_per_step": [round(r, 3) for r in per_step_ratios],
        "shared_core_bound_s": round(shared_bound_s, 3), "shared_core_bound_ratio": round(step_s / shared_bound_s, 3),
        **probe,
        "dtype": args.dtype, "lr": args.lr, "warmup_steps": args.warmup, "losses": [round(x, 5) for x in losses],
        "loss_decreasing": losses[-1] < losses[0],
        "exact_small_copy": None if args.no_small_copy else small_copy(args, data, nvme_dir),
        "load_avg": os.getloadavg(),
        "openblas_coretype": OPENBLAS_CORETYPE,
    }


def activations(d, layers, args):
    """Bytes of the activations autograd keeps for one step (generous: 40 floats per token and width per layer,
    plus the attention maps and the logits)."""
    tokens = args.batch * args.seq
    return 4 * layers * (40 * tokens * d + 4 * max(1, d // 64) * tokens * args.seq) + 4 * 3 * tokens * 256


def io_rate(io, what):
    """Bytes/s of strata's uring engine for `what` (read or write) in strata-bench io's JSON."""
    value = io.get(f"uring_{what}_gib_s")
    if not isinstance(value, (int, float)) or value <= 0:
        raise SystemExit(f"torch_scale: no uring_{what}_gib_s in strata-bench io's output: {sorted(io)}")
    return value * (1 << 30)


if __name__ == "__main__":
    sys.exit(main())
