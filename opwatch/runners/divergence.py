"""``opwatch.diff(a, b)``: which op first made two runs differ, on which line. (Named
``divergence``, not ``diff``: a submodule ``opwatch.diff`` would shadow the function.)

Both runs are recorded with ``watch(fingerprints=True)`` (or ``python -m opwatch
--fingerprints``): every op output has a fingerprint, an exact hash of its bits and its sum,
L2 norm, min and max (:mod:`opwatch.checks.fingerprints`).

1. *Align.* Each op is keyed by (op, source file name and the text of its line, module path,
   phase); the two key sequences are aligned by a shortest edit script (Myers), so an op
   that exists in one run only is reported as such and the rest still lines up. The line's
   text, not its number: a line inserted above moves every later number, not their text.
   Stretches that do not line up (an edited line) are aligned again on (op, file name, module,
   phase). File names, not paths: the runs may come from two machines or checkouts.
2. *Compare.* Aligned ops in order: outputs bitwise (hash, shape, dtype) by default; with a
   tolerance, each statistic within ``atol + rtol * scale`` (the scale of a sum is the larger
   of its size and the L2 norm, of a min or max the largest magnitude: sums of values near zero
   do not make every op differ). When the runs' dtypes differ (bf16 against fp32) and no
   tolerance is given, the default follows the lower precision (:data:`DEFAULT_TOLERANCES`).
3. *Explain.* For the first aligned op whose outputs differ, its inputs are followed to the ops
   that produced them in each run (through views and clones, which hold their input's values),
   and their fingerprints compared: the inputs agreed (this op made the difference), one
   already differed, or one was made before the watch (which no fingerprint covers).

What it cannot see: ops outside the watch, ops that left the bounded log (``max_records``),
in-place writes through a view into a tensor read later under its other name, and values
that differ only in ways the chosen tolerance hides.
"""

from __future__ import annotations

import math
import os
import re
from typing import NamedTuple

from ..storage.jsonl import SavedLog, load
from ..core.ops import facts_of
from ..render.diff import render_diff, render_diff_table
from ..session import Watch
from .divergence_compiled import compiled_side, compiled_tolerance, pair_compiled
from .divergence_layouts import is_ranks, open_ranks
from .divergence_align import matches as _matches

__all__ = ["diff", "Diff", "Divergence", "Tolerance", "DEFAULT_TOLERANCES"]

# dtype name -> (rtol, atol): torch.testing.assert_close's defaults; float8 by its mantissa.
DEFAULT_TOLERANCES = {
    "float64": (1e-7, 1e-7),
    "float32": (1.3e-6, 1e-5),
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float8_e4m3fn": (1.25e-1, 1e-5),
    "float8_e5m2": (2.5e-1, 1e-5),
}

AGREED = "agreed"  # its producers' fingerprints agree (within the tolerance)
DIFFERED = "differed"  # they differ
BEFORE_WATCH = "before_watch"  # made before the watch (or outside torch ops): not fingerprinted
NO_VALUES = "no_values"  # uninitialised memory (empty_like): there are no values to compare
UNKNOWN = "unknown"  # made by an op whose outputs were not fingerprinted (an odd dtype, a collective)


class Output(NamedTuple):
    """Where a tensor's values were made in one run: an output of the op at ``step``."""

    step: int  # the op's position in the run's records
    position: int  # which of its outputs


class DtypePair(NamedTuple):
    """The two runs' dtype names where they differ, the lower precision first."""

    lower: str
    higher: str


class Gap(NamedTuple):
    """How far one statistic of the divergent output differs between the runs."""

    statistic: str  # "sum", "norm", "min" or "max"
    a: float  # its value in run a
    b: float  # in run b
    relative: float  # |a - b| over the statistic's scale


# A made-tensor marker: an Output; these two stand for the rest.
_BEFORE = None
_EMPTY = Output(-1, -1)


