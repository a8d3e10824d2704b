#!/usr/bin/env python3
"""strata.torch against torch alone, on the GPT-style decoder of examples/torch_gpt.py.

    PYTHONPATH=build/release/python /usr/bin/python3 bench/torch_gpt.py [--json] [--sizes 0.8M,25M,100M]

Note [Step-interleaved measurement]
One process holds every variant of the model at once and times them STEP BY STEP on the
same batch: pair i runs one training step of each variant on batch i, in an order that
rotates with i (plain, fit, offload; fit, offload, plain; ...), so that a noisy moment of
the machine and any position effect (caches left warm by the variant before) hit every
variant alike. The figures are the median and the interquartile range (IQR) of the
per-pair RATIOS of step times, not ratios of per-run means: a pair's ratio compares two
steps a few hundred milliseconds apart on the same batch, which is what lets three
invocations agree. Every variant has the same torch thread count (one process), runs
--warmup steps before timing (the first traces and plans), and the garbage collector is
off while a pair is timed (collected between pairs, untimed).
Note [Stopping on the median's CI]
Per-step ratios scatter (IQR about +-30 % on the 0.1 s step of the 0.8 M GPT, quiet machine
included), so the median of a fixed 30 pairs moves by +-5 % between invocations: more than the
effect. By default pairs run until the distribution-free 95 % confidence interval of every
reported step ratio's median (order statistics, no normality assumed) is within +-1 % (--ci) of
it, at least --min-pairs and at most --max-pairs or --max-seconds per size; the output gives
each median's ci95, how many pairs ran and what stopped them ("ci", "max_seconds", "pairs").
Two invocations whose CIs are +-1 % can then agree within about +-2 %, unless the machine
itself changed between them (load_avg_1m is reported for that).
Note [OpenMP waits in the bench]
Most of that scatter was torch's OpenMP threads spin-waiting between parallel regions
(libgomp's default). On this project's 2-vCPU machines a spinning worker slows the thread that
has work: torch alone, the 0.8 M GPT's step took 0.22 s (IQR 0.17-0.26 s) by default and
0.070 s (0.068-0.071 s) with OMP_WAIT_POLICY=PASSIVE, in the same process code (#29). The
bench therefore sets OMP_WAIT_POLICY=PASSIVE before torch loads, for every variant alike,
unless the environment already sets it (the policy in effect is reported as
omp_wait_policy). It is a property of the machine, not of strata: strata's own workers are
its ThreadPool's and do not spin. Likewise glibc keeps freed memory in the process (Note [Freed
memory on these VMs] in bench/malloc_env.py; reported as malloc_freed_memory): torch's AdamW faults
its temporaries in again each step, at a cost that drifts with the host (±10 % across invocations
at 100 M otherwise).
Variants:
  plain           torch only, everything in memory, torch.optim.AdamW (its fastest, foreach);
  strata_fit      strata.torch with budgets where everything fits (all chunks on the device);
  strata_offload  strata.torch with model state >= 4x the device budget: params and gradients
                  stream through the device, optimizer states on host and NVMe;
  --access-ab adds strata_fit_no_access and strata_offload_no_access: the same with the binding
                  as before #25 (STRATA_TORCH_BENCH_NO_ACCESS=1: parameters not readable or
                  writable between steps, Note [Lazy parameters] in strata/torch/_views.py).
Per size (--sizes: 0.8M, 25M, 100M or DxL, the GPT's width and depth), as {median, iqr}:
  fit_overhead          step time strata_fit / plain (1.0 = strata costs nothing);
  offload_over_plain    step time strata_offload / plain;
  fit_fwd_bwd_overhead  forward + backward time strata_fit / plain: the binding's own cost;
  fit_optimizer_ratio   optimizer.step() + zero_grad() time, strata's fused AdamW (mostly run
                        during backward already) / torch.optim.AdamW;
  access_cost_fit / access_cost_offload (--access-ab): step time with torch's contract
                        between steps / without it (> 1: the contract costs that factor).
host_budget (per strata variant): the host budget it ran with; the offload variant's is 0.55x the
model state, or the smallest that plans where the planner refuses that (it says so on stderr).
fit_counters / offload_counters: strata's extra work per measured step (bytes moved between
tiers, Python hook calls, parameter leases taken); where everything fits the bytes are 0.
bit_identical_sgd trains a smaller copy with SGD (power-of-two lr) both ways in this process
and compares every loss and parameter with torch.equal.
--check exits 1 when a target is missed (#29's: the medians fit_overhead <= 1.05 and
offload_over_plain <= 1.15 at every size; and state_over_device_budget >= 4, bit_identical_sgd,
no bytes moved by a fit step).
"""

import argparse
import gc
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

