"""Chunks sized by the runtime's own search in strata.torch (issue #28 item 3, Note [Chunk search bounds] in
python/strata/torch/_layout.py): padding at most 5% on the GPT models the examples and benches train."""

import json
import os
import sys
import types

import pytest
import torch

import strata.torch as st
from strata.torch import _C, _layout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
sys.path.append(os.path.join(HERE, "..", "..", "bench"))  # after examples/: bench/ has a torch_gpt.py too
import torch_scale  # noqa: E402
from torch_gpt import Gpt, init_weights  # noqa: E402


def test_example_gpt_padding_through_wrap(tmp_path):
    """examples/torch_gpt.py's default model and budgets (3 MiB device budget), the wrap path itself. This
    0.8 M-param model packs to 7.8% padding at best: the runtime packs in registration order, and each
    block's small tensors (norms, biases) sit between weights of 16 K-65 K elements, so no chunk size in
    the range leaves less (the example's former chunk_elems, the largest tensor, left 42%). The larger
    shapes below stay within 5%."""
    with st.init():
        model = Gpt(d=128, layers=4, seq=64)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    cfg = {"device": {"kind": "sim", "budget": "512MiB"},
           "budgets": {"gpu": "3MiB", "host": int(0.55 * 16 * n) + (8 << 20), "nvme": "1GiB"},
           "nvme": {"dirs": [str(tmp_path)]}, "threads": 2}
    model = st.wrap(model, cfg, init=init_weights)
    st.AdamW(model.parameters(), lr=1e-3)
    layout = model.strata.engine.layout()
    assert layout["padding_fraction"] <= 0.08, layout
    assert layout["families"] > 3, layout  # streams: not one chunk holding the model
    assert 3 * layout["chunk_elems"] * 4 <= 3 << 20
    model.strata.close()


def layout_of(model, cfg):
    """The runtime's layout for `model`'s parameter shapes (meta tensors: no values, no init)."""
    largest = max(p.numel() for p in model.parameters())
    cfg = _layout.search_bounds({k: v for k, v in cfg.items() if k != "grad_reads"}, "fp32", largest)  # as wrap
    cfg["optimizer"] = {"name": "sgd"}
    engine = _C.Engine(json.dumps(cfg))
    try:
        seen = set()
        for name, p in model.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                engine.register_param(name, p, False)
        engine.init_many([], [])  # fixes the layout
        return engine.layout()
    finally:
        engine.close()


@pytest.mark.parametrize("params", [20e6, 50e6, 1.2e9, 3e9])
def test_torch_scale_gpt_shapes_padding(params, tmp_path):
    """bench/torch_scale.py's models at 20M, 50M, 1.2B and 3B, whole (on the meta device: no memory), with its
    config's budgets. Whole models, not one or two blocks: the last chunk's tail is part of the padding."""
    d, layers = torch_scale.shape_for(params)
    with torch.device("meta") if hasattr(torch.device("cpu"), "__enter__") else st.init():
        model = Gpt(d=d, layers=layers, heads=d // 64, seq=64)
    args = types.SimpleNamespace(threads=2)
    host = 64 * 12 * layers * d * d
    if host <= 4 << 30:
        cfg = torch_scale.config(12 * layers * d * d, d, args, None, host, all_host=True)
    else:  # the layout does not depend on the host budget; the RAM does: states on NVMe (a growing swap file)
        cfg = torch_scale.config(12 * layers * d * d, d, args, str(tmp_path), 2 << 30)
    layout = layout_of(model, cfg)
    assert layout["padding_fraction"] <= 0.05, (params, d, layers, layout)


def test_fixed_chunk_elems_is_kept():
    cfg = _layout.search_bounds({"budgets": {"gpu": "3MiB"}, "layout": {"chunk_elems": 8192}}, "fp32")
    assert cfg["layout"] == {"chunk_elems": 8192}


def test_bounds_follow_the_gpu_budget():
    cfg = _layout.search_bounds({"budgets": {"gpu": "3MiB"}}, "fp32")
    assert cfg["layout"] == {"chunk_elems_min": 4096, "chunk_elems_max": 262144}  # 3 slots of 1 MiB
    cfg = _layout.search_bounds({"budgets": {"gpu": "64GiB"}}, "bf16")
    assert cfg["layout"]["chunk_elems_max"] == 1 << 26


def test_bounds_prefer_the_planners_slots():
    """Note [Chunks for a streaming plan] in _layout.py: 2 + 2 x prefetch_depth_max slots where the largest
    tensor allows, never above three slots, never below twice the largest tensor."""
    mib = 1 << 20
    cfg = _layout.search_bounds({"budgets": {"gpu": 100 * mib}}, "fp32", 1 << 20)
    assert cfg["layout"]["chunk_elems_max"] == 1 << 21  # 12 slots of 8 MiB (10 wanted), not 3 of 32 MiB
    cfg = _layout.search_bounds({"budgets": {"gpu": 100 * mib}, "plan": {"prefetch_depth_max": 1}}, "fp32", 1 << 16)
    assert cfg["layout"]["chunk_elems_max"] == 1 << 22  # 4 slots wanted: 6 of 16 MiB
    cfg = _layout.search_bounds({"budgets": {"gpu": 100 * mib}}, "fp32", 5 << 20)
    assert cfg["layout"]["chunk_elems_max"] == 1 << 23  # the largest tensor's room wins over the slots
    cfg = _layout.search_bounds({"budgets": {"gpu": "3MiB"}}, "fp32", 1 << 20)
    assert cfg["layout"]["chunk_elems_max"] == 262144  # never above three slots


def test_offloaded_25m_gpt_streams_with_prefetch():
    """bench/torch_gpt.py's 25 M GPT with a device budget of a quarter of its state: many chunks, so that the
    plan's 10 slots fit (3 slots of a quarter of the model before: prefetch depth 1, #29)."""
    with torch.device("meta") if hasattr(torch.device("cpu"), "__enter__") else st.init():
        model = Gpt(d=512, layers=8, seq=64)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    gpu = 16 * n // 4
    cfg = {"device": {"kind": "sim", "budget": 1 << 30}, "budgets": {"gpu": gpu, "host": 16 * n, "nvme": 0},
           "threads": 2}
    layout = layout_of(model, cfg)
    assert gpu // (4 * layout["chunk_elems"]) >= 10, layout
    assert layout["families"] >= 10 and layout["padding_fraction"] <= 0.05, layout