class Tolerance:
    """How outputs are compared: ``bitwise``, or ``rtol``/``atol`` on the statistics;
    ``reason``: ``"bitwise"``, ``"given"``, ``"dtypes"`` (the runs' dtypes differ:
    ``dtypes`` holds the two dtype names, lower precision first), ``"compiled"`` (a compiled run
    against an eager one) or ``"layouts"`` (a sharded run's ranks against a single process);
    for the last two ``dtypes`` holds the one dtype name whose default was taken."""

    __slots__ = ("rtol", "atol", "reason", "dtypes")

    def __init__(self, rtol: float | None, atol: float | None, reason: str, dtypes: tuple = ()):
        self.rtol, self.atol, self.reason, self.dtypes = rtol, atol, reason, dtypes

    @property
    def bitwise(self) -> bool:
        return self.rtol is None

    def close(self, a: tuple, b: tuple) -> bool:
        """Whether fingerprints ``a`` and ``b`` agree."""
        if self.rtol is None:
            return a.hash == b.hash
        return all(difference <= self.atol + self.rtol * scale for difference, scale in _gaps(a, b))


def _gaps(a: tuple, b: tuple) -> list[tuple[float, float]]:
    """``(|a - b|, scale)`` of sum, norm, min and max; 0 where both are the same (nan, inf)."""
    norm = max(abs(a.norm), abs(b.norm))
    magnitude = max(abs(a.min), abs(a.max), abs(b.min), abs(b.max))
    scales = (max(abs(a.sum), abs(b.sum), norm), norm, magnitude, magnitude)
    gaps = []
    for x, y, scale in zip(a[1:], b[1:], scales):
        same = x == y or (math.isnan(x) and math.isnan(y))
        gaps.append((0.0 if same else (abs(x - y) if math.isfinite(x - y) else math.inf), scale if math.isfinite(scale) else 0.0))
    return gaps


class Divergence:
    """The first aligned op whose outputs differ, as facts.

    Attributes:
        a / b: the op's record in each run (``OpRecord`` or ``SavedRecord``).
        output: the position of the first output that differs.
        reason: ``"shape"`` (shapes or the number of outputs differ), ``"dtype"``, or
            ``"values"``.
        print_a / print_b: that output's fingerprints ``(hash, sum, norm, min, max)`` (``None``
            for ``"shape"``).
        inputs: per tensor input, ``(position, state, producer in a, producer in b)`` with a
            state of ``AGREED``, ``DIFFERED``, ``BEFORE_WATCH``, ``NO_VALUES``, ``UNKNOWN`` and
            the producers' records (``None`` where there is none).
        verdict: ``"made_here"`` (every input agreed, or it has none), ``"inputs_differ"``,
            ``"before_watch"`` (inputs made in the watch agreed, others were made before it),
            ``"unknown"``.
        whole_script: both runs were watched from their script's first line (logs written by
            ``python -m opwatch --jsonl``): an input "made before the watch" was made by an op
            that left the bounded log, or outside the ops opwatch sees.
        log_cut: a run's log lost its first ops (``max_records``).
    """

    __slots__ = ("a", "b", "output", "reason", "print_a", "print_b", "inputs", "verdict", "whole_script", "log_cut")

    def __init__(self, a, b, output, reason, print_a, print_b, inputs, verdict, whole_script=False, log_cut=False):
        self.a, self.b, self.output, self.reason = a, b, output, reason
        self.print_a, self.print_b, self.inputs, self.verdict = print_a, print_b, inputs, verdict
        self.whole_script, self.log_cut = whole_script, log_cut

    @property
    def lines(self) -> tuple[str, str]:
        """Where the op ran in each run: ``("train.py:23", "train.py:24")``."""
        return self.a.where, self.b.where

    def gaps(self) -> list[Gap]:
        """``Gap(statistic, value in a, value in b, relative difference)`` of sum, norm, min, max."""
        if self.print_a is None:
            return []
        found = []
        for name, x, y, (gap, scale) in zip(("sum", "norm", "min", "max"), self.print_a[1:], self.print_b[1:], _gaps(self.print_a, self.print_b)):
            found.append(Gap(name, x, y, gap / scale if scale else (0.0 if not gap else math.inf)))
        return found

    def __repr__(self) -> str:
        return f"<Divergence {self.a.op} at {self.a.where} / {self.b.where} {self.a.phase}: {self.reason}, {self.verdict}>"


