"""Training loops with dtype and device bugs torch lets through silently or reports late, and
their healthy twins.

The second device is ``meta`` so that everything runs on a CPU-only machine.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class ConvNet(nn.Module):
    """A small torchvision-style classifier: conv-bn-relu stages, global pooling, a linear head."""

    def __init__(self, classes=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.stage = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16, classes)

    def forward(self, images):
        features = self.stage(self.stem(images))
        return self.head(features.mean((2, 3)))


def _images(batch=6):
    return torch.randn(batch, 3, 8, 8)


def classify(labels, steps=3, smoothing=0.0):
    torch.manual_seed(0)
    model = ConvNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images = _images(len(labels))
    for _ in range(steps):
        optimizer.zero_grad()
        logits = model(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=smoothing)
        loss.backward()
        optimizer.step()
    return loss


def classify_int64():
    return classify(torch.tensor([0, 1, 2, 3, 1, 0]))


def classify_uint8():
    return classify(torch.tensor([0, 1, 2, 3, 1, 0], dtype=torch.uint8))


def classify_int32_from_numpy():
    return classify(torch.from_numpy(np.array([0, 1, 2, 3, 1, 0], dtype=np.int32)))


def classify_float_labels():
    labels = torch.tensor([0.0, 1.0, 2.0, 3.0, 1.0, 0.0])  # a label column read as floats
    return classify(labels)


def classify_soft_labels():
    soft = torch.softmax(torch.randn(6, 4), -1)  # class probabilities: floating, input-shaped
    return classify(soft)


def segment(labels, steps=2):
    """Per-pixel classification: nll_loss2d under cross_entropy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    images = _images(2)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)  # per-pixel
        loss.backward()
        optimizer.step()
    return loss


def segment_int64():
    return segment(torch.randint(0, 4, (2, 8, 8)))


def segment_int32():
    return segment(torch.randint(0, 4, (2, 8, 8), dtype=torch.int32))


def regress(target, steps=3, loss_fn=F.mse_loss):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 5)
    for _ in range(steps):
        optimizer.zero_grad()
        pred = model(x).squeeze(-1)
        loss = loss_fn(pred, target)
        loss.backward()
        optimizer.step()
    return loss


def regress_numpy_targets():
    return regress(torch.from_numpy(np.linspace(0.0, 1.0, 8)))  # float64


def regress_float32_targets():
    return regress(torch.from_numpy(np.linspace(0.0, 1.0, 8).astype(np.float32)))


def regress_integer_targets():
    return regress(torch.arange(8))  # counts as i64: converted exactly, not an anomaly


def regress_huber_numpy_targets():
    return regress(torch.from_numpy(np.linspace(0.0, 1.0, 8)), steps=1, loss_fn=F.huber_loss)


class RatingRegressor(nn.Module):
    """Star ratings (1 to 5) predicted from user and item embeddings, trained with a Huber loss."""

    def __init__(self, users=20, items=30, dim=8):
        super().__init__()
        self.users = nn.Embedding(users, dim)
        self.items = nn.Embedding(items, dim)
        self.bias = nn.Parameter(torch.tensor(3.0))

    def forward(self, user, item):
        return (self.users(user) * self.items(item)).sum(-1) + self.bias


def regress_ratings(to_target, loss=None):
    """A rating regressor whose ratings come from the data as integers (``to_target`` maps them)."""
    torch.manual_seed(0)
    model = RatingRegressor()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loss_fn = loss or nn.HuberLoss(delta=1.0)
    user, item = torch.randint(0, 20, (16,)), torch.randint(0, 30, (16,))
    stars = torch.from_numpy(np.random.default_rng(0).integers(1, 6, size=16))  # int64 from the ratings file
    for _ in range(2):
        optimizer.zero_grad()
        loss = loss_fn(model(user, item), to_target(stars))  # RATING LOSS
        loss.backward()
        optimizer.step()
    return loss


def regress_ratings_as_integers():
    return regress_ratings(lambda stars: stars)


def regress_ratings_as_floats():
    return regress_ratings(lambda stars: stars.float())