# Note [OpenMP waits in the bench]: before torch (and its OpenMP runtime) loads.
OMP_WAIT_POLICY = os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Note [OpenBLAS core type] (bench/blas_env.py): before torch (and OpenBLAS) load.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blas_env import set_openblas_coretype  # noqa: E402

OPENBLAS_CORETYPE = set_openblas_coretype()
# Note [Freed memory on these VMs] (bench/malloc_env.py): before torch allocates anything.
from malloc_env import keep_freed_memory  # noqa: E402

MALLOC_FREED = keep_freed_memory(enabled="--malloc-returns-memory" not in sys.argv)

import torch  # noqa: E402
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from torch_gpt import Gpt, batches, corpus  # noqa: E402

import strata.torch as st  # noqa: E402

SIZES = {"0.8M": (128, 4), "25M": (512, 8), "100M": (768, 14)}  # (d_model, layers); heads 4, vocab 256
MIB = 1 << 20


def unique_numel(model):
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def parse_size(text):
    if text in SIZES:
        return SIZES[text]
    try:
        d, layers = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"bench torch_gpt: --sizes: {text!r} is neither one of {', '.join(SIZES)} "
                         "nor DxL (width x depth, e.g. 256x6)") from None
    if d < 4 or d % 4 or layers < 1:
        raise SystemExit(f"bench torch_gpt: --sizes: {text!r}: the width must be a multiple of 4 (heads)")
    return d, layers


def config(model, nvme_dir, device_budget, host_bytes, threads):
    state = 16 * unique_numel(model)
    return {
        "device": {"kind": "sim", "budget": max(device_budget + 64 * MIB, 1 << 30)},
        "budgets": {"gpu": device_budget, "host": host_bytes, "nvme": max(2 * state, 2 << 30)},
        "nvme": {"dirs": [nvme_dir]},
        "threads": threads,
    }


class Variant:
    """One copy of the model and its optimizer, trained one step at a time."""

    def __init__(self, kind, d, layers, args, nvme_dir):
        self.kind = kind
        self.times = []  # (step s, forward + backward s, optimizer s) per measured step
        self.info = {}
        torch.manual_seed(0)
        model = Gpt(d=d, layers=layers, seq=args.seq)
        state = 16 * unique_numel(model)
        base = kind.replace("_no_access", "")
        if base == "plain":
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        else:
            if base == "strata_fit":
                cfg = config(model, nvme_dir, 2 * state + 16 * MIB, 2 * state + 16 * MIB, args.threads)
            else:
                device_budget = state // args.offload_ratio
                cfg = config(model, nvme_dir, device_budget, int(0.55 * state) + 8 * MIB, args.threads)
                self.info["state_over_device_budget"] = state / device_budget
            if kind.endswith("_no_access"):
                os.environ["STRATA_TORCH_BENCH_NO_ACCESS"] = "1"  # read once, by wrap()
            try:
                model = self._wrap(model, cfg, d, layers, args, offload=base == "strata_offload")
            finally:
                os.environ.pop("STRATA_TORCH_BENCH_NO_ACCESS", None)
            self.info["host_budget"] = cfg["budgets"]["host"]
            self.opt = st.AdamW(model.parameters(), lr=1e-3)
        self.model = model
        self.counters = None  # strata's work over the measured steps

    @staticmethod
    def _wrap(model, cfg, d, layers, args, offload):
        """st.wrap, with the plan made at once. The offload variant's host budget (0.55 x the model
        state) is below what the planner accepts at some sizes (it counts every host buffer, #24):
        it then takes the smallest host budget that plans, which the refusal names."""
        wrapped = st.wrap(model, cfg)
        try:
            wrapped.strata._ensure_engine()
            return wrapped
        except st.StrataError as e:
            m = re.search(r"raise host_budget to at least [^(]*\((\d+) bytes\)", str(e))
            if not offload or m is None:
                raise
            wrapped.strata.close()
        print(f"bench torch_gpt: d={d} layers={layers}: the offload variant's host budget "
              f"{cfg['budgets']['host']} B is refused; it takes the smallest that plans, {m.group(1)} B "
              "(reported as host_budget)", file=sys.stderr)
        cfg["budgets"]["host"] = int(m.group(1))
        torch.manual_seed(0)
        model = Gpt(d=d, layers=layers, seq=args.seq)
        wrapped = st.wrap(model, cfg)
        wrapped.strata._ensure_engine()
        return wrapped

    def step(self, x, y, timed):
        t0 = time.perf_counter()
        logits = self.model(x)
        F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).backward()
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if timed:
            self.times.append((t2 - t0, t1 - t0, t2 - t1))

    def start_counting(self):
        if hasattr(self.model, "strata"):
            self.counters = self.model.strata.counters()

    def finish(self):
        if not hasattr(self.model, "strata"):
            return
        w = self.model.strata
        before, after = self.counters, w.counters()
        n = max(1, len(self.times))
        self.info["counters_per_step"] = {k: (after[k] - before[k]) / n for k in after}
        self.info["gpu_high_water_bytes"] = w.last_stats["gpu_high_water_bytes"]
        self.info["stall_s_per_step"] = self.info["counters_per_step"].pop("stall_s")
        w.close()


