"""Logs written by older versions of opwatch load and read as they did.

``data/log_v3_blocks.jsonl`` was written by opwatch at format version 3 (commit dfddf1f) from a
model whose ``nn.Sequential`` children ran the ops of a broadcast, a device and an inf finding
(its source file renamed ``train.py``); ``goldens/load_v3_blocks.txt`` is what that version
printed on loading it: the table, the summary and each message. Version 3 stored a record's
module as one label (``blocks.0 (Block)``); reading it splits the label into the path and the
class (``opwatch.storage.jsonl._upgraded_v3``).
"""

from __future__ import annotations

import pathlib

import torch
from torch import nn

import opwatch
from opwatch.storage.jsonl import _upgraded_v3
from support import assert_golden

OLD_LOG = pathlib.Path(__file__).resolve().parent / "data" / "log_v3_blocks.jsonl"


def _read_out(saved) -> str:
    return saved.table(last=None) + "\n\n" + saved.summary() + "\n\n" + "\n\n".join(str(a) for a in saved.anomalies) + "\n"


def test_a_version_3_log_is_upgraded_when_read_and_prints_what_its_version_printed():
    saved = opwatch.load(OLD_LOG)
    assert saved.header["version"] == 3
    modules = {(record.module, record.module_class) for record in saved.records if record.module}
    # indexed modules: the label split into its two facts; named ones: the path, class unknown
    assert {("blocks.0", "Block"), ("blocks.0.proj", None), ("head", None), ("Net", None)} <= modules
    assert not {path for path, _ in modules if "(" in path}
    assert [(a.kind, a.module) for a in saved.anomalies] == [("broadcast", None), ("device_mismatch", "blocks.0"), ("inf", "blocks.0")]
    assert_golden("load_v3_blocks.txt", _read_out(saved))


def test_the_version_3_upgrade_splits_only_a_label_that_ends_in_an_index():
    def upgraded(label):
        fields = _upgraded_v3({"module": label, "op": "aten.mul.Tensor"})
        assert fields["op"] == "aten.mul.Tensor"
        return fields["module"], fields["module_class"]

    assert upgraded("blocks.3 (Block)") == ("blocks.3", "Block")
    assert upgraded("0 (Linear)") == ("0", "Linear")
    assert upgraded("encoder.attn") == ("encoder.attn", None)
    assert upgraded("Net") == ("Net", None)
    assert upgraded(None) == (None, None)
    # a compiled graph's name is not a module label
    assert upgraded("torch.compile graph 3 (forward)") == ("torch.compile graph 3 (forward)", None)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x).relu()


def test_a_log_written_now_keeps_the_path_and_the_class_and_prints_what_the_watch_printed(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block(), nn.Linear(4, 1))
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    with opwatch.watch(warn=False) as w:
        ((model(x).squeeze(-1) - y) ** 2).mean().backward()  # a broadcast outside modules
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    saved = opwatch.load(path)
    assert saved.header["version"] == 5
    assert [(r.module, r.module_class) for r in saved.records] == [(r.module, r.module_class) for r in w.records]
    assert ("0.proj", "Linear") in {(r.module, r.module_class) for r in saved.records}
    assert saved.table(last=None) == w.table(last=None) and "0 (_Block)" in saved.table(last=None)
    assert saved.summary() == w.summary()


# ``data/log_v4_rules.jsonl`` was written by opwatch at format version 4 (commit 2c970a1, before each
# rule's facts had a type of their own; ``data/make_log_v4_rules.py`` wrote it, its file renamed
# ``train.py``): its findings span broadcast, device, dtype, accumulation and nan/inf rules, with
# causes and where the odd operands were made; ``goldens/load_v4_rules.txt`` is what that version
# printed on loading it.
V4_LOG = pathlib.Path(__file__).resolve().parent / "data" / "log_v4_rules.jsonl"


def test_a_version_4_log_of_the_dict_facts_prints_what_its_version_printed():
    saved = opwatch.load(V4_LOG)
    assert saved.header["version"] == 4
    rules = {anomaly.finding.rule for anomaly in saved.anomalies}
    assert {"broadcast.implicit", "device.mix", "dtype.silent_upcast", "dtype.loss_target", "dtype.narrowing_write",
            "dtype.write_source", "nonfinite.origin", "nonfinite.overflow_risk"} <= rules
    assert_golden("load_v4_rules.txt", _read_out(saved))