def regress_ratings_as_integers_with_mse():
    return regress_ratings(lambda stars: stars, loss=nn.MSELoss())


def rate_classes_as_integers():
    """The same ratings as five classes: cross_entropy takes the integer targets as they are."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    user = torch.randint(0, 20, (16,))
    stars = torch.from_numpy(np.random.default_rng(0).integers(1, 6, size=16))
    for _ in range(2):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(user), stars - 1) + F.nll_loss(model(user).log_softmax(-1), stars - 1)
        loss.backward()
        optimizer.step()
    return loss


def multilabel(targets, steps=2):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 5)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(x), targets)
        loss.backward()
        optimizer.step()
    return loss


def multilabel_int64_targets():
    return multilabel(torch.tensor([[1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 1, 0]]))


def multilabel_float_targets():
    return multilabel(torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0], [0, 1, 0]]))


class SideFeatures(nn.Module):
    """Learned features concatenated with hand-made side features."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(5, 6)
        self.head = nn.Linear(8, 1)

    def forward(self, x, side):
        h = torch.cat([torch.relu(self.encode(x)), side], dim=-1)
        return self.head(h).squeeze(-1)


def side_features(side, steps=2):
    torch.manual_seed(0)
    model = SideFeatures()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 5), torch.randn(4)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((model(x, side) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
    return loss


def side_features_numpy():
    return side_features(torch.from_numpy(np.ones((4, 2))))  # float64


def side_features_float32():
    return side_features(torch.ones(4, 2))


class PickTokens(nn.Module):
    """Scores a sequence, then picks the scores at given positions (pooling by index)."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(4, 1)

    def forward(self, x, positions):
        scores = self.score(x).squeeze(-1)
        return scores[:, positions]


def pick_tokens(positions, steps=2):
    torch.manual_seed(0)
    model = PickTokens()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 6, 4)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(x, positions).pow(2).mean()
        loss.backward()
        optimizer.step()
    return loss


def pick_tokens_float_positions():
    return pick_tokens(torch.linspace(0, 5, 3))  # positions computed as floats


def pick_tokens_int_positions():
    return pick_tokens(torch.tensor([0, 2, 5], dtype=torch.int32))


def pick_tokens_mask():
    return pick_tokens(torch.tensor([True, False, True, False, False, True]))


def gather_log_probs(steps=3):
    """Negative log-likelihood written by hand with gather, the labels as int32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(6, 5)
    labels = torch.tensor([0, 1, 2, 3, 1, 0], dtype=torch.int32)
    for _ in range(steps):
        optimizer.zero_grad()
        log_probs = model(x).log_softmax(-1)
        picked = log_probs.gather(1, labels[:, None])
        counts = torch.zeros(4).scatter_add(0, labels, torch.ones(6))
        loss = -(picked.squeeze(1) / counts[labels]).mean()
        loss.backward()
        optimizer.step()
    return loss


def embed_int32_ids(steps=2):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(ids).pow(2).mean()
        loss.backward()
        optimizer.step()
    return loss


# -- devices -----------------------------------------------------------------------------------


class LearnedPositions(nn.Module):
    """Position embeddings looked up with a non-persistent ``position_ids`` buffer."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 4))
        self.register_buffer("position_ids", torch.arange(16), persistent=False)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        positions = self.table[self.position_ids[: x.shape[1]]]
        return self.out(x + positions).squeeze(-1)


def materialised_from_meta(steps=2):
    """Built on the meta device, then loaded with ``assign=True``: the parameters come from the
    state dict, but the non-persistent buffer is not in it and stays on meta."""
    torch.manual_seed(0)
    state = LearnedPositions().state_dict()
    with torch.device("meta"):
        model = LearnedPositions()
    model.load_state_dict(state, assign=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 5, 4)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
    return loss


def cpu_positions_into_meta_table():
    """Indices on the CPU into a tensor on another device are legal."""
    table = torch.randn(16, 4, device="meta")
    positions = torch.arange(5)
    return table[positions] * 2


def learned_positions_healthy(steps=2):
    torch.manual_seed(0)
    model = LearnedPositions()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 5, 4)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
    return loss


# -- composite modules that check their arguments before any op --------------------------------


class Tagger(nn.Module):
    def __init__(self, cell=nn.LSTM):
        super().__init__()
        self.rnn = cell(4, 8, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x, state=None):
        hidden, _ = self.rnn(x, state) if state is not None else self.rnn(x)
        return self.out(hidden)


def _initial_state(cell, make):
    h = make(torch.zeros(1, 2, 8))
    return (h, make(torch.zeros(1, 2, 8))) if cell is nn.LSTM else h


def tag(cell=nn.LSTM, make_state=None, inputs=None, steps=2):
    torch.manual_seed(0)
    model = Tagger(cell)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 5, 4) if inputs is None else inputs
    labels = torch.randint(0, 3, (2, 5))
    for _ in range(steps):
        optimizer.zero_grad()
        state = _initial_state(cell, make_state) if make_state is not None else None
        logits = model(x, state)
        loss = F.cross_entropy(logits.reshape(-1, 3), labels.reshape(-1))
        loss.backward()
        optimizer.step()
    return loss


def classify_numpy_images(steps=1):
    """Images straight from a numpy pipeline: float64 into a float32 conv net."""
    torch.manual_seed(0)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    images = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 3, 8, 8)))
    labels = torch.tensor([0, 1])
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
    return loss


def classify_under_autocast(steps=2):
    torch.manual_seed(0)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    images, labels = _images(4), torch.tensor([0, 1, 2, 3])
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            stem = model.stem(images)
            logits = model.head(model.stage(stem).mean((2, 3)))
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        optimizer.step()
    return loss


class BagRecommender(nn.Module):
    """Items a user clicked, pooled by an EmbeddingBag weighted by dwell time, scored by a head."""

    def __init__(self, items=50, dim=8):
        super().__init__()
        self.items = nn.EmbeddingBag(items, dim, mode="sum")
        self.head = nn.Linear(dim, 1)

    def forward(self, clicks, offsets, dwell):
        return self.head(self.items(clicks, offsets, per_sample_weights=dwell)).squeeze(-1)


def _clicks():
    clicks = torch.tensor([1, 7, 3, 9, 9, 4, 12, 30])
    offsets = torch.tensor([0, 3, 5])
    return clicks, offsets


def recommend_half_with_float_dwell(steps=1):
    """A half-precision recommender given dwell times as float32 (torch raises at the bag)."""
    torch.manual_seed(0)
    model = BagRecommender().half()
    clicks, offsets = _clicks()
    dwell = torch.rand(8)  # float32 from the logging pipeline
    for _ in range(steps):
        scores = model(clicks, offsets, dwell)
    return scores


def recommend_half_with_half_dwell(steps=2):
    """The healthy twin: dwell times cast to the model's dtype, trained for a few steps."""
    torch.manual_seed(0)
    model = BagRecommender().half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    clicks, offsets = _clicks()
    dwell = torch.rand(8).half()
    target = torch.ones(3, dtype=torch.half)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(model(clicks, offsets, dwell), target)
        loss.backward()
        optimizer.step()
    return loss


class CodebookQuantizer(nn.Module):
    """wav2vec2's quantizer in small: a codebook parameter made with torch.FloatTensor, mixed
    with the half-precision model's probabilities, cast back two lines later."""

    def __init__(self, groups=2, codes=4, dim=6):
        super().__init__()
        self.codevectors = nn.Parameter(torch.FloatTensor(1, groups * codes, dim).uniform_())
        self.proj = nn.Linear(dim, groups * codes)
        self.groups, self.codes = groups, codes

    def forward(self, hidden):
        probs = self.proj(hidden).softmax(-1)
        vectors = probs.unsqueeze(-1) * self.codevectors
        vectors = vectors.view(hidden.shape[0], self.groups, self.codes, -1).sum(-2)
        return vectors.flatten(1).type_as(hidden)


def quantize_half_with_float_codebook():
    torch.manual_seed(0)
    model = CodebookQuantizer()
    model.proj.half()  # the model runs in half; the codebook stayed float32
    return model(torch.randn(3, 6, dtype=torch.half))
