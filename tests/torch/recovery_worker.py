"""One error-recovery scenario of test_error_recovery.py, run in its own process so that the exit
itself is checked (a hang at exit is a timeout there): python recovery_worker.py SCENARIO NVME_DIR OUT.

Each scenario trains a 6-layer MLP through strata.torch for 2 clean steps, meets one error, checks
what the runtime leaves (state_dict and a checkpoint hold the last good values), trains one more step
once the cause is gone and compares it with a clean run of the same 3 steps, then exits without
closing anything (the atexit handler closes the engine). It prints one JSON line of findings.
"""

import json
import os
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import strata.torch as st

SCENARIO, NVME, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
FAULT_FILE = os.environ.get("STRATA_IO_FAULT_FILE")
WIDTH, LAYERS, CHUNK = 64, 6, 8192


class AllAtOnce(nn.Module):
    """Reads every child's parameters in one forward, as attributes (each read binds its layer until this forward
    ends): all are bound at once. Not named in bind_subtree, which would declare them one working set, and the
    plan would then refuse these budgets up front (Note [Working sets] in runtime/src/core/core.cpp)."""

    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(F.linear(x, layer.weight, layer.bias))
        return x


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("user backward failed")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        # One path to each layer (the layers live in the block): a module registered under two
        # paths gets state_dict keys the binding does not fill.
        self.all_at_once = AllAtOnce(nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]))
        # "wide" (OutOfBudget), "forward", "backward" (an exception raised before any gradient is
        # handed over), "backward_mid" (raised after layers 5..3 handed theirs over), or None.
        self.fail = None

    def forward(self, x):
        if self.fail == "wide":
            return self.all_at_once(x)
        for i, layer in enumerate(self.all_at_once.layers):
            x = F.relu(layer(x))
            if i == 2 and self.fail == "forward":
                raise ValueError("user forward failed")
            if i == 2 and self.fail == "backward_mid":
                x = Boom.apply(x)
        return Boom.apply(x) if self.fail == "backward" else x


def config(nvme_dir):
    slot = CHUNK * 4
    cfg = {"device": {"kind": "sim", "budget": "64MiB"},
           "budgets": {"gpu": 4 * slot, "host": "16MiB"},
           "layout": {"chunk_elems": CHUNK}, "threads": 2}
    if nvme_dir is not None:
        # States (and params) on NVMe: the host budget holds the staging only.
        cfg["budgets"] = {"gpu": 4 * slot, "host": 15 * slot, "nvme": "32MiB"}  # the counted host room (Note [Host room])
        cfg["nvme"] = {"dirs": [nvme_dir], "engine": "posix"}
        cfg["plan"] = {"nvme_families_in_flight": 1, "grad_staging_slots": 1, "prefetch_depth_max": 2}
    return cfg


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)


def train_step(model, opt, step):
    x, y = batch(step)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()


def snapshot(model, opt):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for idx, s in opt.state_dict()["state"].items():
        for name, v in s.items():
            state[f"opt.{idx}.{name}"] = v.clone()
    return state


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def build(nvme_dir, clip=0.0):
    model = st.wrap(Net(), config(nvme_dir))
    opt = st.AdamW(model.parameters(), lr=1e-3, max_grad_norm=clip)
    return model, opt


def swap_fds(directory):
    """File descriptors of this process open on swap files in `directory` (unlinked ones too)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(directory.rstrip("/") + "/"):
            out.append(fd)
    return out


def corrupt_swap(directory):
    """Flips bytes all over the swap files' slots (past their 4 KiB header): the next read fails its CRC."""
    for fd in swap_fds(directory):
        with open(f"/proc/self/fd/{fd}", "r+b") as f:
            size = f.seek(0, 2)
            for at in range(4096 + 100, size, 4096):
                f.seek(at)
                byte = f.read(1)
                if not byte:
                    break
                f.seek(at)
                f.write(bytes([byte[0] ^ 0x5A]))


def main():
    use_nvme = SCENARIO in ("eio", "crc")
    clip = 1.0 if SCENARIO == "backward_deferred" else 0.0
    findings = {}
    ref_model, ref_opt = build(os.path.join(NVME, "ref") if use_nvme else None, clip)
    for s in range(3):
        train_step(ref_model, ref_opt, s)
    reference = snapshot(ref_model, ref_opt)
    ref_model.strata.close()

    nvme_dir = os.path.join(NVME, "run") if use_nvme else None
    model, opt = build(nvme_dir, clip)
    for s in range(2):
        train_step(model, opt, s)
    good = snapshot(model, opt)
    good_ckpt = os.path.join(OUT, "good")
    opt.save_checkpoint(good_ckpt)
    if SCENARIO == "eio":
        findings["disk_read"] = model.strata.last_stats["bytes_disk_read"]
        with open(FAULT_FILE, "w") as f:
            f.write("eio-read")
    elif SCENARIO == "crc":
        corrupt_swap(nvme_dir)
    else:
        model.fail = {"oob": "wide", "forward": "forward", "backward": "backward",
                      "backward_deferred": "backward_mid"}[SCENARIO]
    error = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            train_step(model, opt, 2)
        except Exception as e:  # noqa: BLE001 - the scenario's error, reported below
            error = f"{type(e).__name__}: {e}"
    findings["error"] = error
    model.fail = None
    if FAULT_FILE:
        with open(FAULT_FILE, "w") as f:
            f.write("")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        findings["state_dict_is_last_good"] = SCENARIO == "crc" or same(snapshot(model, opt), good)
        if SCENARIO == "crc":
            # The corrupted slots stay bad until a good checkpoint is loaded over them.
            opt.load_checkpoint(good_ckpt)
            findings["loaded_is_last_good"] = same(snapshot(model, opt), good)
        after_ckpt = os.path.join(OUT, "after")
        opt.save_checkpoint(after_ckpt)
        train_step(model, opt, 2)
    findings["next_step_is_clean_runs"] = same(snapshot(model, opt), reference)
    # The checkpoint saved after the error holds the last good values.
    check_model, check_opt = build(os.path.join(NVME, "check") if use_nvme else None, clip)
    check_opt.load_checkpoint(after_ckpt)
    findings["checkpoint_is_last_good"] = same(snapshot(check_model, check_opt), good)
    check_model.strata.close()
    if use_nvme:
        # A new runtime opens on the same directory once the old one is closed.
        model.strata.close()
        again_model, again_opt = build(nvme_dir, clip)
        train_step(again_model, again_opt, 0)
        findings["reopened"] = True
    print(json.dumps(findings), flush=True)
    # Exits with the engines open: the atexit handler closes them.


main()
