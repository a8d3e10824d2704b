#!/usr/bin/env python3
"""Plain torch, no strata: the GPT of bench/torch_gpt.py trained step by step, each step's wall time
beside the process's user and system CPU time, its minor page faults and the machine's steal time
(/proc/stat). It asks where the per-pair scatter of torch_gpt.py at 25M and 100M comes from (#29):
the host (steal), the allocator (page faults, system time) or the work itself (user time).

  python3 bench/torch_plain_scatter.py --size 100M --steps 12 [--mallopt] [--json]

--mallopt keeps glibc from giving freed memory back to the kernel (mallopt M_MMAP_THRESHOLD 1 GiB,
M_TRIM_THRESHOLD 2 GiB), so that a step's buffers do not fault in again. OMP_WAIT_POLICY=PASSIVE as in
torch_gpt.py (Note [OpenMP waits in the bench] there). Each invocation reports one configuration's
absolute figures, not a ratio: compare two invocations by what they count (faults, system time), not
by their wall times, whose difference is within the spread this measures."""

import argparse
import json
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from malloc_env import keep_freed_memory  # noqa: E402

SIZES = {"0.8M": (128, 4), "25M": (512, 8), "100M": (768, 14)}  # as torch_gpt.py


def steal_and_total():
    with open("/proc/stat", encoding="ascii") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    return cpu[7], sum(cpu)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="100M", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--mallopt", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.mallopt:
        keep_freed_memory()  # Note [Freed memory on these VMs] in malloc_env.py
    import torch  # noqa: PLC0415 - after mallopt and OMP_WAIT_POLICY
    import torch.nn.functional as F  # noqa: PLC0415, N812

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from torch_gpt import Gpt  # noqa: PLC0415

    torch.manual_seed(0)
    d, layers = SIZES[args.size]
    model = Gpt(d=d, layers=layers, seq=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(args.steps):
        x = torch.randint(0, 256, (8, 64), generator=g)
        y = torch.randint(0, 256, (8, 64), generator=g)
        s0, t0_all = steal_and_total()
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        logits = model(x)
        F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        s1, t1_all = steal_and_total()
        rows.append({"step": i, "wall_s": round(t1 - t0, 3), "user_s": round(r1.ru_utime - r0.ru_utime, 2),
                     "sys_s": round(r1.ru_stime - r0.ru_stime, 2), "minflt": r1.ru_minflt - r0.ru_minflt,
                     "steal_pct": round(100 * (s1 - s0) / max(1, t1_all - t0_all), 1)})
        if not args.json:
            print(" ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)
    timed = rows[1:]  # the first step faults every buffer in
    walls = [r["wall_s"] for r in timed]
    summary = {"size": args.size, "mallopt": args.mallopt, "steps": len(timed),
               "wall_s_median": round(statistics.median(walls), 3),
               "wall_spread": round((max(walls) - min(walls)) / (2 * statistics.median(walls)), 3),
               "sys_s_median": round(statistics.median(r["sys_s"] for r in timed), 2),
               "minflt_median": statistics.median(r["minflt"] for r in timed),
               "steal_pct_max": max(r["steal_pct"] for r in timed)}
    print(json.dumps({"summary": summary, "steps": rows} if args.json else summary))


if __name__ == "__main__":
    main()
