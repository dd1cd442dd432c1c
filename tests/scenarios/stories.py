"""Programs with real bugs, and healthy look-alikes that must not be flagged."""

import math

import torch
from torch import nn


# -- bugs ---------------------------------------------------------------------------------

def device_mix():
    mask = torch.tensor([0, 1, 0, 1, 1, 0], device="meta", dtype=torch.bool)
    source = torch.tensor([1.0, 2.0, 3.0], device="meta")
    y = torch.zeros(6)
    y.masked_scatter_(mask, source)
    return y


def mask_dtype():
    mask = torch.tensor([0, 1, 0, 1, 1, 0])
    y = torch.zeros(6)
    y.masked_scatter_(mask, torch.tensor([1.0, 2.0, 3.0]))


def double_matmul():
    x = torch.ones(5, 3)
    w = torch.ones(3, 2)
    return x.double() @ w


def numpy_upcast():
    import numpy as np

    weights = torch.from_numpy(np.ones(4))  # float64
    features = torch.ones(4)
    return features * weights


def broadcast_loss(steps=1):
    torch.manual_seed(0)
    x = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    y = torch.tensor([3.0, 5.0, 4.0, 6.0])
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        pred = model(x)
        loss = ((y - pred) ** 2).mean()
        loss.backward()
        optimizer.step()
    return loss


def reshape_column():
    y = torch.ones(4)
    pred = torch.ones(2, 2)
    return y - pred.reshape(4, 1)


class ColumnHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(3, 1)

    def forward(self, x):
        return torch.sigmoid(self.score(x))


def module_column():
    torch.manual_seed(0)
    head = ColumnHead()
    target = torch.ones(5)
    return ((head(torch.randn(5, 3)) - target) ** 2).mean()


def log_zero():
    likelihood = torch.tensor([0.0, 0.25, 0.9, 0.75], requires_grad=True)
    log_likelihood = likelihood.log()
    target = -log_likelihood.mean()
    value = target.item()
    target.backward()
    return value


def sqrt_grad_at_zero():
    x = torch.tensor([0.0, 1.0, 4.0], requires_grad=True)
    distance = x.sqrt()
    distance.sum().backward()
    return x.grad


def diverging(steps=30):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=10.0)
    x = torch.randn(16, 4) * 100
    y = torch.randn(16, 1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# -- healthy look-alikes ------------------------------------------------------------------

def centered():
    x = torch.randn(8, 5)
    return x - x.mean(-1, keepdim=True)


def attention_mask():
    scores = torch.randn(2, 4, 6, 6)
    mask = torch.zeros(2, 1, 1, 6)
    return scores + mask


def outer_products():
    a = torch.randn(5)
    b = torch.randn(7)
    return a[:, None] * b[None, :], a.unsqueeze(1) * b.unsqueeze(0), torch.outer(a, b), a.view(-1, 1) * b.view(1, -1)


def pairwise(n=6):
    a = torch.randn(n, 3)
    b = torch.randn(n, 3)
    return (a[:, None] - b[None]).norm(dim=-1), a[:, None, :] - b


def rotary(seq_len=8, dim=16):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))  # len(inv_freq) == seq_len
    position_ids = torch.arange(seq_len)[None, :]
    freqs = position_ids[..., None].float() * inv_freq
    return torch.cat((freqs, freqs), dim=-1).cos()


def t5_buckets(length=6, num_buckets=8, max_distance=16):
    context = torch.arange(length)[:, None]
    memory = torch.arange(length)[None, :]
    relative = (memory - context).abs()
    max_exact = num_buckets // 2
    is_small = relative < max_exact
    # log(0) on purpose: the -inf is cast to an integer and discarded by where.
    large = max_exact + (
        torch.log(relative.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return torch.where(is_small, relative, large)


def masked_attention():
    scores = torch.randn(2, 5, 5, requires_grad=True)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    masked = scores.masked_fill(~causal, float("-inf"))
    weights = masked.softmax(-1)
    weights.sum().backward()
    return weights


def constants():
    return torch.full((3,), float("inf")), torch.empty(1000).zero_(), torch.zeros(3).fill_(float("nan")).nan_to_num()


def mixed_ints_and_scalars():
    x = torch.randn(4, 3)
    counts = torch.arange(3)
    flags = torch.tensor([True, False, True])
    return x * counts, x * flags, x * torch.tensor(2.0, dtype=torch.float64), x * 2.5


def healthy_training(steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 4), torch.randn(16)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((model(x).squeeze(-1) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
    return loss
