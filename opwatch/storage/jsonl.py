"""A watch's log as JSON Lines, and read back.

- :func:`write_jsonl` / :func:`load`: JSON Lines, one object a line; :func:`load` gives a
  read-only :class:`SavedLog` that prints the same table and summary as the watch that wrote it.

The JSON Lines file (format version 5)::

    {"format": "opwatch.jsonl", "version": 5, "opwatch": "0.1.0", "torch": "2.13.0+cpu", "python": "3.11.7", "rank": null, ...}
    {"type": "site", "site": 1, "filename": "/abs/train.py", "lineno": 26, "end_lineno": 26, "col": 20, "end_col": 28,
     "text": "squared_diff = (y - pred) ** 2", "expression": "y - pred", "carets": ["squared_diff = (y - pred) ** 2", "    ^^^^^^^^"]}
    {"type": "record", "index": 7, "op": "aten.sub.Tensor", "site": 1, "label": null, "filename": "/abs/train.py", "lineno": 26,
     "module": null, "module_class": null, "phase": "forward", "forward_op": null, "inputs": [{"shape": [4], "dtype": "float32", "device": "cpu", "ident": 1403}, ...],
     "outputs": [...], "args": [["alpha", 1]], "flags": ["broadcast"], "start_ns": ..., "end_ns": ...}
    {"type": "anomaly", "in": "anomalies", "kind": "broadcast", "index": 7, "op": "aten.sub.Tensor", "received": false,
     "finding": {"kind": "broadcast", "rule": "broadcast.implicit", "facts": {"dict": {...}}, "operands": [...], "odd": [...], "made": [...]}}

A ``site`` line comes before the first record that refers to it and carries the source text
the renderers show, so a saved log prints its table on a machine without the sources. An
anomaly line says ``"in"`` which list the watch kept it in (``anomalies``, ``contained``,
``allowed``); one whose op has left the bounded log carries that record in its ``record``
field. The header's ``rank`` is the watch's (``null`` outside a ``torch.distributed`` job);
``"whole_script": true`` in a log written by ``python -m opwatch --jsonl`` (its watch ran from the
script's first line).

An anomaly stores its finding's FACTS, never its text: :func:`load` renders every message
again from them with the same code as the live watch, so a saved anomaly reads as the live one
did (paths shown relative to the working directory, as the watch shows them). Values go through
the one codec, :mod:`opwatch.storage.codec`.

A record's module is two facts: ``"module"``, its dotted path (``"enc.0"``), and
``"module_class"``, its class's name (``"Linear"``). Version 3 files stored one label
(``"enc.0 (Linear)"``): :func:`load` upgrades their records as it reads them (:func:`_upgraded_v3`),
so that they render as they did. Version 4 files hold the same records; a finding's facts
of any version are read back as its rule's class of facts, what an older version did not save
worked out when read (:func:`opwatch.storage.codec.rule_facts_from_saved`). Version 5 saves
each rule's facts with every field, tensors tagged ``{"meta": [...]}``, a collective's calls
tagged ``{"collective_call": [...]}``. Version 1 files (which stored the messages' text) are not
read: :func:`load` names the versions it reads.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from ..checks import fingerprints
from ..core.records import BaseRecord
from ..findings.anomaly import BaseAnomaly
from .codec import decode, encode, finding_fields, finding_from_fields, meta_fields, meta_from_fields, op_named

__all__ = ["FORMAT", "VERSION", "READS", "write_jsonl", "load", "SavedLog", "SavedRecord", "SavedAnomaly", "SavedPosition"]

FORMAT = "opwatch.jsonl"
# 3: provenance and other fact tuples are written tagged ({"made_by": [...]}); 4: a record's
# module as two facts, its path and its class
VERSION = 5
READS = (3, 4, 5)  # the format versions load() reads (3 and 4: upgraded as read)

_GROUPS = ("anomalies", "contained", "allowed")  # where a watch keeps what its checks found


# -- writing JSON Lines ---------------------------------------------------------------------


def write_jsonl(watch, path, *, whole_script: bool = False, guard: dict | None = None) -> None:
    """Write ``watch``'s log to ``path``: a header, then its records, anomalies, contained
    nan/inf origins and allowed findings, one JSON object a line (see the module's docstring).
    ``whole_script``: the watch ran from a script's first line (``python -m opwatch``); the
    header says so (``"whole_script": true``), and :func:`opwatch.diff` words its advice by it.
    ``guard``: the run ledger of a ``--guard`` run (``RunLedger.log()``: its counts and the
    steps GradScaler skipped, in the header's ``"guard"``, and a ``"guard_step"`` line per
    failed or skipped step)."""
    records = watch.records
    groups = anomaly_groups(watch)
    sites = _SiteTable()
    logged = {record.index for record in records}
    with open(path, "w", encoding="utf-8") as stream:

        def put(obj: dict) -> None:
            # allow_nan=False: a non-finite number that escaped encode() is a bug, not a file
            # other JSON readers refuse.
            stream.write(json.dumps(obj, ensure_ascii=False, allow_nan=False))
            stream.write("\n")

        # With watch(fingerprints=True) the header says so and each record line carries its
        # outputs' fingerprints, for opwatch.diff.
        prints = getattr(watch, "fingerprints", None)
        header = _header(watch, len(records), groups)
        if prints is not None:
            header["fingerprints"] = True
        if whole_script:
            header["whole_script"] = True
        if guard is not None:
            header["guard"] = {name: value for name, value in guard.items() if name != "failures"}
        put(header)
        for row in (guard or {}).get("failures", ()):
            put({"type": "guard_step", **row})
        for record in records:
            for line in sites.new_lines(record):
                put(line)
            line = {"type": "record", **_record_fields(record, sites)}
            if prints is not None and record.index in prints:
                line["fingerprints"] = fingerprints.encode(prints[record.index])
            put(line)
        for name, group in groups.items():
            for anomaly in group:
                line = {"type": "anomaly", "in": name, **_anomaly_fields(anomaly)}
                if anomaly.index not in logged:  # its op left the bounded log
                    for site_line in sites.new_lines(anomaly.record):
                        put(site_line)
                    line["record"] = _record_fields(anomaly.record, sites)
                put(line)


def anomaly_groups(watch) -> dict:
    """``{"anomalies": [...], "contained": [...], "allowed": [...]}``, as the watch keeps them."""
    return {name: list(getattr(watch, name, ())) for name in _GROUPS}


def _header(watch, records: int, groups: dict) -> dict:
    from .._version import __version__

    return {
        "format": FORMAT,
        "version": VERSION,
        "opwatch": __version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "rank": getattr(watch, "rank", None),
        "strict": watch.strict,
        "records": records,
        **{name: len(group) for name, group in groups.items()},
    }


def rank_of_process() -> int:
    """This process's rank in a ``torch.distributed`` job (see
    :func:`opwatch.core.collective_ops.current_rank`), 0 outside one."""
    from ..core.collective_ops import current_rank

    rank = current_rank()
    return 0 if rank is None else rank


class _SiteTable:
    """Numbers each distinct source position once and writes its text the first time."""

    def __init__(self):
        self._ids: dict = {}

    def site_of(self, record) -> int:
        return self._ids[_position_key(record.position)]

    def new_lines(self, record) -> list[dict]:
        position = record.position
        key = _position_key(position)
        if key in self._ids:
            return []
        site = self._ids[key] = len(self._ids) + 1
        return [
            {
                "type": "site",
                "site": site,
                "filename": position.filename,
                "lineno": position.lineno,
                "end_lineno": position.end_lineno,
                "col": position.col,
                "end_col": position.end_col,
                "text": position.line_text(),
                "expression": position.expression(),
                "carets": position.caret_lines(),
            }
        ]


def _position_key(position) -> tuple:
    return (position.filename, position.lineno, position.end_lineno, position.col, position.end_col)


def _record_fields(record, sites: _SiteTable) -> dict:
    forward = record.forward_func
    outputs = record.outputs
    return {
        "index": record.index,
        "op": record.op,
        "site": sites.site_of(record),
        "label": record.label,
        "filename": record.filename,
        "lineno": record.lineno,
        "module": record.module,
        "module_class": record.module_class,
        "phase": record.phase,
        "forward_op": None if forward is None else str(forward),
        "inputs": [meta_fields(meta) for meta in record.inputs],
        "outputs": None if outputs is None else [meta_fields(meta) for meta in outputs],
        "args": [[name, encode(value)] for name, value in record.args],
        "flags": list(record.flags),
        "start_ns": record.start_ns,  # perf_counter_ns around the kernel
        "end_ns": record.end_ns,
    }


def _anomaly_fields(anomaly) -> dict:
    """An anomaly's facts: its kind, op and finding (the text is rendered again on reading)."""
    return {
        "kind": anomaly.kind,
        "index": anomaly.index,
        "op": anomaly.op,
        "received": anomaly.received,
        "finding": finding_fields(anomaly.finding),
    }


