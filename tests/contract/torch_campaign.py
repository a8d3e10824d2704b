#!/usr/bin/env python3
"""strata.torch's randomized campaign against torch alone (issue #47): random models, optimizers,
loops and budgets, seeded and replayable like strata-contract.

    tests/contract/torch_campaign.py --runs 200 --seed fresh --json
    tests/contract/torch_campaign.py --seeds 1234567 --describe      # replay one run, printing its draw

Note [Torch campaign]
Each run draws (torch_draw.py) a module graph from Linear, Conv1d/Conv2d, Embedding, LayerNorm,
BatchNorm, GRU/LSTM and MultiheadAttention, with a block shared and called twice, the head tied
to the embedding as a module or through F.linear, frozen blocks, a block used on some steps
only, torch.utils.checkpoint and bf16 autocast; an optimizer (any of the 7), clipping (torch's
clip_grad_norm_ or strata's max_grad_norm), micro-batches, zero_grad (set_to_none true or false,
or never), reads and writes of parameters between steps, a state_dict saved, a step, and loaded
back, an optimizer state from the reference loaded mid-run, and budgets from the minimum a
refusal names to everything on the GPU, with and without NVMe. It trains the draw twice: torch
alone (torch.optim where torch has the optimizer, else strata's kernels on torch tensors through
strata.torch.functional), then wrapped by strata. It checks:
  - a plan accepted at the first step trains every step (never an error later);
  - a refusal names a host budget ("raise host_budget to at least ...") and that budget trains;
  - losses and final values are bit-identical to the reference: torch.optim.SGD, or strata's kernel
    on torch tensors for the other optimizers; Adam, AdamW and Adagrad's losses also within
    LOSS_RTOL of torch.optim's (LOSS_RTOL_AUTOCAST under bf16 autocast); with strata's
    max_grad_norm, whose norm the reference cannot sum in the same order, losses within LOSS_RTOL;
  - a loop that never zeroes gets torch's sum with grad_reads true, else exactly one warning
    (Note [No zero_grad] in python/strata/torch/_grads.py), and is then not compared;
  - no file is left in the NVMe directory after close().
Draws torch itself cannot run (a layer without a bf16 kernel, say) are counted, not failed.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from torch_draw import draw, run_seed  # noqa: E402
from torch_train import LOSS_RTOL, one_run  # noqa: E402

FEATURES = ("layers", "shared", "tie", "frozen", "branch", "checkpoint", "autocast", "optimizer", "clip", "micro",
            "zero_grad", "grad_reads", "rw", "reload_at", "torch_state_at", "gpu", "host", "nvme", "threads")


def feature_values(s):
    """The values of each feature a draw covers (a run counts once per value)."""
    out = {}
    for f in FEATURES:
        v = s[f]
        if f == "layers":
            out[f] = sorted(set(v))
        elif f in ("frozen", "checkpoint", "rw"):
            out[f] = ["yes" if v else "no"]
        elif f in ("reload_at", "torch_state_at", "branch"):
            out[f] = ["no" if v is None else "yes"]
        else:
            out[f] = [str(v)]
    return out


def campaign(seeds, jobs):
    results = []
    if jobs > 1:
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(jobs) as pool:
            for res in pool.imap_unordered(one_run, seeds, chunksize=4):
                results.append(res)
    else:
        for s in seeds:
            results.append(one_run(s))
    return results


def summarize(results, campaign_seed, elapsed):
    counts = {}
    for r in results:
        for f, values in feature_values(draw(r["seed"])).items():
            for v in values:
                counts.setdefault(f, {}).setdefault(v, 0)
                counts[f][v] += 1
    outcome = {}
    for r in results:
        outcome[r["outcome"]] = outcome.get(r["outcome"], 0) + 1
    failures = [r for r in results if r["outcome"] == "failed"]
    return {
        "campaign_seed": campaign_seed, "runs": len(results), "seconds": round(elapsed, 1),
        "outcomes": outcome, "failures": len(failures),
        "max_loss_rel_to_torch_optim": max([r.get("loss_rel", 0.0) for r in results] or [0.0]),
        "loss_rtol": LOSS_RTOL, "features": counts,
        "failed": [{"seed": r["seed"], "what": r["what"],
                    "replay": f"tests/contract/torch_campaign.py --seeds {r['seed']} --describe"} for r in failures],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--seed", default="fresh", help='the campaign seed: an integer, or "fresh" (drawn and printed)')
    ap.add_argument("--seeds", help="comma-separated run seeds to replay instead of a campaign")
    ap.add_argument("--regressions", help="a file of run seeds (one per line, # comments) run besides the campaign")
    ap.add_argument("--describe", action="store_true", help="print each run's draw and outcome")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.seeds:
        seeds, campaign_seed = [int(x) for x in args.seeds.split(",")], None
    else:
        if args.runs < 1:
            ap.error("--runs must be >= 1")
        campaign_seed = int.from_bytes(os.urandom(8), "little") if args.seed == "fresh" else int(args.seed)
        print(f"torch_campaign: campaign seed {campaign_seed} (replay: --seed {campaign_seed} --runs {args.runs})",
              flush=True)
        seeds = [run_seed(campaign_seed, i) for i in range(args.runs)]
    if args.regressions:
        with open(args.regressions) as f:
            seeds += [int(line.split("#")[0]) for line in f if line.split("#")[0].strip()]
    # NVMe draws put swap files of up to 64 MiB per run (one per job at once) in the temp directory.
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < 1 << 30:
        print(f"torch_campaign: {free >> 20} MiB free in {tempfile.gettempdir()}, below the 1 GiB the NVMe draws "
              "may take with room to spare; free space there or set TMPDIR", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    results = campaign(seeds, args.jobs)
    summary = summarize(results, campaign_seed, time.monotonic() - t0)
    if args.describe:
        for r in results:
            print(json.dumps({"draw": draw(r["seed"]), "result": r}, default=str))
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"torch_campaign: {summary['runs']} runs in {summary['seconds']} s: {summary['outcomes']}; "
              f"losses at most {summary['max_loss_rel_to_torch_optim']:.3g} from torch.optim's")
    for f in summary["failed"]:
        print(f"FAILED seed {f['seed']}: {f['what']} (replay: {f['replay']})")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
