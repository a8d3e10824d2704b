"""Gradients and the step: each gradient handed to strata's grad chunks as backward computes it
(Note [Gradient hooks]), what p.grad holds meanwhile (Note [Gradients in torch], Note [Zero
gradients]), optimizer.step() and the counters it keeps (Note [Step counters]). Wrapped takes
these methods from _Grads."""

import os
import sys
import warnings

import torch

from . import _C, _compile, _processes
from ._views import _METADATA, _func_name, _tensors_of

StrataError = _C.StrataError

# Note [Gradients in torch]
# strata hands each gradient to its grad chunk during backward and its optimizer may
# run at once, overlapping the rest of backward. torch code that reads or changes
# gradients between backward and step() (torch.nn.utils.clip_grad_norm_,
# clip_grad_value_, logging a gradient norm) needs them as torch tensors, so the wrap
# config's "grad_reads" chooses:
#   - true: gradients stay torch's (p.grad accumulates as in torch) until
#     optimizer.step(), which hands them to strata and runs every family's optimizer
#     there (no overlap with backward; torch's memory for the gradients, as torch alone);
#   - false: gradients are handed during backward, and p.grad is a placeholder (no
#     memory) whose use raises, saying how to get gradients;
#   - "auto" (default): true for the first step, whose optimizer strata defers to
#     step() anyway (the warm-up step); a gradient used by a torch call in it (other
#     than zero_grad's) keeps it true for good, else false from the second step on.
# Either way `p.grad is None` matches torch: a parameter that got a gradient keeps one
# until zero_grad(set_to_none=True) (Note [Zero gradients]).

# Ops on a gradient placeholder that keep torch's zero_grad() working (Note [Gradients in torch]).
_GRAD_NOOPS = frozenset(("zero_", "detach_", "requires_grad_"))