# -- reading back ---------------------------------------------------------------------------


def load(path, *, partial: bool = False) -> SavedLog:
    """Read a log written by :meth:`Watch.export_jsonl`; ``opwatch.load("run.jsonl")``.

    The result is read-only and offers what a watch offers for reading: ``records``,
    ``anomalies``, ``contained``, ``allowed``, ``rank``, ``table(last=None)`` and
    ``summary()``, which print what the watch printed: each message is rendered again from the
    saved facts (file paths shown relative to the working directory, as the watch shows them).
    A file of another format version is a ``ValueError`` naming the versions this opwatch reads.

    A log cut short (a run killed while writing it, a partial copy) is a ``ValueError`` naming
    what its header promised and what was read: read as it is, it would look like a run with
    fewer anomalies, or none. ``partial=True`` reads what there is instead (a last line cut in
    the middle is left out): ``opwatch.load("run.jsonl", partial=True)``.
    """
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
    if not isinstance(partial, bool):
        raise TypeError(f"partial must be True or False, got {partial!r}")
    with open(path, encoding="utf-8") as stream:
        text = stream.read()
    lines = text.splitlines()
    cut_line = None  # the number of a last line cut in the middle (no newline, not JSON)
    if len(lines) > 1 and not text.endswith("\n") and not _is_json(lines[-1]):
        cut_line = len(lines)
        lines.pop()
    if not lines:
        raise ValueError(f"{path}: empty file; expected an opwatch JSON Lines log written by Watch.export_jsonl")
    header = _parse(path, 1, lines[0])
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{path}: not an opwatch log (its first line has no \"format\": \"{FORMAT}\"); write one with Watch.export_jsonl")
    _check_version(path, header.get("version"))
    upgraded = _upgraded_v3 if header.get("version") == 3 else _as_written
    sites: dict[int, SavedPosition] = {}
    records: list[SavedRecord] = []
    by_index: dict[int, SavedRecord] = {}
    groups: dict[str, list[SavedAnomaly]] = {name: [] for name in _GROUPS}
    rank = header.get("rank")
    guarded: list[dict] = []  # the failed and skipped steps of a --guard run
    for number, text in enumerate(lines[1:], 2):
        if not text.strip():
            continue
        line = _parse(path, number, text)
        kind = line.get("type") if isinstance(line, dict) else None
        try:
            if kind == "site":
                sites[line["site"]] = SavedPosition.of(line)
            elif kind == "record":
                record = SavedRecord(upgraded(line), sites[line["site"]], rank)
                records.append(record)
                by_index[record.index] = record
            elif kind == "guard_step":
                guarded.append({name: value for name, value in line.items() if name != "type"})
            elif kind == "anomaly":
                record = SavedRecord(upgraded(line["record"]), sites[line["record"]["site"]], rank) if "record" in line else by_index[line["index"]]
                groups[line["in"]].append(SavedAnomaly(line, record))
            else:
                raise ValueError(f"unknown line type {kind!r}")
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}:{number}: not a valid opwatch log line ({type(error).__name__}: {error})") from None
    cut = _shortfall(header, records, groups, cut_line)
    if cut is not None and not partial:
        _check_complete(path, *cut)
    return SavedLog(header, records, groups, cut=cut, guard=guarded)


