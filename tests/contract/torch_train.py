"""One run of the torch campaign (Note [Torch campaign] in torch_campaign.py): the draw trained by
torch alone and by strata.torch, and the checks between them."""

import copy
import inspect
import math
import os
import re
import shutil
import tempfile
import warnings

import torch
import torch.nn.functional as F

import strata.torch as st
from torch_draw import TORCH_OPTIMIZERS, batch, build, draw

# Adam, AdamW and Adagrad's losses against torch.optim's: rounding differs, and Adam turns a parameter's
# noise-level gradient (a key bias of attention, zero but for rounding) into steps of about lr either way.
# Under bf16 autocast a last-bit difference in a parameter flips bf16 roundings in the forward: 1e-2.
LOSS_RTOL = 1e-3
LOSS_RTOL_AUTOCAST = 1e-2
_STRATA = {"sgd": st.SGD, "adam": st.Adam, "adamw": st.AdamW, "lamb": st.LAMB, "lars": st.LARS, "lion": st.Lion,
           "adagrad": st.Adagrad}
_TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
          "adagrad": torch.optim.Adagrad}
_MAX_NORM = 1.0
KiB, MiB = 1 << 10, 1 << 20


class FunctionalReference(torch.optim.Optimizer):
    """strata's kernel on torch tensors (strata.torch.functional), for the optimizers torch.optim lacks;
    its state is kept in strata's torch format, so strata's optimizer loads it."""

    def __init__(self, params, name, hyper, clip):
        super().__init__(params, dict(hyper))
        self.name, self.clip = name, clip
        cls = _STRATA[name]
        group = {k: v.default for k, v in inspect.signature(cls.__init__).parameters.items()
                 if v.default is not inspect.Parameter.empty}
        group.update(hyper)
        self.kernel_hyper = cls._hyper(None, group)

    @torch.no_grad()
    def step(self):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        scale = _clip_coefficient(params) if self.clip == "strata" else 1.0
        names = st._C.optimizer_states(self.name, self.kernel_hyper)
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                for n in names:
                    state[n] = torch.zeros_like(p)
            state["step"] += 1
            st.functional.step_(self.name, p.data, p.grad, [state[n] for n in names], int(state["step"]),
                                grad_scale=scale, **self.kernel_hyper)


def _clip_coefficient(params):
    """strata's max_grad_norm coefficient (kernels::clip_coefficient): the global norm summed exactly
    (Note [Exact norms]; the squares of floats are exact doubles, and fsum rounds their sum once), then
    max_norm / (norm + 1e-6) in double, at most 1, rounded to float."""
    squares = [x for p in params if p.grad is not None for x in p.grad.double().pow(2).flatten().tolist()]
    c = _MAX_NORM / (math.sqrt(math.fsum(squares)) + 1e-6)
    return float(torch.tensor(min(c, 1.0), dtype=torch.float32))


def _clip_strata_in_torch(params):
    """Reference for strata's max_grad_norm with torch.optim.SGD: the kernel scales each gradient by it, and
    p.grad keeps its value (the step sees the scaled one). Returns the unscaled gradients to put back."""
    coef = _clip_coefficient(params)
    kept = {}
    for p in params:
        if p.grad is not None:
            kept[p] = p.grad.clone()
            p.grad.mul_(coef)
    return kept


