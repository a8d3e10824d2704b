"""Tiny Hugging Face transformers models (random init from small configs, seeded, never downloaded)
and the training loop the HF tests run them through, torch only and through strata.torch."""

import copy
import re

import torch

import strata.torch as st

VOCAB = 64
BATCH, SEQ = 2, 8


def _configs():
    import transformers as tf

    # Dropout stays at the configs' defaults where they have one: each step reseeds torch's RNG
    # before its forward, so torch alone and strata draw the same masks.
    return {
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16)),
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16, tie_word_embeddings=False)),
        "bert": (tf.BertForMaskedLM, tf.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=VOCAB,
            max_position_embeddings=16, type_vocab_size=2)),
        "t5": (tf.T5ForConditionalGeneration, tf.T5Config(
            d_model=32, d_ff=64, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=2, vocab_size=VOCAB,
            relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0)),
    }


NAMES = ("gpt2", "llama", "bert", "t5")
# The fewest GPU chunk slots each model trains in (every layer evicted in every step). T5 needs 4
# (docs/hf.md, Limits): its DenseReluDense reads wo.weight's dtype in its own forward (a reader's
# call, Note [Parameters read by another module], which holds it through that module's backward).
# It needed 8 while such a read was bound for the whole forward, and while the cross-attention k
# and v stayed bound until the encoder output's whole gradient was computed (Note [Module-local
# input gradients] in _hooks.py).
GPU_SLOTS = {"gpt2": 3, "llama": 3, "bert": 3, "t5": 4}


def make(name, seed=0):
    cls, cfg = _configs()[name]
    torch.manual_seed(seed)
    model = cls(cfg)
    model.train()
    return model


def batch(name, step):
    """The step's inputs: token ids, an attention mask with padding in the second row, and labels
    (-100 where padded, which the losses skip)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 2:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if name == "t5":
        return {"input_ids": ids, "attention_mask": mask,
                "labels": torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)}
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def train(model, opt, name, steps):
    """Runs `steps` optimizer steps; returns the losses (tensors)."""
    losses = []
    for step in range(steps):
        torch.manual_seed(step)  # dropout masks: the same draws both ways
        loss = model(**batch(name, step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def _align(n, a=4096):
    return (n + a - 1) // a * a


def strata_config(model, nvme_dir, host, gpu_slots=3, chunk_elems=4096):
    """A sim-device config: a GPU budget of `gpu_slots` chunk slots (the model does not fit, so every
    layer is evicted in every step), `host` bytes of host budget and NVMe (posix engine) in nvme_dir."""
    largest = max(p.numel() for p in model.parameters())
    return {
        "device": {"kind": "sim", "budget": "256MiB"},
        "budgets": {"gpu": gpu_slots * _align(largest, chunk_elems) * 4, "host": host, "nvme": "64MiB"},
        "nvme": {"dirs": [str(nvme_dir)], "engine": "posix"},
        "layout": {"chunk_elems": chunk_elems},
        "threads": 2,
    }


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def placement(model):
    """(params home gpu/host/nvme, optimizer states gpu/host/nvme, planned host bytes) from the plan."""
    plan = model.strata.engine.describe()
    params = re.search(r"params home gpu/host/nvme = (\d+)/(\d+)/(\d+)", plan)
    states = re.search(r"optimizer states gpu/host/nvme = (\d+)/(\d+)/(\d+)", plan)
    host = re.search(r"planned bytes gpu \S+ \S+ host ([\d.]+) (\w+)", plan)
    assert params and states and host, f"the plan's summary changed: {plan}"
    return (tuple(map(int, params.groups())), tuple(map(int, states.groups())),
            int(float(host.group(1)) * _UNITS[host.group(2)]))


def states_on_nvme_config(name, nvme_dir, make_opt, gpu_slots=None):
    """strata_config with the largest host budget (in steps of 16 KiB below what the plan wants with
    everything on host) that puts at least half of the optimizer states' chunk families on NVMe,
    params staying on host. Planned, not run: each try wraps a fresh copy and creates the optimizer."""
    base = make(name)
    slots = gpu_slots or GPU_SLOTS[name]

    def plan_for(host):
        model = st.wrap(copy.deepcopy(base), strata_config(base, nvme_dir, host, slots))
        try:
            make_opt(model.parameters())
            return placement(model)
        finally:
            model.strata.close()

    wanted = plan_for(64 << 20)[2]
    for host in range(wanted - (16 << 10), 0, -(16 << 10)):
        params, states, _ = plan_for(host)
        assert params[2] == 0, f"{name}: params moved to NVMe before half the states did ({host} B host)"
        if 2 * states[2] >= sum(states):
            return strata_config(base, nvme_dir, host, slots)
    raise AssertionError(f"{name}: no host budget puts the optimizer states on NVMe")


def pair(name, cfg, torch_opt, strata_opt):
    """(torch model, torch optimizer, wrapped model, strata optimizer) from the same init."""
    ref = make(name)
    model = st.wrap(copy.deepcopy(ref), cfg)
    return ref, torch_opt(ref.parameters()), model, strata_opt(model.parameters())
