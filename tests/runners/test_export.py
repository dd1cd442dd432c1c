"""Exports: JSON Lines written and read back exactly (``load``), and the Chrome trace checked
against the trace-event format."""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict, namedtuple
from typing import NamedTuple

import pytest
import torch

import opwatch
from support import SCENARIOS
from support.traces import validate_trace_events
from opwatch.checks.finding import Attribute, BeforeWatch, DefaultDevice, DefaultDtype, MadeBy, Owned, Place
from opwatch.storage.chrome_trace import chrome_trace
from opwatch.render.phrases import module_of
from opwatch.storage.codec import _DECODERS, decode, encode
from opwatch.storage.jsonl import FORMAT, READS, VERSION, load
from opwatch.core.fact_tuples import CLASSES, fact_tuple
from opwatch.core.notation import TensorMeta

import stories  # noqa: E402
import training  # noqa: E402

RECORD_FIELDS = (
    "index", "op", "func", "inputs", "outputs", "args", "filename", "lineno", "module", "phase",
    "forward_func", "flags", "where", "start_ns", "end_ns", "rank", "label",
)  # fmt: skip
ANOMALY_FIELDS = ("kind", "op", "filename", "lineno", "module", "phase", "index", "rank", "where", "received", "message")
POSITION_FIELDS = ("filename", "lineno", "end_lineno", "col", "end_col")


def busy_watch(**options) -> opwatch.Watch:
    """Every kind of anomaly, a contained origin, an allowed finding, non-finite and tagged
    arguments, backward ops and nested modules in one watch."""
    model, x, y = training.make()
    allow = [opwatch.Allow(kind="dtype_mismatch", op="aten.mul*")]  # stories.numpy_upcast
    with opwatch.watch(warn=False, allow=allow, **options) as w:
        training.step(model, x, y)
        stories.broadcast_loss(steps=2)
        with pytest.raises(RuntimeError):  # its kernel raises: a record without outputs
            stories.mask_dtype()
        stories.numpy_upcast()
        stories.log_zero()
        stories.sqrt_grad_at_zero()
        stories.t5_buckets()
        stories.constants()
        (torch.zeros(2) / torch.zeros(2)).sum().item()
        try:
            stories.device_mix()
        except RuntimeError:
            pass
        torch.zeros(2, dtype=torch.float64).to(torch.float16).clamp(min=-math.inf, max=math.nan)
        torch.ones(2).to("meta")
        torch.empty(1, 1, 1, 1, memory_format=torch.channels_last)
        torch.tensor([1.0]) * complex(1, math.inf)
    return w


def assert_same_record(saved, live):
    for field in RECORD_FIELDS:
        if field == "args":  # nan != nan: compare their text and types
            assert repr(saved.args) == repr(live.args)
            assert [type(v) for _, v in saved.args] == [type(v) for _, v in live.args]
        else:
            assert getattr(saved, field) == getattr(live, field), field
    for field in POSITION_FIELDS:
        assert getattr(saved.position, field) == getattr(live.position, field), field
    assert saved.position.line_text() == live.position.line_text()
    assert saved.position.expression() == live.position.expression()
    assert saved.position.caret_lines() == live.position.caret_lines()
    assert saved.signature() == live.signature()


def assert_same_finding(saved, live):
    """Equal facts of the same types (``repr``: nan != nan, and it tells tuples from lists)."""
    for field in ("kind", "rule", "facts", "operands", "odd", "made"):
        assert repr(getattr(saved, field)) == repr(getattr(live, field)), field


def assert_same_anomaly(saved, live):
    for field in ANOMALY_FIELDS:
        assert getattr(saved, field) == getattr(live, field), field
    assert str(saved) == str(live)
    assert_same_finding(saved.finding, live.finding)
    assert_same_record(saved.record, live.record)


