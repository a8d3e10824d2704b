"""Small torch models for strata.torch's tests, each exercising one kind of hook use."""

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
import torch.nn.utils.prune as prune
import torch.utils.checkpoint as cp


class Mlp(nn.Module):
    def __init__(self, d=64, h=128, out=10):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, out)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Encoder(nn.Module):
    """nn.TransformerEncoderLayer (attention with its in_proj parameters, MLP, layer norms)."""

    def __init__(self, d=64, out=10):
        super().__init__()
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True)
            for _ in range(2)])
        self.head = nn.Linear(d, out)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))


class Tied(nn.Module):
    """Embedding and output head share one weight."""

    def __init__(self, vocab=200, d=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.mid2 = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mid2(torch.tanh(self.mid(self.emb(idx))))))


class Reused(nn.Module):
    """One layer called twice in a forward."""

    def __init__(self, d=96, out=10):
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, out)

    def forward(self, x):
        h = F.relu(self.inp(x))
        h = F.relu(self.shared(h))
        h = F.relu(self.shared(h))
        return self.out(h)


class FrozenUnused(nn.Module):
    """A frozen layer, and a branch used on even steps only (set .use_branch)."""

    def __init__(self, d=96, out=10):
        super().__init__()
        self.frozen, self.a, self.branch, self.out = (nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d),
                                                      nn.Linear(d, out))
        for p in self.frozen.parameters():
            p.requires_grad_(False)
        self.use_branch = True

    def forward(self, x):
        h = F.relu(self.a(F.relu(self.frozen(x))))
        if self.use_branch:
            h = h + F.relu(self.branch(h))
        return self.out(h)


class Checkpointed(nn.Module):
    """Two blocks under torch.utils.checkpoint (recomputed in backward)."""

    def __init__(self, d=96, out=10):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d)) for _ in range(2)])
        self.out = nn.Linear(d, out)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + cp.checkpoint(b, h)
        return self.out(h)


class Deep(nn.Module):
    """Eight 64x64 layers (one chunk each), the middle ones under checkpoint: many families, so
    that a host budget can hold part of the optimizer states and spill the rest to NVMe."""

    def __init__(self, d=64, depth=8, out=10):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(depth)])
        self.out = nn.Linear(d, out)
        self.checkpointed = (3, 4)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(cp.checkpoint(layer, x) if i in self.checkpointed else layer(x))
        return self.out(x)


class Branch(nn.Module):
    def __init__(self, shared, d):
        super().__init__()
        self.shared, self.own = shared, nn.Linear(d, d)

    def forward(self, x):
        return self.own(torch.tanh(self.shared(x)))


