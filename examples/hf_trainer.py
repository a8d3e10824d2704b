#!/usr/bin/env python3
"""transformers.Trainer training a small GPT-2 (random init, nothing downloaded) through strata.torch
on the repository's own docs as bytes: params and gradients stream through the (sim) device, the
AdamW states live on host and NVMe (a temporary directory; the printed plan says where), Trainer clips, accumulates gradients,
checkpoints and logs as usual. The trained model is saved with save_pretrained: plain safetensors that
transformers loads without strata.

    pip install transformers        # plus strata.torch (pip install --no-build-isolation .)
    python examples/hf_trainer.py [--steps 8] [--out DIR] [--resume CHECKPOINT_DIR]

docs/hf.md describes the integration (strata.torch.hf, Note [Trainer]).
"""

import argparse
import glob
import os
import shutil
import tempfile
import time

import torch
import transformers

from strata.torch import hf

HERE = os.path.dirname(os.path.abspath(__file__))
SEQ = 64


class Bytes(torch.utils.data.Dataset):
    """Windows of SEQ bytes of the repository's docs (vocabulary: the 256 byte values)."""

    def __init__(self):
        text = b"".join(open(p, "rb").read() for p in sorted(glob.glob(os.path.join(HERE, "..", "docs", "*.md"))))
        data = torch.frombuffer(bytearray(text or b"strata " * 1000), dtype=torch.uint8).long()
        self.windows = data[: len(data) // SEQ * SEQ].view(-1, SEQ)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", help="Trainer's output_dir (default: a temporary directory, removed at the end)")
    ap.add_argument("--resume", help="a checkpoint-N directory of an earlier run to resume from")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    a = ap.parse_args()

    out = a.out or tempfile.mkdtemp(prefix="strata-hf-")
    nvme = tempfile.mkdtemp(prefix="strata-hf-nvme-")
    try:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_positions=SEQ, n_embd=a.width, n_layer=a.layers, n_head=4,
            bos_token_id=0, eos_token_id=0))
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=a.steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
            learning_rate=3e-3, weight_decay=0.01, warmup_steps=2, max_grad_norm=1.0, save_steps=max(a.steps // 2, 1),
            logging_steps=1, report_to="none", use_cpu=True, seed=0, disable_tqdm=True)
        params = sum(p.numel() for p in model.parameters())
        # Chunks of 16 Ki elements; the device holds 4 of them (less than the model: every layer
        # streams); the host holds the params, their gradients and about one optimizer state: the
        # rest of the AdamW states go to NVMe.
        chunk = 16384
        config = {"device": {"kind": "sim", "budget": "256MiB"}, "layout": {"chunk_elems": chunk},
                  "budgets": {"gpu": 4 * chunk * 4, "host": params * 4 * 3 + 16 * chunk * 4, "nvme": "1GiB"},
                  "nvme": {"dirs": [nvme]}, "threads": 2}
        model = hf.wrap_for_trainer(model, config, args)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Bytes(),
                                       optimizers=hf.create_optimizer_and_scheduler(model, args, a.steps))
        start = time.perf_counter()
        trainer.train(resume_from_checkpoint=a.resume)
        elapsed = time.perf_counter() - start
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"{params} params, {len(losses)} steps in {elapsed:.1f} s; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        print(model.strata.engine.describe())
        t = model.strata.totals
        print(f"moved: h2d {t['bytes_h2d'] >> 10} KiB, NVMe read {t['bytes_disk_read'] >> 10} KiB, "
              f"write {t['bytes_disk_write'] >> 10} KiB")
        final = os.path.join(out, "final")
        model.save_pretrained(final)
        print(f"saved {final} (transformers.GPT2LMHeadModel.from_pretrained loads it without strata)")
        model.strata.close()
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
        if a.out is None:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