class _Run:
    """One side: its records, fingerprints, alignment keys and the producer of each input."""

    def __init__(self, source, name: str):
        self.ranks = 1  # several: the ranks' logs of a sharded run, combined (divergence_layouts)
        if is_ranks(source):
            self.label, self.torch, records, prints, self.whole_script, self.ranks = _open_ranks(source, name)
        else:
            # whole_script: watched from the script's first line (python -m opwatch --jsonl)
            self.label, self.torch, records, prints, self.whole_script = _open(source, name)
        self.records = records
        self.cut = bool(records) and records[0].index > 0  # the bounded log lost its first ops
        self.prints = prints
        self.keys, self.loose = _keys_of(records)
        self.producers = _producers(records, prints)

    def fingerprints(self, step: int):
        return self.prints.get(self.records[step].index)

    def fingerprint(self, made: Output) -> tuple | None:
        """The fingerprint of output ``made``."""
        prints = self.fingerprints(made.step)
        return prints[made.position] if prints is not None and made.position < len(prints) else None


def _keys_of(records) -> tuple[list, list]:
    """The alignment keys of ``records``: (op, file name, line text, module, phase), and the
    same without the line's text."""
    keys, loose = [], []
    texts: dict = {}  # (file, line) -> the line's text, read once
    for record in records:
        position = record.position
        base = os.path.basename(position.filename) if position.filename else getattr(record, "label", None)
        place = (position.filename, position.lineno)
        text = texts.get(place)
        if text is None:
            text = texts[place] = position.line_text().strip() if position.filename else ""
        module = record.module
        if module and "FSDP" in module:  # fully_shard renames each class: FSDPLinear is Linear
            module = _FSDP_CLASS.sub("", module)
        keys.append((record.op, base, text, module, record.phase))
        loose.append((record.op, base, module, record.phase))
    return keys, loose


_FSDP_CLASS = re.compile(r"(?<![A-Za-z0-9_])FSDP(?=[A-Z])")


def _open_ranks(source, name: str):
    """``(label, torch version, records, fingerprints, whole script, ranks)`` of a sharded
    run's ranks' logs (:func:`opwatch.runners.divergence_layouts.open_ranks`)."""
    return open_ranks(source, name, _open, lambda records: _keys_of(records)[:1], _matches)


def _open(source, name: str):
    """``(label, torch version, records, fingerprints, whole script)`` of a Watch, a SavedLog or
    a path; ``whole script``: a log whose header says its watch ran from the script's first line."""
    if isinstance(source, (str, os.PathLike)):
        label, source = os.fspath(source), load(source)
    elif isinstance(source, SavedLog):
        label = "saved log"
    elif isinstance(source, Watch):
        if source._interceptor is not None:
            raise ValueError(f"opwatch.diff: watch {name} is still running; diff it once its with-block has ended")
        label = "watch"
    else:
        raise TypeError(
            f"opwatch.diff: {name} must be an opwatch.Watch, a log read by opwatch.load or the path of a "
            f".jsonl log written by Watch.export_jsonl / python -m opwatch --jsonl (for a sharded run, a list "
            f"or a directory of its ranks' logs), got {type(source).__name__}"
        )
    prints = source.fingerprints
    if prints is None:
        raise ValueError(
            f"opwatch.diff: {name} ({label}) was recorded without fingerprints; record both runs with "
            "opwatch.watch(fingerprints=True) or python -m opwatch --fingerprints --jsonl PATH script.py"
        )
    whole_script = False
    if isinstance(source, SavedLog):
        version = source.header.get("torch")
        whole_script = bool(source.header.get("whole_script"))
    else:
        import torch

        version = torch.__version__
    return label, version, source.records, prints, whole_script