class SharedTree(nn.Module):
    """One submodule under two parents (model.a.shared is model.b.shared), a frozen layer and
    BatchNorm buffers."""

    def __init__(self, d=64, out=10):
        super().__init__()
        shared = nn.Linear(d, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.a, self.b = Branch(shared, d), Branch(shared, d)
        self.norm = nn.BatchNorm1d(d)
        self.out = nn.Linear(d, out)

    def forward(self, x):
        h = self.norm(torch.tanh(self.frozen(x)))  # (a bias right before a BatchNorm gets ~0 gradients)
        return self.out(torch.tanh(self.a(h) + self.b(h)))


class FunctionalTie(nn.Module):
    """Tied's model with the tie written as F.linear(h, self.emb.weight): no module owns the head."""

    def __init__(self, vocab=200, d=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.mid2 = nn.Linear(d, d)

    def forward(self, idx):
        return F.linear(torch.tanh(self.mid2(torch.tanh(self.mid(self.emb(idx))))), self.emb.weight)


class FeedForward(nn.Module):
    """T5's DenseReluDense: its forward reads its child's weight (for its dtype) through attribute
    access, and it owns no parameter itself."""

    def __init__(self, d):
        super().__init__()
        self.wi, self.wo = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = torch.relu(self.wi(x))
        if h.dtype != self.wo.weight.dtype:
            h = h.to(self.wo.weight.dtype)
        return self.wo(h)


class ChildReads(nn.Module):
    """Six residual FeedForward blocks. Each block's read of wo.weight binds it for that block's own
    call (Note [Parameters read by another module]): one slot more than Mlp's, held through the
    block's backward. Before #27's fix it was bound for the enclosing call, the whole forward: one
    slot more per block, as in T5."""

    def __init__(self, d=64, depth=6, out=10):
        super().__init__()
        self.blocks = nn.ModuleList([FeedForward(d) for _ in range(depth)])
        self.out = nn.Linear(d, out)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


class CrossBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, memory):
        return x + torch.tanh(self.q(x) * self.k(memory))


class SharedInput(nn.Module):
    """Six blocks whose k takes the same tensor (T5's encoder output in every decoder block's
    cross-attention): each k is unbound once its own part of that tensor's gradient is computed
    (Note [Module-local input gradients] in _hooks.py), not once the whole of it is, after the last
    block's backward (#27). Its first layer takes an input without a gradient: unbound once its
    parameters' gradients are computed."""

    def __init__(self, d=64, depth=6, out=10):
        super().__init__()
        self.enc = nn.Linear(d, d)
        self.blocks = nn.ModuleList([CrossBlock(d) for _ in range(depth)])
        self.out = nn.Linear(d, out)

    def forward(self, x):
        memory = torch.tanh(self.enc(x))
        h = x
        for block in self.blocks:
            h = block(h, memory)
        return self.out(h)


class Half(nn.Module):
    def forward(self, w):
        return w * 0.5


class Reparametrized(nn.Module):
    """Weights computed by forward pre-hooks registered before wrap (the old nn.utils.weight_norm and
    spectral_norm, pruning) and by a parametrization (nn.utils.parametrize)."""

    def __init__(self, d=64, out=10):
        super().__init__()
        self.wn = nn.utils.weight_norm(nn.Linear(d, d))
        self.sn = nn.utils.spectral_norm(nn.Linear(d, d))
        self.pruned = nn.Linear(d, d)
        prune.l1_unstructured(self.pruned, "weight", amount=0.25)
        self.out = nn.Linear(d, out)
        parametrize.register_parametrization(self.out, "weight", Half())

    def forward(self, x):
        return self.out(torch.tanh(self.pruned(torch.tanh(self.sn(torch.tanh(self.wn(x)))))))


# name -> (class, input kind, GPU chunk slots: the fewest its working set needs)
MODELS = {
    "mlp": (Mlp, "dense", 3),
    "encoder": (Encoder, "seq", 14),
    "tied": (Tied, "tokens", 3),
    "reused": (Reused, "dense", 3),
    "frozen_unused": (FrozenUnused, "dense", 3),
    "checkpoint": (Checkpointed, "dense", 3),
    "deep": (Deep, "dense", 3),
    "shared": (SharedTree, "dense", 5),  # a.shared, b.shared: inputs without grad (Limits)
    "ftied": (FunctionalTie, "tokens", 3),  # as many as "tied"
    "reparam": (Reparametrized, "dense", 4),
    "child_reads": (ChildReads, "dense", 4),
    "shared_input": (SharedInput, "dense", 3),
}


def make(name, seed=0):
    torch.manual_seed(seed)
    cls, kind, _ = MODELS[name]
    return cls(), kind


def inputs(model, kind, step, micro=0, batch_size=16):
    g = torch.Generator().manual_seed(1000 * step + micro)
    if kind == "tokens":
        return (torch.randint(0, 200, (batch_size, 8), generator=g),
                torch.randint(0, 200, (batch_size, 8), generator=g))
    if kind == "seq":
        return torch.randn(batch_size, 6, 64, generator=g), torch.randint(0, 10, (batch_size,), generator=g)
    d = next(m for m in model.modules() if isinstance(m, nn.Linear)).in_features
    return torch.randn(batch_size, d, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def loss_of(model, x, y):
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
