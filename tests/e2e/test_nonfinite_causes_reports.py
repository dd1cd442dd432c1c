"""Causes of nan/inf origins on bugs from real reports (issue 39), each rule with code that must
show it and a healthy twin that must not:

- a token classifier whose batch has every label ignored (``ignore_index=-100``): nll_loss's
  mean is 0 / 0, said so, with no learning-rate fix;
- data holding nan that reached torch through ``torch.from_numpy`` / ``torch.tensor(array)`` /
  a DataLoader: cause ``input``, not ``deliberate``; a nan placeholder the program writes
  (``full(nan)``, ``x[i] = nan``) stays ``deliberate``;
- a checkpoint with nan weights: found where the weight first feeds an op, cause ``weights``,
  naming the parameter and that it came from the loaded state;
- underflow chains (a float32 Sinkhorn, a mixture density network): the op where the value went
  to 0 is named, cause ``precision``; the log-domain Sinkhorn reports nothing;
- a float16 VAE decoder whose convolution overflows: cause ``precision``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import opwatch
from opwatch.checks.nonfinite.cause import DELIBERATE, INPUT, MATH, PRECISION, WEIGHTS
from opwatch.storage.jsonl import load
from support.helpers import line_of


def nonfinite(w):
    return [a for a in w.anomalies if a.kind in ("nan", "inf")]


def cause_line(anomaly) -> str:
    (line,) = [line for line in anomaly.message.splitlines() if line.startswith("  cause:")]
    return line


def fix_line(anomaly) -> str:
    (line,) = [line for line in anomaly.message.splitlines() if line.startswith("  fix:")]
    return line


# --------------------------------------------------------------------------------------------
# every target ignored: nll_loss's mean is 0 / 0
# --------------------------------------------------------------------------------------------


class Tagger(nn.Module):
    """A token classifier (NER, part of speech): embeddings, a GRU, a linear head."""

    def __init__(self, vocab=50, dim=16, tags=5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, tags)

    def forward(self, tokens):
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(hidden)


def train_tagger(batches):
    torch.manual_seed(0)
    model = Tagger()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = opwatch.watch(warn=False, dump_on_error=False)
    with w:
        for tokens, labels in batches:
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)  # marker: tagger loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return w


def tagger_batches(labelled_last: bool):
    torch.manual_seed(1)
    tokens = torch.randint(1, 50, (4, 7))
    labels = torch.randint(0, 5, (4, 7))
    labels[:, 5:] = -100  # padding
    last = torch.full((4, 7), -100)  # a batch of prompts only: every label masked out
    if labelled_last:
        last[0, 0] = 2
    return [(tokens, labels), (tokens, last)]


def test_a_batch_whose_every_label_is_ignored_says_the_mean_divided_by_zero(tmp_path):
    w = train_tagger(tagger_batches(labelled_last=False))
    first, *_ = nonfinite(w)
    assert first.op == "aten.nll_loss_forward.default" and first.kind == "nan"
    assert first.lineno == line_of("marker: tagger loss", __file__)
    cause = first.finding.facts["cause"]
    assert cause.kind == MATH and cause.detail == "all_ignored" and cause.constant == -100
    assert cause_line(first) == "  cause:    undefined math: every target was ignore_index (-100): the mean divided a sum of 0 by a count of 0, 0 / 0 = nan"
    assert "learning rate" not in fix_line(first)
    assert "skip the loss of such a batch" in fix_line(first)
    w.export_jsonl(tmp_path / "tagger.jsonl")
    (loaded, *_) = [a for a in load(tmp_path / "tagger.jsonl").anomalies if a.kind == "nan"]
    assert loaded.finding.facts["cause"] == cause and cause_line(loaded) == cause_line(first)


def test_a_batch_with_one_label_left_reports_nothing():
    w = train_tagger(tagger_batches(labelled_last=True))
    assert w.anomalies == [], [a.message for a in w.anomalies]


def test_class_weights_of_zero_for_every_target_counted_are_named():
    torch.manual_seed(0)
    logits = torch.randn(6, 4, requires_grad=True)
    target = torch.tensor([1, 1, 3, -100, 3, 1])
    weight = torch.tensor([1.0, 0.0, 2.0, 0.0])  # classes 1 and 3 switched off
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        F.cross_entropy(logits, target, weight=weight, ignore_index=-100).backward()
    # The loss (not kept: backward() ran on it) and its gradient each made nan: 0 / 0 twice.
    first, second = nonfinite(w)
    assert (first.op, second.op) == ("aten.nll_loss_forward.default", "aten.nll_loss_backward.default")
    for found in (first, second):
        assert found.finding.facts["cause"].detail == "zero_weight"
        assert "of a class of weight 0" in cause_line(found) and "learning rate" not in fix_line(found)
    assert first.finding.facts["reached_backward"] and second.finding.facts["reached_gradient"]


# --------------------------------------------------------------------------------------------
# data that came with nan: input, not deliberate
# --------------------------------------------------------------------------------------------


def housing_table(missing: bool) -> np.ndarray:
    """A numeric table as pandas hands it over (``df.to_numpy()``): features, then the price."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(32, 5)).astype(np.float32)
    if missing:
        table[7, 2] = np.nan  # a missing value left in the frame
    return table


