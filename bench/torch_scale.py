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
  - host_cores_s: the host cores' work a step on the sim device, compute_s + strata_adamw_s + the sim
    device's copies + the disk's CPU time, at the probe's rates (Note [Host-cores bound]);
  - bound_s = max(disk_s, host_cores_s), `bound` naming which ("compute" without the probe's rates:
    then max(compute_s, disk_s)); bound_ratio = step_s / bound_s; bound_ratio_per_step: each
    measured step against its own compute and bytes; compute_disk_bound_s (and _ratio) = max(compute_s,
    disk_s), the bound before the host cores were counted;
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
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from blas_env import set_openblas_coretype  # noqa: E402

# Note [OpenBLAS core type] (bench/blas_env.py): before torch loads.
OPENBLAS_CORETYPE = set_openblas_coretype()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "examples"))
from torch_gpt import Gpt, batches, corpus, init_weights  # noqa: E402

import strata.torch as st  # noqa: E402
from scale_bound import (DTYPES, DiskSampler, PairedCompute, activations, compute_bound, io_rate,  # noqa: E402
                         io_rates, probe_prediction)

MEASURED_STEPS = (3, 5, 7)  # 0-based: the second step of each pair after the first (steps 4, 6 and 8)


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
            ("swap files larger than the plan", result["nvme_bytes_allocated"] <= result["nvme_bytes_planned"] + (1 << 20)),
            # Note [Host-cores bound]: with the probe's rates the host's part counts more than compute.
            ("host_cores_s missing or below compute_s", result["probe_step_s"] is None
             or (result["host_cores_s"] is not None and result["host_cores_s"] > result["compute_s"])))
            if not ok]
        if missed:
            print("torch_scale: " + "; ".join(missed), file=sys.stderr)
            return 1
    return 0