def test_round_trip_is_exact(tmp_path):
    w = busy_watch()
    assert {a.kind for a in w.anomalies} >= {"broadcast", "dtype_mismatch", "device_mismatch", "inf", "nan"}
    assert len(w.anomalies) > len({a.kind for a in w.anomalies})  # several of some kinds
    assert w.contained and w.allowed
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    saved = load(path)

    assert saved.table() == w.table()
    assert saved.table(last=7) == w.table(last=7)
    assert saved.table(last=0) == w.table(last=0)
    assert saved.table(tablefmt="github") == w.table(tablefmt="github")
    assert saved.summary() == w.summary()
    assert len(saved.records) == len(w.records)
    for saved_record, record in zip(saved.records, w.records):
        assert_same_record(saved_record, record)
    for group in ("anomalies", "contained", "allowed"):
        assert len(getattr(saved, group)) == len(getattr(w, group)), group
    for saved_anomaly, anomaly in zip(saved.anomalies + saved.contained + saved.allowed, w.anomalies + w.contained + w.allowed):
        assert_same_anomaly(saved_anomaly, anomaly)
    # One interface: the table reads saved records as it reads live ones (no forged log entry).
    assert all(isinstance(r, opwatch.core.records.BaseRecord) and not hasattr(r, "_entry") for r in saved.records)
    assert all(isinstance(a, opwatch.findings.anomaly.BaseAnomaly) for a in saved.anomalies + w.anomalies)
    # A saved anomaly points at the saved record of its op, as a live one does.
    assert all(any(a.record is r for r in saved.records) for a in saved.anomalies)


def test_anomalies_are_saved_as_facts_and_their_messages_rendered_again(tmp_path):
    w = busy_watch()
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    text = path.read_text(encoding="utf-8")
    lines = [json.loads(line) for line in text.splitlines()]
    saved_lines = [line for line in lines if line.get("type") == "anomaly"]
    live = w.anomalies + w.contained + w.allowed
    for line, anomaly in zip(saved_lines, live, strict=True):
        assert "message" not in line
        assert line["finding"]["rule"] == anomaly.finding.rule and line["finding"]["kind"] == anomaly.kind
        # No message, nor any of its lines, is written: load renders them from the facts.
        assert json.dumps(anomaly.message, ensure_ascii=False)[1:-1] not in text
        assert json.dumps(anomaly.message.splitlines()[0], ensure_ascii=False)[1:-1] not in text
    saved = load(path)
    for kind in {a.kind for a in live}:  # several real anomalies of each kind
        pairs = [(s, a) for s, a in zip(saved.anomalies + saved.contained + saved.allowed, live) if a.kind == kind]
        assert pairs and all(str(s) == str(a) for s, a in pairs), kind


def test_a_rank_s_log_reads_back_with_its_rank(tmp_path):
    model, x, y = training.make()
    with opwatch.watch(warn=False) as w:
        w._log.rank = 3  # as a watch in a torch.distributed job on rank 3 sets it
        training.step(model, x, y)
        stories.broadcast_loss()
        stories.log_zero()
    w.export_jsonl(tmp_path / "run.jsonl")
    saved = load(tmp_path / "run.jsonl")
    assert saved.rank == 3 and saved.summary() == w.summary() and "opwatch (rank 3)" in saved.summary()
    assert all("rank 3)" in str(a) for a in saved.anomalies) and len(saved.anomalies) == len(w.anomalies) >= 2
    for saved_anomaly, anomaly in zip(saved.anomalies, w.anomalies):
        assert_same_anomaly(saved_anomaly, anomaly)


