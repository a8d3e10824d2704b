"""strata.torch optimizers' state in torch.optim's format: state_dict() and load_state_dict()
(Note [Optimizer state in torch's format]). _StrataOptimizer takes these methods from _TorchFormat."""

import torch

from . import _C, _processes

# Note [Optimizer state in torch's format]
# state_dict() gives what the torch.optim optimizer of the same name holds: SGD's
# {'momentum_buffer'} (None without momentum) and no 'step', the Adam family's and Adagrad's
# 'step' as a float tensor, and for Adagrad an entry for every parameter (torch creates them
# with the optimizer). load_state_dict() takes torch's dicts and strata's. It refuses, naming the
# key, whatever strata would not continue exactly: a state it has no place for
# (amsgrad's max_exp_avg_sq), a group flag it does not implement (amsgrad, maximize), or a
# hyperparameter that the runtime fixed when the optimizer was created (momentum, betas, eps,
# ...) and the dict sets otherwise; lr and weight_decay are taken per group, and keys torch uses
# for its own implementation choices (foreach, fused, capturable, differentiable) are kept and
# ignored. A torch SGD buffer carries no step: strata sets the step counter to at least 1 so that
# its next step continues the buffer (its step 1 starts one).
_MUST_BE_DEFAULT = {"amsgrad": False, "maximize": False}
# strata's hyperparameter -> torch's param group key, where they differ.
_TORCH_KEY = {"beta1": "betas", "beta2": "betas", "lars_clip": "clip"}