def _producers(records, prints) -> list[tuple]:
    """Per record, per tensor input: the :class:`Output` of the op that made it in
    this run (through views and clones, to the op that made their values), ``_EMPTY`` for
    uninitialised memory, ``_BEFORE`` when made before the watch."""
    made: dict = {}  # tensor ident -> Output | _EMPTY
    found = []
    for step, record in enumerate(records):
        inputs = tuple(made.get(meta.ident, _BEFORE) for meta in record.inputs)
        found.append(inputs)
        outputs = record.outputs or ()
        func = record.func
        facts = facts_of(func) if hasattr(func, "_schema") else None  # None: an op this torch lacks
        source = None  # None: each output holds its own values
        if facts is not None and facts.makes_new_data:
            source = _EMPTY
        elif inputs and (facts.is_view or facts.keeps_values if facts is not None else record.index not in prints):
            source = inputs[0]  # the values of its first input
        for position, meta in enumerate(outputs):
            made[meta.ident] = Output(step, position) if source is None else source
    return found


def align(a: _Run, b: _Run) -> list[tuple]:
    """``(step in a or None, step in b or None)`` for every op of both runs, in stream order."""
    return _align(a.keys, b.keys, a.loose, b.loose)


def _align(keys_a: list, keys_b: list, loose_a: list | None, loose_b: list | None) -> list[tuple]:
    pairs: list = []
    i = j = 0
    for match_i, match_j in [*_matches(keys_a, keys_b), (len(keys_a), len(keys_b))]:
        if match_i > i and match_j > j and loose_a is not None:
            # Ops in both runs between two matches (an edited line): align them without the line.
            for x, y in _align(loose_a[i:match_i], loose_b[j:match_j], None, None):
                pairs.append((None if x is None else i + x, None if y is None else j + y))
        else:
            pairs += [(x, None) for x in range(i, match_i)]
            pairs += [(None, y) for y in range(j, match_j)]
        if match_i < len(keys_a):
            pairs.append((match_i, match_j))
        i, j = match_i + 1, match_j + 1
    return pairs


def choose_tolerance(a: _Run, b: _Run, pairs, rtol, atol) -> Tolerance:
    """The tolerance given, else bitwise, else (dtypes differ) the lower precision's default."""
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0):
            raise ValueError(f"opwatch.diff: {name} must be a number of 0 or more (or None), got {value!r}")
    if rtol is not None or atol is not None:
        return Tolerance(float(rtol or 0.0), float(atol or 0.0), "given")
    lowest = None
    for i, j in pairs:
        if i is None or j is None:
            continue
        for x, y in zip(a.records[i].outputs or (), b.records[j].outputs or ()):
            names = (_dtype_name(x.dtype), _dtype_name(y.dtype))
            if len(set(names)) == 2 and all(name in DEFAULT_TOLERANCES for name in names):
                lower, higher = sorted(names, key=lambda name: -_rtol(name))
                if lowest is None or _rtol(lower) > _rtol(lowest.lower):
                    lowest = DtypePair(lower, higher)
    if lowest is None:
        return Tolerance(None, None, "bitwise")
    return Tolerance(*DEFAULT_TOLERANCES[lowest.lower], "dtypes", lowest)


def _rtol(name: str) -> float:
    rtol, _ = DEFAULT_TOLERANCES[name]
    return rtol


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def compare(a: _Run, b: _Run, i: int, j: int, tolerance: Tolerance, *, sizes_only: bool = False):
    """``None`` when op ``i`` of ``a`` and op ``j`` of ``b`` agree (or cannot be compared),
    else ``(output position, reason, print in a, print in b)``. ``sizes_only``: outputs of
    the same number of elements compare (a compiled graph's output may be a view of its op's)."""
    outputs_a, outputs_b = a.records[i].outputs or (), b.records[j].outputs or ()
    if len(outputs_a) != len(outputs_b):
        return (0, "shape", None, None)
    prints_a, prints_b = a.fingerprints(i), b.fingerprints(j)
    for position, (x, y) in enumerate(zip(outputs_a, outputs_b)):
        if (math.prod(x.shape or ()) != math.prod(y.shape or ())) if sizes_only else (tuple(x.shape or ()) != tuple(y.shape or ())):
            return (position, "shape", None, None)
        if prints_a is None or prints_b is None or position >= len(prints_a) or position >= len(prints_b):
            continue
        print_a, print_b = prints_a[position], prints_b[position]
        if print_a is None or print_b is None:
            continue
        if tolerance.bitwise and x.dtype != y.dtype:
            return (position, "dtype", print_a, print_b)
        if not tolerance.close(print_a, print_b):
            return (position, "values", print_a, print_b)
    return None


