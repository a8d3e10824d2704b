#!/usr/bin/env python3
"""strata.torch where everything fits against torch alone, for any build of strata.torch, old
ones included (#26's before/after):

    PYTHONPATH=<build>/python /usr/bin/python3 bench/torch_fit_ab.py D LAYERS PAIRS

It uses only what every build since fe553f6 has (wrap, AdamW, budgets without an NVMe tier), so
two builds can be run in turn and compared; one process, one strata.torch build (PYTHONPATH), the
GPT of examples/torch_gpt.py at d x layers, everything fits (budgets 4x the state,
no NVMe tier: the same config both trees accept). Steps alternate torch alone and strata.torch
(AdamW both, fresh copies with the same seed); per pair the ratio strata/torch step time.
The order within a pair alternates (torch first on even pairs, strata first on odd ones), and
OMP_WAIT_POLICY is PASSIVE unless the environment sets it (Note [OpenMP waits in the bench] in
torch_gpt.py). Prints one JSON line: median and IQR of the ratios, medians of both step times."""
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import strata.torch as st  # noqa: E402
from torch_gpt import Gpt, corpus, batches  # noqa: E402

d, layers, pairs, warm = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), 3
torch.set_num_threads(2)
torch.manual_seed(0)
plain = Gpt(d=d, layers=layers, seq=64)
torch.manual_seed(0)
wrapped_src = Gpt(d=d, layers=layers, seq=64)
n = sum(p.numel() for p in {id(p): p for p in plain.parameters()}.values())
state = 16 * n
cfg = {"device": {"kind": "sim", "budget": max(4 * state, 64 << 20) + (64 << 20)},
       "budgets": {"gpu": max(4 * state, 64 << 20), "host": max(4 * state, 64 << 20)}, "threads": 2}
model = st.wrap(wrapped_src, cfg)
opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-3, foreach=True)
opt_s = st.AdamW(model.parameters(), lr=1e-3)
data = corpus(fixed=True)
it = batches(data, 8, 64, seed=1)


def step(m, o, x, y):
    t = time.perf_counter()
    logits = m(x)
    F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).backward()
    o.step()
    o.zero_grad(set_to_none=True)
    return time.perf_counter() - t


ratios, tp, ts = [], [], []
for i in range(warm + pairs):
    x, y = next(it)
    if i % 2 == 0:
        a, b = step(plain, opt_p, x, y), step(model, opt_s, x, y)
    else:
        b, a = step(model, opt_s, x, y), step(plain, opt_p, x, y)
    if i >= warm:
        ratios.append(b / a); tp.append(a); ts.append(b)
q = statistics.quantiles(ratios, n=4)
print(json.dumps({"d": d, "layers": layers, "params": n, "pairs": pairs,
                  "ratio_median": round(statistics.median(ratios), 4), "ratio_iqr": [round(q[0], 4), round(q[2], 4)],
                  "torch_step_s": round(statistics.median(tp), 5), "strata_step_s": round(statistics.median(ts), 5)}))
model.strata.close()
