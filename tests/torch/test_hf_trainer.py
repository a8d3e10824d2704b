"""transformers.Trainer trains a wrapped model with strata's optimizer (#27; strata.torch.hf, Note [Trainer]):
a tiny GPT-2 (random init, never downloaded) with max_grad_norm 1.0, gradient_accumulation_steps 2 and
save_steps, on the CPU; states partly on NVMe, every layer evicted each step.
  - SGD with momentum under Trainer is bit-identical to Trainer with torch.optim.SGD (clipping is torch's);
  - a run resumed with resume_from_checkpoint from step 3 reproduces the uninterrupted run's losses and
    final weights exactly (AdamW, linear schedule with warmup);
  - save_pretrained, then from_pretrained in a process that never imports strata, gives identical logits.
Skipped where transformers is not installed."""

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the torch 2.x venv has "
                                                          "it: scripts/requirements-torch2.txt)")

from hf_models import VOCAB, make, strata_config  # noqa: E402
from strata.torch import hf  # noqa: E402

STEPS, SAVE_AT = 6, 3


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=32, seq=8):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recording(transformers.Trainer):
    """Trainer that keeps each micro-batch's loss as computed (the logs round to 4 digits)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.raw_losses.append((out[0] if return_outputs else out).detach().clone())
        return out


def arguments(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
                max_grad_norm=1.0, learning_rate=1e-2, weight_decay=0.01, lr_scheduler_type="linear",
                warmup_steps=1, save_strategy="steps", save_steps=SAVE_AT, logging_steps=1, report_to="none",
                use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def strata_trainer(args, nvme_dir):
    nvme_dir.mkdir()
    base = make("gpt2")
    # 3 GPU chunk slots: every layer is evicted in every step; a host budget short of the optimizer
    # states (states_on_nvme_config finds the same for test_hf_models): some of them live on NVMe.
    model = hf.wrap_for_trainer(base, strata_config(base, nvme_dir, 420 << 10), args)
    trainer = Recording(model=model, args=args, train_dataset=Tokens(),
                        optimizers=hf.create_optimizer_and_scheduler(model, args, args.max_steps))
    trainer.raw_losses = []
    # Trainer keeps the dataset columns that forward's signature names (remove_unused_columns).
    assert "input_ids" in inspect.signature(model.forward).parameters
    return model, trainer


def test_sgd_under_trainer_bit_identical_to_torch(tmp_path):
    args = arguments(tmp_path / "out", optim="sgd", learning_rate=0.125, lr_scheduler_type="constant", warmup_steps=0,
                     weight_decay=0.0, save_strategy="no")
    ref = make("gpt2")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.125, momentum=0.5)
    ref_trainer = Recording(model=ref, args=args, train_dataset=Tokens(),
                            optimizers=(ref_opt, torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0)))
    ref_trainer.raw_losses = []
    ref_trainer.train()

    base = make("gpt2")
    (tmp_path / "nvme").mkdir()
    model = hf.wrap_for_trainer(base, strata_config(base, tmp_path / "nvme", 420 << 10), args)
    import strata.torch as st
    opt = st.SGD(model.parameters(), lr=0.125, momentum=0.5)
    trainer = Recording(model=model, args=args, train_dataset=Tokens(),
                        optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)))
    trainer.raw_losses = []
    trainer.train()
    assert len(trainer.raw_losses) == 2 * STEPS
    for i, (a, b) in enumerate(zip(ref_trainer.raw_losses, trainer.raw_losses)):
        assert torch.equal(a, b), f"micro-batch {i}: {a.item()!r} vs {b.item()!r}"
    norms = [(r["grad_norm"], s["grad_norm"]) for r, s in zip(ref_trainer.state.log_history,
                                                               trainer.state.log_history) if "grad_norm" in r]
    assert len(norms) == STEPS and all(a == b for a, b in norms), norms
    assert any(a > 1.0 for a, _ in norms), f"clipping never engaged: {norms}"
    sa, sb = ref.state_dict(), model.state_dict()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert model.strata.totals["bytes_disk_write"] > 0, "the optimizer states never used NVMe"


def test_resume_reproduces_losses_and_pretrained_loads_without_strata(tmp_path):
    out = tmp_path / "run"
    args = arguments(out)
    model, trainer = strata_trainer(args, tmp_path / "nvme")
    trainer.train()
    straight = trainer.raw_losses
    assert len(straight) == 2 * STEPS
    checkpoint = out / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "model.safetensors").is_file()
    assert model.strata.totals["bytes_disk_write"] > 0, "the optimizer states never used NVMe"
    final = {k: v.clone() for k, v in model.state_dict().items()}

    args2 = arguments(tmp_path / "resumed")
    model2, trainer2 = strata_trainer(args2, tmp_path / "nvme2")
    trainer2.train(resume_from_checkpoint=str(checkpoint))
    resumed = trainer2.raw_losses
    assert len(resumed) == 2 * (STEPS - SAVE_AT)
    for i, (a, b) in enumerate(zip(straight[2 * SAVE_AT:], resumed)):
        assert torch.equal(a, b), f"micro-batch {2 * SAVE_AT + i}: {a.item()!r} straight vs {b.item()!r} resumed"
    for k, v in model2.state_dict().items():
        assert torch.equal(v, final[k]), f"{k} differs after the resumed run"

    # save_pretrained, then from_pretrained in a process without strata: the same logits.
    saved = tmp_path / "pretrained"
    model.save_pretrained(str(saved))
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torch.save(ids, tmp_path / "ids.pt")
    script = (
        "import sys, torch, transformers\n"
        "m = transformers.GPT2LMHeadModel.from_pretrained(sys.argv[1]).eval()\n"
        "assert not any(k.startswith('strata') for k in sys.modules), 'strata was imported'\n"
        "with torch.no_grad():\n"
        "    torch.save(m(input_ids=torch.load(sys.argv[2])).logits, sys.argv[3])\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", script, str(saved), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")],
                   check=True, env=env, cwd=str(tmp_path), timeout=300)
    plain = torch.load(tmp_path / "logits.pt")
    assert torch.equal(logits, plain), f"max |d| = {(logits - plain).abs().max()}"
    with open(saved / "config.json") as f:
        assert json.load(f)["model_type"] == "gpt2"