def _as_written(fields: dict) -> dict:
    return fields


def _upgraded_v3(fields: dict) -> dict:
    """A version 3 record's fields as versions 4 and 5 write them: its module label
    (``"enc.0 (Linear)"``, the class shown where the path ends in an index) split into the
    path and the class. A label without a class (``"encoder.attn"``, ``"Net"``,
    ``"torch.compile graph 3 (forward)"``) is the path, its class unknown."""
    label = fields.get("module")
    path, cls = label, None
    if isinstance(label, str) and label.endswith(")"):
        head, _, tail = label.partition(" (")
        _, _, last = head.rpartition(".")
        if last.isdigit():
            path, cls = head, tail[:-1]
    return {**fields, "module": path, "module_class": cls}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _shortfall(header: dict, records: list, groups: dict, cut_line: int | None) -> tuple | None:
    """``(promised, read, cut_line)`` for a log that holds fewer records or anomalies than its
    header counted, or whose last line is cut; ``None`` for a whole log."""
    read = {"records": len(records), **{name: len(group) for name, group in groups.items()}}
    promised = {name: header.get(name) for name in read}
    if cut_line is None and all(not isinstance(count, int) or count == read[name] for name, count in promised.items()):
        return None
    return promised, read, cut_line


def _check_complete(path, promised: dict, read: dict, cut_line: int | None) -> None:
    """Raise for a log cut short (:func:`_shortfall`)."""
    told = ", ".join(f"{count} {name}" for name, count in promised.items() if isinstance(count, int))
    got = ", ".join(f"{count} {name}" for name, count in read.items())
    raise ValueError(
        f"{path}: the log is cut short (a run killed while writing it, or a partial copy): its header promises "
        f"{told}; read {got}{'' if cut_line is None else f', and line {cut_line} is cut in the middle'}. Read what there is with opwatch.load(path, partial=True) or show --partial"
    )


