#!/usr/bin/env python3
"""strata's optimizer against DeepSpeed's, side by side in one process (issue #27).

    PYTHONPATH=<strata for this torch> ~/.cache/strata/venv-torch2/bin/python bench/peers.py --json

Part 1, the optimizer step on the same torch tensors and the same threads:
  deepspeed      DeepSpeedCPUAdam (its JIT-built cpu_adam op: AVX2/AVX512 + OpenMP), adamw_mode=True;
  strata         strata's fused AdamW kernel (strata.torch.functional.step_, the kernel the runtime
                 runs on its chunks), on a pool of the same thread count.
All runs take the same hyperparameters (lr, betas, eps, weight_decay, bias correction on, decoupled
weight decay). Each round runs every variant once, one after the other (A, B, C, A, B, C, ...), so
the machine's noise hits all alike; a figure is the median over rounds of one step's wall time, and
each ratio is the median (and interquartile range) of the per-round ratios.

  strata_over_deepspeed = strata's step time / DeepSpeed's step time, in the same round:
  < 1 means strata is faster.

Variants (per size):
  fp32            fp32 params, grads and states, both sides (ZeRO-Offload's CPU step).
  bf16_states     strata: fp32 master, bf16 grad, bf16 exp_avg/exp_avg_sq, the bf16 param copy written
                  in the same pass. DeepSpeed has no fp32 master with bf16 states, so it is compared
                  with (a) DeepSpeed fp32 (what ZeRO-Offload runs: fp32 master and states), and (b)
                  DeepSpeed on bf16 params and bf16 states (fp32_optimizer_states=False, no master).
strata's kernel reads the gradient once for Inf/NaN before writing anything (kernels/optim.hpp,
Note [Inf/NaN and untouched states]); DeepSpeed's does not check. `strata` rows include that read
(what a host gradient costs); `strata_kernel_only` rows skip it (grad_checked=True, the runtime's path
when the device checked the gradient) and are reported beside.

Agreement: --agree-steps steps on random gradients (new each step), then the max abs difference of
the parameters between DeepSpeed and strata, and of each against torch.optim.AdamW (fp32, foreach=False).

Threads: OMP_NUM_THREADS (set before torch or the DeepSpeed op loads: DeepSpeed's op links the
system libgomp, torch its own copy, so torch.set_num_threads alone does not reach DeepSpeed's),
torch.set_num_threads and strata's pool all get --threads; the output lists what each OpenMP
runtime in the process reports.

Part 2 (--zero, on by default; --no-zero skips it): whether DeepSpeed's ZeRO-Offload engine
(deepspeed.initialize, ZeRO stage 2 with offload_optimizer cpu) trains the repository's GPT
(examples/torch_gpt.py) on this machine, in a subprocess with a time limit, and its tokens/s and losses.
Its time against strata's is bench/zero_infinity.py --peer offload's figure: interleaved runs, the losses
checked against torch alone's (a run here and strata's after it, not interleaved, moved from 0.30 to 1.42).

The DeepSpeed op is built once into TORCH_EXTENSIONS_DIR (default
~/.cache/strata/torch-extensions/torch-<version>-py<XY>);
the build (or load) time is reported apart. --check exits 1 when a number disagrees beyond its
tolerance or a field is missing, 77 when DeepSpeed's op cannot be built or loaded here (with why).
"""

import argparse
import json
import os
import sys


def early_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--sizes", default="8M,64M", help="parameter elements per run, e.g. 8M,64M or 65536")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (each runs every variant once)")
    ap.add_argument("--agree-steps", type=int, default=10)
    ap.add_argument("--agree-elems", type=int, default=1 << 16)
    ap.add_argument("--no-zero", dest="zero", action="store_false", help="skip the ZeRO-Offload part")
    ap.add_argument("--zero-timeout", type=int, default=900, help="seconds for the ZeRO-Offload subprocess")
    ap.add_argument("--zero-steps", type=int, default=6)
    ap.add_argument("--check", action="store_true", help="exit 1 on disagreement or a missing field")
    ap.add_argument("--zero-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--build-op", action="store_true",
                    help="only build (or load) DeepSpeed's cpu_adam op into TORCH_EXTENSIONS_DIR and exit "
                         "(scripts/install-deps runs it, so that no test pays the build)")
    return ap.parse_args(argv)