def train_measured(args, nvme_dir, data, d, layers, n, host):
    """The compute bound on its own, then the model built, trained and closed: a namespace of what run
    reports of them."""
    m = types.SimpleNamespace()
    # The compute bound first, on a quiet heap (after the model is closed, the kernel is still taking back
    # its memory, and the block's times scatter more).
    m.alone_s, m.adamw_s, m.strata_adamw_s, m.alone_range = compute_bound(d, layers, args)
    progress("measured one resident block")
    m.paired = PairedCompute(d, layers, args, nvme_dir)  # held through training: its parameters are in rss_start
    torch.manual_seed(0)
    t0 = time.perf_counter()
    m.rss_start = rss_now()  # (not ru_maxrss: that holds the block's peak, which is gone)
    m.cfg = config(n, d, args, nvme_dir, host)
    model, opt = build(d, layers, args.seq, m.cfg, args.lr, DTYPES[args.dtype])
    m.init_s = time.perf_counter() - t0
    progress(f"built and initialised in {m.init_s:.1f} s")
    m.params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    m.layout = model.strata.engine.layout()
    m.disk = DiskSampler(nvme_dir)
    m.losses, m.times, m.stats = train(model, opt, data, args, args.steps, m.disk, m.paired)
    m.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    m.nvme_alloc = swap_file_bytes(nvme_dir)
    m.plan_nvme = model.strata.engine.layout()["plan_nvme_bytes"]
    model.strata.close(restore=False)  # 4 B a parameter back in torch memory would not fit beside the host tier
    del model, opt
    progress("closed the model")
    return m


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
    m = train_measured(args, nvme_dir, data, d, layers, n, host)
    m.measured = measured = MEASURED_STEPS  # the second of each pair (Note [Compute paired with the steps])
    times, stats = m.times, m.stats
    m.mid = mid = sorted(measured, key=lambda i: times[i])[1]
    m.step_s = step_s = times[mid]
    m.compute_s = compute_s = statistics.median(stats[i]["compute_s"] for i in measured)
    m.read_b, m.write_b = read_b, write_b = stats[mid]["bytes_disk_read"], stats[mid]["bytes_disk_write"]
    io_bytes = args.io_bytes or max(256 << 20, min(1 << 30, (read_b + write_b) // 4 // (4 << 20) * (4 << 20)))
    io, m.io_cmd = io_rates(args, nvme_dir, io_bytes)
    m.read_rate, m.write_rate = io_rate(io, "read"), io_rate(io, "write")
    m.disk_s_after_close = read_b / m.read_rate + write_b / m.write_rate
    # Each measured step's bytes at the rates measured beside it (Note [Compute paired with the steps]).
    m.disk_s_per_step = [m.paired.disk_around(i, stats[i]["bytes_disk_read"], stats[i]["bytes_disk_write"])
                         for i in measured]
    m.disk_s = disk_s = statistics.median(m.disk_s_per_step)
    m.probe = probe_prediction(args, nvme_dir, d, layers, m.layout["chunk_elems"], m.cfg, host, compute_s)
    if m.probe["probe_step_s"] is not None:
        m.probe["probe_ratio"] = round(step_s / m.probe["probe_step_s"], 3)
    m.compute_disk_bound_s = max(compute_s, disk_s)
    # Each measured step against its own paired compute and its own bytes (Note [Compute paired with the steps]).
    # On the sim device forward, backward and strata's optimizer run on the same cores: their sum is the
    # compute this machine must do each step (docs/scale.md, "Two bounds").
    m.shared_bound_s = max(compute_s + m.strata_adamw_s, disk_s)
    m.host_cores_s_per_step = [host_cores_seconds(m, stats[i]) for i in measured]
    m.host_cores_s = statistics.median(m.host_cores_s_per_step) if m.host_cores_s_per_step[0] is not None else None
    m.bound_s = max(disk_s, m.host_cores_s or compute_s)
    m.bound = "disk" if m.bound_s == disk_s else ("host_cores" if m.host_cores_s is not None else "compute")
    m.per_step_ratios = [times[i] / max(m.disk_s_per_step[k], m.host_cores_s_per_step[k] or stats[i]["compute_s"])
                         for k, i in enumerate(measured)]
    return report(args, m, data, nvme_dir, d, layers, host, ram)


# Note [Host-cores bound]
# On the sim device every piece of a step's work runs on the host's cores: torch's forward and
# backward (compute_s), strata's optimizer (strata_adamw_s), the sim device's copies (memcpy: each
# byte read and written, at the host-memory rate the probe measures, as the probe's cost model
# counts them: Note [Host cores as a resource]) and the disk's CPU time (checksums, the I/O
# engine: the bytes at the probe's cpu_s_per_gib, over the cores). On 2 cores they add up: at
# 1.2 B fp32 the step was 11.2 s against 4.9 s of compute and 5.4 s of disk. So bound_s is the
# larger of the disk's time and that sum (host_cores_s), and `bound` says which it was; the older
# max(compute_s, disk_s) stays as compute_disk_bound_s. Without the probe's rates (no
# --strata-probe) the host's part is compute_s alone and `bound` says "compute".
def host_cores_seconds(m, step):
    """The host cores' work in one step (Note [Host-cores bound]), or None without the probe's rates."""
    rate = m.probe.get("probe_host_memory_bytes_s")
    if not rate or "compute_s" not in step:
        return None
    copies_s = 2 * (step["bytes_h2d"] + step["bytes_d2h"]) / rate
    disk_cpu_s = ((step["bytes_disk_read"] + step["bytes_disk_write"]) * m.probe["probe_disk_cpu_s_per_byte"]
                  / max(1, m.probe["probe_cores"]))
    return step["compute_s"] + m.strata_adamw_s + copies_s + disk_cpu_s


def report(args, m, data, nvme_dir, d, layers, host, ram):
    """The run's JSON object from run's measurements `m`; runs the small copy (exact_small_copy) unless
    --no-small-copy."""
    return {
        "params": m.params, "d_model": d, "layers": layers, "batch": args.batch, "seq": args.seq,
        "state_bytes": 16 * m.params, "state_over_ram": round(16 * m.params / ram, 3),
        "host_budget_bytes": host, "peak_rss_bytes": m.peak_rss,
        # Stated overhead (docs/scale.md): the process before the model (Python, torch, the corpus), the host
        # tier's pinned region (budgets.host and its allocator's room, 1/4 of it + 8 MiB), the sim device's
        # memory, activations of one step, 2 x (the largest module + one chunk) of init scratch and a fixed
        # 128 MiB (the allocator's retained free memory, the runtime's tables, torch's transient gradients
        # before they are handed over).
        "host_region_bytes": m.layout["host_region_bytes"],
        "rss_bound_bytes": m.rss_start + m.layout["host_region_bytes"] + m.cfg["device"]["budget"]
        + activations(d, layers, args) + 2 * 4 * (4 * d * d + m.layout["chunk_elems"]) + (128 << 20)
        + m.paired.param_bytes,  # the paired block's gradient (its parameters are in rss_start)
        "block_bytes": 2 * m.paired.param_bytes,  # its parameters and gradient
        "nvme_bytes_allocated": m.nvme_alloc, "nvme_bytes_planned": m.plan_nvme,
        "chunk_elems": m.layout["chunk_elems"], "padding_fraction": round(m.layout["padding_fraction"], 4),
        "init_s": round(m.init_s, 2), "step_times_s": [round(t, 3) for t in m.times], "step_s": round(m.step_s, 3),
        "disk_read_bytes_per_step": m.read_b, "disk_write_bytes_per_step": m.write_b,
        # Of the reads: NVMe-homed params read for forward and backward, and read again beside their states for
        # the optimizer (Note [NVMe-homed params] in runtime/src/residency/residency.hpp).
        "disk_read_param_uses_bytes_per_step": m.stats[m.mid]["bytes_disk_read_param_uses"],
        "disk_read_param_updates_bytes_per_step": m.stats[m.mid]["bytes_disk_read_param_updates"],
        "plan": m.layout.get("plan_summary"),
        # Where the median step's time went (item 4 of #28: what the bound leaves on the table).
        "median_step_split_s": {k: round(m.stats[m.mid][k], 3) for k in ("forward_s", "backward_s", "step_call_s",
                                                                     "stall_s", "user_s", "system_s",
                                                                     "minor_faults")},
        # The same step as the kernel saw the disk (Note [Disk seen by the kernel]).
        "disk_device": m.disk.device, "median_step_disk": m.stats[m.mid]["disk_phases"],
        "io_read_bytes_s": m.read_rate, "io_write_bytes_s": m.write_rate, "io_bench": " ".join(m.io_cmd),
        "disk_s_after_close": round(m.disk_s_after_close, 3),
        "disk_s_per_step": [round(t, 3) for t in m.disk_s_per_step],
        "paired_io_rates_bytes_s": [[round(r), round(w)] for r, w in m.paired.rates],
        "compute_s": round(m.compute_s, 3),
        "compute_s_per_step": [round(m.stats[i]["compute_s"], 3) for i in m.measured],
        "compute_bursts_s": [round(t, 3) for t in m.paired.bursts],
        "compute_s_before_build": round(m.alone_s, 3), "compute_s_before_build_range": [round(t, 3) for t in m.alone_range],
        "torch_adamw_s": round(m.adamw_s, 3),
        "strata_adamw_s": round(m.strata_adamw_s, 3), "disk_s": round(m.disk_s, 3),
        "host_cores_s": None if m.host_cores_s is None else round(m.host_cores_s, 3),
        "host_cores_s_per_step": [None if t is None else round(t, 3) for t in m.host_cores_s_per_step],
        "bound": m.bound, "bound_s": round(m.bound_s, 3), "bound_ratio": round(m.step_s / m.bound_s, 3),
        "bound_ratio_per_step": [round(r, 3) for r in m.per_step_ratios],
        "compute_disk_bound_s": round(m.compute_disk_bound_s, 3),
        "compute_disk_bound_ratio": round(m.step_s / m.compute_disk_bound_s, 3),
        "shared_core_bound_s": round(m.shared_bound_s, 3), "shared_core_bound_ratio": round(m.step_s / m.shared_bound_s, 3),
        **m.probe,
        "dtype": args.dtype, "lr": args.lr, "warmup_steps": args.warmup, "losses": [round(x, 5) for x in m.losses],
        "loss_decreasing": m.losses[-1] < m.losses[0],
        "exact_small_copy": None if args.no_small_copy else small_copy(args, data, nvme_dir),
        "load_avg": os.getloadavg(),
        "openblas_coretype": OPENBLAS_CORETYPE,
    }


if __name__ == "__main__":
    sys.exit(main())