@pytest.mark.parametrize(
    "value",
    [
        None, True, 0, -3, 2**70, 1.5, -0.0, math.inf, -math.inf, "text", "nan", "inf", "-inf", "",
        (1, 2), [1, 2], (), [], ([1, (2, [3])],), {"a": 1, "b": (1.0, [2])}, {1: "one", (2, 3): None},
        torch.float16, torch.bfloat16, torch.device("cpu"), torch.device("meta"), torch.strided,
        torch.channels_last, complex(1, -math.inf), torch.Size([4, 1]),
        ((4, 1), torch.float32, torch.device("cpu"), 140234),  # tensor metadata, as findings hold it
        TensorMeta((2, 3), torch.float64, torch.device("cpu"), 7),
        Place("aten.addmm.default", "/abs/train.py", 23, "forward"),
        Place("c10d.allreduce_.default", None, None, "backward", "DDP bucket [fc.weight]"),
        {"odd": (Place("aten.mm.default", None, None, "backward"),), "counts": [3, math.inf], "names": ("self", "other")},
        torch.ops.aten.add.Tensor,
        # where an odd operand was made (Finding.made), each kind of provenance fact
        (MadeBy("made_by", Place("aten.zeros.default", "/abs/train.py", 4, "forward"), DefaultDtype("default_dtype", None, torch.float32)),),
        MadeBy("made_by", Place("aten.ones.default", None, None, "forward"), DefaultDevice("default_device", torch.device("meta"))),
        MadeBy("made_by", Place("aten.mul.Tensor", "/abs/train.py", 5, "forward")),
        Owned("buffer", "encoder.norm", "running_mean"), Attribute("attribute", "Scaled", "scale", "model.scaled"), BeforeWatch(),
    ],
    ids=repr,
)
def test_the_codec_keeps_values_and_their_types(value):
    encoded = encode(value)
    line = json.dumps(encoded, allow_nan=False)  # plain JSON
    decoded = decode(json.loads(line))
    assert repr(decoded) == repr(value) and type(decoded) is type(value)
    assert decoded == value or value != value


def test_every_registered_fact_tuple_keeps_its_class_and_others_read_back_as_tuples():
    assert {"meta", "place", "made_by", "owned", "attribute", "before_watch", "default_device", "default_dtype"} <= set(CLASSES)
    assert not set(CLASSES) & set(_DECODERS)  # a fact tuple's tag never shadows one of the codec's own
    for tag, cls in CLASSES.items():
        value = cls(*(f"{tag}.{field}" for field in cls._fields))
        decoded = decode(json.loads(json.dumps(encode(value))))
        assert type(decoded) is cls and decoded == value
    unregistered = namedtuple("Unregistered", "a b")(1, 2)
    assert encode(unregistered) == [1, 2] and type(decode(encode(unregistered))) is tuple

    class Other(NamedTuple):
        op: str

    with pytest.raises(TypeError, match="one NamedTuple class per tag"):
        fact_tuple("place")(Other)
    assert CLASSES["place"] is Place


def test_the_codec_keeps_nan_and_reads_unknown_objects_as_their_text():
    decoded = decode(json.loads(json.dumps(encode((math.nan, [math.nan])))))
    assert math.isnan(decoded[0]) and isinstance(decoded[1], list) and math.isnan(decoded[1][0])
    assert decode(encode(object)) == repr(object)
    with pytest.raises(ValueError, match="unknown value tag 'bogus'; the tags are 'str'"):
        decode({"bogus": 1})


def test_arguments_keep_their_values_and_types(tmp_path):
    w = busy_watch()
    w.export_jsonl(tmp_path / "run.jsonl")
    saved = load(tmp_path / "run.jsonl")
    values = [value for record in saved.records for _, value in record.args]
    assert any(isinstance(v, float) and math.isnan(v) for v in values)
    assert math.inf in values and -math.inf in values
    assert torch.float16 in values and torch.device("meta") in values
    assert torch.strided in values and torch.channels_last in values
    assert any(isinstance(v, complex) and v.imag == math.inf for v in values)


