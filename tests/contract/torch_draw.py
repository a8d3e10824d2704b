"""What one run of the torch campaign draws (Note [Torch campaign] in torch_campaign.py): a
random nn.Module graph, an optimizer, a training loop and budgets, all from one seed, and the
module built from that draw. Nothing here knows strata: the same draw builds the torch-only
reference and the model strata wraps."""

import random

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp

LAYERS = ("linear", "conv1d", "conv2d", "layernorm", "batchnorm", "gru", "lstm", "mha")
OPTIMIZERS = ("sgd", "adam", "adamw", "lamb", "lars", "lion", "adagrad")
TORCH_OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad")  # those torch.optim has


def run_seed(campaign_seed, index):
    """The seed of run `index` of a campaign (splitmix64), so that any run replays alone."""
    z = (campaign_seed + (index + 1) * 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return z ^ (z >> 31)


def _optimizer(r):
    name = r.choice(OPTIMIZERS)
    lr = {"sgd": 2.0**-4, "lars": 2.0**-4, "adagrad": 2.0**-5}.get(name, 2.0**-8)
    hyper = {"lr": lr}
    if name == "sgd":
        hyper["lr"] = r.choice((2.0**-4, 0.05, 0.1))
        hyper["momentum"] = r.choice((0.0, 0.5, 0.9))
        hyper["nesterov"] = hyper["momentum"] > 0 and r.random() < 0.3
        hyper["dampening"] = 0.0 if hyper["nesterov"] else r.choice((0.0, 0.0, 0.1))
        hyper["weight_decay"] = r.choice((0.0, 0.01))
    elif name in ("adam", "adamw", "lamb", "lion", "adagrad"):
        hyper["weight_decay"] = r.choice((0.0, 0.01))
    elif name == "lars":
        hyper["momentum"] = 0.9
    return name, hyper


def draw(seed):
    """The run's plan: a dict of plain values (printed by --describe)."""
    r = random.Random(seed)
    layers = [r.choice(LAYERS) for _ in range(r.randint(1, 4))]
    shared = r.random() < 0.35
    d = r.choice((16, 32, 48))
    opt, hyper = _optimizer(r)
    micro = r.choice((1, 1, 2, 3))
    steps = r.randint(3, 6)
    s = {
        "seed": seed, "d": d, "vocab": r.choice((64, 200)), "seq": r.choice((4, 6)), "batch": r.choice((2, 3)),
        "layers": layers,
        "shared": shared,  # a block appended twice: one submodule, called twice
        "tie": r.choice(("none", "module", "functional")),
        "frozen": [i for i in range(len(layers)) if r.random() < 0.2],
        "branch": r.choice((None, None, 2, 3)),  # the last block runs on steps % branch == 0 only
        "checkpoint": [i for i in range(len(layers)) if r.random() < 0.25],
        "use_reentrant": r.random() < 0.5,
        "autocast": r.random() < 0.25,
        "optimizer": opt, "hyper": hyper,
        "clip": r.choice(("none", "none", "torch", "strata")),
        "micro": micro, "steps": steps,
        "zero_grad": r.choice(("none_true", "none_false", "none_true", "none_false", "never")),
        "grad_reads": r.choice(("auto", "auto", False, True)),
        "rw": {s_: r.choice(("read", "mul_", "data_copy", "fill")) for s_ in range(steps) if r.random() < 0.3},
        "reload_at": r.randint(1, steps - 1) if r.random() < 0.3 else None,  # state_dict save, a step, load back
        "torch_state_at": r.randint(1, steps - 1) if r.random() < 0.25 else None,
        "chunk_elems": r.choice((0, 4096, 4096)),
        "gpu": r.choice(("fewest", "half", "all")),
        "host": r.choice(("suggested", "suggested_x2", "plenty")),
        "nvme": r.choice((None, "uring", "posix")),
        "threads": r.choice((1, 2)),
    }
    if s["clip"] == "torch" and s["grad_reads"] is False:
        s["grad_reads"] = "auto"  # clip_grad_norm_ reads torch's gradients (Note [Gradients in torch])
    return s


class _Block(nn.Module):
    """One drawn layer on (batch, seq, d), residual where the shape allows."""

    def __init__(self, kind, d):
        super().__init__()
        self.kind = kind
        if kind == "linear":
            self.f = nn.Linear(d, d)
        elif kind == "conv1d":
            self.f = nn.Conv1d(d, d, kernel_size=3, padding=1)
        elif kind == "conv2d":
            self.f = nn.Conv2d(1, 2, kernel_size=3, padding=1)
        elif kind == "layernorm":
            self.f = nn.LayerNorm(d)
        elif kind == "batchnorm":
            self.f = nn.BatchNorm1d(d)
        elif kind == "gru":
            self.f = nn.GRU(d, d, batch_first=True)
        elif kind == "lstm":
            self.f = nn.LSTM(d, d, batch_first=True)
        elif kind == "mha":
            self.f = nn.MultiheadAttention(d, num_heads=2, batch_first=True)

    def forward(self, h):
        k, f = self.kind, self.f
        if k == "linear":
            return h + torch.tanh(f(h))
        if k in ("conv1d", "batchnorm"):
            return h + f(h.transpose(1, 2)).transpose(1, 2)
        if k == "conv2d":
            return h + f(h.unsqueeze(1)).mean(dim=1)
        if k == "layernorm":
            return f(h)
        if k in ("gru", "lstm"):
            return h + f(h)[0]
        return h + f(h, h, h, need_weights=False)[0]


class Net(nn.Module):
    """The drawn graph: tokens -> embedding -> blocks (one maybe shared, some checkpointed, the last
    maybe on some steps only) -> a head (maybe tied to the embedding, as a module or through F.linear)."""

    def __init__(self, s):
        super().__init__()
        self.s = s
        self.emb = nn.Embedding(s["vocab"], s["d"])
        self.blocks = nn.ModuleList([_Block(k, s["d"]) for k in s["layers"]])
        if s["shared"]:
            self.blocks.append(self.blocks[0])
        if s["tie"] != "functional":
            self.head = nn.Linear(s["d"], s["vocab"], bias=s["tie"] == "none")
            if s["tie"] == "module":
                self.head.weight = self.emb.weight
        for i in s["frozen"]:
            self.blocks[i].requires_grad_(False)
        self.step = 0

    def forward(self, idx):
        h = self.emb(idx)
        for i, block in enumerate(self.blocks):
            if self.s["branch"] and i == len(self.blocks) - 1 and self.step % self.s["branch"] != 0:
                continue
            if i in self.s["checkpoint"]:
                h = cp.checkpoint(block, h, use_reentrant=self.s["use_reentrant"])
            else:
                h = block(h)
        if self.s["tie"] == "functional":
            return F.linear(h, self.emb.weight)
        return self.head(h)


def build(s):
    """The drawn model, its initial values from the run's seed (the same for every build)."""
    torch.manual_seed(s["seed"] % (2**63))
    return Net(s)


def batch(s, step, micro):
    g = torch.Generator().manual_seed(s["seed"] % (2**31) + 1000 * step + micro)
    x = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)
    return x, torch.roll(x, -1, dims=1)
