#!/usr/bin/env python3
"""strata.torch under cProfile (#29):

    PYTHONPATH=build/release/python /usr/bin/python3 bench/torch_gpt_profile.py

cProfile of 30 strata.torch steps (fit, 0.8 M GPT, OMP_WAIT_POLICY=PASSIVE),
for whichever strata.torch build PYTHONPATH names. Prints per step: wall time, the time inside
strata.torch's Python (tottime of functions in strata/torch/*.py) and in the engine's C++ calls
(_C methods), and the top functions by own time with their calls per step."""
import cProfile
import json
import os
import pstats
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # Note [OpenMP waits in the bench] in torch_gpt.py
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import strata.torch as st  # noqa: E402
from torch_gpt import Gpt, corpus, batches  # noqa: E402

torch.set_num_threads(2)
torch.manual_seed(0)
m = Gpt(d=128, layers=4, seq=64)
cfg = {"device": {"kind": "sim", "budget": 256 << 20}, "budgets": {"gpu": 128 << 20, "host": 128 << 20}, "threads": 2}
model = st.wrap(m, cfg)
opt = st.AdamW(model.parameters(), lr=1e-3)
it = batches(corpus(fixed=True), 8, 64, seed=1)


def step():
    x, y = next(it)
    logits = model(x)
    F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(5):
    step()
N = 30
pr = cProfile.Profile()
t = time.perf_counter()
pr.enable()
for _ in range(N):
    step()
pr.disable()
wall = (time.perf_counter() - t) / N
stats = pstats.Stats(pr)
py_s, c_s = 0.0, 0.0
rows = []
for (file, _, fn), (_, nc, tt, _, _) in stats.stats.items():
    if "strata/torch/" in file:
        py_s += tt
        rows.append((tt, nc, f"{os.path.basename(file)}:{fn}"))
    elif file == "~" and "strata.torch._C" in fn:
        c_s += tt
        rows.append((tt, nc, fn))
rows.sort(reverse=True)
print(json.dumps({"wall_s_per_step": round(wall, 5), "strata_python_s_per_step": round(py_s / N, 5),
                  "engine_cpp_s_per_step": round(c_s / N, 5),
                  "top": [[f"{r[2]}", round(r[0] / N * 1e3, 3), r[1] // N] for r in rows[:8]]}, indent=1))
model.strata.close()