def test_file_format(tmp_path):
    w = busy_watch()
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    lines = path.read_text(encoding="utf-8").splitlines()

    def strict_json(text):  # NaN and Infinity are not JSON
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"non-JSON constant {name} in {text[:80]}"))

    objects = [strict_json(line) for line in lines]
    header = objects[0]
    assert header["format"] == FORMAT and header["version"] == VERSION
    assert header["torch"] == torch.__version__ and header["opwatch"] == opwatch.__version__ and header["rank"] is None
    kinds = defaultdict(list)
    for obj in objects[1:]:
        kinds[obj["type"]].append(obj)
    assert len(kinds["record"]) == len(w.records) == header["records"]
    assert len(kinds["anomaly"]) == len(w.anomalies) + len(w.contained) + len(w.allowed)
    assert [a["in"] for a in kinds["anomaly"]] == ["anomalies"] * len(w.anomalies) + ["contained"] * len(w.contained) + ["allowed"] * len(w.allowed)
    assert (header["anomalies"], header["contained"], header["allowed"]) == (len(w.anomalies), len(w.contained), len(w.allowed))
    record = next(r for r in kinds["record"] if r["flags"] == ["broadcast"])
    assert record["op"] == "aten.sub.Tensor" and record["phase"] == "forward"
    assert [(m["shape"], m["dtype"], m["device"]) for m in record["inputs"]] == [([4], "float32", "cpu"), ([4, 1], "float32", "cpu")]
    clamp = next(r for r in kinds["record"] if r["op"] == "aten.clamp.default")
    assert dict(clamp["args"]) == {"min": "-inf", "max": "nan"}
    # A site line comes before the first record that refers to it.
    seen = set()
    for obj in objects[1:]:
        if obj["type"] == "site":
            seen.add(obj["site"])
        elif obj["type"] == "record":
            assert obj["site"] in seen


def test_anomalies_whose_op_left_the_log_keep_their_record(tmp_path):
    with opwatch.watch(warn=False, max_records=5) as w:
        stories.broadcast_loss(steps=3)
    assert w.anomalies[0].index < w.records[0].index  # the first anomaly's op left the ring
    w.export_jsonl(tmp_path / "run.jsonl")
    saved = load(tmp_path / "run.jsonl")
    assert saved.summary() == w.summary() and saved.table() == w.table()
    for saved_anomaly, anomaly in zip(saved.anomalies, w.anomalies):
        assert_same_anomaly(saved_anomaly, anomaly)


def test_an_op_stopped_by_strict_reads_back_as_not_run(tmp_path):
    w = opwatch.strict(warn=False, dump_on_error=False)
    with pytest.raises(opwatch.AnomalyError):
        with w:
            stories.broadcast_loss()
    w.export_jsonl(tmp_path / "run.jsonl")
    saved = load(tmp_path / "run.jsonl")
    assert saved.records[-1].outputs is None and saved.records[-1].end_ns is None
    assert saved.table() == w.table() and "not run" in saved.table()
    assert saved.summary() == w.summary()


def test_load_refuses_other_files(tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match="not an opwatch log"):
        load(other)
    newer = tmp_path / "newer.jsonl"
    newer.write_text(json.dumps({"format": FORMAT, "version": VERSION + 1}) + "\n")
    reads = "versions 3, 4 and 5" if READS == (3, 4, 5) else f"version {VERSION}"
    assert reads.endswith(str(VERSION))
    with pytest.raises(ValueError, match=f"version {VERSION + 1}; this opwatch reads {reads}: upgrade opwatch"):
        load(newer)
    # Version 1 stored the messages' text, not the findings' facts: not read, and said so.
    older = tmp_path / "older.jsonl"
    older.write_text(json.dumps({"format": FORMAT, "version": 1}) + "\n")
    with pytest.raises(ValueError, match=f"version 1; this opwatch reads {reads}: export the run again"):
        load(older)
    assert 1 not in READS and VERSION in READS
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"format": FORMAT, "version": VERSION}) + '\n{"type": "record"}\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not a valid opwatch log line"):
        load(broken)


