"""What one module hook call costs strata.torch (issue #29), in one command with --json.

    PYTHONPATH=build/release/python /usr/bin/python3 bench/torch_hook_cost.py --json

Three figures, each the median of --trials trials of --calls calls:
  per_call_plain_us   a no-op forward pre- + post-hook pair on an empty module, per hook call,
                      over the same module without hooks: what torch charges for a Python hook;
  per_call_eager_us   the same hooks wrapped by strata.torch._compile.eager (dynamo's disable on
                      torch >= 2; torch 1.x returns the function itself, so it equals plain);
  strata_forward_us   one forward of a small GPT wrapped by strata (sim device, everything fits),
                      with strata's hooks as wrap() installs them; strata_hooks says whether they
                      are plain functions or dynamo-disabled ones (Note [torch.compile] in
                      strata/torch/_compile.py), hook_calls_per_forward how many ran;
                      strata_forward_disabled_hooks_us (torch >= 2) the same forward after the hooks
                      were swapped for dynamo-disabled ones, as every hook was before #29;
  fit_step_ms_held / fit_step_ms_not_held / held_over_not_held
                      a training step of that model with parameters held from forward to backward
                      (Note [Holding parameters where everything fits] in _hooks.py) and without,
                      alternating trial by trial, and the median of the per-trial ratios.
The first two isolate the wrapper; the third is what a user's forward pays. Run it on each torch
(/usr/bin/python3 for 1.13, the torch2 venv's python for 2.x) and on two builds to compare.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


class _Hooks:
    def pre(self, module, inputs):
        return None

    def post(self, module, inputs, output):
        return None


def _time_calls(module, x, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        module(x)
    return (time.perf_counter() - t0) / calls * 1e6


def hook_cost(calls, trials, wrap_fn):
    """Per hook call (µs) of a pre + post hook pair wrapped by wrap_fn, over no hooks."""
    x = torch.zeros(1)
    bare = torch.nn.Identity()
    hooked = torch.nn.Identity()
    h = _Hooks()
    hooked.register_forward_pre_hook(wrap_fn(h.pre))
    hooked.register_forward_hook(wrap_fn(h.post))
    diffs = []
    for _ in range(trials):  # alternate, so a noisy moment hits both
        t_bare = _time_calls(bare, x, calls)
        t_hooked = _time_calls(hooked, x, calls)
        diffs.append((t_hooked - t_bare) / 2)
    return statistics.median(diffs)


def _is_disabled(fn):
    return getattr(fn, "_torchdynamo_disable", False) or type(fn).__name__ != "method"


def _time_steps(model, opt, x, steps):
    t0 = time.perf_counter()
    for _ in range(steps):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / steps * 1e3


def hold_ab(model, opt, x, trials, steps):
    """Training steps (ms) with parameters held from forward to backward and without (Note [Holding
    parameters where everything fits] in strata/torch/_hooks.py), alternating trial by trial."""
    w = model.strata
    held, plain = [], []
    for _ in range(trials):
        for on, out in ((True, held), (False, plain)):
            os.environ["STRATA_TORCH_BENCH_NO_HOLD"] = "0" if on else "1"
            w._update_hold()
            out.append(_time_steps(model, opt, x, steps))
    os.environ.pop("STRATA_TORCH_BENCH_NO_HOLD")
    w._update_hold()
    ratios = sorted(h / p for h, p in zip(held, plain))
    return {"fit_step_ms_held": round(statistics.median(held), 3),
            "fit_step_ms_not_held": round(statistics.median(plain), 3),
            "held_over_not_held": round(statistics.median(ratios), 3),
            "held_over_not_held_iqr": [round(ratios[len(ratios) // 4], 3), round(ratios[(3 * len(ratios)) // 4], 3)]}


def strata_forward(trials, steps):
    import strata.torch as st  # noqa: PLC0415
    from torch_gpt import Gpt  # noqa: PLC0415

    torch.manual_seed(0)
    model = st.wrap(Gpt(d=64, layers=4, seq=32), {"device": {"kind": "sim", "budget": "256MiB"},
                                                  "budgets": {"gpu": "128MiB", "host": "128MiB"}, "threads": 1})
    opt = st.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 32))
    for _ in range(3):  # build, trace, plan
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    hooks = [h for m in model.modules() for h in m._forward_pre_hooks.values()]
    disabled = sum(1 for h in hooks if _is_disabled(h))
    times = []
    calls_before = model.strata.counters()["hook_calls"]
    with torch.no_grad():
        for _ in range(trials):
            t0 = time.perf_counter()
            for _ in range(steps):
                model(x)
            times.append((time.perf_counter() - t0) / steps * 1e6)
    per_forward = (model.strata.counters()["hook_calls"] - calls_before) / (trials * steps)
    out = {"strata_forward_us": round(statistics.median(times), 2),
           "strata_hooks": "disabled" if disabled == len(hooks) else "plain" if disabled == 0 else "mixed",
           "forward_pre_hooks": len(hooks), "hook_calls_per_forward": per_forward}
    out.update(hold_ab(model, opt, x, trials, max(1, steps // 5)))
    from strata.torch import _compile  # noqa: PLC0415

    if hasattr(torch, "compile") and not _compile.hooks_swapped():
        # The same model with the hooks every compile gets (as before #29, always): the wrapper's cost in place.
        _compile._on_compile_start()
        with torch.no_grad():
            times = []
            for _ in range(trials):
                t0 = time.perf_counter()
                for _ in range(steps):
                    model(x)
                times.append((time.perf_counter() - t0) / steps * 1e6)
        out["strata_forward_disabled_hooks_us"] = round(statistics.median(times), 2)
    model.strata.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--forward-steps", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from strata.torch import _compile  # noqa: PLC0415

    out = {"torch": torch.__version__, "load_avg_1m": round(os.getloadavg()[0], 2), "calls": args.calls,
           "trials": args.trials,
           "per_call_plain_us": round(hook_cost(args.calls, args.trials, lambda f: f), 3),
           "per_call_eager_us": round(hook_cost(args.calls, args.trials, _compile.eager), 3)}
    out.update(strata_forward(args.trials, args.forward_steps))
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:24s} {v}")


if __name__ == "__main__":
    main()