def fit_regressor(table, to_tensor):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        data = to_tensor(table)  # TABLE TO TORCH
        features, price = data[:, :4], data[:, 4:]
        for _ in range(2):
            loss = F.mse_loss(model(features), price)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return w


@pytest.mark.parametrize("to_tensor", [torch.from_numpy, torch.tensor, torch.as_tensor], ids=["from_numpy", "tensor", "as_tensor"])
def test_a_table_with_a_missing_value_is_input_with_a_fix_about_the_data(to_tensor, tmp_path):
    w = fit_regressor(housing_table(missing=True), to_tensor)
    (anomaly,) = nonfinite(w)
    assert anomaly.op == "aten.lift_fresh.default" and anomaly.lineno == line_of("# TABLE TO TORCH", __file__)
    cause = anomaly.finding.facts["cause"]
    assert cause.kind == INPUT and cause.detail == "data" and cause.held == "nan"
    assert cause_line(anomaly).startswith("  cause:    input: the data f32[32, 5] cpu already held nan when it came into torch here")
    assert "deliberate" not in anomaly.message and "placeholder" not in anomaly.message
    assert "torch.isfinite(x).all() in the dataset's __getitem__ or the collate_fn" in fix_line(anomaly)
    w.export_jsonl(tmp_path / "table.jsonl")
    (loaded,) = [a for a in load(tmp_path / "table.jsonl").anomalies if a.kind == "nan"]
    assert loaded.finding.facts["cause"] == cause and loaded.message == anomaly.message


def test_the_same_table_without_missing_values_reports_nothing():
    w = fit_regressor(housing_table(missing=False), torch.from_numpy)
    assert w.anomalies == [], [a.message for a in w.anomalies]


class RasterTiles(Dataset):
    """Elevation tiles of a geospatial raster, read as numpy arrays (rasterio's ``read()``), with
    their nodata pixels turned into nan as rasterio's masked reads do."""

    def __init__(self, nodata_in: int | None):
        rng = np.random.default_rng(1)
        self.tiles = rng.uniform(100, 900, size=(8, 1, 16, 16)).astype(np.float32)
        if nodata_in is not None:
            self.tiles[nodata_in, 0, :3, :5] = np.nan  # the edge of the survey
        self.labels = rng.integers(0, 3, size=8)

    def __len__(self):
        return len(self.tiles)

    def __getitem__(self, index):
        return self.tiles[index], int(self.labels[index])  # the default collate lifts the arrays


