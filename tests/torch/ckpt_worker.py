"""One leg of the checkpoint round trip, run in its own process by test_checkpoint.py:

    ckpt_worker.py OUT_DIR NVME_DIR straight|first|resume|rt-first|rt-resume
straight: 20 steps; first: 10 steps, then save model and optimizer; resume: load them into a
fresh model, train steps 10..19. rt-first / rt-resume: the same through strata's own
checkpoint (opt.save_checkpoint / opt.load_checkpoint into OUT_DIR/rt). Each writes its
final model/optimizer state to OUT_DIR.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import strata.torch as st  # noqa: E402
from harness import tiered_config  # noqa: E402
from models import inputs, loss_of, make  # noqa: E402

out, nvme, mode = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = tiered_config("deep", nvme)
model, kind = make("deep")
model = st.wrap(model, cfg)
opt = st.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
begin, end = {"straight": (0, 20), "first": (0, 10), "resume": (10, 20), "rt-first": (0, 10),
              "rt-resume": (10, 20)}[mode]
if mode == "rt-resume":
    opt.load_checkpoint(os.path.join(out, "rt"))
if mode == "resume":
    model.load_state_dict(torch.load(os.path.join(out, "model10.pt")))
    opt.load_state_dict(torch.load(os.path.join(out, "opt10.pt")))
for step in range(begin, end):
    x, y = inputs(model, kind, step)
    loss_of(model, x, y).backward()
    opt.step()
if mode == "rt-first":
    opt.save_checkpoint(os.path.join(out, "rt"))
tag = {"straight": "straight", "first": "10", "resume": "resumed", "rt-first": "rt10", "rt-resume": "rtresumed"}[mode]
torch.save(model.state_dict(), os.path.join(out, f"model{tag}.pt"))
torch.save(opt.state_dict(), os.path.join(out, f"opt{tag}.pt"))
model.strata.close()