ARGS = early_args(sys.argv[1:])
# Before torch or any OpenMP runtime loads (see the docstring's "Threads").
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)

import ctypes  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from deepspeed_env import pin_cxx, set_torch_extensions_dir  # noqa: E402

set_torch_extensions_dir(torch.__version__)  # DeepSpeed's JIT-built op (bench/deepspeed_env.py)

HERE = os.path.dirname(os.path.abspath(__file__))
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
# Tolerances (max abs parameter difference after --agree-steps AdamW steps, lr 1e-3, N(0,1) init
# and gradients): fp32 implementations differ only in rounding (DeepSpeed multiplies by
# 1/sqrt(bias correction) where torch divides; FMA or not): a few ulp of the largest parameter,
# TOL_FP32_ULPS of them. bf16 states round exp_avg and exp_avg_sq to 8 bits each step, which moves
# each update by well under TOL_BF16_OF_LR_STEPS of the most it can move (lr per step).
TOL_FP32_ULPS = 8
TOL_BF16_OF_LR_STEPS = 0.02
CONVENTION = "strata_over_deepspeed = strata step time / DeepSpeed step time (median of per-round ratios); < 1: strata faster"


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def load_strata():
    try:
        import strata.torch as st
        from strata.torch import functional
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"peers.py: cannot import strata.torch ({e}); build it for this torch "
                         f"({torch.__version__}) and put it on PYTHONPATH (docs/peers.md)")
    return st, functional


def load_deepspeed_op():
    """(op module, info); op None when it cannot build or load, info says why and how to fix."""
    ext_dir = os.environ["TORCH_EXTENSIONS_DIR"]
    info = {"torch_extensions_dir": ext_dir}
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as e:  # noqa: BLE001
        info.update(ok=False, why=f"import deepspeed failed: {type(e).__name__}: {e}",
                    fix="install the pinned deepspeed into this venv (scripts/requirements-torch2.txt)")
        return None, info
    info["deepspeed_version"] = deepspeed.__version__
    pin_cxx()
    builder = CPUAdamBuilder()
    info["op_name"] = builder.absolute_name()
    info["cached_before"] = os.path.isdir(os.path.join(ext_dir, builder.name)) and any(
        f.endswith(".so") for f in os.listdir(os.path.join(ext_dir, builder.name)))
    t0 = time.perf_counter()
    try:
        op = builder.load(verbose=False)
    except Exception as e:  # noqa: BLE001
        missing = [t for t in ("ninja", "g++") if not shutil_which(t)]
        info.update(ok=False, why=f"{type(e).__name__}: {e}",
                    fix=("install " + " and ".join(missing) + " (apt-get install ninja-build g++)") if missing else
                    f"see the compiler output above; remove {ext_dir}/{builder.name} to rebuild from scratch")
        return None, info
    info["build_or_load_s"] = time.perf_counter() - t0
    info["ok"] = True
    return op, info


def shutil_which(tool):
    import shutil
    return shutil.which(tool)


def omp_threads():
    """omp_get_max_threads() of every OpenMP runtime loaded in this process."""
    seen = {}
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "gomp" in line or "libiomp" in line or "libomp" in line}
    except OSError:
        return seen
    for lib in sorted(libs):
        try:
            seen[os.path.basename(lib)] = ctypes.CDLL(lib).omp_get_max_threads()
        except (OSError, AttributeError):
            pass
    return seen


class DsAdam:
    """DeepSpeedCPUAdam on one tensor; `dtype`/`fp32_states` as its constructor takes them."""

    def __init__(self, n, dtype, fp32_states, seed=0):
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        g = torch.Generator().manual_seed(seed)
        self.p = torch.nn.Parameter(torch.randn(n, generator=g).to(dtype))
        self.p.grad = torch.randn(n, generator=g).to(dtype)
        self.opt = DeepSpeedCPUAdam([self.p], lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                                    weight_decay=HYPER["weight_decay"], bias_correction=True, adamw_mode=True,
                                    fp32_optimizer_states=fp32_states)

    def step(self):
        self.opt.step()