def classify_tiles(dataset):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for tiles, labels in DataLoader(dataset, batch_size=4):  # THE LOADER
            loss = F.cross_entropy(model((tiles - 500.0) / 200.0), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return w


def test_nodata_pixels_of_a_raster_loaded_by_a_dataloader_are_input():
    w = classify_tiles(RasterTiles(nodata_in=5))
    first, *_ = nonfinite(w)
    assert first.op == "aten.lift_fresh.default" and first.lineno == line_of("# THE LOADER", __file__)
    assert first.finding.facts["cause"].kind == INPUT and first.finding.facts["cause"].detail == "data"
    assert "a DataLoader's collate" in cause_line(first)


def test_raster_tiles_without_nodata_report_nothing():
    w = classify_tiles(RasterTiles(nodata_in=None))
    assert w.anomalies == [], [a.message for a in w.anomalies]


def impute_and_fit(leak: bool):
    """Sensor readings gathered into a table the program fills: nan where no reading came
    (``full(nan)``), then ``x[i] = nan`` for a reading known bad; the loss takes the readings
    present only, unless ``leak``."""
    torch.manual_seed(0)
    model = nn.Linear(6, 6)
    readings = {0: [0.5, 0.1, 0.3], 1: [0.2, 0.9], 3: [0.4, 0.4, 0.8, 0.1]}
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        table = torch.full((4, 6), float("nan"))  # PLACEHOLDER
        for row, values in readings.items():
            table[row, : len(values)] = torch.tensor(values)
        table[3, 2] = float("nan")  # a reading known bad
        present = ~table.isnan()
        prediction = model(torch.nan_to_num(table))
        if leak:
            loss = (prediction - table).pow(2).mean()
        else:
            loss = (prediction[present] - table[present]).pow(2).mean()
        loss.backward()
    return w


def test_a_placeholder_table_the_program_fills_and_masks_reports_nothing():
    w = impute_and_fit(leak=False)
    assert w.anomalies == [], [a.message for a in w.anomalies]


def test_a_placeholder_nan_the_program_wrote_that_reaches_the_loss_stays_deliberate():
    w = impute_and_fit(leak=True)
    (anomaly,) = nonfinite(w)
    assert anomaly.op == "aten.full.default" and anomaly.lineno == line_of("# PLACEHOLDER", __file__)
    cause = anomaly.finding.facts["cause"]
    assert (cause.kind, cause.detail) == (DELIBERATE, "nan_constant")
    assert cause_line(anomaly).startswith("  cause:    deliberate: the program wrote this nan itself")


# --------------------------------------------------------------------------------------------
# a checkpoint holding nan: weights, found where the weight first feeds the forward
# --------------------------------------------------------------------------------------------


class SurvivalNet(nn.Module):
    """A DeepSurv-style risk model: an MLP scoring each patient's log-risk."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.risk = nn.Linear(16, 1)

    def forward(self, x):
        return self.risk(self.body(x)).squeeze(-1)  # SCORE


def cox_loss(risk, time, event):
    """The negative Cox partial log-likelihood, patients sorted by descending time."""
    order = time.argsort(descending=True)
    risk, event = risk[order], event[order]
    return -((risk - risk.logcumsumexp(0)) * event).sum() / event.sum().clamp_min(1)


def save_checkpoint(path, poisoned: bool):
    torch.manual_seed(0)
    trained = SurvivalNet()
    if poisoned:
        with torch.no_grad():
            trained.body[2].weight[4, :3] = float("nan")  # what a diverged run saved
    torch.save({"model": trained.state_dict(), "epoch": 7}, path)


def resume_and_train(path):
    torch.manual_seed(1)
    model = SurvivalNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, time, event = torch.randn(24, 12), torch.rand(24) * 10, (torch.rand(24) > 0.3).float()
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        checkpoint = torch.load(path, weights_only=True)
        model.load_state_dict(checkpoint["model"])  # RESUME
        loss = cox_loss(model(x), time, event)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return w


def test_a_checkpoint_holding_nan_is_found_at_the_forward_with_cause_weights_loaded(tmp_path):
    path = tmp_path / "deepsurv.pt"
    save_checkpoint(path, poisoned=True)
    w = resume_and_train(path)
    first, *_ = nonfinite(w)
    assert first.op == "aten.addmm.default" and first.lineno == line_of("# SCORE", __file__)
    assert first.record.module.startswith("body.2")
    cause = first.finding.facts["cause"]
    assert cause.kind == WEIGHTS and cause.held == "nan"
    assert (cause.made.how, cause.made.path, cause.made.name, cause.made.cls) == ("parameter", "body.2", "weight", "Linear")
    assert cause.loaded is not None and cause.loaded.lineno == line_of("# RESUME", __file__)
    line = cause_line(first)
    assert line.startswith("  cause:    weights: parameter f32[16, 32] cpu already held nan when addmm ran")
    assert "it came from the loaded state" in line and "unknown" not in line
    assert "the checkpoint holds nan" in fix_line(first) and "learning rate" not in fix_line(first)
    w.export_jsonl(tmp_path / "resume.jsonl")
    loaded, *_ = [a for a in load(tmp_path / "resume.jsonl").anomalies if a.kind == "nan"]
    assert loaded.message == first.message


def test_a_finite_checkpoint_reports_nothing(tmp_path):
    path = tmp_path / "deepsurv.pt"
    save_checkpoint(path, poisoned=False)
    w = resume_and_train(path)
    assert w.anomalies == [], [a.message for a in w.anomalies]


# --------------------------------------------------------------------------------------------
# a float16 VAE decoder whose convolution overflows: precision
# --------------------------------------------------------------------------------------------


class ResnetBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(8, channels), nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(8, channels), nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        return x + self.conv2(F.silu(self.norm2(h)))


class VAEDecoder(nn.Module):
    """The shape of diffusers' AutoencoderKL decoder, small: conv_in, a resnet block, two
    upsampling stages (nearest, then a convolution), conv_out."""

    def __init__(self, latent=4, channels=32):
        super().__init__()
        self.conv_in = nn.Conv2d(latent, channels, 3, padding=1)
        self.mid = ResnetBlock(channels)
        self.up = nn.ModuleList([nn.Conv2d(channels, channels, 3, padding=1) for _ in range(2)])
        self.norm_out, self.conv_out = nn.GroupNorm(8, channels), nn.Conv2d(channels, 3, 3, padding=1)

    def forward(self, z):
        h = self.mid(self.conv_in(z))
        for conv in self.up:
            h = conv(F.interpolate(h, scale_factor=2.0, mode="nearest"))  # UPSAMPLE CONV
        return self.conv_out(F.silu(self.norm_out(h)))


def decode(dtype):
    """Decode a latent with a decoder whose late activations run large (as SDXL's VAE does,
    the reason diffusers sets force_upcast): fine in float32, past 65504 in float16."""
    torch.manual_seed(0)
    decoder = VAEDecoder()
    with torch.no_grad():
        for conv in decoder.up:
            conv.weight.mul_(1000.0)
    decoder = decoder.to(dtype)
    latents = torch.randn(1, 4, 8, 8)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        with torch.no_grad():
            image = decoder(latents.to(dtype))
        pixels = (image.float() / 2 + 0.5).clamp(0, 1)
        pixels.mean().item()
    return w


def test_a_float16_vae_decoder_whose_convolution_overflows_is_a_precision_cause():
    w = decode(torch.float16)
    first, *_ = nonfinite(w)
    assert first.op == "aten.convolution.default" and first.kind == "inf"
    assert first.lineno == line_of("# UPSAMPLE CONV", __file__)
    cause = first.finding.facts["cause"]
    assert cause.kind == PRECISION and cause.dtype == torch.float16 and cause.wider == torch.float32 and cause.bound
    assert cause.largest > torch.finfo(torch.float16).max
    assert cause_line(first).startswith("  cause:    precision: convolution made inf in f16; its inputs' ranges bound its result by")
    assert "force_upcast" in fix_line(first) and "learning rate" not in fix_line(first)


def test_the_same_decoder_upcast_to_float32_reports_nothing():
    w = decode(torch.float32)  # what force_upcast does
    assert w.anomalies == [], [a.message for a in w.anomalies]


# --------------------------------------------------------------------------------------------
# underflow chains: the op where the value went to 0, not the op that divided by it
# --------------------------------------------------------------------------------------------


def sinkhorn_distance(x, y, eps=0.1, iters=30):
    """Entropic optimal transport between two point clouds, as often written (POT's
    ``sinkhorn_knopp``): the Gibbs kernel ``exp(-C / eps)`` in the points' dtype."""
    cost = torch.cdist(x, y) ** 2
    kernel = torch.exp(-cost / eps)  # GIBBS KERNEL
    a = torch.full((x.shape[0],), 1.0 / x.shape[0], dtype=x.dtype)
    b = torch.full((y.shape[0],), 1.0 / y.shape[0], dtype=y.dtype)
    u = torch.ones_like(a)
    for _ in range(iters):
        v = b / (kernel.T @ u)  # SINKHORN COLUMN UPDATE
        u = a / (kernel @ v)
    plan = u[:, None] * kernel * v[None, :]
    return (plan * cost).sum()


def log_sinkhorn_distance(x, y, eps=0.1, iters=30):
    """The same in the log domain: logsumexp instead of exp and matrix products."""
    cost = torch.cdist(x, y) ** 2
    log_a = torch.full((x.shape[0],), -math.log(x.shape[0]), dtype=x.dtype)
    log_b = torch.full((y.shape[0],), -math.log(y.shape[0]), dtype=y.dtype)
    f, g = torch.zeros_like(log_a), torch.zeros_like(log_b)
    for _ in range(iters):
        g = eps * (log_b - torch.logsumexp((f[:, None] - cost) / eps, dim=0))
        f = eps * (log_a - torch.logsumexp((g[None, :] - cost) / eps, dim=1))
    plan = torch.exp((f[:, None] + g[None, :] - cost) / eps)
    return (plan * cost).sum()


def point_clouds():
    torch.manual_seed(0)
    return torch.randn(16, 2), torch.randn(16, 2) + 4  # two clouds some distance apart


def test_a_float32_sinkhorn_whose_kernel_column_underflows_names_the_exp(tmp_path):
    x, y = point_clouds()
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        distance = sinkhorn_distance(x, y)
        distance.item()
    first, *_ = nonfinite(w)
    assert first.op == "aten.div.Tensor" and first.kind == "inf" and first.lineno == line_of("# SINKHORN COLUMN UPDATE", __file__)
    cause = first.finding.facts["cause"]
    assert cause.kind == PRECISION and cause.went_to == "0" and cause.dtype == torch.float32 and cause.wider == torch.float64
    assert cause.went.op == "aten.exp.default" and cause.went.lineno == line_of("# GIBBS KERNEL", __file__)
    assert 0 < cause.largest < torch.finfo(torch.float32).tiny
    line = cause_line(first)
    assert line.startswith(f"  cause:    precision: exp underflowed to 0 in f32 at {__file__}:{line_of('# GIBBS KERNEL', __file__)}")
    assert "and div made inf of it" in line and "undefined math" not in line
    assert "logsumexp" in fix_line(first) and "add an epsilon" not in fix_line(first)
    # the same computation in float64 is finite: the chain, not the division, is the cause
    assert math.isfinite(sinkhorn_distance(x.double(), y.double()).item())
    w.export_jsonl(tmp_path / "sinkhorn.jsonl")
    loaded, *_ = [a for a in load(tmp_path / "sinkhorn.jsonl").anomalies if a.kind == "inf"]
    assert loaded.finding.facts["cause"] == cause and loaded.message == first.message


def test_a_log_domain_sinkhorn_reports_nothing():
    x, y = point_clouds()
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        distance = log_sinkhorn_distance(x, y)
        distance.item()
    assert math.isfinite(distance.item()) and w.anomalies == [], [a.message for a in w.anomalies]


def test_division_by_an_exact_zero_stays_undefined_math():
    """A zero that no underflow made (a count of an empty mask as a float): nothing to run
    again in float64 makes it finite."""
    values, mask = torch.randn(4, 5), torch.zeros(4, 5)
    mask[0] = 1.0
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        pooled = (values * mask).sum(1) / mask.sum(1)
        pooled.sum().item()
    first, *_ = nonfinite(w)
    assert first.finding.facts["cause"].kind == MATH and first.finding.facts["cause"].went is None


class MixtureDensityNetwork(nn.Module):
    """Bishop's mixture density network: for each input, K Gaussians over a 31-dim target."""

    def __init__(self, features=8, dims=31, components=5):
        super().__init__()
        self.dims, self.components = dims, components
        self.body = nn.Sequential(nn.Linear(features, 64), nn.Tanh())
        self.logits = nn.Linear(64, components)
        self.mean = nn.Linear(64, components * dims)
        self.log_std = nn.Linear(64, components * dims)

    def forward(self, x):
        h = self.body(x)
        shape = (x.shape[0], self.components, self.dims)
        return self.logits(h).softmax(-1), self.mean(h).view(shape), self.log_std(h).view(shape).exp().clamp_min(1.0)  # a floor on the spread


def mdn_nll_by_densities(weights, mean, std, y):
    """The likelihood as written from the formula: the product of the per-dim densities."""
    z = (y[:, None, :] - mean) / std
    densities = torch.exp(-0.5 * z**2) / (std * math.sqrt(2 * math.pi))
    likelihood = (weights * densities.prod(-1)).sum(-1)  # PRODUCT OF DENSITIES
    return -torch.log(likelihood).mean()  # LOG LIKELIHOOD


def mdn_nll_by_logs(weights, mean, std, y):
    """The same in the log domain: sum the log-densities, logsumexp over the components."""
    z = (y[:, None, :] - mean) / std
    log_densities = -0.5 * z**2 - std.log() - 0.5 * math.log(2 * math.pi)
    return -torch.logsumexp(weights.log() + log_densities.sum(-1), dim=-1).mean()


def fit_mdn(nll):
    torch.manual_seed(0)
    model = MixtureDensityNetwork()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(32, 8)
    y = torch.randn(32, 31) * 2.5  # targets spread wider than the untrained components
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for _ in range(2):
            loss = nll(*model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return w


def test_a_mixture_density_network_whose_product_of_densities_underflows_names_the_product():
    w = fit_mdn(mdn_nll_by_densities)
    first, *_ = nonfinite(w)
    assert first.op == "aten.log.default" and first.kind == "inf" and first.lineno == line_of("# LOG LIKELIHOOD", __file__)
    cause = first.finding.facts["cause"]
    assert cause.kind == PRECISION and cause.went_to == "0", cause
    assert cause.went.lineno == line_of("# PRODUCT OF DENSITIES", __file__) and cause.went.op.startswith("aten.prod")
    assert "underflowed to 0 in f32" in cause_line(first) and "and log made inf of it" in cause_line(first)
    assert "undefined math" not in cause_line(first)


def test_a_mixture_density_network_in_the_log_domain_reports_nothing():
    w = fit_mdn(mdn_nll_by_logs)
    assert w.anomalies == [], [a.message for a in w.anomalies]


# -- an inf that came in with a tensor made before the watch: data, or a module's mask --------


class FeatureRegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(6, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x))).squeeze(-1)  # FEATURE REGRESSOR