def explain_inputs(a: _Run, b: _Run, i: int, j: int, tolerance: Tolerance) -> tuple[list, str]:
    """The inputs of the divergent pair, each with its state, and the verdict."""
    inputs = []
    for position, (made_a, made_b) in enumerate(zip(a.producers[i], b.producers[j])):
        record_a = a.records[made_a.step] if made_a not in (_BEFORE, _EMPTY) else None
        record_b = b.records[made_b.step] if made_b not in (_BEFORE, _EMPTY) else None
        if made_a is _BEFORE or made_b is _BEFORE:
            state = BEFORE_WATCH
        elif made_a == _EMPTY and made_b == _EMPTY:
            state = NO_VALUES
        else:
            print_a = None if record_a is None else a.fingerprint(made_a)
            print_b = None if record_b is None else b.fingerprint(made_b)
            if print_a is None or print_b is None:
                state = UNKNOWN
            else:
                state = AGREED if tolerance.close(print_a, print_b) else DIFFERED
        inputs.append((position, state, record_a, record_b))
    states = {state for _, state, _, _ in inputs}
    if DIFFERED in states:
        verdict = "inputs_differ"
    elif BEFORE_WATCH in states:
        verdict = "before_watch"
    elif UNKNOWN in states:
        verdict = "unknown"
    else:
        verdict = "made_here"
    return inputs, verdict