class StrataAdam:
    """strata's fused AdamW kernel on one tensor: fp32 master; bf16=True: bf16 grad, states, param copy."""

    def __init__(self, fn, n, bf16, threads, grad_checked, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.fn, self.threads, self.grad_checked = fn, threads, grad_checked
        self.master = torch.randn(n, generator=g)
        sd = torch.bfloat16 if bf16 else torch.float32
        self.grad = torch.randn(n, generator=g).to(sd)
        self.states = [torch.zeros(n, dtype=sd), torch.zeros(n, dtype=sd)]
        self.copy = self.master.to(torch.bfloat16) if bf16 else None
        self.t = 0

    def step(self):
        self.t += 1
        self.fn.step_("adamw", self.master, self.grad, self.states, self.t, param_copy=self.copy,
                      threads=self.threads, grad_checked=self.grad_checked, lr=HYPER["lr"],
                      beta1=HYPER["betas"][0], beta2=HYPER["betas"][1], eps=HYPER["eps"],
                      weight_decay=HYPER["weight_decay"], bias_correction=True)


def quartiles(v):
    if len(v) < 2:
        return [v[0], v[0]] if v else [None, None]
    q = statistics.quantiles(v, n=4, method="inclusive")
    return [q[0], q[2]]


def time_round_robin(makers, rounds):
    """{name: [seconds per step per round]}; one warm-up step each, then `rounds` rounds."""
    objs = {name: make() for name, make in makers.items()}
    for o in objs.values():
        o.step()
    times = {name: [] for name in objs}
    for r in range(rounds):
        names = list(objs)
        names = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
        for name in names:
            t0 = time.perf_counter()
            objs[name].step()
            times[name].append(time.perf_counter() - t0)
    return times


def ratio_stats(num, den):
    r = [a / b for a, b in zip(num, den)]
    return {"median": statistics.median(r), "iqr": quartiles(r)}


def bench_size(fn, n, args):
    T = args.threads
    makers = {
        "deepspeed_fp32": lambda: DsAdam(n, torch.float32, True),
        "strata_fp32": lambda: StrataAdam(fn, n, False, T, False),
        "strata_kernel_only_fp32": lambda: StrataAdam(fn, n, False, T, True),
        "deepspeed_bf16_params_fp32_states": lambda: DsAdam(n, torch.bfloat16, True),
        "deepspeed_bf16_params_bf16_states": lambda: DsAdam(n, torch.bfloat16, False),
        "strata_bf16_states": lambda: StrataAdam(fn, n, True, T, False),
        "strata_kernel_only_bf16_states": lambda: StrataAdam(fn, n, True, T, True),
    }
    times = time_round_robin(makers, args.rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"elements": n,
           "median_step_s": med,
           "mparams_per_s": {k: n / v / 1e6 for k, v in med.items()},
           "strata_over_deepspeed": {
               "fp32": ratio_stats(times["strata_fp32"], times["deepspeed_fp32"]),
               "fp32_kernel_only": ratio_stats(times["strata_kernel_only_fp32"], times["deepspeed_fp32"]),
               "bf16_states_vs_deepspeed_fp32": ratio_stats(times["strata_bf16_states"], times["deepspeed_fp32"]),
               "bf16_states_vs_deepspeed_bf16": ratio_stats(times["strata_bf16_states"],
                                                            times["deepspeed_bf16_params_bf16_states"]),
               "bf16_states_kernel_only_vs_deepspeed_fp32": ratio_stats(times["strata_kernel_only_bf16_states"],
                                                                        times["deepspeed_fp32"]),
           }}
    return out


def agreement(fn, args):
    """Max abs parameter differences after args.agree_steps steps on the same random gradients."""
    n, steps = args.agree_elems, args.agree_steps
    g = torch.Generator().manual_seed(7)
    init = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) for _ in range(steps)]
    ds = DsAdam(n, torch.float32, True)
    ds.p.data.copy_(init)
    ref = torch.nn.Parameter(init.clone())
    torch_opt = torch.optim.AdamW([ref], foreach=False, **HYPER)
    st32 = StrataAdam(fn, n, False, args.threads, False)
    st32.master.copy_(init)
    st16 = StrataAdam(fn, n, True, args.threads, False)
    st16.master.copy_(init)
    for gr in grads:
        ds.p.grad = gr.clone()
        ds.step()
        ref.grad = gr.clone()
        torch_opt.step()
        st32.grad.copy_(gr)
        st32.step()
        st16.grad.copy_(gr.to(torch.bfloat16))
        st16.step()
    d = lambda a, b: float((a.detach() - b.detach()).abs().max())  # noqa: E731
    res = {"elements": n, "steps": steps, "hyper": {**HYPER, "bias_correction": True,
                                                    "weight_decay_mode": "decoupled (AdamW)"},
           "max_abs_diff": {
               "strata_fp32_vs_deepspeed_fp32": d(st32.master, ds.p),
               "strata_fp32_vs_torch_adamw": d(st32.master, ref),
               "deepspeed_fp32_vs_torch_adamw": d(ds.p, ref),
               "strata_bf16_states_master_vs_deepspeed_fp32": d(st16.master, ds.p),
               "strata_bf16_param_copy_vs_master": d(st16.copy.float(), st16.master),
           },
           "max_abs_update": float((ref.detach() - init).abs().max())}
    tol32 = TOL_FP32_ULPS * torch.finfo(torch.float32).eps * float(init.abs().max())
    tol16 = TOL_BF16_OF_LR_STEPS * HYPER["lr"] * steps
    res["tolerance"] = {"fp32": tol32, "bf16_states": tol16,
                        "rule": f"fp32: {TOL_FP32_ULPS} ulp of max|param|; bf16 states: "
                                f"{TOL_BF16_OF_LR_STEPS} x lr x steps"}
    m = res["max_abs_diff"]
    res["ok"] = (m["strata_fp32_vs_deepspeed_fp32"] <= tol32 and m["strata_fp32_vs_torch_adamw"] <= tol32
                 and m["deepspeed_fp32_vs_torch_adamw"] <= tol32
                 and m["strata_bf16_states_master_vs_deepspeed_fp32"] <= tol16)
    return res