def train_on_features(features, tmp_path=None):
    """SGD over the table ``features`` in batches of 8: a tensor made before the watch, or a
    NumPy array made into one inside it, as a whole script under ``python -m opwatch`` does (a
    dataset read with NumPy at the top)."""
    torch.manual_seed(0)
    model = FeatureRegressor()
    optimizer = torch.optim.SGD(model.parameters(), 1e-2)
    lifted = isinstance(features, np.ndarray)
    if lifted:
        targets = torch.from_numpy(np.nan_to_num(features, nan=0, posinf=0, neginf=0).sum(-1))
    else:
        targets = features.nan_to_num(0, 0, 0).sum(-1)
    w = opwatch.watch(warn=False, dump_on_error=False)
    with w:
        if lifted:
            features = torch.from_numpy(features)  # THE TABLE COMES INTO TORCH
        for start in range(0, len(features), 8):
            loss = F.mse_loss(model(features[start:start + 8]), targets[start:start + 8])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    if tmp_path is not None:
        w.export_jsonl(tmp_path / "run.jsonl")
    return w


def test_an_inf_a_batch_brought_that_a_linear_turns_to_nan_is_not_called_a_mask(tmp_path):
    """A table whose one feature is a ratio divided by a zero count (+inf), made before the
    watch: the first Linear carries the inf, the second sums inf of both signs into nan. The inf
    came in with the batch; it is not told as a masking constant, and the fix names the data."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(32, 6, generator=generator)
    features[3, 2] = torch.tensor(1.0) / torch.tensor(0.0)  # a ratio over a zero count: +inf
    w = train_on_features(features, tmp_path)
    (first, *_) = nonfinite(w)
    cause = first.finding.facts["cause"]
    assert first.kind == "nan" and cause.kind == MATH and cause.detail == "entered_inf", cause
    assert tuple(cause.tensor.shape) == (8, 6) and cause.made.how == "before_watch", cause
    line = cause_line(first)
    assert "an inf that came in with f32[8, 6] cpu, made before the watch" in line and "masking" not in line, line
    assert "torch.isfinite(batch).all()" in fix_line(first), fix_line(first)
    assert "masked_fill" not in first.message.split("  fix:")[0], first.message  # the problem names no mask either
    (saved, *_) = [a for a in load(tmp_path / "run.jsonl").anomalies if a.kind == "nan"]
    assert saved.finding.facts["cause"] == cause  # the cause survives the JSON Lines round trip


def a_table_with_a_zero_scale(zero: bool) -> np.ndarray:
    """Features divided by a per-row scale read with the data; with ``zero``, one row's scale
    is 0 and its features turn to inf of both signs."""
    generator = np.random.default_rng(0)
    raw = generator.standard_normal((32, 6)).astype(np.float32)
    scale = np.abs(raw[:, :1]) + 0.5
    if zero:
        scale[3] = 0.0
    with np.errstate(divide="ignore"):
        return raw / scale


def test_an_inf_numpy_data_brought_into_the_watch_is_not_called_a_mask(tmp_path):
    """Before, an inf in an array that came into torch under the watch counted as a masking
    constant: ``a masking -inf met another one or a 0``, fix ``zero the masked entries``. The
    inf came in with the data: both are told, with where the data came into torch."""
    w = train_on_features(a_table_with_a_zero_scale(zero=True), tmp_path)
    (first, *_) = nonfinite(w)
    cause = first.finding.facts["cause"]
    assert first.kind == "nan" and cause.kind == MATH and cause.detail == "entered_inf", cause
    assert tuple(cause.tensor.shape) == (32, 6) and cause.made.how == "made_by", cause
    made_at = f"{__file__}:{line_of('# THE TABLE COMES INTO TORCH', __file__)}"
    assert f"an inf that came in with f32[32, 6] cpu, Python or NumPy data that came into torch at {made_at}" in cause_line(first)
    assert "masking" not in cause_line(first), cause_line(first)
    assert f"it held inf when it came into torch at {made_at}" in fix_line(first) and "np.isfinite(array).all()" in fix_line(first)
    assert "infs that came in with Python or NumPy data (a mask, or data holding inf)" in first.message.split("  cause:")[0], first.message
    (saved, *_) = [a for a in load(tmp_path / "run.jsonl").anomalies if a.kind == "nan"]
    assert saved.finding.facts["cause"] == cause and saved.message == first.message


def test_the_same_numpy_table_with_no_zero_scale_reports_nothing():
    assert nonfinite(train_on_features(a_table_with_a_zero_scale(zero=False))) == []


def test_the_same_table_without_the_zero_count_reports_nothing():
    generator = torch.Generator().manual_seed(0)
    assert nonfinite(train_on_features(torch.randn(32, 6, generator=generator))) == []


class BufferedMaskAttention(nn.Module):
    """A causal mask of -inf registered as a buffer in ``__init__`` (made before the watch),
    with one row masked whole by mistake."""

    def __init__(self):
        super().__init__()
        self.query = nn.Linear(8, 8)
        mask = torch.full((4, 4), float("-inf")).triu(1)
        mask[2] = float("-inf")  # every key of query 2 masked
        self.register_buffer("mask", mask)

    def forward(self, x):
        scores = self.query(x) @ x.transpose(-1, -2) + self.mask
        return scores.softmax(-1) @ x  # MASKED SOFTMAX


class NumpyMaskAttention(BufferedMaskAttention):
    """The same mask built in NumPy when the module is made (under the watch, as a whole script
    under ``python -m opwatch`` makes it), kept as a buffer."""

    def __init__(self):
        super().__init__()
        mask = np.triu(np.full((4, 4), -np.inf, dtype=np.float32), 1)
        mask[2] = -np.inf  # every key of query 2 masked
        self.register_buffer("mask", torch.from_numpy(mask))


def test_a_module_s_mask_built_in_numpy_under_the_watch_stays_a_mask():
    torch.manual_seed(0)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        model = NumpyMaskAttention()
        model(torch.randn(4, 8)).sum().backward()
    (first, *_) = nonfinite(w)
    cause = first.finding.facts["cause"]
    assert first.op == "aten._softmax.default" and cause.kind == MATH and cause.detail == "masked", cause


def test_a_module_s_mask_made_before_the_watch_stays_a_mask():
    torch.manual_seed(0)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        BufferedMaskAttention()(torch.randn(4, 8)).sum().backward()
    (first, *_) = nonfinite(w)
    cause = first.finding.facts["cause"]
    assert first.op == "aten._softmax.default" and cause.kind == MATH and cause.detail == "masked", cause
    assert "a masking -inf met another one or a 0" in cause_line(first)


# -- too few values: a mean over none, a variance over one -------------------------------------


def train_two_tasks(empty_at: int | None):
    """A model with two heads; task b is labelled on a random half of each batch's rows, and on
    none at step ``empty_at``: its loss is the mean over the labelled rows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for step in range(6):
            x, y_a, y_b = torch.randn(16, 8), torch.randn(16), torch.randn(16)
            labelled = torch.arange(16) % 2 == 0 if step != empty_at else torch.zeros(16, dtype=torch.bool)
            out = model(x)
            loss = F.mse_loss(out[:, 0], y_a) + F.mse_loss(out[labelled, 1], y_b[labelled])  # TASK B'S LOSS
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return w