def median_ci95(values):
    """The distribution-free 95 % confidence interval of the median (order statistics:
    the ranks n/2 -+ 1.96 sqrt(n)/2), or None below 10 values. Note [Stopping on the median's CI]."""
    n = len(values)
    if n < 10:
        return None
    v = sorted(values)
    half = 1.96 * math.sqrt(n) / 2
    lo = max(0, int(math.floor(n / 2 - half)) - 1)
    hi = min(n - 1, int(math.ceil(n / 2 + half)))
    return v[lo], v[hi]


def spread(values):
    """{median, iqr: [q1, q3], ci95: [lo, hi]} of per-pair ratios."""
    if len(values) < 2:
        v = round(values[0], 3) if values else None
        return {"median": v, "iqr": [v, v], "ci95": [v, v]}
    q = statistics.quantiles(values, n=4, method="inclusive")
    ci = median_ci95(values)
    return {"median": round(statistics.median(values), 3), "iqr": [round(q[0], 3), round(q[2], 3)],
            "ci95": [round(ci[0], 3), round(ci[1], 3)] if ci else None}


def ci_narrow(variants, by, rel):
    """True when the 95 % CI of every reported step ratio's median is within +-rel of it."""
    plain = by["plain"]
    for v in variants:
        if v is plain:
            continue
        r = ratios(v, plain, 0)
        ci = median_ci95(r)
        if ci is None:
            return False
        m = statistics.median(r)
        if max(m - ci[0], ci[1] - m) > rel * m:
            return False
    return True


def ratios(a, b, field):
    return [x[field] / y[field] for x, y in zip(a.times, b.times) if y[field] > 0]


def measure(size, args, data, nvme_dir):
    d, layers = parse_size(size)
    kinds = ["plain", "strata_fit", "strata_offload"]
    if args.access_ab:
        kinds += ["strata_fit_no_access", "strata_offload_no_access"]
    variants = [Variant(k, d, layers, args, nvme_dir) for k in kinds]
    it = batches(data, args.batch, args.seq, seed=1)
    for _ in range(args.warmup):  # traces, plans, allocator warm-up: untimed
        x, y = next(it)
        for v in variants:
            v.step(x, y, timed=False)
    for v in variants:
        v.start_counting()
    by = {v.kind: v for v in variants}
    fixed = args.pairs is not None
    most = args.pairs if fixed else args.max_pairs
    started = time.perf_counter()
    stopped_by = "pairs"
    gc.collect()
    gc.disable()
    try:
        for i in range(most):
            x, y = next(it)
            for j in range(len(variants)):
                variants[(i + j) % len(variants)].step(x, y, timed=True)
            if i % 4 == 3:
                gc.collect()  # untimed: between pairs
            done = i + 1
            if not fixed and done >= args.min_pairs and done % 10 == 0:
                if ci_narrow(variants, by, args.ci):
                    stopped_by = "ci"
                    break
                if time.perf_counter() - started > args.max_seconds:
                    stopped_by = "max_seconds"
                    break
            if not args.json and done % 50 == 0:
                print(f"{size}: pair {done}", file=sys.stderr)
    finally:
        gc.enable()
    for v in variants:
        v.finish()
    plain, fit, off = by["plain"], by["strata_fit"], by["strata_offload"]
    fit_c, off_c = fit.info["counters_per_step"], off.info["counters_per_step"]
    out = {
        "params": unique_numel(plain.model), "d_model": d, "layers": layers,
        "pairs": len(plain.times), "stopped_by": stopped_by,
        "measured_s": round(time.perf_counter() - started, 1),
        "fit_overhead": spread(ratios(fit, plain, 0)),
        "offload_over_plain": spread(ratios(off, plain, 0)),
        "fit_fwd_bwd_overhead": spread(ratios(fit, plain, 1)),
        "fit_optimizer_ratio": spread(ratios(fit, plain, 2)),
        "step_s": {v.kind: round(statistics.median(t[0] for t in v.times), 5) for v in variants},
        "fwd_bwd_s": {v.kind: round(statistics.median(t[1] for t in v.times), 5) for v in variants},
        "optimizer_s": {v.kind: round(statistics.median(t[2] for t in v.times), 5) for v in variants},
        "state_over_device_budget": round(off.info["state_over_device_budget"], 2),
        "host_budget": {v.kind: v.info["host_budget"] for v in variants if "host_budget" in v.info},
        "fit_counters": {k: round(v, 1) for k, v in fit_c.items()},
        "offload_counters": {k: round(v, 1) for k, v in off_c.items()},
        "offload_stall_s_per_step": round(off.info["stall_s_per_step"], 4),
    }
    out["plain_tokens_per_s"] = round(args.batch * args.seq / out["step_s"]["plain"], 1)
    if args.access_ab:
        out["access_cost_fit"] = spread(ratios(fit, by["strata_fit_no_access"], 0))
        out["access_cost_offload"] = spread(ratios(off, by["strata_offload_no_access"], 0))
    return out