class Diff:
    """What :func:`diff` found.

    Attributes:
        first: the first :class:`Divergence` (``None`` when every aligned op agrees); its
            ``a``/``b`` are both runs' records, ``lines`` their places.
        only_in_a / only_in_b: records of the ops that exist in one run only.
        agree: no aligned op differs and no op is in one run only.
        tolerance: the :class:`Tolerance` the outputs were compared with.
        pairs: the alignment, ``(record in a or None, record in b or None)`` in stream order.
        labels / torch: each run's source (a path, ``"watch"``, ``"saved log"``) and torch version.
        compared: how many aligned ops had fingerprints on both sides.
        compiled: ``"a"`` or ``"b"`` when that run was recorded with ``watch(compiled=...)``:
            its records are paired with the eager run's at the level both can see (``pairs``
            in its order; ``only_in_a``/``only_in_b`` its records without an eager counterpart);
            ``None`` for two runs aligned op by op.
        not_visible: for a compiled run, how many eager ops with fingerprints no compiled
            record pairs with (fused into a kernel, decomposed): not compared.
        ranks: ``(ranks of a, ranks of b)``: more than 1 for a side given as a sharded run's
            ranks' logs (a list, or a directory of ``.jsonl``), combined into one run; its ops
            in one run only (collectives, redistributions) do not make ``agree`` false.
    """

    def __init__(self, a: _Run, b: _Run, steps: list, tolerance: Tolerance, first, first_pair: int | None, compared: int, compiled: str | None = None):
        self.pairs = [(None if i is None else a.records[i], None if j is None else b.records[j]) for i, j in steps]
        self.only_in_a = [record for record, other in self.pairs if other is None]
        self.only_in_b = [other for record, other in self.pairs if record is None]
        self.first = first
        self.tolerance = tolerance
        self.labels = (a.label, b.label)
        self.torch = (a.torch, b.torch)
        self.compared = compared
        self._first_pair = first_pair
        self._statuses = None
        # "a" or "b": that run was recorded under watch(compiled=...), compared at the level
        # both runs can see (its records paired with the eager run's); None: op by op.
        self.compiled = compiled
        # (ranks of a, ranks of b): more than 1 for a sharded run given as its ranks' logs.
        self.ranks = (a.ranks, b.ranks)
        self._prints = (a.prints, b.prints)
        # Eager ops with fingerprints no compiled record was paired with (fused or decomposed
        # away): not compared.
        self.not_visible = 0
        if compiled is not None:
            eager, side = (b, 1) if compiled == "a" else (a, 0)
            paired = {pair[side] for pair in steps if None not in pair}
            self.not_visible = sum(1 for step in range(len(eager.records)) if step not in paired and eager.fingerprints(step))

    @property
    def agree(self) -> bool:
        """No aligned op differs and no op is in one run only; for a compiled run against an
        eager one, no paired op differs (at the level both can see)."""
        if self.compiled is not None:
            return self.first is None
        # A sharded run's own ops (collectives, redistributions) do not make the runs disagree.
        # Nor do the single run's ops that have no fingerprint (views, the gradients' detaches:
        # autograd's in one run, the DTensor gradients' own in the other).
        sharded_a, sharded_b = (ranks > 1 for ranks in self.ranks)
        if sharded_a or sharded_b:
            single = self.only_in_b if sharded_a else self.only_in_a
            prints_a, prints_b = self._prints
            prints = prints_b if sharded_a else prints_a
            return self.first is None and not any(prints.get(record.index) for record in single)
        return self.first is None and not self.only_in_a and not self.only_in_b

    def table(self, context: int = 5, *, tablefmt: str = "simple") -> str:
        """The aligned neighbourhood of the first divergence (``context`` ops either side; the
        start of both runs when they agree), both runs side by side."""
        return render_diff_table(self.rows(context), tablefmt=tablefmt)

    def rows(self, context: int = 5) -> list[tuple]:
        """The rows of :meth:`table`: ``(number, record in a or None, record in b or None,
        status)``, status one of ``"agreed"``, ``"first"``, ``"after"``, ``"only_a"``, ``"only_b"``."""
        if isinstance(context, bool) or not isinstance(context, int):
            raise TypeError(f"context must be an int, got {type(context).__name__}")
        if context < 0:
            raise ValueError(f"context must be 0 or more, got {context}")
        centre = self._first_pair if self._first_pair is not None else 0
        start = max(0, centre - context)
        return [(number, *self.pairs[number], self._status(number)) for number in range(start, min(len(self.pairs), centre + context + 1))]

    def _repr_html_(self) -> str:
        """What a notebook shows: the report's words and the aligned ops around the first
        difference (5 either side), marked."""
        from ..render.html_repr import diff_html

        return diff_html(self, self.rows(5))

    def report_html(self, path, *, context: int = 20) -> None:
        """Write both runs side by side to ``path``, one self-contained HTML page: the report
        of :func:`str`, then ``context`` aligned ops either side of the first divergence,
        marked. ``opwatch.diff(a, b).report_html("diff.html")``."""
        from ..render.html_diff import render_diff_report

        rows = self.rows(context)
        with open(path, "w", encoding="utf-8") as stream:
            stream.write(render_diff_report(self, rows))

    def _status(self, number: int) -> str:
        record_a, record_b = self.pairs[number]
        if record_a is None:
            return "only_b"
        if record_b is None:
            return "only_a"
        if number == self._first_pair:
            return "first"
        return "after" if self._first_pair is not None and number > self._first_pair else "agreed"

    def __str__(self) -> str:
        return render_diff(self)

    def __repr__(self) -> str:
        first = "" if self.first is None else f", first at {self.first.a.op} {self.first.a.where}"
        return f"<Diff {len(self.pairs)} ops, {len(self.only_in_a)} only in a, {len(self.only_in_b)} only in b{first}>"


