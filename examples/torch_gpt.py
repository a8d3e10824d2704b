#!/usr/bin/env python3
"""A GPT-style decoder made of torch.nn modules, trained through strata.torch on text the
repository and the system ship, with model state several times the device budget: params
and gradients stream through the (sim) device, params live in pinned host memory,
optimizer states on host and NVMe.

    PYTHONPATH=build/release/python /usr/bin/python3 examples/torch_gpt.py [--steps 150]

On a CUDA machine (device.kind auto finds the GPU) the same script trains on the GPU.
Prints a progress bar, then a summary (loss, tokens/s, bytes per link, stall).
"""

import argparse
import glob
import json
import math
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class Attention(nn.Module):
    def __init__(self, d, heads, seq):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.register_buffer("causal", torch.tril(torch.ones(seq, seq, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        att = att.masked_fill(~self.causal[:t, :t], float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d, heads, seq):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads, seq)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def init_weights(m):
    """GPT-2's init of one module's own parameters; Gpt applies it in modules() order. A model built
    inside strata.torch.init() gets the same values from strata.torch.wrap(model, config,
    init=init_weights) (Note [Deferred init] in python/strata/torch/_deferred.py)."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


class Gpt(nn.Module):
    """Token and position embeddings, pre-norm blocks, a final norm and an output head tied to
    the token embedding."""

    def __init__(self, vocab=256, d=192, layers=4, heads=4, seq=64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads, seq) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():
            init_weights(m)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def corpus(fixed=False):
    """Bytes of the repository's README and docs and the system's license texts.

    fixed: the license texts alone. --check-loss trains on them, so that what it checks
    does not move with every edit of the docs (the loss after 40 steps did)."""
    files = []
    if not fixed:
        files = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    files += [f for f in sorted(glob.glob("/usr/share/common-licenses/*")) if os.path.isfile(f)][:8]
    data = b"".join(open(f, "rb").read() for f in files if os.path.isfile(f))
    if len(data) < 4096:
        raise SystemExit("torch_gpt: found less than 4 KiB of text to train on")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(data, batch, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + seq] for s in starts])
        y = torch.stack([data[s + 1:s + seq + 1] for s in starts])
        yield x, y


def state_bytes(model):
    """params + grads + two fp32 AdamW states, as strata holds them."""
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return 16 * n


def strata_config(args, model, nvme_dir):
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return {
        "device": {"kind": args.device, "budget": "512MiB"},
        "budgets": {"gpu": args.device_budget, "host": int(args.host_fraction * 16 * n) + (8 << 20),
                    "nvme": "1GiB"},
        "nvme": {"dirs": [nvme_dir], "engine": args.engine},
        "threads": args.threads,
    }


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def parse_args():
    """The command line, refused (ap.error) where a size is out of range."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--device", default="auto", help="auto (cuda when usable, else sim), sim or cuda")
    ap.add_argument("--device-budget", default="3MiB", help="strata's GPU chunk budget")
    ap.add_argument("--host-fraction", type=float, default=0.55,
                    help="host budget as a fraction of the model state (the rest of the states go to NVMe)")
    ap.add_argument("--nvme", default=None, help="NVMe directory (default: a temporary one, removed at exit)")
    ap.add_argument("--engine", default="auto", choices=["auto", "uring", "posix"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--check-loss", action="store_true",
                    help="exit 1 unless the loss falls by a third (trains on the license texts alone)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args()
    if args.steps < 1 or args.batch < 1 or args.seq < 2 or args.layers < 1 or args.d_model < 4 or \
            args.d_model % 4 != 0:
        ap.error("--steps, --batch >= 1, --seq >= 2, --layers >= 1, --d-model a multiple of 4")
    return args


def train(model, opt, sched, data, args):
    """--steps steps with a progress bar on stderr: (losses, the time after the first step, tokens since)."""
    it = batches(data, args.batch, args.seq)
    losses, t_start, tokens = [], None, 0
    width = 30
    for step in range(args.steps):
        x, y = next(it)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 0:
            t_start = time.perf_counter()  # the first step traces and plans
        else:
            tokens += x.numel()
        done = (step + 1) / args.steps
        bar = "#" * int(width * done) + "." * (width - int(width * done))
        rate = tokens / (time.perf_counter() - t_start) if tokens else 0.0
        line = f"\r[{bar}] {step + 1}/{args.steps} loss {loss.item():.3f} {rate:,.0f} tok/s"
        if sys.stderr.isatty() or step + 1 == args.steps or (step + 1) % 25 == 0:
            print(line, end="" if sys.stderr.isatty() else "\n", file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    return losses, t_start, tokens


def report(model, args, losses, t_start, tokens, ratio):
    """Prints the summary (JSON with --json, else one line); (mean loss of the first 5 steps, of the last 5)."""
    elapsed = time.perf_counter() - t_start
    tot = model.strata.totals
    first = sum(losses[:5]) / min(5, len(losses))
    last = sum(losses[-5:]) / min(5, len(losses))
    summary = {
        "steps": args.steps, "loss_first": round(first, 4), "loss_last": round(last, 4),
        "tokens_per_s": round(tokens / elapsed, 1) if tokens else 0.0,
        "state_over_device_budget": round(ratio, 2),
        "bytes_h2d": tot["bytes_h2d"], "bytes_d2h": tot["bytes_d2h"],
        "bytes_disk_read": tot["bytes_disk_read"], "bytes_disk_write": tot["bytes_disk_write"],
        "stall_s": round(tot["stall_s"], 3),
        "gpu_high_water_bytes": model.strata.last_stats["gpu_high_water_bytes"],
        "host_high_water_bytes": model.strata.last_stats["host_high_water_bytes"],
        "chunk_padding": round(model.strata.engine.layout()["padding_fraction"], 4),  # the runtime's search
    }
    if args.json:
        print(json.dumps(summary))
    else:
        n = max(1, args.steps)
        print(f"done: {args.steps} steps, loss {first:.3f} -> {last:.3f} (mean of 5 steps), "
              f"{summary['tokens_per_s']:,.0f} tokens/s; per step h2d {fmt_bytes(tot['bytes_h2d'] / n)}, "
              f"d2h {fmt_bytes(tot['bytes_d2h'] / n)}, disk read {fmt_bytes(tot['bytes_disk_read'] / n)}, "
              f"write {fmt_bytes(tot['bytes_disk_write'] / n)}; stall {tot['stall_s']:.2f} s in all; "
              f"state {ratio:.1f}x the device budget")
    return first, last


def main():
    args = parse_args()

    import strata.torch as st  # noqa: E402 (after argument errors, which need no torch extension)

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    data = corpus(fixed=args.check_loss)
    model = Gpt(d=args.d_model, layers=args.layers, seq=args.seq)
    own_dir = args.nvme is None
    nvme_dir = tempfile.mkdtemp(prefix="strata-gpt-") if own_dir else args.nvme
    try:
        cfg = strata_config(args, model, nvme_dir)
        model = st.wrap(model, cfg)
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        opt = st.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                       lr=args.lr, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        ratio = state_bytes(model) / st_bytes(cfg["budgets"]["gpu"])
        print(f"torch_gpt: {sum(p.numel() for p in opt.param_groups[0]['params'] + opt.param_groups[1]['params']) / 1e6:.2f} M "
              f"params, {len(data) / 1024:.0f} KiB of text; model state {fmt_bytes(state_bytes(model))} = "
              f"{ratio:.1f}x the device budget {cfg['budgets']['gpu']}; {model.strata.engine.describe()}",
              file=sys.stderr)
        losses, t_start, tokens = train(model, opt, sched, data, args)
        first, last = report(model, args, losses, t_start, tokens, ratio)
        model.strata.close()
        if args.check_loss and not last < first * 2 / 3:
            print(f"torch_gpt: the loss did not fall by a third ({first:.3f} -> {last:.3f})", file=sys.stderr)
            return 1
        return 0
    finally:
        if own_dir:
            shutil.rmtree(nvme_dir, ignore_errors=True)


def st_bytes(size):
    """Bytes of a size like "6MiB" or an int."""
    if isinstance(size, int):
        return size
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "B": 1}
    for u, m in units.items():
        if size.endswith(u):
            return int(float(size[:-len(u)]) * m)
    return int(size)


if __name__ == "__main__":
    sys.exit(main())
