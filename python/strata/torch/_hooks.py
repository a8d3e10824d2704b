"""strata.torch's module hooks: a module's parameters bound for its forward and its backward.
Wrapped takes these methods from _Hooks.

Note [Hooks]
Each module that owns parameters gets a forward pre-hook and a forward hook:
  - before its forward, its parameters are bound: their storage points at the
    param chunk's lease (Note [Rebinding storage] in python/src/param_binds.cpp);
  - after its forward, they are unbound (their storage points at a poison
    region, Note [Poisoned parameters] in python/src/poison.hpp), and when grad
    is on, a hook on every output tensor that requires grad binds them again as
    soon as backward reaches the module (the first such gradient);
  - a hook on every input tensor that requires grad unbinds them once all of the
    inputs' gradients are computed (the module's backward is over); whatever is
    still bound when backward ends is unbound by a callback queued on the engine;
  - a hook on each trainable parameter's gradient accumulator hands the gradient
    to its grad chunk (overwrite in a step's first micro-batch, add in later ones)
    and sets p.grad = None, so gradients never pile up in torch memory.
Tensor hooks fire when the gradient of that tensor is computed, i.e. before the
nodes that consume it (the module's backward) and after the ones that produce it,
which is what "before/after the module's backward" needs, without rebuilding the
module's inputs or outputs. The root module's forward begins a micro-batch.
"""

import functools
import os
import warnings
import weakref

import torch

from . import _compile, _processes


