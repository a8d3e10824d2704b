"""strata.torch training is bit-identical to torch-only training (SGD, power-of-two lr, no
momentum) for models that use the hooks in every way, with every layer evicted from the
device and NVMe on both I/O engines."""

import os

import pytest
import torch

from harness import assert_identical, config, run
from models import MODELS, make

STEPS = 20


@pytest.mark.parametrize("engine", ["none", "uring", "posix"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_bit_identical_to_torch(name, engine, tmp_path):
    model, _ = make(name)
    cfg = config(model, None if engine == "none" else tmp_path, engine)
    reference = run(name, STEPS)
    strata = run(name, STEPS, cfg)
    assert_identical(reference, strata)
    wrapped = strata[2].strata
    # Every layer was evicted: each step moved more than the whole model to the device.
    param_bytes = sum(p.numel() * 4 for p in wrapped.params)
    assert wrapped.last_stats["bytes_h2d"] >= param_bytes
    assert wrapped.last_stats["gpu_high_water_bytes"] <= cfg["budgets"]["gpu"]
    wrapped.close()
    assert os.listdir(tmp_path) == [], "swap files left behind"


@pytest.mark.parametrize("name", ["mlp", "tied", "encoder"])
def test_micro_batches_bit_identical(name, tmp_path):
    model, _ = make(name)
    cfg = config(model, tmp_path)
    cfg["gradient_accumulation_steps"] = 4
    reference = run(name, 6, micro=4)
    strata = run(name, 6, cfg, micro=4)
    assert_identical(reference, strata)