def bit_identical_sgd(args, data, nvme_dir):
    results = []
    for use_strata in (False, True):
        torch.manual_seed(0)
        model = Gpt(d=64, layers=2, seq=args.seq)
        if use_strata:
            n = unique_numel(model)
            model = st.wrap(model, config(model, nvme_dir, 16 * n // 4, 3 * 16 * n, args.threads))
            opt = st.SGD(model.parameters(), lr=2.0 ** -4)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=2.0 ** -4)
        it = batches(data, 4, args.seq, seed=2)
        losses = []
        for _ in range(5):
            x, y = next(it)
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        results.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
        if use_strata:
            model.strata.close()
    (la, sa), (lb, sb) = results
    return all(torch.equal(a, b) for a, b in zip(la, lb)) and all(torch.equal(sa[k], sb[k]) for k in sa)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sizes", default="0.8M", help="comma-separated: 0.8M, 25M, 100M or DxL (default 0.8M)")
    ap.add_argument("--pairs", type=int, default=None,
                    help="measured steps of each variant (one pair each); default: until the median's 95 %% "
                         "CI is within --ci (Note [Stopping on the median's CI])")
    ap.add_argument("--ci", type=float, default=0.01,
                    help="stop when every step ratio's median is known within +-this fraction (95 %% CI)")
    ap.add_argument("--min-pairs", type=int, default=40)
    ap.add_argument("--max-pairs", type=int, default=3000)
    ap.add_argument("--max-seconds", type=float, default=300, help="per size, when the CI is still wider")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--offload-ratio", type=int, default=4, help="model state / device budget")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--malloc-returns-memory", action="store_true",
                    help="leave glibc's default of giving freed memory back (read before torch loads; "
                         "Note [Freed memory on these VMs] in bench/malloc_env.py)")
    ap.add_argument("--access-ab", action="store_true",
                    help="also run strata without torch's contract between steps (#25) and report its cost")
    args = ap.parse_args()
    if args.malloc_returns_memory and MALLOC_FREED == "kept":  # an abbreviation argparse took, read too late
        ap.error("--malloc-returns-memory must be spelled in full: it is read before torch loads "
                 "(Note [Freed memory on these VMs] in bench/malloc_env.py)")
    if args.pairs is None and not 0 < args.ci < 1:
        ap.error("--ci must be a fraction in (0, 1), e.g. 0.01")
    if min(args.pairs or 1, args.min_pairs, args.batch, args.offload_ratio) < 1 or args.warmup < 2:
        ap.error("--pairs, --batch and --offload-ratio must be >= 1 and --warmup >= 2 (the first step plans)")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        parse_size(s)
    torch.set_num_threads(args.threads)
    data = corpus()
    nvme_dir = tempfile.mkdtemp(prefix="strata-bench-gpt-")
    try:
        results = {s: measure(s, args, data, nvme_dir) for s in sizes}
        identical = bit_identical_sgd(args, data, nvme_dir)
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    out = {"device": "sim", "threads": args.threads, "batch": args.batch, "seq": args.seq,
           "warmup": args.warmup, "load_avg_1m": round(os.getloadavg()[0], 2),
           "omp_wait_policy": OMP_WAIT_POLICY, "openblas_coretype": OPENBLAS_CORETYPE,
           "malloc_freed_memory": MALLOC_FREED,
           "sizes": results, "bit_identical_sgd": identical}
    met = identical and all(r["fit_overhead"]["median"] <= 1.05 and r["offload_over_plain"]["median"] <= 1.15 and
                            r["state_over_device_budget"] >= 4 and r["fit_counters"]["bytes_moved"] == 0
                            for r in results.values())
    out["targets_met"] = met
    if args.json:
        print(json.dumps(out))
    else:
        for s, r in results.items():
            print(f"== {s} ({r['params'] / 1e6:.2f} M params)")
            for k, v in r.items():
                print(f"  {k}: {v}")
        print(f"bit_identical_sgd: {identical}\nload_avg_1m: {out['load_avg_1m']}\ntargets_met: {met}")
    if not identical:
        print("bench torch_gpt: strata.torch and torch differ with SGD", file=sys.stderr)
        return 1
    return 1 if args.check and not met else 0


if __name__ == "__main__":
    sys.exit(main())