def diff(a, b, *, rtol: float | None = None, atol: float | None = None) -> Diff:
    """Which op first made two runs differ, on which line. ::

        with opwatch.watch(fingerprints=True) as run_a:
            train_step(model_a, batch)
        with opwatch.watch(fingerprints=True) as run_b:
            train_step(model_b, batch)
        result = opwatch.diff(run_a, run_b)
        print(result)                 # the first op that differs, its line in each run, why
        print(result.table(context=5))

    ``a`` and ``b``: :class:`~opwatch.Watch` objects (their blocks ended), logs read by
    :func:`opwatch.load`, or paths of ``.jsonl`` logs, recorded with fingerprints; or, for a
    sharded run, a list or tuple of its ranks' logs or the directory that holds them, combined
    into the global tensors' statistics (:mod:`opwatch.runners.divergence_layouts`). A run
    recorded with ``watch(compiled=...)`` is compared with an eager run at the level both can
    see (:mod:`opwatch.runners.divergence_compiled`). Outputs are
    compared bitwise, or within ``rtol``/``atol`` (on each output's sum, L2 norm, min and max)
    when either is given; when the runs' dtypes differ (a bf16 run against an fp32 one) the
    default tolerance is the lower precision's (:data:`DEFAULT_TOLERANCES`), and the report
    says so. Returns a :class:`Diff`: ``.first``, ``.only_in_a``, ``.only_in_b``, ``.agree``,
    ``.table(context=N)``, and ``str()``.
    """
    run_a, run_b = _Run(a, "a"), _Run(b, "b")
    level = compiled_side(run_a, run_b)
    if level is None:
        steps = align(run_a, run_b)
        tolerance = choose_tolerance(run_a, run_b, steps, rtol, atol)
        if tolerance.bitwise and (run_a.ranks > 1 or run_b.ranks > 1):
            # Shards' statistics combine; their hashes do not: the dtype's default tolerance.
            name = _lowest_dtype(run_a if run_a.ranks > 1 else run_b)
            tolerance = Tolerance(*DEFAULT_TOLERANCES[name], "layouts", (name,))
    else:
        steps, tolerance = _compiled_steps(run_a, run_b, level, rtol, atol)
    first, first_pair, compared = None, None, 0
    for number, (i, j) in enumerate(steps):
        if i is None or j is None:
            continue
        if run_a.fingerprints(i) is not None and run_b.fingerprints(j) is not None:
            compared += 1
        found = compare(run_a, run_b, i, j, tolerance, sizes_only=level is not None) if first is None else None
        if found is not None:
            inputs, verdict = explain_inputs(run_a, run_b, i, j, tolerance)
            first = Divergence(
                run_a.records[i], run_b.records[j], *found, inputs, verdict,
                run_a.whole_script and run_b.whole_script, run_a.cut or run_b.cut,
            )
            first_pair = number
    return Diff(run_a, run_b, steps, tolerance, first, first_pair, compared, compiled=level)


def _lowest_dtype(run: _Run) -> str:
    """The lowest-precision floating dtype among ``run``'s outputs with fingerprints (float32
    when none is known)."""
    lowest = "float32"
    for step, record in enumerate(run.records):
        if run.fingerprints(step):
            for meta in record.outputs or ():
                name = _dtype_name(meta.dtype)
                if name in DEFAULT_TOLERANCES and _rtol(name) > _rtol(lowest):
                    lowest = name
    return lowest


def _compiled_steps(run_a: _Run, run_b: _Run, level: str, rtol, atol) -> tuple[list, Tolerance]:
    """A compiled run against an eager one (:mod:`opwatch.runners.divergence_compiled`): the
    pairs in the compiled run's order, and the tolerance (the dtype's default when none is given)."""
    compiled, eager = (run_a, run_b) if level == "a" else (run_b, run_a)
    tolerance = choose_tolerance(run_a, run_b, [], rtol, atol)
    if tolerance.reason != "given":
        rtol_, atol_, name = compiled_tolerance(compiled, _dtype_name, DEFAULT_TOLERANCES)
        tolerance = Tolerance(rtol_, atol_, "compiled", (name,))
    pairs = pair_compiled(compiled, eager, tolerance, _gaps)
    steps = pairs if level == "a" else [(j, i) for i, j in pairs]
    return steps, tolerance
