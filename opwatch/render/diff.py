"""The words of :func:`opwatch.diff`: the report of the first divergence and the aligned table.

Everything here reads the facts of an :class:`opwatch.diff.Diff` (records, fingerprints,
states); nothing here compares.
"""

from __future__ import annotations

from ..core.notation import format_meta
from ..core.sites import location
from .phrases import module_of

__all__ = ["render_diff", "render_diff_table", "DIFF_TABLE_HEADERS"]

DIFF_TABLE_HEADERS = ("#", "op in a", "where in a", "op in b", "where in b", "phase", "")
_STATUS = {"agreed": "=", "first": "<- first difference", "after": "", "only_a": "only in a", "only_b": "only in b"}
_SHOWN_ONLY = 5  # ops only in one run named in the report


def _op(record) -> str:
    return record.op.removesuffix(".default")


def _place(record) -> str:
    return f"{_op(record)} at {location(record)}"


def _number(value: float) -> str:
    return f"{value:.6g}"


def render_tolerance(tolerance) -> str:
    if tolerance.bitwise:
        return "compared bitwise"
    text = f"compared within rtol={tolerance.rtol:g}, atol={tolerance.atol:g} on each output's sum, L2 norm, min and max"
    if tolerance.reason == "compiled":
        (name,) = tolerance.dtypes
        text += f" (the default for a compiled run against an eager one: {name}'s, as torch.testing.assert_close; compiled kernels round and sum in another order)"
    if tolerance.reason == "layouts":
        (name,) = tolerance.dtypes
        text += f" (the default for a sharded run against a single-process one: {name}'s; the shards' statistics combine, their exact hashes do not)"
    if tolerance.reason == "dtypes":
        low, high = tolerance.dtypes
        text += f" (the default for {low}: the runs' dtypes differ, {low} against {high})"
    return text


def render_diff(result) -> str:
    """The report: both runs, how they were compared, the first divergence (or agreement), and
    the ops only one run has."""
    (label_a, label_b), (torch_a, torch_b) = result.labels, result.torch
    lines = [f"opwatch diff: a = {label_a} (torch {torch_a}), b = {label_b} (torch {torch_b}); {render_tolerance(result.tolerance)}."]
    first = result.first
    compiled = getattr(result, "compiled", None)
    if compiled is not None:
        lines.append(_render_level(result, compiled))
    for name, ranks in zip("ab", getattr(result, "ranks", (1, 1))):
        if ranks > 1:
            lines.append(
                f"Run {name} is {ranks} ranks' logs, combined: each DTensor output's shards by its placement (Shard: sums and "
                "squares added, min and max of the ranks; Replicate and plain tensors: rank 0's; Partial: not compared); "
                "its collectives and redistributions are ops in one run only."
            )
    if first is None:
        if compiled is not None:
            lines.append(f"The runs agree at the level both can see: {result.compared} records of the compiled run compared with the eager op of the same line, phase, size and dtype.")
        elif result.agree:
            lines.append(f"The runs agree: {len(result.pairs)} ops aligned, {result.compared} with fingerprints compared.")
        else:
            lines.append(f"No aligned op differs ({result.compared} compared), but some ops ran in one run only.")
    else:
        lines += _render_first(first, result.tolerance, compiled is not None)
    lines += _render_only(result) if compiled is None else _render_unpaired(result, compiled)
    return "\n".join(lines)


def _render_level(result, compiled: str) -> str:
    eager = "b" if compiled == "a" else "a"
    return (
        f"Run {compiled} ran compiled (watch(compiled=...)): what its graphs made (every node under an AOT backend, "
        f"each graph's outputs under inductor) is paired with the op of run {eager} on the same line, phase, size "
        f"and dtype; {result.not_visible} ops of run {eager} are not visible in the compiled run (fused or "
        "decomposed) and not compared."
    )


def _render_unpaired(result, compiled: str) -> list[str]:
    records = result.only_in_a if compiled == "a" else result.only_in_b
    if not records:
        return []
    counts: dict = {}
    for record in records:
        counts[_place(record)] = counts.get(_place(record), 0) + 1
    shown = ", ".join(place + (f" ({count} times)" if count > 1 else "") for place, count in list(counts.items())[:_SHOWN_ONLY])
    more = f" and {len(counts) - _SHOWN_ONLY} more places" if len(counts) > _SHOWN_ONLY else ""
    return [
        f"{len(records)} record{'s' if len(records) != 1 else ''} of run {compiled} had no eager op of the same line, phase, size "
        f"and dtype that agrees (not compared): {shown}{more}."
    ]