def _user_stacklevel():
    """warnings.warn's stacklevel of the nearest caller outside strata and torch (the user's step() call)."""
    inside = (os.path.dirname(__file__), os.path.dirname(torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


class _StrataGrad(torch.Tensor):
    """p.grad of a wrapped parameter whose gradient strata holds (Note [Gradients in torch])."""

    _strata_name = "?"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = _func_name(func)
        if name in _GRAD_NOOPS:
            if name == "zero_":  # torch code zeroing p.grad by hand (torch.optim's zero_grad(set_to_none=False))
                owner = getattr(args[0], "_strata_owner", None)
                if owner is not None:
                    owner._unzeroed.discard(args[0]._strata_pid)
            return args[0]
        if name not in _METADATA or getattr(func, "__name__", "") == "__set__":
            t = _tensors_of((args, kwargs or {}), _StrataGrad, [None])[-1]
            raise RuntimeError(
                f"strata.torch: the gradient of {getattr(t, '_strata_name', '?')!r} was handed to strata's optimizer "
                "during backward (it overlaps backward), so torch cannot read or change it. To use gradients in "
                "torch (clip_grad_norm_, clip_grad_value_, logging), wrap with the config key \"grad_reads\": true "
                "(gradients stay torch tensors until optimizer.step()), or pass max_grad_norm= to the strata "
                "optimizer for clipping by global norm (Note [Gradients in torch] in strata/torch/_grads.py)")
        with torch._C.DisableTorchFunction():
            return func(*args, **(kwargs or {}))


class _WatchedGrad(torch.Tensor):
    """A torch gradient during the first step of "grad_reads": "auto": notes that torch code used it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = _func_name(func)
        if name not in _METADATA and name not in _GRAD_NOOPS:
            for t in _tensors_of((args, kwargs or {}), _WatchedGrad, []):
                w = getattr(t, "_strata_owner", None)
                if w is not None:
                    w._grads_used = True
                t.__class__ = torch.Tensor
        with torch._C.DisableTorchFunction():
            return func(*args, **(kwargs or {}))


class _Grads:
    """Wrapped's gradients and step (Note [Gradients in torch])."""

    # Note [Gradient hooks]
    # Each trainable parameter's hook runs once its gradient has been accumulated into p.grad.
    # torch >= 2.1 has the supported hook for that, Tensor.register_post_accumulate_grad_hook,
    # kept by the parameter and removed with its handle at close(). torch 1.13 has none: the
    # hook goes on the parameter's AccumulateGrad node, reached through autograd's internals
    # (p.expand_as(p).grad_fn.next_functions), which fires at the same point.

    def _install_grad_hook(self, pid, p):
        hook = self._make_grad_hook(pid, p)
        if hasattr(p, "register_post_accumulate_grad_hook"):
            self._handles.append(p.register_post_accumulate_grad_hook(hook))
            return
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(hook)
        self._acc_nodes.append(acc)

    def _make_grad_hook(self, pid, p):
        def hook(*unused):
            if _compile.compiling():  # compiled autograd traces backward (Note [torch.compile])
                _compile.refuse_traced_backward()
            self._hook_calls += 1
            if self._grad_waiters:
                self._gradient_computed(pid)
            g = p.grad
            if g is None or self.engine is None:
                return
            if self._frozen[pid]:
                return  # not in the optimizer: torch keeps its gradient in p.grad and updates nothing
            if self._keep_grads:  # handed at step() (Note [Gradients in torch])
                if pid in self._backward_pids:
                    self._grad_pieces = True  # torch adds the pieces in p.grad (Note [Gradient pieces])
                self._backward_pids.add(pid)
                if self.grad_reads == "auto" and type(g) is torch.Tensor:
                    g.__class__ = _WatchedGrad
                    g._strata_owner = self
                return
            if pid in self._backward_pids:
                raise RuntimeError(
                    f"strata.torch: {self.names[pid]!r} got its gradient in two pieces in one backward: it is used "
                    "both inside a torch.utils.checkpoint segment and outside it (or in two segments), so autograd "
                    "delivers two gradients, and strata hands a parameter's gradient to its optimizer once per "
                    "backward. Wrap with the config key \"grad_reads\": true (torch adds the pieces in p.grad and "
                    "strata takes the sum at optimizer.step()), or use those parameters in one segment only (Note "
                    "[Gradient pieces] in strata/torch/_grads.py)")
            if not self._grad_written[pid] and pid in self._unzeroed:
                self._missed_zero.append(self.names[pid])  # torch would add the last step's (Note [No zero_grad])
            self.engine.hand_grad(pid, g, self._grad_written[pid])
            self._grad_written[pid] = True
            self._grads_handed += 1
            self._grad_live[pid] = True
            if self._phase == "backward":
                # p.grad stays None until backward ends, so that a second piece would reach this hook
                # rather than autograd's in-place add into the placeholder (Note [Gradient pieces]).
                self._backward_pids.add(pid)
                p.grad = None
            else:
                p.grad = self._placeholder(pid) if self._access else None
        return hook

    def _placeholder(self, pid):
        """The placeholder to put in p.grad (the caller puts it there)."""
        self._cleared.discard(pid)
        ph = self._placeholders.get(pid)
        if ph is None:
            p = self.params[pid]
            ph = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape).as_subclass(_StrataGrad)
            ph._strata_name = self.names[pid]
            ph._strata_owner = self
            ph._strata_pid = pid
            self._placeholders[pid] = ph
        return ph

    def _clear_placeholders(self):
        """Takes placeholders out of p.grad before a backward (autograd would accumulate into them).
        One that is gone was set to None by torch code (a submodule's zero_grad(set_to_none=True)):
        torch would skip that parameter in a step without a gradient (Note [Zero gradients])."""
        for pid, ph in self._placeholders.items():
            p = self.params[pid]
            if p.grad is ph:
                p.grad = None
                self._cleared.add(pid)
            elif p.grad is None and pid not in self._cleared:
                self._grad_live[pid] = False
                self._unzeroed.discard(pid)  # torch code set it to None: nothing to add to
            # (None where this took the placeholder out at an earlier forward with no backward since, a
            # no-grad one included: still torch's zero gradient. torch code that sets that None to None,
            # e.g. a submodule's own zero_grad(set_to_none=True), is not seen then; a strata optimizer's
            # zero_grad(set_to_none=True) is)

    # Note [Zero gradients]
    # torch.optim skips a parameter whose p.grad is None and steps one whose p.grad is
    # a tensor of zeros (SGD's momentum and weight decay, Adam's moments go on). torch
    # 1.13's zero_grad() leaves zeros (set_to_none=False) unless asked for None, so a
    # parameter that got a gradient once and none in this step is still updated. strata
    # keeps torch's answer to "is p.grad None" per parameter (_grad_live: set when a
    # gradient is handed, cleared by zero_grad(set_to_none=True)) and, at step(),
    # hands a zero gradient for each live one that got none in this step. With
    # gradients kept in torch (Note [Gradients in torch]) p.grad is torch's own and
    # this needs nothing.

    def zero_grad(self, params, set_to_none):
        for p in params:
            pid = self._pid.get(id(p))
            self._unzeroed.discard(pid)
            g = p.grad
            if g is None:
                if set_to_none and pid is not None:
                    self._grad_live[pid] = False  # torch's zero gradient (placeholder taken out) is None now
                continue
            if set_to_none:
                p.grad = None
                if pid is not None:
                    self._grad_live[pid] = False
            elif isinstance(g, _StrataGrad):
                continue  # strata's gradient is consumed; the next is written whole
            else:
                if g.grad_fn is not None:
                    g.detach_()
                else:
                    g.requires_grad_(False)
                g.zero_()

    # --- steps -----------------------------------------------------------------------------

    def _hand_kept_grads(self):
        """Hands torch's gradients to strata at step() (Note [Gradients in torch]); p.grad stays torch's.
        Besides the kept ones, a tensor found in p.grad that strata did not get (a gradient set by hand,
        or one whose accumulator hook was lost to p.set_()) is handed too, as torch.optim would use it.
        Last parameter first, the order backward produces gradients in."""
        for pid in reversed(range(len(self.params))):
            p = self.params[pid]
            g = p.grad
            if g is None or self._frozen[pid] or isinstance(g, _StrataGrad) or self._grad_written[pid]:
                continue
            if type(g) is _WatchedGrad:
                g.__class__ = torch.Tensor
            g = g.detach()
            if self._comm is not None:  # Note [Averaged gradients in torch] in _processes.py
                g = _processes.kept_grad_to_hand(self._comm, g)
            self.engine.hand_grad(pid, g, False)
            self._grad_written[pid] = True
            self._grads_handed += 1
            self._grad_live[pid] = True

    def _average_kept_grads(self):
        """The kept p.grad become the average over the ranks (Note [Averaged gradients in torch])."""
        watched = [p.grad for p in self.params if type(p.grad) is _WatchedGrad]
        for g in watched:
            g.__class__ = torch.Tensor  # strata's own reads are not the user's (Note [Gradients in torch])
        _processes.average_grads(self._comm, self.params, self._frozen,
                                 lambda g: g is not None and not isinstance(g, _StrataGrad))
        for g in watched:
            g.__class__ = _WatchedGrad
        self._grads_averaged = True

    def _hand_zero_grads(self):
        """A zero gradient for each parameter whose p.grad torch would hold but that got none (Note [Zero gradients])."""
        if self._keep_grads:
            return  # p.grad is torch's own: a zero one was handed with the others
        for pid, p in enumerate(self.params):
            if self._grad_live[pid] and not self._grad_written[pid] and not self._frozen[pid]:
                self.engine.hand_grad(pid, torch.zeros(p.shape, dtype=p.dtype, device=p.device), False)
                self._grad_written[pid] = True
                if self._access and p.grad is None:
                    p.grad = self._placeholder(pid)  # torch's zero gradient stays in p.grad

    # Note [Gradient pieces]
    # A parameter used inside a torch.utils.checkpoint segment and outside it (or in two
    # segments) gets its gradient in two pieces in one backward: the segment's recomputed
    # backward runs its own accumulation. torch adds them in p.grad; strata hands a
    # gradient over once per backward (Note [Gradient completion]: its optimizer may start
    # at once). With gradients kept in torch the pieces add up there, so "auto", which
    # keeps them in its first step, sees the second piece and keeps them for good; with
    # "grad_reads": false the second piece raises, naming the parameter and the fix. While
    # backward runs, a handed parameter's p.grad is None (its placeholder goes back at
    # backward's end), so a second piece reaches the hook instead of failing in autograd's
    # in-place add into the placeholder, with torch's message about expanded tensors.

    def _next_keep_grads(self):
        if self.grad_reads == "auto":
            return self._steps == 0 or self._grads_used or self._grad_pieces
        return bool(self.grad_reads)

    # Note [No zero_grad]
    # torch adds each backward's gradient to p.grad, so a loop that never calls zero_grad()
    # trains on the sum of every step's gradients so far. strata hands a gradient to its
    # optimizer during backward (Note [Gradients in torch]) and does not keep it past the
    # step, so it cannot add the next step's to it: without "grad_reads": true it trains on
    # each step's gradient alone. It is never silent: _unzeroed holds the parameters whose
    # gradient torch would still hold (a step handed it; zero_grad(), p.grad.zero_() on the
    # placeholder or p.grad = None takes it out), a gradient handed for one of them is noted,
    # and step() warns once, naming the way to torch's sum. With "grad_reads": true the
    # gradients are torch's own until step() and add up as in torch, so nothing is noted.

    def _warn_missed_zero(self):
        missed, self._missed_zero = self._missed_zero, []
        if not missed or self._warned_no_zero:
            return
        self._warned_no_zero = True
        others = f" and {len(missed) - 1} other parameter(s)" if len(missed) > 1 else ""
        warnings.warn(
            f"strata.torch: step {self._steps + 1} got a gradient for {missed[0]!r}{others} whose gradient from an "
            "earlier step was never zeroed (no zero_grad() between the steps). torch would add the two; strata "
            "handed the earlier one to its optimizer during backward and trains on this step's alone, so the "
            "update differs from torch's. Call optimizer.zero_grad() (or model.zero_grad()) every step, or wrap "
            "with the config key \"grad_reads\": true, which keeps gradients as torch tensors that add up as in "
            "torch (Note [No zero_grad] in strata/torch/_grads.py)", RuntimeWarning, stacklevel=_user_stacklevel())

    def _reset_step_counts(self):
        self._grads_averaged = False
        self._missed_zero = []
        self._backward_pids.clear()
        self._micro_in_step = 0
        self._grads_handed = 0
        self._grad_written = [False] * len(self.params)

    def step(self):
        if self._phase == "backward":
            # A backward that raised never reached its end (or step() was called inside backward).
            self._settle()
            raise RuntimeError(
                "strata.torch: optimizer.step() after a backward that raised (or during backward): its "
                "gradients were discarded; run forward and backward again")
        if self.engine is not None:
            self._set_lazy(False)
            self.engine.sync_views()
            if self._micro_in_step > 0:
                if self._comm is not None and self._keep_grads and not self._grads_averaged:
                    self._average_kept_grads()  # fewer micro-batches than gradient_accumulation_steps
                self._hand_kept_grads()
        if self.engine is None or self._grads_handed == 0:
            raise RuntimeError(
                "strata.torch: optimizer.step() without a backward since the last step: no gradient reached "
                "strata (call loss.backward() first)")
        handed = [pid for pid, written in enumerate(self._grad_written) if written]
        self._hand_zero_grads()
        try:
            stats = self.engine.step()
        except StrataError:
            # The runtime discarded the step (Note [Failed steps]): the next one starts clean.
            self._reset_step_counts()
            self._phase = "idle"
            raise
        self._warn_missed_zero()
        self._unzeroed.update(handed)
        self._steps += 1
        self._update_hold()  # step() may have re-planned
        self._set_lazy(True)
        self._micro_in_step = 0
        self._grads_handed = 0
        self._grads_averaged = False
        self._grad_written = [False] * len(self.params)
        self._phase = "idle"
        was_keeping = self._keep_grads
        self._keep_grads = self._next_keep_grads()
        if was_keeping and not self._keep_grads:
            # "auto" stops keeping gradients: torch's p.grad from this step become placeholders.
            for pid, p in enumerate(self.params):
                if p.grad is not None and not isinstance(p.grad, _StrataGrad) and not self._frozen[pid]:
                    p.grad = self._placeholder(pid)
        self.last_stats = stats
        return stats

    @property
    def totals(self):
        """Steps, bytes per link and stall since wrap: the C++ runtime's running totals
        (strata::Runtime::stats, kept in that one place, #26), read, not summed here. An
        engine is rebuilt only before the first step, so the newest one holds them all."""
        engine = self._last_engine
        return engine.totals() if engine is not None else _C.zero_totals()

    # Note [Step counters]
    # counters() is strata's own work so far, for bench/torch_gpt.py and the tests that hold a
    # fit step to zero extra work (tests/torch/test_step_cost.py): bytes moved between tiers
    # (the runtime's StepStats, summed over steps), Python hook calls (module and tensor hooks,
    # gradient hand-overs) and the engine's crossings (calls into the binding from hooks) and
    # param leases taken. Differences over N steps divided by N are per-step figures.

    def counters(self):
        c = {k: v for k, v in self.totals.items() if k != "steps"}
        c["steps"] = self.totals["steps"]
        c["bytes_moved"] = c["bytes_h2d"] + c["bytes_d2h"] + c["bytes_disk_read"] + c["bytes_disk_write"]
        c["hook_calls"] = self._hook_calls
        e = self.engine.counters() if self.engine is not None else {}
        c["crossings"] = e.get("crossings", 0)
        c["param_leases"] = e.get("param_leases", 0)
        return c


def _zero_grad(self, set_to_none=False):
    """Module.zero_grad for a wrapped model (Note [Zero gradients])."""
    wrapped = getattr(self, "_strata_wrapped", None)
    if wrapped is None:
        return torch.nn.Module.zero_grad(self, set_to_none)
    wrapped.zero_grad(list(self.parameters()), set_to_none)
    return None