def test_a_log_cut_short_is_refused_naming_what_its_header_promised(tmp_path):
    """A killed run or a partial copy must not read as a clean run ("no anomalies")."""
    w = busy_watch()
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    header = json.loads(lines[0])
    assert header["anomalies"] == len(w.anomalies) > 0
    promised = f"its header promises {len(w.records)} records, {len(w.anomalies)} anomalies, {len(w.contained)} contained, {len(w.allowed)} allowed"
    first_anomaly = next(i for i, line in enumerate(lines) if '"type": "anomaly"' in line)
    # Cut at a line's end, before the anomalies: the records all read, no anomaly.
    at_line = tmp_path / "at_line.jsonl"
    at_line.write_text("".join(lines[:first_anomaly]))
    with pytest.raises(ValueError) as caught:
        load(at_line)
    message = str(caught.value)
    assert message.startswith(f"{at_line}: the log is cut short") and promised in message
    assert f"read {len(w.records)} records, 0 anomalies, 0 contained, 0 allowed." in message
    assert "partial=True" in message and "show --partial" in message
    # Cut in the middle of a line.
    mid_line = tmp_path / "mid_line.jsonl"
    mid_line.write_text(text[: len("".join(lines[:5])) + 20])
    kept = sum('"type": "record"' in line for line in lines[:5])
    with pytest.raises(ValueError, match=rf"read {kept} records, 0 anomalies, .*, and line 6 is cut in the middle"):
        load(mid_line)
    # partial=True reads what there is.
    saved = load(mid_line, partial=True)
    assert len(saved.records) == kept and saved.anomalies == [] and saved.header["anomalies"] == len(w.anomalies)
    assert len(load(at_line, partial=True).records) == len(w.records)
    # The whole file still loads; a complete last line without its newline too.
    assert len(load(path).anomalies) == len(w.anomalies)
    path.write_text(text.rstrip("\n"))
    assert len(load(path).anomalies) == len(w.anomalies)


