#!/usr/bin/python3
"""torch.optim's step rate on one tensor, the baseline of `strata-bench optim`.

Usage: torch_optim_rate.py OPTIMIZER N THREADS REPEATS [GRAD_DTYPE]
Prints one JSON object: {"optimizer", "mparams_per_s", "variant", "torch_version", "threads"}.

GRAD_DTYPE fp32 (default; "f32" is read too, the name strata-bench passed before
issue #26): fp32 param, grad and states, as strata's fp32 rows.
GRAD_DTYPE bf16: the same streams as strata's rows with bf16 grad and param and
fp32 master and states, in torch's usual mixed-precision recipe: the bf16
gradient is copied into the fp32 master's .grad, torch.optim steps the fp32
master and states, and the master is copied out to the bf16 param; all three
are timed. (torch.optim keeps states in the param's dtype, so strata's rows with
bf16 states have no torch counterpart: the bench says so instead of running one.)

Tries foreach=False and foreach=True where torch 1.13 offers it (Adam, AdamW,
SGD, Adagrad; `fused` is CUDA-only in torch 2.x and absent in 1.13) and reports
the faster, naming it. Best of REPEATS timed steps after one warm-up step, as
strata's own rows.
"""
import json
import sys
import time

import torch


def make(name, p, foreach):
    if name == "adamw":
        return torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam([p], lr=1e-3, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD([p], lr=1e-3, momentum=0.9, foreach=foreach)
    if name == "adagrad":
        return torch.optim.Adagrad([p], lr=1e-3, foreach=foreach)
    raise SystemExit(f"torch.optim has no {name}")


def rate(name, n, repeats, foreach, grad_dtype):
    master = torch.full((n,), 0.01, dtype=torch.float32, requires_grad=True)
    master.grad = torch.full((n,), 0.001, dtype=torch.float32)
    opt = make(name, master, foreach)
    if grad_dtype == "fp32":
        step = opt.step
    else:
        grad = torch.full((n,), 0.001, dtype=torch.bfloat16)
        param = torch.empty((n,), dtype=torch.bfloat16)

        def step():
            master.grad.copy_(grad)
            opt.step()
            with torch.no_grad():
                param.copy_(master)

    step()
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        t = time.perf_counter() - t0
        best = t if best is None else min(best, t)
    return n / best / 1e6


def main():
    name, n, threads, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    grad_dtype = sys.argv[5] if len(sys.argv) > 5 else "fp32"
    grad_dtype = "fp32" if grad_dtype == "f32" else grad_dtype
    if grad_dtype not in ("fp32", "bf16"):
        raise SystemExit(f"no torch recipe for grad dtype {grad_dtype} (fp32 or bf16)")
    torch.set_num_threads(threads)
    dtypes = ("fp32" if grad_dtype == "fp32" else
              "bf16 grad copied into fp32 master .grad, fp32 states, master copied out to bf16 param")
    best = None
    for foreach in (False, True):
        r = rate(name, n, repeats, foreach, grad_dtype)
        if best is None or r > best[0]:
            best = (r, f"torch.optim.{name} foreach={foreach} {dtypes}")
    print(json.dumps({"optimizer": name, "mparams_per_s": best[0], "variant": best[1],
                      "torch_version": torch.__version__, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
