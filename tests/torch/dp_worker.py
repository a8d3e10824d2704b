"""One rank of a strata.torch data-parallel job (Note [Ranks under torchrun] in
strata/torch/_processes.py), for test_data_parallel.py.

    dp_worker.py RANK WORLD STORE OUT CASE [FAULT|- [CKPT]]
    torchrun ... dp_worker.py torchrun OUTDIR CASE [kill-once]   (env://; OUTDIR/rank<r>.pt)

Initialises torch.distributed on gloo (a file:// rendezvous at STORE), wraps a model from
models.py with strata.torch, and trains it: at step s rank r takes micro-batch r of the global
batch (models.inputs(model, kind, s, r)), as one process taking that batch as WORLD micro-batches
would. Writes {"losses", "state", "opt_state"} to OUT with torch.save. CASE names the model,
optimizer and tier (CASES); FAULT (kill, raise) makes the last rank fail in step 1, differ gives it a
model without fc2's bias, trainer wraps with hf.wrap_for_trainer on every rank; CKPT is a
directory every rank saves a checkpoint into at the end. A rank that fails prints the error and
exits 3.
"""

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

import strata.torch as st
from harness import config, tiered_config
from models import MODELS, inputs, loss_of, make

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

# case -> (model, optimizer, hyper, steps, clip, tiers). Models: models.py's, "gpt_deferred" (the
# repository's GPT built on the meta device, deferred init), "hf_gpt2" and "hf_llama" (hf_models.py's
# tiny configs; transformers is in the torch 2.x venv only).
CASES = {
    "sgd": ("mlp", "sgd", {"lr": 0.125, "momentum": 0.9}, 4, None, "host"),
    "adamw_clip": ("encoder", "adamw", {"lr": 1e-3, "weight_decay": 0.01}, 4, 0.5, "host"),
    "adamw_nvme": ("tied", "adamw", {"lr": 1e-3}, 3, None, "nvme"),
    "lamb": ("mlp", "lamb", {"lr": 1e-3}, 3, None, "host"),
    "unused": ("frozen_unused", "adamw", {"lr": 1e-3}, 4, None, "host"),
    "int8": ("encoder", "adamw", {"lr": 1e-3, "weight_decay": 0.01, "state_dtype": "int8"}, 3, 0.5, "host"),
    "int8_nvme": ("tied", "adamw", {"lr": 1e-3, "state_dtype": "int8"}, 3, None, "nvme"),
    "gpt_deferred": ("gpt_deferred", "adamw", {"lr": 1e-3, "weight_decay": 0.01}, 3, 1.0, "host"),
    "hf_gpt2": ("hf_gpt2", "adamw", {"lr": 1e-3, "weight_decay": 0.01}, 3, 1.0, "host"),
    "hf_llama": ("hf_llama", "sgd", {"lr": 0.05, "momentum": 0.9}, 3, None, "host"),
}


def build(name, seed):
    """(model, wrap() keyword arguments, loss(model, step, i): micro-batch i of step's global batch)."""
    if name.startswith("hf_"):
        import hf_models
        base = name[3:]

        def hf_loss(model, step, i):
            torch.manual_seed(1000 * step + i)  # dropout: micro-batch i's masks, whichever process runs it
            return model(**hf_models.batch(base, 100 * step + i)).loss
        return hf_models.make(base, seed), {}, hf_loss
    if name == "gpt_deferred":
        from torch_gpt import Gpt, init_weights
        torch.manual_seed(seed)
        with st.init():
            model = Gpt(d=64, layers=2, seq=16)

        def gpt_loss(model, step, i):
            x = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1000 * step + i))
            out = model(x[:, :-1])
            return F.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten())
        return model, {"init": init_weights}, gpt_loss
    model, kind = make(name, seed)
    return model, {}, lambda model, step, i: loss_of(model, *inputs(model, kind, step, i))


def strata_config(name, tiers, nvme_dir):
    if tiers == "nvme":
        cfg = tiered_config(name, nvme_dir)
    else:
        model = make(name)[0] if name in MODELS else build(name, 0)[0]
        cfg = config(model, gpu_slots=None if name in MODELS else 4)
    cfg["comm"] = {"timeout_s": 20}
    cfg["budgets_per"] = "rank"  # the budgets are sized for one process: each rank gets them whole
    return cfg


def optimizer_of(opt_name, params, hyper):
    cls = {"sgd": st.SGD, "adamw": st.AdamW, "lamb": st.LAMB}[opt_name]
    return cls(params, **hyper)