def _check_version(path, version) -> None:
    if isinstance(version, int) and not isinstance(version, bool) and version in READS:
        return
    *earlier, last = map(str, READS)
    accepted = f"versions {', '.join(earlier)} and {last}" if earlier else f"version {last}"
    if isinstance(version, int) and version > VERSION:
        raise ValueError(f"{path}: written in opwatch log version {version!r}; this opwatch reads {accepted}: upgrade opwatch to read it")
    raise ValueError(
        f"{path}: written in opwatch log version {version!r}; this opwatch reads {accepted}: "
        "export the run again with this opwatch (older versions stored the messages' text, not their facts)"
    )


def _parse(path, number: int, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{number}: not JSON ({error})") from None


class SavedLog:
    """A log read back by :func:`load`: what the watch that wrote it recorded, read-only.

    Attributes:
        records: the records (:class:`SavedRecord`), oldest first.
        anomalies / contained / allowed: the anomalies, contained nan/inf origins and allowed
            findings (:class:`SavedAnomaly`).
        header: the file's first line: format, version, opwatch, torch and Python versions,
            rank (``None`` outside a distributed job), strict, counts.
        rank: the watch's rank, as :attr:`Watch.rank`.
    """

    __slots__ = ("header", "_records", "_anomalies", "_contained", "_allowed", "_cut", "_guard")

    def __init__(self, header: dict, records: list, groups: dict, *, cut: tuple | None = None, guard=()):
        self.header = header
        self._guard = tuple(guard)
        self._cut = cut  # (promised, read, cut_line) of a log cut short, read with partial=True
        self._records = tuple(records)
        self._anomalies = tuple(groups["anomalies"])
        self._contained = tuple(groups["contained"])
        self._allowed = tuple(groups["allowed"])

    @property
    def records(self) -> list[SavedRecord]:
        return list(self._records)

    @property
    def anomalies(self) -> list[SavedAnomaly]:
        return list(self._anomalies)

    @property
    def contained(self) -> list[SavedAnomaly]:
        return list(self._contained)

    @property
    def allowed(self) -> list[SavedAnomaly]:
        return list(self._allowed)

    @property
    def rank(self) -> int | None:
        """The watch's rank in a ``torch.distributed`` job, ``None`` outside one."""
        return self.header.get("rank")

    @property
    def guard(self) -> dict | None:
        """A ``--guard`` run's ledger as saved: its counts (``steps``, ``audited``, ``failed``,
        ``skipped``; ``scaler_skipped``, the steps GradScaler skipped, ``scaler_skipped_loss``,
        those of them whose loss was not finite before it was scaled, and ``evaluations_nan``,
        the calls with gradients off that returned nan, in a log saved since each was counted) and ``failures``, a dict per failed step (``step``, ``cause``, ``action``,
        ``parameters``, ``loss``, ``origin``, ``batch``: what a bad batch held, its ``model``,
        ``argument``, ``kind``, ``where``, ``call`` and ``rank``); ``None`` for a log of no
        guarded run."""
        counts = self.header.get("guard")
        return None if counts is None else {**counts, "failures": [dict(row) for row in self._guard]}

    @property
    def fingerprints(self) -> dict | None:
        """Op index -> its outputs' fingerprints, as :attr:`Watch.fingerprints`;
        ``None`` for a log recorded without ``fingerprints=True``."""
        if not self.header.get("fingerprints"):
            return None
        return {record.index: record.fingerprints for record in self._records if record.fingerprints is not None}

    def table(self, last: int | None = None, *, tablefmt: str = "simple") -> str:
        """The op table, as :meth:`Watch.table` prints it."""
        from ..render import render_table

        records = list(self._records)
        if last is not None:
            if isinstance(last, bool) or not isinstance(last, int):
                raise TypeError(f"last must be an int, got {type(last).__name__}")
            if last < 0:
                raise ValueError(f"last must be 0 or more, got {last}")
            records = records[-last:] if last else []
        return render_table(records, tablefmt=tablefmt)

    def summary(self) -> str:
        """The summary, as :meth:`Watch.summary` prints it; for a log cut short (read with
        ``partial=True``), first a line saying so and how many of the anomalies its header
        promised were read."""
        from ..render import render_summary

        return render_summary(self._anomalies, self._contained, self._allowed, rank=self.rank, cut=self._cut)

    def _repr_html_(self) -> str:
        """What a notebook shows, as for a watch."""
        from ..render.html_repr import watch_html

        return watch_html(self)

    def report_html(self, path) -> None:
        """Write the report, as :meth:`Watch.report_html` writes it."""
        from ..render.html import render_report

        with open(path, "w", encoding="utf-8") as stream:
            stream.write(render_report(self))

    def __repr__(self) -> str:
        return f"<SavedLog {len(self._records)} records, {len(self._anomalies)} anomalies, {len(self._contained)} contained, {len(self._allowed)} allowed>"


class SavedPosition:
    """A record's source position, with the source text saved at export time: the same
    attributes and methods as the position of a live record, without reading the file."""

    __slots__ = ("filename", "lineno", "end_lineno", "col", "end_col", "_text", "_expression", "_carets")

    def __init__(self, filename, lineno, end_lineno, col, end_col, *, text: str, expression: str | None, carets: list[str]):
        self.filename = filename
        self.lineno = lineno
        self.end_lineno = end_lineno
        self.col = col
        self.end_col = end_col
        self._text = text
        self._expression = expression
        self._carets = tuple(carets)

    @classmethod
    def of(cls, line: dict) -> SavedPosition:
        """The position of a ``site`` line."""
        return cls(
            line["filename"], line["lineno"], line["end_lineno"], line["col"], line["end_col"],
            text=line["text"], expression=line["expression"], carets=line["carets"],
        )

    def line_text(self) -> str:
        return self._text

    def expression(self) -> str | None:
        return self._expression

    def caret_lines(self) -> list[str]:
        return list(self._carets)


class SavedRecord(BaseRecord):
    """One op of a saved log: the record interface of :class:`opwatch.OpRecord`
    (:class:`~opwatch.core.records.BaseRecord`), read-only.

    ``func`` and ``forward_func`` are the ``OpOverload`` where this torch has that op, else
    its name; tensors' dtypes and devices are torch's objects where this torch knows them.
    """

    __slots__ = ("_fields", "position", "inputs", "outputs", "args", "rank")

    def __init__(self, fields: dict, position: SavedPosition, rank: int | None = None):
        self._fields = fields
        self.position = position
        self.inputs = tuple(meta_from_fields(meta) for meta in fields["inputs"])
        outputs = fields["outputs"]
        self.outputs = None if outputs is None else tuple(meta_from_fields(meta) for meta in outputs)
        self.args = tuple((name, decode(value)) for name, value in fields["args"])
        self.rank = rank

    flags = property(lambda self: tuple(self._fields["flags"]))
    index = property(lambda self: self._fields["index"])
    op = property(lambda self: self._fields["op"])
    module = property(lambda self: self._fields["module"])
    module_class = property(lambda self: self._fields.get("module_class"))
    phase = property(lambda self: self._fields["phase"])
    label = property(lambda self: self._fields.get("label"))
    start_ns = property(lambda self: self._fields.get("start_ns"))
    end_ns = property(lambda self: self._fields.get("end_ns"))

    @property
    def fingerprints(self) -> tuple | None:
        """The outputs' fingerprints, when the log was recorded with them."""

        fields = self._fields.get("fingerprints")
        return None if fields is None else fingerprints.decode(fields)

    @property
    def func(self):
        return op_named(self._fields["op"])

    @property
    def forward_func(self):
        forward = self._fields["forward_op"]
        return None if forward is None else op_named(forward)


class SavedAnomaly(BaseAnomaly):
    """One anomaly of a saved log: the anomaly interface of :class:`opwatch.Anomaly`
    (:class:`~opwatch.findings.anomaly.BaseAnomaly`). ``finding`` holds the saved facts; ``message`` is
    rendered from them as the watch rendered it."""

    __slots__ = ("record", "finding", "_received", "_message")

    def __init__(self, fields: dict, record: SavedRecord):
        self.record = record
        self.finding = finding_from_fields(fields["finding"])
        self._received = fields["received"]

    @property
    def received(self) -> bool:
        # As the watch judged it (a collective op this torch may not have cannot be asked).
        return self._received
