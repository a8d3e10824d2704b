#!/usr/bin/python3
"""torch.optim's step rate on one fp32 tensor, the baseline of `strata-bench optim`.

Usage: torch_optim_rate.py OPTIMIZER N THREADS REPEATS
Prints one JSON object: {"optimizer", "mparams_per_s", "variant", "torch_version"}.
Tries foreach=False and foreach=True where torch 1.13 offers it (Adam, AdamW,
SGD, Adagrad; `fused` is CUDA-only in torch 2.x and absent in 1.13) and reports
the faster, naming it. Median of REPEATS timed steps after one warm-up step.
"""
import json
import statistics
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


def rate(name, n, repeats, foreach):
    p = torch.full((n,), 0.01, dtype=torch.float32, requires_grad=True)
    p.grad = torch.full((n,), 0.001, dtype=torch.float32)
    opt = make(name, p, foreach)
    opt.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times) / 1e6


def main():
    name, n, threads, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(threads)
    best = None
    for foreach in (False, True):
        r = rate(name, n, repeats, foreach)
        if best is None or r > best[0]:
            best = (r, f"torch.optim.{name} foreach={foreach} fp32")
    print(json.dumps({"optimizer": name, "mparams_per_s": best[0], "variant": best[1],
                      "torch_version": torch.__version__, "threads": threads}))


if __name__ == "__main__":
    main()