def _tensors_in(obj, out):
    """Every tensor in a module's inputs or outputs (tuples, lists, dicts, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _tensors_in(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors_in(o, out)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            _tensors_in(getattr(obj, name, None), out)
    return out


# Note [Module-local input gradients]
# A module's parameters are unbound in backward once the gradients of its inputs are computed
# (Note [Hooks]). A hook on an input tensor fires when that tensor's whole gradient is computed,
# which for a tensor that several modules take (T5's encoder output, an input of every decoder
# block's cross-attention k and v) is only once backward is past all of them: each holds its
# slot until then. Where the plan streams, a leaf module of torch.nn's own (Linear, Embedding,
# LayerNorm, ...: none changes its input in place) instead takes its tensor inputs through
# _InputsDone, an identity node (views of the same tensors, the same one for a tensor passed
# twice): its backward runs once this module's own part of those gradients is computed, and
# unbinds there. The gradients pass through unchanged. Not for other modules (an identity's view
# must not be changed in place, as for torch's full backward hooks), tensors nested in containers
# or passed as keywords (their tensor hooks stay), nor where everything fits (nothing is unbound
# in backward). Under torch.compile the identity runs in strata's eager hook, at a graph break.
# A call with no input that needs a gradient (an embedding of token ids, T5's relative attention
# bias of bucket indices) has no input hook at all and stayed bound to the end of backward; it is
# now unbound once the gradients of all of its trainable parameters are computed (their gradient
# hooks, _gradient_computed): backward is then past every node that reads them.
class _InputsDone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, done, *tensors):
        ctx.done = done
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.done(None)
        return (None,) + grads


class _Call:
    """One call of a module: its parameters and whether backward bound them."""

    __slots__ = ("pids", "bound", "inputs_pending", "grads_pending")

    def __init__(self, pids):
        self.pids = pids
        self.bound = False
        self.inputs_pending = 0
        self.grads_pending = 0


class _Hooks:
    """Wrapped's module hooks (Note [Hooks]) and the passes they follow."""

    def _install_hooks(self):
        root = self.model
        # Note [torch.compile] in _compile.py: plain hooks, dynamo-disabled once a compile is seen.
        pre_hook, hook = _compile.forward_pre_hook, _compile.forward_hook
        pre, post = self._pre_forward, self._post_forward
        self._handles.append(pre_hook(root, self._root_pre_forward))
        # Note [Module-local input gradients]: torch.nn's own leaf modules.
        self._local_inputs = {m for m in self._module_pids
                              if type(m).__module__.startswith("torch.nn.modules.") and not any(m.children())}
        for module in self._module_pids:
            self._handles.append(pre_hook(module, pre))
            self._handles.append(hook(module, post))
        self._handles.append(hook(root, self._root_post_forward))
        for pid, p in enumerate(self.params):
            if p.requires_grad:
                self._install_grad_hook(pid, p)

    def _check_unchanged(self):
        if self._model_signature() != self._signature:
            now = {id(p) for p in self.model.parameters()}
            known = {id(p) for p in self.params}
            added = [n for n, p in self.model.named_parameters() if id(p) not in known]
            gone = [n for n, p in zip(self.names, self.params) if id(p) not in now]
            detail = []
            if added:
                detail.append(f"new or replaced: {', '.join(added)}")
            if gone:
                detail.append(f"removed or replaced: {', '.join(gone)}")
            if not detail:
                detail.append("a parameter's requires_grad changed")
            raise RuntimeError(
                "strata.torch: the model changed after wrap (" + "; ".join(detail) + "); strata holds the "
                "parameters it found at wrap: build the model completely, then wrap it")

    def _check_poison(self):
        if self.engine is None:
            return
        hits = self.engine.poison_hits()
        if hits:
            raise RuntimeError(
                f"strata.torch: parameter(s) {', '.join(repr(h) for h in hits)} were used while not bound to "
                "strata's memory: a hook was missed (a parameter used outside its own module's forward, a "
                "module called without its hooks, or a parameter read directly). The values read were zeros. "
                "Use parameters only inside the module that owns them, read them with model.state_dict(), or, "
                "for a module that reads its children's parameters, name its class in the wrap config's "
                "\"bind_subtree\" list (Note [Modules that read their children's parameters])." +
                self._state.poison_context() + _compile.poison_hint())

    def _root_pre_forward(self, module, inputs):
        _compile.check_forward()  # compiled autograd (Note [torch.compile])
        _processes.check_not_inside_parallel_wrapper(self.model)  # Note [Ranks under torchrun]
        self._set_lazy(False)
        self._check_unchanged()
        self._ensure_engine()
        if self.engine.device_kind() == "cuda":
            # Binds and releases are ordered against torch's current stream by events, not by host
            # waits (Note [Torch's stream] in python/src/stream_order.hpp).
            self.engine.set_torch_stream(torch.cuda.current_stream(self._device_wanted()).cuda_stream)
        if self._access:
            self.engine.sync_views()  # writes between steps reach the chunks (Note [Parameters between steps])
        self._clear_placeholders()
        self._check_poison()
        self._settle()
        if self._phase != "idle":
            # An earlier forward or backward raised before its hooks ended (the root module is
            # never run again inside backward): start clean.
            self.engine.unbind_all()
            self._calls.clear()
            self._grad_waiters.clear()
            self._phase = "idle"
        if torch.is_grad_enabled() and self._phase != "backward":
            self._begin_micro_batch()

    def _begin_micro_batch(self):
        if self._micro_in_step >= self.accumulation_steps:
            raise RuntimeError(
                f"strata.torch: micro-batch {self._micro_in_step + 1} before optimizer.step(), but "
                f"gradient_accumulation_steps = {self.accumulation_steps}; call optimizer.step() after that many "
                "backward passes, or raise gradient_accumulation_steps in the wrap config")
        if self._micro_in_step == 0 and self.optimizer is not None:
            self.optimizer._push_groups()
        self.engine.begin_micro_batch(self._micro_in_step == self.accumulation_steps - 1)
        self._phase = "forward"

    def _pre_forward(self, module, inputs):
        self._hook_calls += 1
        if self.engine is None:
            self._ensure_engine()
        pids = self._module_pids[module]
        if pids:  # the root owns none of its own: no call
            self.engine.bind_many(pids)  # one call per module (Note [Batched binds] in engine.hpp)
        call = _Call(pids)
        self._calls.setdefault(id(module), []).append(call)
        if torch.is_grad_enabled():
            waiting = [t for t in _tensors_in(inputs, []) if t.requires_grad]
            if waiting and module in self._local_inputs and not self._hold:
                direct = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
                if len(direct) == len(waiting):  # Note [Module-local input gradients]
                    call.inputs_pending = 1
                    unique = list({id(inputs[i]): inputs[i] for i in direct}.values())
                    views = dict(zip(map(id, unique), _InputsDone.apply(self._make_input_hook(call), *unique)))
                    return tuple(views.get(id(t), t) if i in direct else t for i, t in enumerate(inputs))
            self._await_backward_end(call, waiting)
        return None

    def _await_backward_end(self, call, waiting):
        """What ends the call's backward, where its parameters are unbound: the gradients of `waiting`, its
        inputs that need one (tensor hooks), or, with none, its trainable parameters' gradients (Note
        [Module-local input gradients])."""
        call.inputs_pending = len(waiting)
        for t in waiting:
            t.register_hook(self._make_input_hook(call))
        if not waiting and call.pids and not self._hold:
            trainable = [pid for pid in call.pids if self.params[pid].requires_grad]
            call.grads_pending = len(trainable)
            for pid in trainable:
                self._grad_waiters.setdefault(pid, []).append(call)

    def _gradient_computed(self, pid):
        """Backward is past every use of parameter pid: a call that had no input to wait for is over once
        all of its parameters' gradients are (Note [Module-local input gradients])."""
        for call in self._grad_waiters.pop(pid, ()):
            call.grads_pending -= 1
            if call.grads_pending == 0 and call.bound:
                call.bound = False
                self.engine.unbind_many(call.pids)

    def _post_forward(self, module, inputs, output):
        self._hook_calls += 1
        self._end_call(self._calls[id(module)].pop(), output)
        return None

    def _end_call(self, call, output, inputs=None):
        """A call's forward ended: its parameters are unbound (or held, where everything fits) and hooks on
        its outputs bind them again when backward reaches it. `inputs`: a reader's call, made after its
        forward began (ModelState.touched), whose input hooks are put on here."""
        waiting = [t for t in _tensors_in(output, []) if t.requires_grad] if torch.is_grad_enabled() else []
        if call.pids and waiting and self._hold:
            call.bound = True  # held until its backward (Note [Holding parameters where everything fits])
        elif call.pids and self.engine.unbind_many(call.pids):  # a poisoned region was touched
            self._check_poison()
        for t in waiting:
            t.register_hook(self._make_output_hook(call))
        if inputs is not None and waiting:
            self._await_backward_end(call, [t for t in _tensors_in(inputs, []) if t.requires_grad])

    @staticmethod
    def _reader_call():
        """A call for a module that owns no strata parameter and read one in its forward (Note [Parameters
        read by another module]): it ends with the module's forward (ModelState._pop), not the caller's."""
        return _Call([])

    def _make_output_hook(self, call):
        def hook(grad):
            if _compile.compiling():  # compiled autograd traces backward (Note [torch.compile])
                _compile.refuse_traced_backward()
            self._hook_calls += 1
            self._on_backward_begins()  # returns at once after the first (a held call is bound already)
            if not call.bound:
                call.bound = True
                if call.pids:
                    self.engine.bind_many(call.pids)
            return None
        return hook

    def _make_input_hook(self, call):
        def hook(grad):
            self._hook_calls += 1
            call.inputs_pending -= 1
            if call.inputs_pending == 0 and call.bound:
                call.bound = False
                if call.pids:
                    self.engine.unbind_many(call.pids)
            return None
        return hook

    def _on_backward_begins(self):
        if self._phase == "backward":
            return
        self._phase = "backward"
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_ends)

    def _on_backward_ends(self):
        self.engine.unbind_all()
        for pid in self._backward_pids:  # handed in this backward: torch's p.grad holds one from now on
            p = self.params[pid]
            if p.grad is None and self._access and not self._keep_grads:
                p.grad = self._placeholder(pid)
        self._backward_pids.clear()
        if self.engine.gradients_pending():  # Note [Gradients in pieces] in strata/runtime/gradient_order.hpp
            # Families some of whose params got no gradient complete now, not at step(): a param whose
            # torch p.grad would be a zero tensor gets zeros (Note [Zero gradients]), the others none.
            zero = [live and not written and not frozen
                    for live, written, frozen in zip(self._grad_live, self._grad_written, self._frozen)]
            for pid in self.engine.end_backward(zero):
                self._grad_written[pid] = True
                if self._access and self.params[pid].grad is None:
                    self.params[pid].grad = self._placeholder(pid)  # torch's zero gradient stays in p.grad
        self._calls.clear()
        self._grad_waiters.clear()
        self._phase = "idle"
        self._micro_in_step += 1
        if self._comm is not None and self._keep_grads and self._micro_in_step == self.accumulation_steps:
            self._average_kept_grads()  # Note [Averaged gradients in torch] in _processes.py
        self._set_lazy(True)
        self._check_poison()

    def _root_post_forward(self, module, inputs, output):
        if self._phase == "idle":  # a forward without grad: parameters are readable again
            self._set_lazy(True)
        return None

    # Note [Holding parameters where everything fits]
    # Where the plan keeps every family's params on the device for the whole step (the engine's
    # layout()["plan_params_resident"]: all_gpu, or params resident with optimizer states
    # elsewhere), a module's forward post-hook keeps its parameters bound instead of unbinding them,
    # and its backward finds them bound instead of binding them again: one bind (forward) and one
    # unbind (the module's backward, or the sweep at backward's end) per call instead of two each.
    # The forward unbind released a lease that the runtime records (its release wakes its threads:
    # ~0.3 ms a module on a loaded 2-core machine, the largest of the binding's costs in a profile of
    # a fit step, #29). What stays:
    #   - backward's unbind per module: the family's optimizer starts only when no lease reads its
    #     params (gradients_complete() in runtime/src/optimizer_pipeline.cpp), so it is what lets the
    #     optimizer overlap the rest of backward;
    #   - the sweep at backward's end and lazy parameters between steps (Note [Lazy parameters]):
    #     state_dict, p.data and reads between steps are served as before;
    #   - forward without grad (or a module whose outputs need no gradient): unbound at once, as before.
    # A parameter read through attribute access by another module while it is held only by a finished
    # call binds for that read as if it were unbound (ModelState.touched in _state.py): the owner's
    # backward may end before the reader's.
    # What changes, only where everything fits: a parameter read through a reference kept outside
    # attribute access after its module's forward and before its backward (Sneaky in
    # tests/torch/test_features.py reads one never bound, which still raises) reads its value instead of
    # raising the poison error; the same code raises once the plan streams. The value read is the right
    # one (the lease holds it; the optimizer cannot run under it), so never a silent wrong answer. The plan
    # is read at the build and after each step (step() may re-plan); STRATA_TORCH_BENCH_NO_HOLD=1 turns
    # this off (bench/torch_hook_cost.py's A/B).
    def _update_hold(self):
        self._hold = (self.engine is not None and self.engine.layout()["plan_params_resident"] and
                      os.environ.get("STRATA_TORCH_BENCH_NO_HOLD") != "1")  # no plan yet: False

    # --- failed passes (Note [Failed steps] in runtime/src/step_abort.cpp) --------------------

    def _install_forward_wrapper(self):
        """Catches an exception raised anywhere in the model's forward: the step is discarded at once
        (every parameter unbound, every gradient of the step dropped), so state_dict(), a checkpoint and
        the next forward see the last good values."""
        inner = self.model.forward
        wrapped = weakref.ref(self)

        def forward(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            except BaseException:
                w = wrapped()
                if w is not None:
                    w._abort_pass("an exception was raised in forward")
                raise

        # inspect.signature(model.forward) stays the model's (it follows __wrapped__): transformers.Trainer
        # keeps the dataset columns that forward names (remove_unused_columns).
        functools.update_wrapper(forward, inner)
        self._forward_wrapper = forward
        object.__setattr__(self.model, "forward", forward)

    def _abort_pass(self, why):
        """Discards the step in progress: unbinds every parameter, drops its gradients (every
        micro-batch of it) and starts the next step clean."""
        self._calls.clear()
        self._grad_waiters.clear()
        self._phase = "idle"
        had_grads = self._grads_handed > 0 or self._micro_in_step > 0
        self._reset_step_counts()
        if self.engine is None:
            return
        self.engine.abort_step()
        if had_grads:
            warnings.warn(f"strata.torch: {why}; the gradients of this step were discarded (parameters keep "
                          "their last good values)", stacklevel=3)

    def _settle(self):
        """A backward that raised never reached its end (Note [Hooks]): its parameters are still
        bound and its gradients half handed over. Discards that step before anything reads or steps."""
        if self._phase == "backward":
            self._abort_pass("the last backward raised before it ended")