def _render_first(first, tolerance, compiled: bool = False) -> list[str]:
    a, b = first.a, first.b
    phase = first.a.phase
    module = f" in module {module_of(a)}" if a.module else ""
    lines = [f"The runs first differ at {_op(a)} ({phase}{module}): {location(a)} in a, {location(b)} in b."]
    if phase == "backward":
        lines.append("  A backward op: its line is that of the forward op it computes the gradient of.")
    for name, record in (("a", a), ("b", b)):
        text = record.position.line_text().strip() if record.filename else ""
        if text:
            lines.append(f"    {name}  {location(record)}  {text}")
    lines += _render_outputs(first, tolerance)
    if compiled:
        lines.append("  " + _render_compiled_inputs(first, tolerance))
        return lines
    if tuple(a.args) != tuple(b.args):
        lines.append(f"  Its other arguments differ: {_args(a)} in a, {_args(b)} in b.")
    lines.append("  " + _render_inputs(first, tolerance))
    return lines


def _render_compiled_inputs(first, tolerance) -> str:
    """Why a compiled record differs from its eager op: a node whose inputs agreed is computed
    differently by the compiled graph; a graph output (inductor) hides how it was made."""
    graph = next((record.module for record in (first.a, first.b) if (record.module or "").startswith("torch.compile graph")), None)
    if not first.inputs:
        return (
            f"A compiled graph's output ({graph}): the kernels that made it are not visible, so the op inside the graph that "
            "differs first is not known here. Record the compiled run with compiled=\"aot_eager\" to see every node: when it "
            "agrees, the difference is inductor's own (its decompositions or kernels); else it names the node."
        )
    inputs = first.inputs
    made = "; ".join(_input_origin(position, record_a, record_b, state) for position, state, record_a, record_b in inputs)
    if first.verdict == "inputs_differ":
        differed = [position for position, state, _, _ in inputs if state == "differed"]
        return f"Its input {_positions(differed)} already differed ({made}): the difference grew here."
    return (
        f"Its inputs agreed, or were made before the watch ({made}): the compiled graph ({graph}) computes this node "
        "differently from eager (a backend pass that changed its math, a miscompile, or a kernel that rounds beyond the tolerance)."
    )


def _args(record) -> str:
    return "(" + ", ".join(f"{name}={value!r}" for name, value in record.args) + ")"


def _render_outputs(first, tolerance) -> list[str]:
    a, b = first.a, first.b
    position = first.output
    outputs_a, outputs_b = a.outputs or (), b.outputs or ()
    if first.reason == "shape":
        if len(outputs_a) != len(outputs_b):
            return [f"  It has {len(outputs_a)} outputs in a and {len(outputs_b)} in b."]
        return [f"  Output {position} has another shape: {format_meta(outputs_a[position])} in a, {format_meta(outputs_b[position])} in b."]
    metas = f"{format_meta(outputs_a[position])} in a, {format_meta(outputs_b[position])} in b"
    if first.reason == "dtype":
        return [f"  Output {position} has another dtype: {metas}."]
    gaps = first.gaps()
    how = "bitwise" if tolerance.bitwise else "beyond the tolerance"
    lines = [f"  Output {position} differs {how} ({metas})."]
    if all(gap == 0 for *_, gap in gaps):
        lines.append("    Its sum, L2 norm, min and max are equal in both runs: the same values in another order, or differences too small for them.")
        return lines
    stats = ", ".join(f"{name} {_number(x)} against {_number(y)}" for name, x, y, _ in gaps)
    name, x, y, gap = max(gaps, key=lambda found: found.relative)
    lines.append(f"    {stats}; the largest difference: {name}, relative {gap:.2g}.")
    return lines