# ---- Part 2: ZeRO-Offload on the repository's GPT -------------------------------------------

def zero_worker(args):
    """Runs in a subprocess: DeepSpeed ZeRO-2 with offload_optimizer cpu on examples/torch_gpt.py's Gpt."""
    import faulthandler
    faulthandler.dump_traceback_later(max(10, args.zero_timeout - 20), exit=True)  # a hang names where
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import socket
    import deepspeed
    import torch.nn.functional as F
    from torch_gpt import Gpt, batches, corpus
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.manual_seed(0)
    model = Gpt(d=128, layers=4, seq=64)
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": HYPER["lr"], "weight_decay": HYPER["weight_decay"]}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           # DeepSpeed clips the gradient norm at 1.0 by default; strata's run does not clip (the same work).
           "gradient_clipping": 0.0,
           "zero_allow_untested_optimizer": True}
    stage = "deepspeed.initialize"
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                           dist_init_required=True)
    it = batches(corpus(), 8, 64, seed=1)
    stage = "training step"
    tokens, t0, losses = 0, None, []
    for step in range(2 + args.zero_steps):
        if step == 2:
            t0 = time.perf_counter()
        x, y = next(it)
        logits = engine(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        if step >= 2:
            tokens += x.numel()
    del stage
    print("ZERO_RESULT " + json.dumps({"ran": True, "tokens_per_s": tokens / (time.perf_counter() - t0),
                                       "losses": losses, "optimizer": type(engine.optimizer).__name__}))


def zero_offload(args):
    cmd = [sys.executable, os.path.abspath(__file__), "--zero-worker", "--threads", str(args.threads),
           "--zero-steps", str(args.zero_steps)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.zero_timeout)
    except subprocess.TimeoutExpired:
        return {"ran": False, "why": f"ZeRO-Offload run did not finish within {args.zero_timeout} s"}
    res = {"wall_s": time.perf_counter() - t0, "config": "ZeRO stage 2, offload_optimizer cpu, GPT d=128 layers=4"}
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("ZERO_RESULT ")]
    if p.returncode != 0 or not line:
        err = [ln for ln in (p.stderr + p.stdout).splitlines() if ln.strip()]
        last = next((ln for ln in reversed(err) if "Error" in ln or "error" in ln), err[-1] if err else "")
        res.update(ran=False, why=f"exit {p.returncode}: {last.strip()}", stderr_tail=err[-15:])
        return res
    res.update(json.loads(line[-1][len("ZERO_RESULT "):]))
    res["timed_against_strata_by"] = "bench/zero_infinity.py --peer offload (interleaved, losses checked)"
    return res


