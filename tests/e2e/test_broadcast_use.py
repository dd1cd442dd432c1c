"""The broadcast check judges some broadcasts by how their result is used: a pairwise table
combined with a tensor of its own shape is deliberate; a result that holds the batch size twice
(or whose column came from a keepdim reduction) and is reduced straight away to a loss is a bug."""

from __future__ import annotations

import inspect

import torch
from torch import nn

import opwatch


def line_of(function, text: str) -> int:
    lines, first = inspect.getsourcelines(function)
    matches = [first + number for number, line in enumerate(lines) if text in line]
    assert len(matches) == 1, (text, matches)
    return matches[0]


def train(loss_of, steps: int = 3):
    """A small scorer trained for a few steps with ``loss_of(model, batch)``; its anomalies."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(6, 8), torch.randn(6, 8), torch.randn(6, 5, 8)) for _ in range(steps)]
    with opwatch.watch() as w:
        for batch in batches:
            optimizer.zero_grad()
            loss = loss_of(model, batch)
            loss.backward()
            optimizer.step()
    return w


def margin_loss_needless_unsqueeze(model, batch, margin=1.0):
    query, positive, negatives = batch
    q = model(query)  # (B, D)
    scores_pos = (q * model(positive)).sum(-1)  # (B,)
    scores_neg = torch.einsum("bd,bkd->bk", q, model(negatives))  # (B, K)
    pos = scores_pos.unsqueeze(1).unsqueeze(2)  # (B, 1, 1): one unsqueeze too many
    return (margin - pos + scores_neg).clamp(min=0).mean()


def margin_loss(model, batch, margin=1.0):
    query, positive, negatives = batch
    q = model(query)
    scores_pos = (q * model(positive)).sum(-1)
    scores_neg = torch.einsum("bd,bkd->bk", q, model(negatives))
    pos = scores_pos.unsqueeze(1)  # (B, 1)
    return (margin - pos + scores_neg).clamp(min=0).mean()


def ranking_loss_needless_unsqueeze(model, batch, margin=1.0):
    """A pairwise margin-ranking loss (BPR-style): positive scores (B, 1) against negative
    scores (B,), a (B, B) table where row i should meet row i only."""
    query, positive, negatives = batch
    q = model(query)
    scores_pos = (q * model(positive)).sum(-1).unsqueeze(1)  # (B, 1)
    scores_neg = (q * model(negatives[:, 0])).sum(-1)  # (B,)
    return torch.relu(margin - scores_pos + scores_neg).mean()


def ranking_loss(model, batch, margin=1.0):
    query, positive, negatives = batch
    q = model(query)
    scores_pos = (q * model(positive)).sum(-1)  # (B,)
    scores_neg = (q * model(negatives[:, 0])).sum(-1)  # (B,)
    return torch.relu(margin - scores_pos + scores_neg).mean()


def ranking_loss_in_batch_negatives(model, batch, margin=1.0):
    """Every positive against every negative of the batch on purpose: None on both sides."""
    query, positive, negatives = batch
    q = model(query)
    scores_pos = (q * model(positive)).sum(-1)
    scores_neg = (q * model(negatives[:, 0])).sum(-1)
    return torch.relu(margin - scores_pos[:, None] + scores_neg[None, :]).mean()


def pairwise_rank_loss_one_list(model, batch):
    """A RankNet-style loss over one list of scores: every score against every other, written
    ``s[:, None] - s``; and a same-label mask ``labels[:, None] == labels``."""
    query, _, _ = batch
    scores = model(query).sum(-1)  # (B,)
    relevance = torch.arange(len(query)) % 3
    differences = scores[:, None] - scores  # (B, B): one set against itself
    preferred = (relevance[:, None] > relevance).float()
    same = (relevance.unsqueeze(1) == relevance).float().sum()
    return nn.functional.softplus(-differences).mul(preferred).sum() / preferred.sum().clamp_min(1) + 0 * same


def contrastive_loss(model, batch, temperature=0.5):
    """In-batch negatives: a (B, B) table of distances, unsqueeze on both sides, reduced to a
    loss straight away."""
    query, positive, _ = batch
    a, b = model(query), model(positive)
    distances = (a.unsqueeze(1) - b.unsqueeze(0)).pow(2).sum(-1)  # (B, B)
    scores = a.sum(-1).unsqueeze(1) * b.sum(-1).unsqueeze(0)  # (B, B)
    logits = -distances / temperature + 0.01 * scores
    return nn.functional.cross_entropy(logits, torch.arange(len(a))) + (scores.tanh()).mean()


def pairwise_distance(x, y):
    """torchmetrics' pairwise euclidean distance: (N, 1) norms plus (M,) norms next to an
    (N, M) matmul."""
    x_norm = (x * x).sum(1, keepdim=True)
    y_norm = (y * y).sum(1)
    return (x_norm + y_norm - 2 * x.mm(y.T)).clamp_min(0)


def prototype_loss(model, batch):
    """Prototype classification: every query against every prototype, a pairwise table."""
    query, positive, _ = batch
    prototypes = model(positive[:4])
    logits = -pairwise_distance(model(query), prototypes)  # (B, 4)
    return nn.functional.cross_entropy(logits, torch.arange(len(query)) % 4)


def self_distance_loss(model, batch):
    """The same table of a set against itself (torchmetrics with y=None), reduced to a loss."""
    query, _, _ = batch
    z = model(query)
    return pairwise_distance(z, z).mean()


def kmeans_loss(model, batch, k=3):
    """A k-means assignment step on the embeddings: (N, 1, D) against (K, D) centroids."""
    query, _, _ = batch
    z = model(query)
    centroids = z[:k].detach()
    distances = ((z[:, None] - centroids) ** 2).sum(-1)  # (N, K)
    assignment = distances.argmin(1)
    return distances.gather(1, assignment[:, None]).mean() + ((z.unsqueeze(1) - centroids) ** 2).mean()


def nll_keepdim_bug(model, batch):
    """A hand-written cross-entropy where the picked logit lost its dim: (B, 1) minus (B,)."""
    query, _, _ = batch
    logits = model(query)
    target = torch.arange(len(query)) % 8
    lse = logits.logsumexp(-1, keepdim=True)  # (B, 1)
    picked = logits.gather(1, target[:, None]).squeeze(1)  # (B,)
    return (lse - picked).mean()


def nll(model, batch):
    query, _, _ = batch
    logits = model(query)
    target = torch.arange(len(query)) % 8
    lse = logits.logsumexp(-1, keepdim=True)
    picked = logits.gather(1, target[:, None])  # (B, 1)
    return (lse - picked).mean()


def test_needless_unsqueeze_in_a_margin_loss_is_flagged_at_its_line():
    w = train(margin_loss_needless_unsqueeze)
    line = line_of(margin_loss_needless_unsqueeze, "return (margin - pos + scores_neg)")
    # once per step, at the loss line
    assert [(a.kind, a.finding.rule, a.lineno) for a in w.anomalies] == [("broadcast", "broadcast.paired", line)] * 3
    message = w.anomalies[0].message
    assert "[6, 6, 5]" in message and "size 6 twice" in message and "aten.add.Tensor" in message
    assert "mean reduces it straight away" in message and "[6, 1]" in message


def test_needless_unsqueeze_of_positive_scores_against_1d_negatives_is_flagged():
    w = train(ranking_loss_needless_unsqueeze)
    line = line_of(ranking_loss_needless_unsqueeze, "return torch.relu(margin - scores_pos + scores_neg).mean()")
    assert [(a.kind, a.finding.rule, a.lineno) for a in w.anomalies] == [("broadcast", "broadcast.paired", line)] * 3
    message = w.anomalies[0].message
    assert "[6, 1]" in message and "[6, 6]" in message and "size 6 twice" in message and "mean reduces it straight away" in message
    assert "leave out the unsqueeze" in message


def test_ranking_losses_without_the_needless_unsqueeze_or_with_intended_tables_are_not_flagged():
    assert train(ranking_loss).anomalies == []
    assert train(ranking_loss_in_batch_negatives).anomalies == []
    assert train(pairwise_rank_loss_one_list).anomalies == []


def test_margin_loss_with_matching_dims_is_not_flagged():
    assert train(margin_loss).anomalies == []


def test_contrastive_table_with_unsqueeze_on_both_sides_is_not_flagged():
    assert train(contrastive_loss).anomalies == []


def test_pairwise_distance_table_is_not_flagged():
    assert train(prototype_loss).anomalies == []
    assert train(self_distance_loss).anomalies == []


def test_kmeans_assignment_is_not_flagged():
    assert train(kmeans_loss).anomalies == []


def test_keepdim_column_reduced_straight_away_is_flagged():
    w = train(nll_keepdim_bug)
    line = line_of(nll_keepdim_bug, "return (lse - picked).mean()")
    assert [(a.kind, a.finding.rule, a.op, a.lineno) for a in w.anomalies] == [("broadcast", "broadcast.implicit", "aten.mean.default", line)] * 3
    assert "aten.sub.Tensor at" in w.anomalies[0].message and "mean reduces it straight away" in w.anomalies[0].message
    assert train(nll).anomalies == []


def test_strict_raises_before_the_loss_is_reduced():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    batch = (torch.randn(6, 8), torch.randn(6, 8), torch.randn(6, 5, 8))
    try:
        with opwatch.strict():
            margin_loss_needless_unsqueeze(model, batch)
    except opwatch.AnomalyError as error:
        assert "broadcast" in str(error)
    else:
        raise AssertionError("strict() did not raise")


def test_findings_judged_by_use_survive_the_jsonl_round_trip(tmp_path):
    for loss_of in (margin_loss_needless_unsqueeze, nll_keepdim_bug):
        w = train(loss_of, steps=1)
        path = tmp_path / f"{loss_of.__name__}.jsonl"
        w.export_jsonl(path)
        saved = opwatch.load(path)
        assert len(w.anomalies) == 1 and [str(a) for a in saved.anomalies] == [str(a) for a in w.anomalies]
