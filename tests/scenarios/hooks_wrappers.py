"""Ops run from module hooks and from torch functions behind library wrappers (decorators)."""

import functools

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import deprecated


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x):
        return x + F.relu(self.norm(self.conv(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block = Block()
        self.head = nn.Linear(4, 2)

    def forward(self, images):
        h = self.block(self.stem(images))
        return self.head(h.mean((2, 3)))


def scale_input(module, args):
    return (args[0] * 0.5,)


def keep_features(store):
    def hook(module, args, output):
        store.append(output.detach().mean())
        return output * 1.0
    return hook


def train_with_hooks(steps=2, hooks=True):
    """A conv net whose block is hooked: its input scaled, its features kept (feature
    extraction / activation statistics), during an ordinary training loop."""
    torch.manual_seed(0)
    model = Net()
    features = []
    handles = []
    if hooks:
        handles.append(model.block.register_forward_pre_hook(scale_input))
        handles.append(model.block.register_forward_hook(keep_features(features)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    images, labels = torch.randn(2, 3, 6, 6), torch.tensor([0, 1])
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
    for handle in handles:
        handle.remove()
    return model, features


def global_pre_hook(module, args):
    if isinstance(module, nn.Conv2d):
        return (args[0] - 0.0,)
    return None


def global_hook(module, args, output):
    if isinstance(module, nn.Linear):
        return output + 0.0
    return None


class Failing(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x).view(3)  # 8 elements into 3: raises


def recursive_tree(depth=2):
    """The same module called inside itself (a weight-tied recursive cell)."""
    cell = Recursive()
    return cell(torch.randn(2, 4), depth)


class Recursive(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, depth):
        if depth:
            x = self(x, depth - 1)
        return torch.tanh(self.linear(x))


# A torch function behind a library's deprecation wrapper, as torch ships several (wrapping a
# partial, so that F.silu itself is left unmarked).
legacy_silu = deprecated("use F.silu")(functools.partial(F.silu))


def call_legacy_silu():
    x = torch.randn(3)
    return legacy_silu(x) * 2


def quantize_and_run():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    return quantized(torch.randn(3, 4))