def test_show_of_a_log_cut_short_exits_1_with_one_line(tmp_path, capsys):
    from opwatch.runners.cli import main

    with opwatch.watch(warn=False) as w:
        stories.broadcast_loss()
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(line for line in lines if '"type": "anomaly"' not in line))
    assert main(["show", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"python -m opwatch show: error: {path}: the log is cut short")
    assert "1 anomalies" in captured.err and "read 0 anomalies" not in captured.err and "0 anomalies" in captured.err
    assert main(["show", "--partial", str(path)]) == 0
    out = capsys.readouterr().out
    summary = out[out.index("opwatch: a partial log") :]
    assert summary == (
        "opwatch: a partial log: read 0 of the 1 anomalies its header promised; what was not read is not in this summary.\n"
        "opwatch: no anomalies among what was read.\n"
    )
    # The whole log: no word of a part.
    path.write_text("".join(lines))
    assert main(["show", "--partial", str(path)]) == 0
    out = capsys.readouterr().out
    assert "partial" not in out and "among what was read" not in out and "opwatch: 1 anomaly at 1 place:" in out


def test_show_partial_of_a_busy_log_counts_what_was_read_of_what_was_promised(tmp_path, capsys):
    from opwatch.runners.cli import main

    w = busy_watch()
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    text = path.read_text()
    first_anomaly = text.index('{"type": "anomaly"')
    second = text.index('{"type": "anomaly"', first_anomaly + 1)
    path.write_text(text[: second + 30])  # one anomaly whole, the next cut in the middle
    assert main(["show", "--partial", str(path)]) == 0
    out = capsys.readouterr().out
    cut_line = text[: second + 30].count("\n") + 1
    assert (
        f"opwatch: a partial log (line {cut_line} cut in the middle): read 1 of the {len(w.anomalies)} anomalies"
        in out
    ), out
    assert "opwatch: 1 anomaly at 1 place among what was read:" in out and "opwatch: no anomalies" not in out


def test_load_refuses_what_is_not_a_path():
    with pytest.raises(TypeError, match="path must be a file path \\(str or os.PathLike\\), got int"):
        load(3)  # open(3) would read file descriptor 3
    with pytest.raises(TypeError, match="partial must be True or False"):
        load("run.jsonl", partial="yes")


# -- Chrome trace ---------------------------------------------------------------------------

def test_chrome_trace_follows_the_trace_event_format(tmp_path):
    model, x, y = training.make()
    with opwatch.watch(warn=False) as w:
        training.step(model, x, y)
        stories.broadcast_loss()
    path = tmp_path / "trace.json"
    w.export_chrome_trace(path)
    trace = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"non-JSON constant {name}"))
    events = validate_trace_events(trace)

    ops = [e for e in events if e["ph"] == "X" and e["cat"] == "op"]
    records = w.records
    assert len(ops) == len(records)
    for event, record in zip(ops, records):
        assert event["name"] == record.op.removesuffix(".default")
        assert event["args"]["index"] == record.index and event["args"]["phase"] == record.phase
        assert event["args"]["inputs"] == [str(meta) for meta in record.inputs]
        assert event["args"]["line"] == record.where and event["args"]["module"] == module_of(record)  # the label messages show
        # Times in microseconds from the first op's start, as measured around the kernel.
        assert event["dur"] == pytest.approx((record.end_ns - record.start_ns) / 1000, abs=1e-3)
        assert event["ts"] == pytest.approx((record.start_ns - records[0].start_ns) / 1000, abs=1e-3)

    modules = {e["name"] for e in events if e["ph"] == "X" and e["cat"] == "module"}
    assert {"blocks", "blocks.0", "blocks.0.proj", "blocks.1.norm", "head"} <= modules

    # Flows join backward ops to the forward op they differentiate.
    op_at = {e["ts"]: e for e in ops}
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = [e for e in events if e["ph"] == "f"]
    assert ends and len(ends) == len(starts)
    for end in ends:
        forward, backward = op_at[starts[end["id"]]["ts"]], op_at[end["ts"]]
        assert forward["args"]["phase"] == "forward" and backward["args"]["phase"] == "backward"
        assert backward["args"]["forward op"] == forward["name"]
        assert backward["args"]["line"] == forward["args"]["line"] and backward["args"]["module"] == forward["args"]["module"]
    backward_addmm = [e for e in ops if e["args"].get("forward op") == "aten.addmm"]
    assert backward_addmm and all(any(op_at[end["ts"]] is e for end in ends) for e in backward_addmm)

    (instant,) = [e for e in events if e["ph"] == "i"]
    assert instant["name"] == "broadcast: aten.sub.Tensor" and instant["args"]["message"] == w.anomalies[0].message
    assert op_at[instant["ts"]]["args"]["flags"] == ["broadcast"]