def train(case, rank, world, nvme_dir, micro=1, fault=None, ckpt=None):
    """Trains CASES[case]: this rank's slice of each global batch, `micro` micro-batches of it per step
    (loss divided by micro, as gradient accumulation does); then saves a checkpoint into `ckpt` when
    given (every rank, one directory). Returns (losses, model state dict, optimizer state dict)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS: torch's sums then split alike everywhere
    try:
        return _train(case, rank, world, nvme_dir, micro, fault, ckpt)
    finally:
        torch.set_num_threads(threads)


def _train(case, rank, world, nvme_dir, micro, fault, ckpt):
    name, opt_name, hyper, steps, clip, tiers = CASES[case]
    cfg = strata_config(name, tiers, nvme_dir)
    if micro > 1:
        cfg["gradient_accumulation_steps"] = micro
    model, wrap_kwargs, loss_fn = build(name, seed=rank)  # ranks with different seeds start from rank 0's values
    if fault == "differ" and rank == world - 1:
        model.fc2 = torch.nn.Linear(model.fc2.in_features, model.fc2.out_features, bias=False)
    if fault == "trainer":
        from types import SimpleNamespace

        from strata.torch import hf
        hf.wrap_for_trainer(model, cfg, SimpleNamespace(gradient_accumulation_steps=1))  # refused under W > 1
    model = st.wrap(model, cfg, **wrap_kwargs)
    opt = optimizer_of(opt_name, model.parameters(), hyper)
    losses, first = [], 0
    if fault == "kill-once" and os.path.exists(os.path.join(ckpt, "manifest.json")):
        opt.load_checkpoint(ckpt)  # torchrun restarted the job: go on from the last checkpoint
        first = model.strata.engine.tensor_steps(0)
    for step in range(first, steps):
        if hasattr(model, "use_branch"):
            model.use_branch = step % 2 == 0  # FrozenUnused: a branch that gets no gradient on odd steps
        marker = os.path.join(os.path.dirname(ckpt or "."), "killed")
        if fault == "kill-once" and step == 2 and rank == world - 1 and not os.path.exists(marker):
            open(marker, "w").close()  # the job that runs after this one trains on
            os.kill(os.getpid(), 9)
        for m in range(micro):
            if fault == "raise" and rank == world - 1 and step == 1:
                raise RuntimeError("a rank raised in forward")
            if fault == "kill" and rank == world - 1 and step == 1:
                os.kill(os.getpid(), 9)
            loss = loss_fn(model, step, rank * micro + m)
            if micro > 1:
                loss = loss * (1.0 / micro)
            loss.backward()
            losses.append(loss.detach().clone())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if fault == "kill-once":
            opt.save_checkpoint(ckpt)  # every step, collective
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    if ckpt is not None and fault != "kill-once":
        opt.save_checkpoint(ckpt)
    model.strata.close()
    return losses, state, opt_state


def main():
    if sys.argv[1] == "torchrun":  # dp_worker.py torchrun OUTDIR CASE [kill-once]: RANK, WORLD_SIZE from torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        out, case, fault, ckpt = os.path.join(sys.argv[2], f"rank{rank}.pt"), sys.argv[3], None, None
        if len(sys.argv) > 4:  # kill-once: the last rank dies in step 2 of the first job; the next resumes
            fault, ckpt = sys.argv[4], os.path.join(sys.argv[2], "ckpt")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    else:
        rank, world, store, out, case = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
        fault = sys.argv[6] if len(sys.argv) > 6 and sys.argv[6] != "-" else None
        ckpt = sys.argv[7] if len(sys.argv) > 7 else None
        os.environ["WORLD_SIZE"] = str(world)
        os.environ["LOCAL_WORLD_SIZE"] = str(world)
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
    nvme_dir = os.path.join(os.path.dirname(out), f"nvme-{rank}")
    os.makedirs(nvme_dir, exist_ok=True)
    try:
        micro = 2 if fault == "accum2" else 1  # two micro-batches of gradient accumulation per rank
        losses, state, opt_state = train(case, rank, world, nvme_dir, micro=micro, fault=fault, ckpt=ckpt)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        print(f"rank {rank} failed: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(3)  # without the group's teardown, which could wait on a peer that is gone
    torch.save({"losses": losses, "state": state, "opt_state": opt_state}, out)
    print(json.dumps({"rank": rank, "nvme_left": os.listdir(nvme_dir)}), flush=True)
    dist.destroy_process_group()  # the last rank out removes the store file
    print("ok", flush=True)


if __name__ == "__main__":
    main()
