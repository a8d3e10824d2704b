"""strata.torch with Hugging Face transformers' Trainer (docs/hf.md).

    from strata.torch import hf
    model = hf.wrap_for_trainer(model, strata_config, args)   # args: transformers.TrainingArguments
    trainer = Trainer(model=model, args=args, train_dataset=...,
                      optimizers=hf.create_optimizer_and_scheduler(model, args, num_training_steps))
    trainer.train()                                  # or trainer.train(resume_from_checkpoint=...)
    model.save_pretrained(d)                         # plain safetensors: from_pretrained needs no strata

Note [Trainer]
Trainer takes a ready optimizer and scheduler (`optimizers=(opt, sched)`), which is what HF
users do for any optimizer Trainer does not know; nothing in Trainer needs patching. What
Trainer does with them, and what strata needs for it:
  - per optimizer step it runs `gradient_accumulation_steps` backward passes, then (when
    `max_grad_norm` > 0) torch's `clip_grad_norm_` on every `p.grad`, then `optimizer.step()`,
    `scheduler.step()` and `model.zero_grad()`; with `max_grad_norm` 0 it still calls
    `clip_grad_norm_(..., inf)` for the logged norm. So the wrap config must say the same
    `gradient_accumulation_steps` (the binding refuses an extra micro-batch), and gradients are
    read in torch every step: `grad_reads: true` (Note [Gradients in torch] in _grads.py;
    "auto" would find that out in the first step anyway, true says it up front).
  - the scheduler changes the groups' lr after `optimizer.step()`, in time for the next
    step's first forward (Note [When lr is read] in optim.py).
  - checkpoints: `model.state_dict()` goes to safetensors, `optimizer.state_dict()` (torch.optim's
    format) to optimizer.pt; `resume_from_checkpoint` loads them back with
    `model.load_state_dict(sd, strict=False)` and `optimizer.load_state_dict`, both strata's
    (Notes in _state.py and _optim_state.py), after the optimizer exists. Resuming is exact.
  - the param groups are Trainer's own (`get_decay_parameter_names`: no weight decay for
    biases and norms); strata's groups may differ in lr and weight decay, which is all they do.
"""

import torch

from . import _processes, _wrap, optim

# Trainer's optimizer names (TrainingArguments.optim) that map onto a strata optimizer.
_OPTIMIZERS = {"adamw_torch": optim.AdamW, "adamw_torch_fused": optim.AdamW, "adamw_hf": optim.AdamW,
               "sgd": optim.SGD, "adagrad": optim.Adagrad, "lion_32bit": optim.Lion,
               # bitsandbytes' and torchao's 8-bit AdamW: strata's blockwise 8-bit states, the same maps and
               # blocks of 256 (Note [Optimizer state dtype] in optim.py)
               "adamw_bnb_8bit": optim.AdamW, "adamw_8bit": optim.AdamW, "adamw_torch_8bit": optim.AdamW}
_EIGHT_BIT = ("adamw_bnb_8bit", "adamw_8bit", "adamw_torch_8bit")


def trainer_config(config, args):
    """The wrap config `config` (a dict) with the keys Trainer's loop needs (Note [Trainer])."""
    cfg = _wrap._load_config(config)
    accum = int(args.gradient_accumulation_steps)
    given = cfg.get("gradient_accumulation_steps", accum)
    if given != accum:
        raise ValueError(
            f"strata.torch.hf: the wrap config says gradient_accumulation_steps = {given!r} but "
            f"TrainingArguments says {accum}; leave it out of the config (it is taken from the arguments)")
    cfg["gradient_accumulation_steps"] = accum
    if cfg.get("grad_reads", True) is not True:
        raise ValueError(
            f"strata.torch.hf: the wrap config says grad_reads = {cfg['grad_reads']!r}, but Trainer reads torch's "
            "gradients every step (clip_grad_norm_ clips them, or measures their norm for the logs when "
            "max_grad_norm is 0); leave grad_reads out of the config (Note [Trainer] in strata/torch/hf.py)")
    cfg["grad_reads"] = True
    return cfg


def wrap_for_trainer(model, config, args):
    """strata.torch.wrap(model, config) for a model that `transformers.Trainer(args=args)` trains.
    One process only, so far: under torchrun Trainer (through Accelerate) puts DistributedDataParallel
    around the model, which would reduce what strata reduces; refused before anything changes."""
    group = _processes.shard_group(model, None)
    if group is not None:
        raise RuntimeError(
            f"strata.torch.hf.wrap_for_trainer: this process is rank {_processes.rank_in(group)} of "
            f"{_processes.ranks_in(group)}, and Trainer under torchrun puts DistributedDataParallel "
            "around the model (Accelerate's prepare), which strata refuses: strata reduces the gradients itself. "
            "Trainer with strata runs in one process so far (issue #48); under torchrun, train with a plain loop "
            "(docs/torch.md, data parallelism under torchrun)")
    return _wrap.wrap(model, trainer_config(config, args))


def _decay_names(model):
    from transformers import Trainer  # imported here: strata.torch does not need transformers

    return set(Trainer.get_decay_parameter_names(None, model))


def create_optimizer(model, args):
    """The strata optimizer Trainer would create from `args` (its optim name, learning_rate, betas, eps,
    weight_decay, and its groups: no decay for biases and norms). `model` must be wrapped."""
    if getattr(model, "_strata_wrapped", None) is None:
        raise ValueError("strata.torch.hf.create_optimizer: wrap the model first (hf.wrap_for_trainer)")
    name = str(getattr(args.optim, "value", args.optim))
    cls = _OPTIMIZERS.get(name)
    if cls is None:
        raise ValueError(f"strata.torch.hf: TrainingArguments.optim = {name!r} has no strata optimizer; use one of "
                         f"{', '.join(sorted(_OPTIMIZERS))}, or create a strata.torch optimizer yourself")
    decay = _decay_names(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in params if n in decay], "weight_decay": args.weight_decay},
              {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if cls is optim.AdamW:
        return cls(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                   state_dtype="int8" if name in _EIGHT_BIT else None)
    if cls is optim.Lion:
        return cls(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2))
    return cls(groups, lr=args.learning_rate)


def create_optimizer_and_scheduler(model, args, num_training_steps):
    """(optimizer, scheduler) for Trainer(optimizers=...): create_optimizer(model, args) and Trainer's own
    scheduler (args.lr_scheduler_type, warmup) over num_training_steps."""
    from transformers import get_scheduler

    opt = create_optimizer(model, args)
    sched = get_scheduler(args.lr_scheduler_type, optimizer=opt,
                          num_warmup_steps=args.get_warmup_steps(num_training_steps),
                          num_training_steps=num_training_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})
    return opt, sched


__all__ = ["trainer_config", "wrap_for_trainer", "create_optimizer", "create_optimizer_and_scheduler"]

del torch