# ---- main --------------------------------------------------------------------------------

REQUIRED = ("threads", "convention", "deepspeed_op", "sizes", "agreement", "zero_offload")


def main(args):
    if args.zero_worker:
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
        torch.set_num_threads(args.threads)
        zero_worker(args)
        return 0
    if args.build_op:
        op, op_info = load_deepspeed_op()
        print(json.dumps(op_info))
        return 0 if op is not None else 1
    torch.set_num_threads(args.threads)
    st, fn = load_strata()
    op, op_info = load_deepspeed_op()
    out = {"convention": CONVENTION, "torch_version": torch.__version__, "strata_module": st.__file__,
           "uptime_before": open("/proc/loadavg").read().split()[:3], "deepspeed_op": op_info}
    if op is None:
        print(f"peers.py: SKIP: DeepSpeed's cpu_adam op cannot be built or loaded here: {op_info['why']}. "
              f"Fix: {op_info['fix']}", file=sys.stderr)
        if args.json:
            print(json.dumps(out, indent=1))
        return 77
    out["threads"] = {"requested": args.threads, "torch_get_num_threads": torch.get_num_threads(),
                      "strata_pool": args.threads, "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],
                      "openmp_runtimes": omp_threads()}
    out["agreement"] = agreement(fn, args)
    out["sizes"] = [bench_size(fn, parse_size(s), args) for s in args.sizes.split(",")]
    out["rounds"] = args.rounds
    out["zero_offload"] = zero_offload(args) if args.zero else {"ran": False, "why": "skipped (--no-zero)"}
    out["uptime_after"] = open("/proc/loadavg").read().split()[:3]
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(CONVENTION)
        for s in out["sizes"]:
            r = s["strata_over_deepspeed"]
            print(f"{s['elements']:>10} elems  fp32 {r['fp32']['median']:.3f}  "
                  f"bf16_states/ds_fp32 {r['bf16_states_vs_deepspeed_fp32']['median']:.3f}  "
                  + "  ".join(f"{k} {v:.0f} Mp/s" for k, v in s["mparams_per_s"].items()))
        print("agreement:", json.dumps(out["agreement"]["max_abs_diff"]), "ok" if out["agreement"]["ok"] else "FAIL")
        print("zero_offload:", json.dumps(out["zero_offload"])[:400])
    if args.check:
        missing = [k for k in REQUIRED if k not in out]
        for s in out["sizes"]:
            missing += [f"sizes[{s['elements']}].{k}" for k in ("fp32", "bf16_states_vs_deepspeed_fp32")
                        if k not in s["strata_over_deepspeed"]]
        if missing:
            print(f"peers.py: FAILED: fields missing: {missing}", file=sys.stderr)
            return 1
        if not out["agreement"]["ok"]:
            print(f"peers.py: FAILED: strata and DeepSpeed disagree beyond tolerance: "
                  f"{out['agreement']['max_abs_diff']} (tolerance {out['agreement']['tolerance']})", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
