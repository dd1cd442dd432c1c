"""Training loops where a floating promotion is deliberate, torch's own, or a real bug.

- A mixture-of-experts layer in a float16 model keeping its routing weights in float32 (as
  Mixtral-style code does): the product of an expert's output and its weight is cast back to
  the activations' dtype (``cast_back``), or flows on in float32 (``flows_on``: a bug).
- A transformer block calling ``F.scaled_dot_product_attention`` with half-precision q, k, v and
  a mask of the same dtype (the math backend upcasts inside), or a float32 mask (legal).
- A float32 parameter left in a float16 model (wav2vec2-style codevectors) whose product feeds on.
- A float64 numpy weight meeting a float32 model, the float64 operand first or second.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel


class MoE(nn.Module):
    """Top-2 routing over 4 experts; the router and its weights in float32 on purpose."""

    def __init__(self, dim=16, experts=4, cast_back=True):
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)) for _ in range(experts))
        self.cast_back = cast_back

    def forward(self, hidden):
        logits = self.router(hidden.float())  # the router runs in float32
        weights, chosen = torch.topk(F.softmax(logits, dim=-1), 2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)  # float32 routing weights
        out = torch.zeros_like(hidden)
        for index, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == index)
            if self.cast_back:
                product = expert(hidden[rows]) * weights[rows, slot, None]  # MOE_PRODUCT
                out.index_add_(0, rows, product.to(hidden.dtype))
            else:
                product = expert(hidden[rows]) * weights[rows, slot, None]  # MOE_FLOWS
                out = out.float().index_add(0, rows, product)
        return out


class MoEModel(nn.Module):
    def __init__(self, cast_back=True):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.moe = MoE(cast_back=cast_back)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.embed(x)
        return self.head((h + self.moe(h)).to(self.head.weight.dtype))


def moe_training(cast_back=True, dtype=torch.float16, steps=3):
    torch.manual_seed(0)
    model = MoEModel(cast_back).to(dtype)
    model.moe.router.float()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(12, 8, dtype=dtype), torch.randint(0, 3, (12,))
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        optimizer.step()
    return loss


def moe_cast_back():
    return moe_training(cast_back=True)


def moe_cast_back_bf16():
    return moe_training(cast_back=True, dtype=torch.bfloat16)


def moe_flows_on():
    return moe_training(cast_back=False)


class Block(nn.Module):
    """A pre-norm transformer block calling SDPA with an additive padding mask."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # SDPA_CALL
        x = x + self.proj(attended.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


def attention_training(dtype=torch.float16, mask_dtype=None, math=True, steps=3):
    torch.manual_seed(0)
    model = nn.ModuleList([Block(), Block()]).to(dtype)
    head = nn.Linear(32, 5).to(dtype)
    optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=1e-2)
    x, y = torch.randn(2, 6, 32, dtype=dtype), torch.randint(0, 5, (2,))
    lengths = torch.tensor([6, 4])
    padding = torch.arange(6)[None, :] >= lengths[:, None]
    mask_dtype = mask_dtype or dtype
    mask = torch.zeros(2, 1, 1, 6, dtype=mask_dtype).masked_fill(padding[:, None, None, :], torch.finfo(mask_dtype).min)
    with sdpa_kernel([SDPBackend.MATH] if math else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        for _ in range(steps):
            optimizer.zero_grad()
            h = x
            for block in model:
                h = block(h, mask)
            loss = F.cross_entropy(head(h.mean(1)).float(), y)
            loss.backward()
            optimizer.step()
    return loss


class Quantizer(nn.Module):
    """wav2vec2-style: codevectors left in float32 while the model is float16."""

    def __init__(self, dim=8, codes=6):
        super().__init__()
        self.logits = nn.Linear(dim, codes)
        self.codevectors = nn.Parameter(torch.randn(codes, dim))

    def forward(self, x):
        probs = self.logits(x).softmax(-1)
        return (probs.unsqueeze(-1) * self.codevectors).sum(-2)  # CODEVECTORS


def quantizer_training(steps=2):
    torch.manual_seed(0)
    model = Quantizer().half()
    model.codevectors.data = model.codevectors.data.float()  # left behind by a custom init
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, dtype=torch.float16)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
    return loss


def numpy_weight_training(float64_first, steps=2):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 4), torch.randn(8)
    weights = torch.from_numpy(np.linspace(0.5, 1.5, 8))  # float64 per-sample weights
    for _ in range(steps):
        optimizer.zero_grad()
        error = (model(x).squeeze(-1) - y) ** 2
        if float64_first:
            loss = (weights * error).mean()  # FLOAT64_FIRST
        else:
            loss = (error * weights).mean()  # FLOAT64_SECOND
        loss.backward()
        optimizer.step()
    return loss
