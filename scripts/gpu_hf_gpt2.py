#!/usr/bin/env python3
"""A tiny Hugging Face GPT2LMHeadModel trained through strata.torch, checked against torch alone.

    python scripts/gpu_hf_gpt2.py --device cuda --json     # scripts/gpu-check runs this on a GPU
    python scripts/gpu_hf_gpt2.py --device sim  --json     # the same on strata's sim device (CPU)

Random init from a small config (no download). Two copies start from the same weights: the
reference trains with torch alone on the CPU in fp32 (torch.optim.AdamW), the other
through strata.torch on --device with the device budget a quarter of the model state, so every
step moves chunks. Per step the losses are compared; at the end the parameters. Both sides use AdamW (lr 1e-3). On CUDA, TF32 is
switched off so both sides compute in fp32; the tolerance (--tol, relative to the loss, absolute
for parameters) covers cuBLAS's other summation order. Exits 1 beyond tolerance, 77 when
transformers or (for --device cuda) a GPU is missing.
"""

import argparse
import json
import sys
import tempfile
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "sim"), default="cuda")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        print(f"gpu_hf_gpt2: SKIP: transformers is not importable ({e})", file=sys.stderr)
        return 77
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_hf_gpt2: SKIP: torch sees no CUDA device", file=sys.stderr)
        return 77
    import strata.torch as st
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(cfg)
    model = GPT2LMHeadModel(cfg)
    model.load_state_dict(ref.state_dict())
    dev = torch.device("cuda" if args.device == "cuda" else "cpu")
    model.to(dev)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    largest = max(p.numel() for p in model.parameters())
    out = {"device": args.device, "torch": torch.__version__, "params": n, "steps": args.steps}
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 256, (4, 32), generator=g) for _ in range(args.steps)]
    with tempfile.TemporaryDirectory(prefix="strata-hf-gpt2-") as nvme:
        wrapped = st.wrap(model, {"device": {"kind": args.device, "budget": "256MiB"},
                                  "budgets": {"gpu": 16 * n // 4, "host": 64 * n, "nvme": "256MiB"},
                                  "nvme": {"dirs": [nvme]},
                                  "layout": {"chunk_elems": (largest + 4095) // 4096 * 4096}})
        # One optimizer for the whole run (strata's is planned before the first step).
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        st_opt = st.AdamW(wrapped.parameters(), lr=1e-3)
        losses, t0 = [], time.perf_counter()
        for x in data:
            lr_ = ref(x, labels=x).loss
            lr_.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            xs = x.to(dev)
            ls = wrapped(xs, labels=xs).loss
            ls.backward()
            st_opt.step()
            st_opt.zero_grad()
            losses.append((float(lr_.detach()), float(ls.detach())))
        if args.device == "cuda":
            torch.cuda.synchronize()
        out["strata_wall_s"] = time.perf_counter() - t0
        out["losses_ref_strata"] = losses
        out["max_loss_rel_diff"] = max(abs(a - b) / max(abs(a), 1e-12) for a, b in losses)
        sd = wrapped.state_dict()
        out["max_param_abs_diff"] = max(float((v.detach().float().cpu() - sd[k].detach().float().cpu()).abs().max())
                                        for k, v in ref.state_dict().items() if k in sd)
        wrapped.strata.close()
    out["tol"] = args.tol
    out["ok"] = out["max_loss_rel_diff"] <= args.tol and out["max_param_abs_diff"] <= args.tol
    print(json.dumps(out, indent=1) if args.json else
          f"gpu_hf_gpt2 {args.device}: loss rel diff {out['max_loss_rel_diff']:.2e}, "
          f"param abs diff {out['max_param_abs_diff']:.2e} ({'ok' if out['ok'] else 'FAILED'})")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