def test_a_mean_over_rows_a_mask_left_empty_is_told_as_no_values_not_undecided():
    """Before: ``not decided: mse_loss could not be run again in a wider dtype``."""
    (first, *_) = nonfinite(train_two_tasks(empty_at=3))
    cause = first.finding.facts["cause"]
    assert (first.op, first.lineno) == ("aten.mse_loss.default", line_of("# TASK B'S LOSS", __file__))
    assert cause.kind == MATH and cause.detail == "empty_mean", cause
    assert "mse_loss averages its input, which holds no values" in cause_line(first), cause_line(first)
    assert "input f32[0] cpu: empty" in first.message and "skip this term when it has no values" in fix_line(first)


def test_the_same_two_tasks_with_rows_for_each_report_nothing():
    assert nonfinite(train_two_tasks(empty_at=None)) == []


class Features(Dataset):
    def __init__(self, count):
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.randn(count, 6, generator=generator)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def train_with_batch_statistics(count: int, drop_last: bool):
    """Each batch standardised by its own statistics, as a hand-written batch norm does."""
    torch.manual_seed(0)
    model = FeatureRegressor()
    optimizer = torch.optim.SGD(model.parameters(), 1e-2)
    with opwatch.watch(warn=False, dump_on_error=False) as w:
        for batch in DataLoader(Features(count), batch_size=8, drop_last=drop_last):
            batch = (batch - batch.mean(0)) / batch.std(0)  # STANDARDISED
            loss = model(batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return w


def test_the_spread_of_a_last_batch_of_one_is_told_as_too_few_values():
    (first, *_) = nonfinite(train_with_batch_statistics(count=17, drop_last=False))
    cause = first.finding.facts["cause"]
    assert (first.op, first.lineno) == ("aten.std.correction", line_of("# STANDARDISED", __file__))
    assert cause.kind == MATH and cause.detail == "too_few_for_spread", cause
    assert "drop_last=True" in fix_line(first), fix_line(first)


def test_the_same_loader_dropping_the_last_batch_reports_nothing():
    assert nonfinite(train_with_batch_statistics(count=17, drop_last=True)) == []