def _drawn_gpu(s):
    """The GPU budget drawn: 4 KiB ("fewest": the refusal names the minimum), half the state, or all of it."""
    state = sum(p.numel() * 4 for p in build(s).parameters())
    return {"fewest": 4 * KiB, "half": state // 2, "all": 8 * state + 4 * MiB}[s["gpu"]]


def _config(s, nvme_dir, host, gpu):
    cfg = {"device": {"kind": "sim", "budget": "256MiB"}, "layout": {"chunk_elems": s["chunk_elems"]},
           "budgets": {"gpu": gpu, "host": host}, "threads": s["threads"], "grad_reads": s["grad_reads"],
           "gradient_accumulation_steps": s["micro"]}
    if nvme_dir is not None:
        cfg["budgets"]["nvme"] = "64MiB"
        cfg["nvme"] = {"dirs": [nvme_dir], "engine": s["nvme"]}
    return cfg


def _make(s, cfg, torch_optim=False):
    model = build(s)
    trainable = [p for p in model.parameters() if p.requires_grad]
    name, hyper = s["optimizer"], s["hyper"]
    if cfg is not None:
        model = st.wrap(model, cfg)
        extra = {"max_grad_norm": _MAX_NORM} if s["clip"] == "strata" else {}
        return model, _STRATA[name](trainable, **hyper, **extra), trainable
    if name == "sgd" or (torch_optim and name in _TORCH):
        return model, _TORCH[name](trainable, **hyper), trainable
    return model, FunctionalReference(trainable, name, hyper, s["clip"]), trainable


def _between_steps(s, step, model, trainable, reads):
    op = s["rw"].get(step)
    if op is None:
        return
    p = trainable[step % len(trainable)]
    with torch.no_grad():
        if op == "read":
            reads.append(sum(float(q.double().sum()) for q in model.parameters()))
        elif op == "mul_":
            p.mul_(0.5)
        elif op == "data_copy":
            p.data.copy_(p.data * 0.75)
        else:
            p.fill_(0.01)


def train(s, cfg=None, reference=None, torch_optim=False, probe=False):
    """(losses, final state_dict, reads, warnings, states saved at torch_state_at or, for strata, whether
    gradients were kept in torch at the end) of the drawn loop
    (torch_optim: with torch.optim's Adam, AdamW or Adagrad, not strata's kernel, as the reference);
    `reference` (the reference run's states) gives the state loaded at torch_state_at."""
    model, opt, trainable = _make(s, cfg, torch_optim)
    losses, reads, saved, ref_states = [], [], None, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(s["steps"]):
            model.step = step
            for m in range(s["micro"]):
                x, y = batch(s, step, m)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s["autocast"]):
                    out = model(x)
                loss = F.cross_entropy(out.float().reshape(-1, s["vocab"]), y.reshape(-1)) / s["micro"]
                loss.backward()
                losses.append(loss.detach().clone())
                if probe:  # the first backward planned and ran: the budgets were accepted
                    model.strata.close()
                    return None
            if s["clip"] == "torch":
                torch.nn.utils.clip_grad_norm_(trainable, _MAX_NORM)
            kept = {}
            if s["clip"] == "strata" and cfg is None and not isinstance(opt, FunctionalReference):
                kept = _clip_strata_in_torch(trainable)
            opt.step()
            for p, g in kept.items():
                p.grad.copy_(g)
            if s["zero_grad"] != "never":
                opt.zero_grad(set_to_none=s["zero_grad"] == "none_true")
            _between_steps(s, step, model, trainable, reads)
            if step == s["reload_at"]:
                saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
            elif saved is not None and step == s["reload_at"] + 1:
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
            if step == s["torch_state_at"]:
                if cfg is None:
                    ref_states.append((copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())))
                else:
                    model.load_state_dict(reference[0][0])
                    opt.load_state_dict(reference[0][1])
    state = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    if cfg is not None:
        # "auto" keeps gradients in torch when torch code read them or they came in pieces (Note [Gradient pieces])
        ref_states = model.strata._keep_grads
        model.strata.close()
    return losses, state, reads, [str(w.message) for w in caught if "zero_grad" in str(w.message)], ref_states


def _same_bits(a, b):
    """Equal, NaNs included (a run that diverges must diverge alike)."""
    if torch.equal(a, b):
        return True
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b]))


def _max_rel(a_list, b_list):
    return max(float(abs(a - b) / abs(a)) for a, b in zip(a_list, b_list))


