"""The summary of a watch, the dump after a failing block, and the note added to its exception.
(Every rank's anomalies in one summary: :mod:`.ranks`.)"""

from __future__ import annotations

from ..core.records import BaseRecord, short_op_name
from ..core.sites import location
from .phrases import module_of
from .table import DUMP_WIDTH, render_table

__all__ = ["in_phase", "render_summary", "render_disabled", "render_cut_short", "every_check", "raised_above", "render_failure", "exception_note", "overwritten_save_note", "tagged", "count_places", "group_messages", "for_the_command_line"]


def tagged(rank) -> str:
    """``opwatch`` outside a distributed job, ``opwatch (rank 1)`` in one."""
    return "opwatch" if rank is None else f"opwatch (rank {rank})"


# -- the summary ----------------------------------------------------------------------------


def in_phase(summary: str, phase: str) -> str:
    """The summary of a trainer's watch of ``phase`` batches (``validation``, ``test``,
    ``predict``), its tag naming the phase: ``opwatch (validation): no anomalies.``."""
    tag, colon, rest = summary.partition(":")
    return f"{tag} ({phase}){colon}{rest}" if tag.startswith("opwatch") else f"{phase}: {summary}"


def render_summary(anomalies, contained, allowed=(), *, rank: int | None = None, raised=None, ran=None, off=(), cut=None) -> str:
    """Distinct anomalies (one per kind, line, op and phase, with how often each fired), then a
    count of contained nan/inf origins and of allowed findings. ``rank``: the process's rank in
    a distributed job (``opwatch (rank 1): ...``). ``raised``: an anomaly whose message the
    reader has just seen in full (the ``AnomalyError`` of a strict watch): its group is its
    first line only.

    What was not looked at is said, never "no anomalies" alone: ``ran`` and ``off``, the check
    names that ran and the default ones that were turned off (``checks=[...]``); ``cut``, for a
    log cut short, ``(promised, read, cut_line)`` as :func:`render_cut_short` takes them."""
    groups: dict = {}
    shown = None
    for anomaly in anomalies:
        key = (anomaly.kind, anomaly.filename, anomaly.lineno, anomaly.op, anomaly.phase)
        if key in groups:
            first, count = groups[key]
            groups[key] = [first, count + 1]
        else:
            groups[key] = [anomaly, 1]
        if anomaly is raised:
            shown = key
    lines = [render_cut_short(*cut)] if cut is not None else []
    among = " among what was read" if cut is not None else ""
    if off and not ran:
        lines.append(f"{tagged(rank)}: no check ran (off: {', '.join(off)}), so no anomaly could be found: the ops were only recorded.")
    elif not groups and off:
        lines.append(f"{tagged(rank)}: no anomalies{among} among the checks that ran ({', '.join(ran)}); off: {', '.join(off)}.")
    elif not groups:
        lines.append(f"{tagged(rank)}: no anomalies{among}.")
    else:
        lines.append(f"{tagged(rank)}: {count_places(groups)}{among}:")
        lines += group_messages(groups, shown=shown)
    if contained:
        lines.append("")
        lines.append(f"({len(contained)} nan/inf origin(s) were absorbed before they mattered; see Watch.contained)")
    if allowed:
        lines.append("")
        lines.append(f"({len(allowed)} finding(s) matched an allow entry; see Watch.allowed)")
    if groups and off:
        lines.append("")
        lines.append(f"(checks off: {', '.join(off)}; anomalies of their kinds were not looked for)")
    return "\n".join(lines)


def render_cut_short(promised: dict, read: dict, cut_line: int | None) -> str:
    """The first line of the summary of a log cut short (``show --partial``,
    ``load(partial=True)``): ``promised`` and ``read`` count records, anomalies, contained and
    allowed (``{"anomalies": 160, ...}``); ``cut_line``: the number of a last line cut in the
    middle."""
    order = sorted(promised, key=lambda name: name != "anomalies")  # the anomalies first
    counts = [f"{read.get(name, 0)} of the {promised[name]} {name}" for name in order if isinstance(promised[name], int) and promised[name] != read.get(name, 0)]
    where = "" if cut_line is None else f" (line {cut_line} cut in the middle)"
    if not counts:
        return f"opwatch: a partial log{where}: read every line its header counted."
    first, *rest = counts
    more = f" ({', '.join(rest)})" if rest else ""
    return f"opwatch: a partial log{where}: read {first} its header promised{more}; what was not read is not in this summary."


def every_check(command: str) -> str:
    """The line after a summary of a run with checks turned off: the command that runs them."""
    return f"opwatch: to run every check: {command}"


def render_disabled(variable: str, value: str) -> str:
    """The summary of a watch that the kill switch turned off: it saw nothing, so it cannot
    say there were no anomalies."""
    return f"opwatch: nothing was watched ({variable}={value} turned opwatch off), so no anomalies could be found."


