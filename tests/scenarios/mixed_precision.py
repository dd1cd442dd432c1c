"""Mixed-precision training loops under ``torch.autocast`` on the CPU, and float64 look-alikes.

Under autocast the residual stream stays float32 while every sublayer (Linear, attention)
returns the autocast dtype, so ``x + attn(x)`` mixes float32 with bfloat16/float16 in every
layer: that is the design, not an anomaly. A float64 tensor meeting the model still is.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 50
WIDTH = 32


class Block(nn.Module):
    """A pre-norm transformer block with LayerScale (``gamma * mlp(x)``, as in CaiT/ConvNeXt):
    its backward multiplies the float32 gradient by the autocast-dtype MLP output."""

    def __init__(self, width=WIDTH, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.gamma = nn.Parameter(torch.full((width,), 0.1))

    def attn(self, x):
        batch, length, width = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, length, width))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        x = x + self.gamma * self.mlp(self.norm2(x))
        return x


class TinyLM(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(16, WIDTH))
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def positions(self, length):
        return self.pos[:length]

    def forward(self, ids):
        x = self.embed(ids) + self.positions(ids.shape[1])
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class NumpyPositionsLM(TinyLM):
    """The sinusoidal position table is computed with numpy: a float64 buffer."""

    def __init__(self):
        super().__init__()
        angles = np.arange(16)[:, None] / 10000 ** (np.arange(WIDTH)[None, :] / WIDTH)
        self.register_buffer("table", torch.from_numpy(np.sin(angles)))

    def positions(self, length):
        return self.table[:length]


def train_lm(dtype=torch.bfloat16, steps=4, model_class=TinyLM):
    torch.manual_seed(0)
    model = model_class()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (4, 12))
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def mixed_outside_autocast():
    """The same f32 + bf16 sum without autocast: a stray .bfloat16() somewhere."""
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 5, WIDTH)
    h = block.mlp(x).bfloat16()
    return x + h


class ScaledHead(nn.Module):
    """A per-feature scale made from a numpy array: a float64 parameter in a float32 model."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.from_numpy(np.ones(8)))

    def forward(self, x):
        return (self.body(x) * self.scale).sum(-1)


def float64_parameter(steps=2):
    torch.manual_seed(0)
    model = ScaledHead()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(6, 8), torch.randn(6)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
    return loss