def _compare(s, ref, got, torch_ref):
    """(max relative loss difference from torch.optim, what differs or None). Every optimizer must be
    bit-identical to its reference: torch.optim.SGD, or strata's kernel on torch tensors for the others
    (the same arithmetic); Adam, AdamW and Adagrad's losses also within LOSS_RTOL of torch.optim's. With
    strata's max_grad_norm the losses are held to LOSS_RTOL (LOSS_RTOL_AUTOCAST under autocast): its norm sums squares in fp32 groups of 64
    elements placed by the chunk layout (Note [Exact norms]), which the reference cannot reproduce."""
    rtol = LOSS_RTOL_AUTOCAST if s["autocast"] else LOSS_RTOL
    if s["clip"] == "strata":
        # Under bf16 autocast the clip coefficient's last bits (the norm's order) reach the loss through
        # bf16 products, as any difference does: the autocast tolerance (seed 1840102489753000129, 1.4e-3).
        rel = _max_rel(ref[0], got[0])
        finite = all(bool(torch.isfinite(v).all()) for v in got[1].values())
        what = None if rel <= rtol and finite else f"clipped by strata: losses {rel:.3g} apart, finite {finite}"
        return rel, what
    pairs = list(zip(ref[0], got[0])) + [(ref[1][k], got[1][k]) for k in ref[1]]
    pairs += [(torch.tensor(a), torch.tensor(b)) for a, b in zip(ref[2], got[2])]
    if not all(bool(torch.isfinite(x)) for x in ref[0]):
        # torch alone diverged: a step on Inf/NaN gradients writes NaN there, where strata leaves the family
        # unchanged and warns (docs/torch.md, limits); the losses up to the first non-finite one must agree.
        pairs = list(zip(ref[0], got[0]))
        pairs = pairs[:next(i for i, (a, _) in enumerate(pairs) if not bool(torch.isfinite(a))) + 1]
    for i, (a, b) in enumerate(pairs):
        if not _same_bits(a, b):
            where = f"loss {i}" if i < len(ref[0]) else "a value"
            d = float((a.double() - b.double()).abs().max())
            return 0.0, f"not bit-identical to the reference: {where} differs by up to {d:.3g}"
    rel = 0.0
    if torch_ref is not None:
        rel = _max_rel(torch_ref[0], got[0])
        if rel > rtol:
            return rel, f"a loss {rel:.3g} (relative) from torch.optim's, above {rtol}"
    return rel, None


def _strata_run(s, ref, host, gpu, probe=False):
    nvme_dir = tempfile.mkdtemp(prefix="strata-campaign-") if s["nvme"] else None
    try:
        got = train(s, _config(s, nvme_dir, host, gpu), ref[4], probe=probe)
        left = sorted(os.listdir(nvme_dir)) if nvme_dir else []
        return got, left
    finally:
        if nvme_dir:
            shutil.rmtree(nvme_dir, ignore_errors=True)


_UNITS = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": 1 << 30}