# -- a failing block ------------------------------------------------------------------------


def render_failure(records: list[BaseRecord], failed: BaseRecord | None, error: BaseException, *, rank: int | None = None, width: int = DUMP_WIDTH) -> str:
    """The dump printed when a watched block raises: the last ops as a compact table at most
    ``width`` wide (repeated ops folded, the failing one marked and its neighbours kept). The
    failing op's line, tensors and module are in the exception's note or message, not
    repeated here."""
    lines = [f"{tagged(rank)}: the watched block raised {type(error).__name__}; the last {len(records)} ops:"]
    lines.append(render_table(records, mark=failed.index if failed else None, width=width))
    return "\n".join(lines)


def raised_above(error: BaseException, reported: str) -> str:
    """The last line of a traceback whose ``AnomalyError`` message opwatch's report above holds
    in full: its type and the message's first line (``reported``: the exception as Python
    prints it, notes apart)."""
    return f"{reported.partition(': ')[0]}: {str(error).partition(chr(10))[0]} (in full in opwatch's report above)\n"


def exception_note(failed: BaseRecord) -> str:
    """The note added to the exception of a failing block: the op, its line and its tensors."""
    position = failed.position
    note = f"{tagged(failed.rank)}: raised in {failed.op} (op #{failed.index}) at {location(failed)}"
    code = position.expression() or position.line_text()
    if code:
        note += f": {code}"
    note += "\n  inputs: " + ", ".join(str(meta) for meta in failed.inputs)
    if failed.module:
        note += f"\n  module: {module_of(failed)}"
    return note


def overwritten_save_note(facts) -> str:
    """The note added to torch's "modified by an inplace operation" error of a backward
    (``facts``: :class:`~opwatch.modes.saved_tensors.OverwrittenSave`): the op whose backward
    needed the tensor, the ops that wrote into it since, and the fix."""
    needed = facts.needed_by
    saved = "its result" if facts.saved.startswith("result") else f"its argument {facts.saved}"
    if facts.tensor is not None:
        saved += f" ({facts.tensor})"
    note = f"{tagged(needed.rank)}: the backward of {short_op_name(needed.op)} needed {saved} as its forward op saved it, but it was written in place since:"
    module = module_of(needed)
    note += f"\n  saved by:   {short_op_name(needed.op)} (op #{needed.index}{f', module {module}' if module else ''}) at {_code_at(needed)}"
    if not facts.writers:
        return note + "\n  written by: an op the log no longer holds"
    for writer in facts.writers:
        step = ", an optimizer step" if writer.phase == "optimizer" else ""
        note += f"\n  written by: {short_op_name(writer.op)} (op #{writer.index}{step}) at {_code_at(writer)}"
    if any(writer.phase == "optimizer" for writer in facts.writers):
        fix = ("run this backward before the optimizer step that updates the weights its graph saved (a GAN: compute the "
               "generator's loss after the discriminator's step, or call both backward() before either step)")
    else:
        fix = "write it out of place (x = x + y, not x += y; nn.ReLU(inplace=False)), or clone it first (h = h.clone(); h[:, 0] = 0)"
    return note + f"\n  fix:        {fix}"


def _code_at(record) -> str:
    """``file:line: code`` of ``record``, or ``file:line``."""
    position = record.position
    code = position.expression() or position.line_text()
    return f"{location(record)}: {code}" if code else location(record)


def count_places(groups) -> str:
    """``3 anomalies at 2 places`` for ``{key: [anomaly, count]}``."""
    total = sum(count for _, count in groups.values())
    return f"{total} anomal{'y' if total == 1 else 'ies'} at {len(groups)} place{'' if len(groups) == 1 else 's'}"


def group_messages(groups, *, shown=None) -> list[str]:
    """Each group's message, after a blank line, its first line marked ``[xN]`` when it fired
    N > 1 times; the group of key ``shown`` (its message already read) in its first line."""
    lines = []
    for key, (anomaly, count) in groups.items():
        lines.append("")
        text = anomaly.message
        if key == shown:
            text = f"{text.partition(chr(10))[0]} (the AnomalyError above)"
        if count > 1:
            first, _, rest = text.partition("\n")
            text = f"{first} [x{count}]\n{rest}" if rest else f"{first} [x{count}]"
        lines.append(text)
    return lines


def shown_of(shown: int, total: int) -> str:
    """The note under a summary that holds only the newest ``shown`` of ``total`` anomalies."""
    return f"\n(the summary shows the last {shown} of {total} anomalies)"


def for_the_command_line(summary: str) -> str:
    """A watch's summary as ``python -m opwatch`` prints it: its pointers to Python objects
    (``see Watch.contained``), which a command-line user does not have, said as what they mean."""
    return summary.replace(
        "were absorbed before they mattered; see Watch.contained)",
        "were absorbed before they mattered)",
    ).replace("matched an allow entry; see Watch.allowed)", "matched an --allow entry)")
