#!/usr/bin/python3
"""Writes the torch.optim trajectories the kernel tests compare against.

Run with Debian's python3-torch (1.13):  /usr/bin/python3 tests/kernels/gen_torch_reference.py
It rewrites tests/kernels/fixtures/torch_trajectories.json (committed, so the
C++ test always runs). Inputs are not stored: initial params and every step's
gradient come from an integer hash that test_torch_reference.cpp computes
identically (IEEE double arithmetic, then one rounding to float32), so the
fixture holds only hyperparameters and the params at a few checkpoints.
"""
import json
import os
import sys

import torch

N = 256
STEPS = 100
CHECKPOINTS = [1, 10, 100]


def hash_unit(i, t, salt):
    """Deterministic value in [-1, 1], the same formula as in the C++ test."""
    x = (i * 2654435761 + t * 40503 + salt * 97) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 1274126177) & 0xFFFFFFFF
    x ^= x >> 16
    return (x % 2001 - 1000) / 1000.0


def initial_params():
    return torch.tensor([hash_unit(i, 0, 1) for i in range(N)], dtype=torch.float32)


def grad(t):
    return torch.tensor([0.1 * hash_unit(i, t, 2) for i in range(N)], dtype=torch.float32)


CASES = [
    ("adamw", lambda p: torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
     dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)),
    ("adam", lambda p: torch.optim.Adam([p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.001),
     dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.001)),
    ("sgd_momentum", lambda p: torch.optim.SGD([p], lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
     dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3, nesterov=False)),
    ("sgd_nesterov", lambda p: torch.optim.SGD([p], lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
     dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=1e-3, nesterov=True)),
    ("adagrad", lambda p: torch.optim.Adagrad([p], lr=0.05, lr_decay=0.01, weight_decay=1e-3, eps=1e-10),
     dict(lr=0.05, lr_decay=0.01, weight_decay=1e-3, eps=1e-10)),
]


def main():
    torch.set_num_threads(1)
    out = {"n": N, "steps": STEPS, "torch_version": torch.__version__, "cases": []}
    for name, make, hyper in CASES:
        p = initial_params().clone().requires_grad_(True)
        opt = make(p)
        checkpoints = {}
        for t in range(1, STEPS + 1):
            p.grad = grad(t)
            opt.step()
            if t in CHECKPOINTS:
                checkpoints[str(t)] = [float(x) for x in p.detach().tolist()]
        out["cases"].append({"name": name, "hyper": hyper, "params": checkpoints})
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "torch_trajectories.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=0)
        f.write("\n")
    print(f"wrote {path} (torch {torch.__version__})", file=sys.stderr)


if __name__ == "__main__":
    main()
