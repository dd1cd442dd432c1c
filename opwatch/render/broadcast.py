"""The sentences of the broadcast rules (:mod:`opwatch.checks.broadcast`).

Facts of both rules: ``op`` (``sub``), ``vector`` (the operand that gets new leading dims),
``column`` (the one stretched along its own size-1 dims), ``made_by`` (a
:class:`~opwatch.checks.finding.Place` for the op that made ``column``, or ``None``), ``dims``
(the stretched dims, negative), ``result`` (the broadcast shape), ``growth`` (times more
elements than the largest operand).

When the finding waited for its result's use (the stretched operand's size-1 dims were made by a
``keepdim=True`` reduction), two more: ``at`` (a Place, the broadcasting op) and ``reduced_by``
(``mean``, ``sum``: the op that reduced the result straight away, where it is reported).

- ``broadcast.implicit``: a pointwise op broadcast its operands.
- ``broadcast.tensors``: ``torch.broadcast_tensors`` did (two ``expand`` ops, as the losses do).
- ``broadcast.paired``: a column whose size-1 dims were made with ``unsqueeze`` met a vector
  (other values, for a 1-d one) sharing none of its dims, the result holds one size twice, and it was
  reduced straight away. Facts: ``op``, ``vector``, ``column``, ``dims``, ``result``,
  ``growth`` as above, ``size`` (the size held twice), ``at``, ``reduced_by``.
"""

from __future__ import annotations

from ..core.notation import format_meta, format_shape
from .phrases import place
from .rules import explains


@explains("broadcast.implicit", "broadcast.tensors")
def explain_broadcast(finding) -> tuple[str, str, str]:
    facts = finding.facts
    vector, column, dims, result = facts.vector, facts.column, facts.dims, facts.result
    made = f" (made by {place(facts.made_by)})" if facts.made_by else ""
    dims_text = ", ".join(str(len(result) + d) for d in dims)
    if finding.rule == "broadcast.tensors":
        returns = (
            f"this call broadcasts them together (torch.broadcast_tensors, as F.mse_loss, F.l1_loss, "
            f"F.smooth_l1_loss and F.huber_loss do with input and target: torch only warns) to {format_shape(result)}"
        )
    elif facts.at:
        returns = f"{place(facts.at)} returns {format_shape(result)}"
    else:
        returns = f"{facts.op} returns {format_shape(result)}"
    reduced = f", and {facts.reduced_by} reduces it straight away" if facts.reduced_by else ""
    problem = (
        f"both operands were expanded: {format_meta(vector)} gets new leading dims and "
        f"{format_meta(column)}{made} is stretched along dim {dims_text}; "
        f"{returns}, {facts.growth}x more elements than its largest input{reduced}"
    )
    shape = format_shape(vector.shape)
    expected = f"operands whose shapes already agree (e.g. {shape} with {shape}), or size-1 dims made on purpose with unsqueeze / None indexing"
    fix = (
        f"drop the size-1 dim where it is made (.squeeze({dims[0]}) or .view(-1) on the "
        f"{format_shape(column.shape)} operand), or give the other side the same dim with .unsqueeze({dims[0]}); "
        f"if the {format_shape(result)} result is intended, write it with unsqueeze/None on both sides"
    )
    return problem, expected, fix


@explains("broadcast.paired")
def explain_paired(finding) -> tuple[str, str, str]:
    facts = finding.facts
    vector, column, result, size = facts.vector, facts.column, facts.result, facts.size
    own = vector.shape
    wanted = (size,) + (1,) * (len(own) - 1)
    problem = (
        f"{format_meta(column)} (size-1 dims made with unsqueeze) meets {format_meta(vector)}, which gets new "
        f"leading dims: {place(facts.at)} returns {format_shape(result)}, holding size {size} twice, so every row "
        f"of one is paired with every row of the other ({facts.growth}x more elements than its largest input), "
        f"and {facts.reduced_by} reduces it straight away"
    )
    expected = f"the {format_shape(column.shape)} operand as {format_shape(wanted)}, so that row i meets row i of the {format_shape(own)} operand"
    how = (
        f"leave out the unsqueeze: {format_shape(wanted)} values meet the other operand row by row"
        if len(own) == 1
        else f"unsqueeze only as far as the other operand needs ({format_shape(wanted)}: one .unsqueeze(1) on the {size}-long values)"
    )
    fix = f"{how}; if the {format_shape(result)} table is intended, give both sides their own dims with unsqueeze/None before combining them"
    return problem, expected, fix