def test_chrome_trace_of_a_saved_log_without_times(tmp_path):
    # A log that carries no op times gets a synthetic clock: one microsecond per op.
    with opwatch.watch(warn=False) as w:
        stories.log_zero()
    path = tmp_path / "run.jsonl"
    w.export_jsonl(path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        for key in ("start_ns", "end_ns"):
            line.pop(key, None)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    saved = load(path)
    assert saved.records[0].start_ns is None
    trace = chrome_trace(saved)
    events = validate_trace_events(trace)
    ops = [e for e in events if e["ph"] == "X" and e["cat"] == "op"]
    assert [(e["ts"], e["dur"]) for e in ops] == [(float(i), 1.0) for i in range(len(ops))]
    assert "synthetic" in trace["otherData"]["timestamps"]
    assert [e["name"] for e in events if e["ph"] == "i"] == [f"{a.kind}: {a.op.removesuffix('.default')}" for a in w.anomalies]


# -- the command line -----------------------------------------------------------------------

SCRIPT = """\
import torch
torch.manual_seed(0)
x, y = torch.randn(4, 2), torch.randn(4)
layer = torch.nn.Linear(2, 1)
loss = ((y - layer(x)) ** 2).mean()
loss.backward()
"""


def test_cli_writes_both_exports_and_shows_a_saved_log(tmp_path, capsys):
    from opwatch.runners.cli import main

    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    jsonl, trace = tmp_path / "run.jsonl", tmp_path / "trace.json"
    assert main(["--jsonl", str(jsonl), "--trace", str(trace), str(script)]) == 0
    watched = capsys.readouterr().err
    saved = load(jsonl)
    assert watched == saved.summary() + "\n"
    assert [a.kind for a in saved.anomalies] == ["broadcast"]
    validate_trace_events(json.loads(trace.read_text()))

    assert main(["show", str(jsonl), "--last", "3"]) == 0
    assert capsys.readouterr().out == saved.table(last=3) + "\n\n" + saved.summary() + "\n"
    assert main(["show", str(jsonl)]) == 0
    assert capsys.readouterr().out.count("\n") == len(saved.table().splitlines()) + 1 + len(saved.summary().splitlines())
    assert main(["show", str(tmp_path / "missing.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "No such file" in err and err.count("\n") == 1


# -- one anomaly interface ----------------------------------------------------------------------


class OneRecord(opwatch.core.records.BaseRecord):
    """A record with only the primitive accessors, as another kind of record has them."""

    index, module, phase, forward_func, args, flags, rank, label = 5, None, "forward", None, (), (), None, None
    inputs = (TensorMeta((4,), torch.float32, torch.device("cpu"), 1),)
    outputs = (TensorMeta((4,), torch.float32, torch.device("cpu"), 2),)

    def __init__(self, func):
        from opwatch.core.sites import Position

        self.func = func
        self.position = Position(str(SCENARIOS / "stories.py"), 3)


class OneAnomaly(opwatch.findings.anomaly.BaseAnomaly):
    """What a subclass must provide: ``finding`` and ``record``."""

    def __init__(self, finding, record):
        self.finding, self.record = finding, record


def test_the_anomaly_interface_derives_everything_from_finding_and_record():
    w = busy_watch()
    live = w.anomalies[0]
    other = OneAnomaly(live.finding, live.record)
    for field in ANOMALY_FIELDS:
        assert getattr(other, field) == getattr(live, field), field
    assert str(other) == str(live) and repr(other) == repr(live).replace("<Anomaly", "<OneAnomaly")


def test_received_is_a_nan_or_inf_on_a_collective_op():
    import dataclasses

    with opwatch.watch(warn=False) as w:
        stories.log_zero()
    made = next(a for a in w.anomalies if a.kind in ("nan", "inf"))
    assert not made.received  # made here, by aten.log
    finding = made.finding
    allreduce = torch.ops.c10d.allreduce_.default
    assert OneAnomaly(finding, OneRecord(allreduce)).received
    assert not OneAnomaly(finding, OneRecord(torch.ops.aten.add.Tensor)).received
    other_kind = dataclasses.replace(finding, kind="broadcast")
    assert not OneAnomaly(other_kind, OneRecord(allreduce)).received
    # A saved record whose op this torch does not have names it by a string: no collective
    # that can be asked about, so not received (a saved anomaly keeps what the watch judged).
    by_name = OneAnomaly(finding, OneRecord("c10d.allreduce_.default"))
    assert not by_name.received
    assert by_name.message.startswith(f"{finding.kind} in c10d.allreduce_.default at stories.py:3")


def test_a_default_dtype_saved_by_format_4_reads_back_with_its_tag_as_how():
    """Format 4 and older wrote a ``DefaultDtype`` whose ``how`` ("dtype") disagreed with its tag."""
    saved = {"default_dtype": ["dtype", {"dtype": "float64"}, {"dtype": "float32"}]}
    assert decode(saved) == DefaultDtype("default_dtype", torch.float64, torch.float32)
    assert decode(encode(decode(saved))) == decode(saved)
