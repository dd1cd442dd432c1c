"""Each rule's facts are one typed class, shared by the check that makes them and the renderer
that words them: no dict of ad-hoc keys between a check and render, and a log of an older
version is upgraded when read (``opwatch.storage.codec``), never re-derived in render."""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib

import pytest
import torch
from torch import nn

import opwatch
from opwatch.checks.collectives import CollectiveCall, CollectiveCalls
from opwatch.checks.device import DeviceMix
from opwatch.checks.nonfinite.cause import MATH, Cause
from opwatch.checks.nonfinite.origin import OriginFacts
from opwatch.core.fact_tuples import RULE_FACTS, RuleFacts, facts_of_rule
from opwatch.core.notation import TensorMeta
from opwatch.render import explanations  # noqa: F401  (every render module: each rule's explain registered)
from opwatch.render.rules import EXPLAIN
from opwatch.storage.codec import finding_fields, finding_from_fields, rule_facts_from_saved

RENDER = pathlib.Path(opwatch.__file__).parent / "render"
V4_LOG = pathlib.Path(__file__).resolve().parent / "data" / "log_v4_rules.jsonl"


def plain_metas(value) -> list:
    """The tensor metadata in ``value`` (facts, nested) held as plain tuples, not TensorMeta."""
    if isinstance(value, RuleFacts):
        return plain_metas(tuple(value.fields().values()))
    if type(value) is TensorMeta:
        return []
    if isinstance(value, (tuple, list)):
        items = list(value)
        if type(value) is tuple and len(items) == 4 and isinstance(items[1], torch.dtype) and isinstance(items[2], torch.device):
            return [value]
        return [found for item in items for found in plain_metas(item)]
    return []


def test_every_explained_rule_has_one_frozen_class_of_facts():
    assert set(EXPLAIN) == set(RULE_FACTS)
    for rule, cls in RULE_FACTS.items():
        assert issubclass(cls, RuleFacts) and dataclasses.is_dataclass(cls), rule
        # every class of its line has slots: its instances have no __dict__ to take stray keys
        assert cls.__dataclass_params__.frozen and all("__slots__" in vars(base) for base in cls.__mro__[:-1]), rule


class _Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(4, 1)

    def forward(self, x):
        return (torch.sigmoid(self.score(x)).squeeze(-1) * (x[:, 0] > -10)).log()


def test_a_training_run_hands_render_typed_facts_that_survive_the_export(tmp_path):
    torch.manual_seed(0)
    model = _Scorer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    x[2, 0] = -20.0  # this row's probability is masked to 0: log(0)
    with opwatch.watch(warn=False) as w:
        for _ in range(2):
            optimizer.zero_grad()
            loss = -model(x).mean() + ((model.score(x).squeeze(-1) - y) ** 2).mean()  # a broadcast too
            loss.backward()
            optimizer.step()
            model.score(x) + torch.zeros(6, 1, dtype=torch.float64)  # a silent upcast
    findings = [anomaly.finding for anomaly in w.anomalies]
    assert {"broadcast.implicit", "dtype.silent_upcast", "nonfinite.origin"} <= {finding.rule for finding in findings}
    for finding in findings:
        assert type(finding.facts) is RULE_FACTS[finding.rule], finding.rule
        assert not plain_metas(finding.facts), finding.rule
        saved = finding_from_fields(json.loads(json.dumps(finding_fields(finding))))
        assert type(saved.facts) is type(finding.facts) and saved.facts.fields().keys() == finding.facts.fields().keys()
    origin = next(finding for finding in findings if finding.rule == "nonfinite.origin")
    assert origin.facts.cause == Cause(MATH, "log_zero") and origin.facts["cause"] is origin.facts.cause
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    assert [str(anomaly) for anomaly in opwatch.load(path).anomalies] == [str(anomaly) for anomaly in w.anomalies]


def test_a_format_4_log_reads_each_rules_facts_as_its_class_with_tensors_read_by_field():
    saved = opwatch.load(V4_LOG)
    assert saved.anomalies
    for anomaly in [*saved.anomalies, *saved.contained]:
        facts = anomaly.finding.facts
        assert type(facts) is RULE_FACTS[anomaly.finding.rule] and not plain_metas(facts), anomaly.finding.rule
    assert plain_metas(((4,), torch.float32, torch.device("cpu"), 1)) and not plain_metas(TensorMeta((4,), torch.float32, torch.device("cpu"), 1))


def test_a_format_4_origin_without_the_derived_facts_gets_them_when_read():
    inputs = (((6,), torch.float32, torch.device("cpu"), 7),)
    saved = {
        "op": "aten.log.default", "inputs": inputs, "outputs": (((6,), torch.float32, torch.device("cpu"), 8),),
        "op_name": "log", "input_ranges": ((inputs[0], (0.0, 0.5)),),  # an untagged range, no cause
    }
    facts = rule_facts_from_saved("nonfinite.origin", "inf", saved)
    assert type(facts) is OriginFacts and facts.cause == Cause(MATH, "log_zero")
    assert facts.written == () and facts.largest_read == 0.5
    in_place = rule_facts_from_saved("nonfinite.origin", "nan", dict(saved, op="aten.sqrt_.default", op_name="sqrt", outputs=inputs))
    assert in_place.written == (7,)


def test_format_4_collective_calls_read_back_as_their_tuple_and_unknown_rules_keep_their_dict():
    call = {"ranks": [1], "op": "c10d.allreduce_", "tensors": ["f32[6] cpu"], "where": [["train.py", 3, None]]}
    saved = {"op": "c10d.allreduce_", "number": 1, "group": "0", "timeout": 5.0, "missing": [], "calls": [call]}
    facts = rule_facts_from_saved("collective.mismatch", "collective_mismatch", saved)
    assert type(facts) is CollectiveCalls and facts.calls == [CollectiveCall(**call)]
    assert facts_of_rule("a.newer_rule", {"x": 1}) == {"x": 1}
    assert facts_of_rule("device.mix", {"devices": ["cpu"], "names": [], "target": "cpu", "newer": 1}) == DeviceMix(["cpu"], [], "cpu")


def test_a_rule_facts_class_reads_by_name_and_refuses_what_it_does_not_hold():
    facts = DeviceMix(devices=["cuda:0", "cpu"], names=["self", "other"], target="cuda:0")
    assert facts["target"] == facts.target == "cuda:0" and facts.get("missing") is None
    with pytest.raises(KeyError):
        facts["missing"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.target = "cpu"
    assert facts.replace(target="cpu").target == "cpu" and facts.target == "cuda:0"


def facts_read_by_key(source: str) -> list[str]:
    """``facts["x"]`` / ``facts.get("x")`` in ``source``: a rule's facts read as a dict."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            target = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant):
            target = node.func.value
        else:
            continue
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        if name == "facts":
            found.append(ast.unparse(node))
    return found


def test_render_reads_facts_by_field_and_derives_no_cause():
    offenders = {path.name: facts_read_by_key(path.read_text()) for path in sorted(RENDER.glob("*.py"))}
    assert not {name: found for name, found in offenders.items() if found}
    nonfinite = (RENDER / "nonfinite.py").read_text()
    for name in ("range_cause", "read_ranges", "written_inputs"):
        assert name not in nonfinite, name


@pytest.mark.parametrize("source, count", [
    ('x = finding.facts["devices"]', 1),
    ('x = facts.get("cause")', 1),
    ('x = facts.devices; y = other["devices"]; z = facts[0]', 0),
])
def test_the_key_read_detector_itself(source, count):
    assert len(facts_read_by_key(source)) == count