def named_minimum(message, key):
    """The budget `key` ("host" or "gpu") a refusal names: its byte count, or its rounded size rounded up to
    the next KiB; None where it names none."""
    m = re.search(key + r"_budget to at least [^(]*\((\d+) bytes\)", message)
    if m:
        return int(m.group(1))
    for pattern in (key + r"_budget budget is .* needs ([0-9.]+) (B|KiB|MiB|GiB); raise " + key,
                    r"budgets\." + key + r" to at least ([0-9.]+) (B|KiB|MiB|GiB)"):
        m = re.search(pattern, message)
        if m:
            return -(-int(float(m.group(1)) * _UNITS[m.group(2)] + 1023) // KiB) * KiB
    return None


def _minimum(s, ref, key, host, gpu):
    """(the budget `key` at which the first step plans, None) or (None, a failed run's result): from the
    given budgets, each refusal's named minimum is tried next (a refusal at wrap may name a lower bound,
    before the tensors' sizes are known: counted in the run's "refusals")."""
    refusals = []
    for _ in range(3):
        try:
            _strata_run(s, ref, host, gpu, probe=True)
            return (host if key == "host" else gpu), refusals
        except Exception as e:  # noqa: BLE001 - a refusal is any error at the first step; it must name a budget
            if s["grad_reads"] is False and "got its gradient in two pieces" in str(e):
                return None, {"outcome": "refused_gradient_pieces"}  # Note [Gradient pieces]: by design
            least = named_minimum(str(e), key)
            if least is None or least <= (host if key == "host" else gpu):
                return None, {"outcome": "failed", "what": f"refused without naming a larger {key} budget: {e}"[:600]}
            refusals.append(least)
            if key == "host":
                host = least
            else:
                gpu = least
    return None, {"outcome": "failed", "what": f"{key} budget refused 3 times: {refusals}"}


def _budgets(s, ref):
    """(host, gpu, refusals, None): the budgets as drawn, or the minimums refusals name; or (.., a failed run)."""
    gpu, refused = _minimum(s, ref, "gpu", 64 * MiB, _drawn_gpu(s))
    if gpu is None:
        return None, None, 0, refused
    if s["host"] == "plenty":
        return 64 * MiB, gpu, len(refused), None
    host, refused_host = _minimum(s, ref, "host", 4 * KiB, gpu)
    if host is None:
        return None, None, 0, refused_host
    if refused_host:  # the smallest, in the planner's steps of 64 KiB: one step less is refused too
        try:
            _strata_run(s, ref, host - 64 * KiB, gpu, probe=True)
            return None, None, 0, {"outcome": "failed", "what": f"host budget {host - 64 * KiB} plans, below the "
                                                                f"{host} a refusal named as the smallest"}
        except Exception:  # noqa: BLE001, S110 - refused, as it should be
            pass
    return (host if s["host"] == "suggested" else 2 * host), gpu, len(refused) + len(refused_host), None


def one_run(seed, change=None):
    s = draw(seed)
    s.update(change or {})
    try:
        ref = train(s)
    except Exception as e:  # noqa: BLE001 - torch alone cannot run this draw: not strata's to pass
        return {"seed": seed, "outcome": "torch_refused", "what": f"{type(e).__name__}: {e}"[:300]}
    host, gpu, refusals, failed = _budgets(s, ref)
    if failed:
        return {"seed": seed, **failed}
    try:
        got, left = _strata_run(s, ref, host, gpu)
    except Exception as e:  # noqa: BLE001 - after a plan was accepted (or at the suggested minimum): a failure
        if s["grad_reads"] is False and "got its gradient in two pieces" in str(e):
            return {"seed": seed, "outcome": "refused_gradient_pieces"}  # Note [Gradient pieces]: by design
        return {"seed": seed, "outcome": "failed", "what": f"failed after accept: {type(e).__name__}: {e}"[:600]}
    if left:
        return {"seed": seed, "outcome": "failed", "what": f"files left in the NVMe directory: {left}"}
    if s["zero_grad"] == "never" and not got[4]:  # gradients handed during backward (Note [No zero_grad])
        if len(got[3]) != 1:
            return {"seed": seed, "outcome": "failed", "what": f"no zero_grad: {len(got[3])} warnings, want 1"}
        return {"seed": seed, "outcome": "passed_warned"}
    if got[3]:
        return {"seed": seed, "outcome": "failed", "what": f"unexpected warning: {got[3][0]}"}
    torch_ref = train(s, torch_optim=True) if s["optimizer"] in ("adam", "adamw", "adagrad") else None
    loss_rel, what = _compare(s, ref, got, torch_ref)
    outcome = "failed" if what else ("passed_at_minimum" if s["host"] == "suggested" else "passed")
    return {"seed": seed, "outcome": outcome, "what": what, "loss_rel": loss_rel, "refusals": refusals}
