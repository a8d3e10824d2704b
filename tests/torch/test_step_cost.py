"""strata.torch's own work per step (issue #29, Note [Step counters] in strata/torch/_grads.py):
where everything fits a step moves no bytes between tiers, and the binding crosses from Python
once per module hook (Note [Batched binds] in python/src/engine.hpp), not once per parameter.
Offloaded steps move bytes, so the counters are live. bench/torch_gpt.py reports the same
counters; its shortest run is smoke-tested here."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import strata.torch as st

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from torch_gpt import Gpt  # noqa: E402

MiB = 1 << 20


def wrapped(fit, tmp_path):
    torch.manual_seed(0)
    model = Gpt(d=64, layers=2, seq=32)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    state = 16 * n
    gpu, host = (2 * state + 16 * MiB, 2 * state + 16 * MiB) if fit else (state // 4, state // 2 + 8 * MiB)
    cfg = {"device": {"kind": "sim", "budget": "256MiB"}, "budgets": {"gpu": gpu, "host": host, "nvme": "256MiB"},
           "nvme": {"dirs": [str(tmp_path)]}, "threads": 2}
    model = st.wrap(model, cfg)
    return model, st.AdamW(model.parameters(), lr=1e-3)


def train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 32), generator=g)
        logits = model(x)
        F.cross_entropy(logits.view(-1, 256), x.view(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def per_step(model, opt, steps=3):
    train(model, opt, 3, seed=1)  # the first steps trace, plan and load
    before = model.strata.counters()
    train(model, opt, steps, seed=2)
    after = model.strata.counters()
    return {k: (after[k] - before[k]) / steps for k in after}


def module_calls(model):
    """Modules whose hooks run in one forward (each owns parameters), and trainable parameters."""
    w = model.strata
    return len(w._module_pids) - 1, sum(1 for p in w.params if p.requires_grad)  # - 1: the root's entry


def test_fit_step_moves_no_bytes_and_crosses_once_per_module_hook(tmp_path):
    model, opt = wrapped(True, tmp_path)
    c = per_step(model, opt)
    model.strata.close()
    assert c["steps"] == 1
    assert c["bytes_moved"] == 0, f"a fit step moved bytes between tiers: {c}"
    modules, params = module_calls(model)
    # Per module (and the root): forward pre + post, backward bind + unbind (at most); one
    # hand-over per gradient. One crossing per parameter and hook would be over twice this.
    assert c["crossings"] <= 4 * (modules + 1) + params, c
    assert c["hook_calls"] <= 4 * (modules + 1) + params, c
    # A lease per parameter for forward and one for backward (a tied one: once per owner), no more.
    assert c["param_leases"] <= 2 * (params + 1), c


def test_offload_step_moves_bytes(tmp_path):
    model, opt = wrapped(False, tmp_path)
    c = per_step(model, opt)
    model.strata.close()
    assert c["bytes_h2d"] > 0 and c["bytes_moved"] >= c["bytes_h2d"], c


def test_bench_smoke(tmp_path):
    env = dict(os.environ, STRATA_LOG_LEVEL="warn")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "torch_gpt.py"), "--json", "--pairs", "3",
                          "--warmup", "2", "--sizes", "64x2"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    s = r["sizes"]["64x2"]
    assert r["bit_identical_sgd"] is True
    # Note [Freed memory on these VMs] in bench/malloc_env.py: kept unless the environment chose.
    assert r["malloc_freed_memory"] == ("environment" if "MALLOC_MMAP_THRESHOLD_" in env or
                                        "MALLOC_TRIM_THRESHOLD_" in env else "kept"), r
    for key in ("fit_overhead", "offload_over_plain", "fit_fwd_bwd_overhead", "fit_optimizer_ratio"):
        assert s[key]["median"] > 0 and s[key]["iqr"][0] <= s[key]["median"] <= s[key]["iqr"][1], (key, s[key])
    assert s["fit_counters"]["bytes_moved"] == 0 and s["offload_counters"]["bytes_moved"] > 0, s


# --- Note [Holding parameters where everything fits] in strata/torch/_hooks.py -----------------------

def _fit_config(name):
    from harness import config  # noqa: PLC0415
    from models import make  # noqa: PLC0415

    model, _ = make(name)
    cfg = config(model, gpu_slots=64)
    cfg["budgets"]["gpu"] = "64MiB"  # every family resident: all_gpu
    cfg["budgets"]["host"] = "64MiB"
    return cfg


def test_fit_step_holds_parameters_one_lease_per_parameter(tmp_path):
    model, opt = wrapped(True, tmp_path)
    c = per_step(model, opt)
    assert model.strata._hold, model.strata.engine.describe()
    modules, params = module_calls(model)
    model.strata.close()
    # A bind per module call in forward and an unbind in its backward (or the sweep): no unbind after
    # forward, no bind again in backward. Without holding this is 4 per module (the test above).
    assert c["crossings"] <= 2 * (modules + 1) + params, c
    assert c["param_leases"] <= params + 1, c


def test_offload_step_does_not_hold(tmp_path):
    model, opt = wrapped(False, tmp_path)
    per_step(model, opt, steps=1)
    assert not model.strata._hold, model.strata.engine.describe()
    model.strata.close()


@pytest.mark.parametrize("name", ["mlp", "encoder", "tied", "reused", "frozen_unused", "checkpoint", "shared",
                                  "ftied", "reparam"])
def test_holding_is_bit_identical_to_torch(name, monkeypatch):
    """Every way the models use the hooks (tied, reused, frozen, checkpointed, ...), where everything fits:
    held (the default there) and not held (STRATA_TORCH_BENCH_NO_HOLD=1) train to torch's bits."""
    from harness import assert_identical, run  # noqa: PLC0415

    reference = run(name, 4)
    held = run(name, 4, _fit_config(name))
    assert held[2].strata._hold, held[2].strata.engine.describe()
    assert_identical(reference, held)
    held[2].strata.close()
    monkeypatch.setenv("STRATA_TORCH_BENCH_NO_HOLD", "1")
    plain = run(name, 4, _fit_config(name))
    assert not plain[2].strata._hold
    assert_identical(reference, plain)
    plain[2].strata.close()


def test_holding_with_micro_batches_and_reads_between_steps():
    """Gradient accumulation and state_dict/parameter reads between steps, held."""
    from harness import assert_identical, run  # noqa: PLC0415

    reference = run("tied", 3, micro=3)
    held = run("tied", 3, _fit_config("tied") | {"gradient_accumulation_steps": 3}, micro=3)
    assert held[2].strata._hold
    assert_identical(reference, held)
    model = held[2]
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in reference[1].items())
    assert torch.equal(model.emb.weight.detach().clone(), reference[1]["emb.weight"])  # lazy read between steps
    model.strata.close()