class _TorchFormat:
    """An optimizer's state_dict and load_state_dict in torch.optim's format."""

    def state_dict(self):
        """torch.optim's format (Note [Optimizer state in torch's format]): {'state': {index: {...}},
        'param_groups': [...]}, loadable by the torch.optim optimizer of the same name."""
        w = self._wrapped
        w._settle()
        w.engine.flush()
        names = self._state_names()
        state, groups, index, parts = {}, [], 0, []
        for g in self.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = list(range(index, index + len(g["params"])))
            for p in g["params"]:
                s = self._param_state(p, names, parts)
                if s is not None:
                    state[index] = s
                index += 1
            groups.append(entry)
        if w._comm is not None:
            _processes.sum_over_ranks(w._comm, [t for t, _ in parts])  # Note [Optimizer states across ranks]
        for t, (s, key, dtype) in parts:
            s[key] = t.to(dtype) if dtype != torch.float32 else t
        return {"state": state, "param_groups": groups}

    # Note [Optimizer states across ranks]
    # Under data parallelism each rank holds 1/W of every optimizer state (Note [Sharded step]), and
    # read_tensor fills this rank's part of a state, -0.0 elsewhere. state_dict() is torch's whole
    # state on every rank, as with one process: the ranks add their reads in rank order
    # (_processes.sum_over_ranks), which is exact, since every element is one rank's value plus
    # -0.0s. So state_dict() is collective: every rank calls it, as FSDP's optimizer state dict is;
    # a rank that does not fails the others' wait after comm.timeout_s, naming the collective.
    # load_state_dict() needs no exchange: write_tensor stores this rank's part of the values.

    def _param_state(self, p, names, parts):
        """One parameter's state as torch.optim holds it, or None where torch holds none; its fp32 reads
        go into `parts` as (tensor, (state, key, dtype)), put in `state` by the caller."""
        """One parameter's state as torch.optim holds it, or None where torch holds none."""
        w = self._wrapped
        pid = w._pid[id(p)]
        if w._frozen[pid]:
            # torch.optim.Adagrad holds a state for every parameter from the start, even one without gradients
            return {"step": torch.tensor(0.0), "sum": torch.zeros_like(p, device="cpu")} \
                if self._name == "adagrad" else None
        steps = w.engine.tensor_steps(pid)
        if steps == 0 and self._name != "adagrad":
            return None
        s = {} if self._name == "sgd" else {"step": torch.tensor(float(steps))}
        if self._name == "sgd" and not names:
            s["momentum_buffer"] = None  # what torch.optim.SGD keeps without momentum
        for k, name in enumerate(names):
            parts.append((w.engine.read_tensor(pid, _C.STATE0 + k), (s, name, p.dtype)))
        if w.engine.separate_master():
            parts.append((w.engine.read_tensor(pid, _C.MASTER), (s, "master_param", torch.float32)))
        return s

    def load_state_dict(self, state_dict):
        """Loads torch.optim's format, from strata or from the torch.optim optimizer of the same name
        (Note [Optimizer state in torch's format]); every entry is checked before anything is
        written, and what strata cannot continue exactly is refused, naming the key."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("load_state_dict: expected {'state': ..., 'param_groups': ...}")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"load_state_dict: {len(groups)} param groups in the checkpoint, "
                             f"{len(self.param_groups)} in the optimizer")
        errors, to_write = [], []
        names = self._state_names()
        for gi, (saved, mine) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(mine["params"]):
                errors.append(f"group {gi}: {len(saved['params'])} params in the checkpoint, "
                              f"{len(mine['params'])} here")
                continue
            errors.extend(self._check_saved_group(gi, saved, mine))
            for index, p in zip(saved["params"], mine["params"]):
                s = state_dict["state"].get(index)
                errors.extend(self._check_saved_state(index, s, p, names, saved))
                to_write.append((p, s))
        if errors:
            raise ValueError(f"{type(self).__name__}.load_state_dict refused, nothing was loaded: " +
                             "; ".join(errors))
        self._write_states(to_write, names)
        for saved, mine in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v
        self._check_groups()

    def _check_saved_group(self, gi, saved, mine):
        """Errors for a saved param group that strata's optimizer, as created, would not follow."""
        errors = []
        for key, default in _MUST_BE_DEFAULT.items():
            if saved.get(key, default) != default:
                errors.append(f"param_groups[{gi}][{key!r}] = {saved[key]!r}: strata's {type(self).__name__} "
                              f"does not implement {key} (use torch.optim to continue this state)")
        candidate = dict(mine)
        candidate.update({k: v for k, v in saved.items() if k != "params"})
        try:
            new, old = self._hyper(candidate), self._hyper(mine)
        except (KeyError, TypeError, IndexError) as e:
            return errors + [f"param_groups[{gi}]: a hyperparameter is malformed ({e!r})"]
        for k in new:
            if k not in self._per_group and new[k] != old[k]:
                torch_key = _TORCH_KEY.get(k, k)
                errors.append(
                    f"param_groups[{gi}][{torch_key!r}] = {saved.get(torch_key)!r} in the state dict but "
                    f"{mine.get(torch_key)!r} in this optimizer; strata fixes it when the optimizer is created: "
                    f"create {type(self).__name__}(..., {torch_key}={saved.get(torch_key)!r})")
        return errors

    def _check_saved_state(self, index, s, p, names, group):
        """Errors for one parameter's saved state (None: the parameter has none)."""
        if s is None:
            if self._name == "adagrad" and group.get("initial_accumulator_value", 0) != 0:
                return [f"state of param {index}: missing, and param_groups' initial_accumulator_value = "
                        f"{group['initial_accumulator_value']!r} (strata starts a sum of squares at 0)"]
            return []
        errors = []
        w = self._wrapped
        if w._frozen[w._pid[id(p)]] and any(
                isinstance(v, torch.Tensor) and v.count_nonzero() > 0 for k, v in s.items() if k != "master_param"):
            return [f"state of param {index}: the parameter is frozen here (requires_grad=False or not in the "
                    "optimizer when the engine was built) but its state holds values; they would be dropped"]
        allowed = {"step", "master_param", *names} | ({"momentum_buffer"} if self._name == "sgd" else set())
        for key in s:
            if key not in allowed:
                why = " (amsgrad's state; strata has no amsgrad)" if key == "max_exp_avg_sq" else ""
                errors.append(f"state of param {index}: {key!r} is not a state of strata's "
                              f"{type(self).__name__}{why}; it would be dropped")
        if self._name == "sgd" and not names and s.get("momentum_buffer") is not None:
            errors.append(f"state of param {index}: a 'momentum_buffer' but momentum = 0")
        if self._name != "sgd" and "step" not in s:
            errors.append(f"state of param {index}: no 'step' (the bias correction's counter)")
        for name in names:
            t = s.get(name)
            if t is None and self._name == "sgd":
                continue  # torch.optim.SGD starts the buffer at the next step, as strata does at step 1
            if not isinstance(t, torch.Tensor):
                errors.append(f"state of param {index}: no {name!r}" if t is None else
                              f"state of param {index}: {name} is a {type(t).__name__}, not a tensor")
            elif tuple(t.shape) != tuple(p.shape):
                errors.append(f"state of param {index}: {name} has shape {tuple(t.shape)}, "
                              f"the parameter {tuple(p.shape)}")
        return errors

    def _write_states(self, to_write, names):
        w = self._wrapped
        w.engine.flush()
        for p, s in to_write:
            pid = w._pid[id(p)]
            if w._frozen[pid]:
                continue
            fresh = s is None or (self._name == "sgd" and names and s.get(names[0]) is None)
            if fresh:
                zeros = torch.zeros(p.shape)
                for k in range(len(names)):
                    w.engine.write_tensor(pid, _C.STATE0 + k, zeros)
                w.engine.set_tensor_steps(pid, 0)
                continue
            for k, name in enumerate(names):
                w.engine.write_tensor(pid, _C.STATE0 + k, s[name])
            if "master_param" in s and w.engine.separate_master():
                w.engine.write_tensor(pid, _C.MASTER, s["master_param"])
            step = s.get("step", 0)
            step = int(step.item() if isinstance(step, torch.Tensor) else step)
            if self._name == "sgd":
                step = max(step, 1)  # torch's buffers carry no step; strata's step 1 would restart the buffer
            w.engine.set_tensor_steps(pid, step)

    def _state_names(self):
        """The names of the states strata's kernel keeps for this optimizer, in state order (STATE0, STATE1),
        from the binding (Note [Optimizer state names] in python/src/functional.cpp)."""
        return _C.optimizer_states(self._name, self._hyper(self.param_groups[0]))