def _render_inputs(first, tolerance) -> str:
    inputs = first.inputs
    if not inputs:
        return "It has no tensor inputs: the op itself made the difference (a random op differs when the runs are not seeded alike)."
    whole = first.whole_script
    made = "; ".join(_input_origin(position, record_a, record_b, state, whole) for position, state, record_a, record_b in inputs)
    if first.verdict == "made_here" and tolerance.reason == "dtypes":
        low, high = tolerance.dtypes
        return (
            f"Its inputs agreed within the tolerance ({made}): this op lost the precision, its {low} result "
            f"far from the {high} one (a cancellation, an overflow, a long reduction)."
        )
    if first.verdict == "made_here":
        return (
            f"Its inputs agreed ({made}): this op made the difference (a random op not seeded alike, a "
            "nondeterministic kernel, or a change to this op or its arguments)."
        )
    if first.verdict == "inputs_differ":
        differed = [position for position, state, _, _ in inputs if state == "differed"]
        return (
            f"Its input {_positions(differed)} already differed ({made}), within the tolerance where it was made "
            "or made by an op one run only has: the difference grew here."
        )
    before = [position for position, state, _, _ in inputs if state == "before_watch"]
    if first.verdict == "before_watch" and whole:
        # python -m opwatch watched from line 1: starting the watch earlier is no advice.
        which = "Its inputs were" if len(before) == len(inputs) else f"Its inputs made in the log agreed; input {_positions(before)} was"
        if first.log_cut:
            return (
                f"{which} made by ops that left the bounded log ({made}; the watch ran from the script's first "
                "line, and the log keeps its last max_records ops), so no fingerprint covers them: those inputs "
                "differ between the runs, or the op is not deterministic. Watch the step that differs in both "
                "runs (opwatch.watch(fingerprints=True) around it in the script, then Watch.export_jsonl), so "
                "that the log holds the ops that made its inputs."
            )
        return (
            f"{which} made where opwatch sees no op ({made}; the watch ran from the script's first line: "
            "another thread or process, or an extension), so no fingerprint covers them: those inputs differ "
            "between the runs, or the op is not deterministic. Compare those inputs directly (torch.save them "
            "in both runs)."
        )
    if first.verdict == "before_watch":
        if len(before) == len(inputs):
            return (
                "Its inputs were made before the watch, where opwatch has no fingerprints: the inputs made "
                "before the watch differ, or the op is not deterministic. Start the watch before they are made."
            )
        return (
            f"Its inputs made in the watch agreed; input {_positions(before)} was made before the watch ({made}): "
            "either the inputs made before the watch differ, or the op is not deterministic."
        )
    unknown = [position for position, state, _, _ in inputs if state == "unknown"]
    return f"Input {_positions(unknown)} was made by an op without fingerprints ({made}): whether it agreed is not known."


def _input_origin(position: int, record_a, record_b, state: str, whole_script: bool = False) -> str:
    if state == "before_watch":
        return f"input {position} made before the log's first op" if whole_script else f"input {position} made before the watch"
    if state == "no_values":
        return f"input {position} uninitialised memory"
    if record_a is not None and record_b is not None and location(record_a) == location(record_b) and record_a.op == record_b.op:
        return f"input {position} made by {_place(record_a)}"
    made_a = _place(record_a) if record_a is not None else "nothing"
    made_b = _place(record_b) if record_b is not None else "nothing"
    return f"input {position} made by {made_a} in a, {made_b} in b"


def _positions(positions: list[int]) -> str:
    return ", ".join(str(position) for position in positions)


def _render_only(result) -> list[str]:
    lines = []
    for name, records in (("a", result.only_in_a), ("b", result.only_in_b)):
        if not records:
            continue
        counts: dict = {}  # each place once, in order, with how often
        for record in records:
            counts[_place(record)] = counts.get(_place(record), 0) + 1
        shown = ", ".join(place + (f" ({count} times)" if count > 1 else "") for place, count in list(counts.items())[:_SHOWN_ONLY])
        more = f" and {len(counts) - _SHOWN_ONLY} more places" if len(counts) > _SHOWN_ONLY else ""
        lines.append(f"{len(records)} op{'s' if len(records) != 1 else ''} only in {name}: {shown}{more}.")
    return lines


def render_diff_table(rows, *, tablefmt: str = "simple") -> str:
    """``rows``: ``(number, record in a or None, record in b or None, status)``."""
    from tabulate import tabulate

    table = []
    for number, record_a, record_b, status in rows:
        phase = (record_a or record_b).phase
        table.append((
            number,
            _op(record_a) if record_a is not None else "",
            location(record_a) if record_a is not None else "",
            _op(record_b) if record_b is not None else "",
            location(record_b) if record_b is not None else "",
            phase,
            _STATUS[status],
        ))
    return tabulate(table, headers=DIFF_TABLE_HEADERS, tablefmt=tablefmt, disable_numparse=True)


def cannot_compare(error) -> str:
    """``python -m opwatch diff``'s line when a log cannot be read or compared."""
    return f"python -m opwatch diff: {error}"
