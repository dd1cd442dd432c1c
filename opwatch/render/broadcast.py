"""The sentences of the broadcast rules (:mod:`opwatch.checks.broadcast`).

Facts of both rules: ``op`` (``sub``), ``vector`` (the operand that gets new leading dims),
``column`` (the one stretched along its own size-1 dims), ``made_by`` (a
:class:`~opwatch.checks.finding.Place` for the op that made ``column``, or ``None``), ``dims``
(the stretched dims, negative), ``result`` (the broadcast shape), ``growth`` (times more
elements than the largest operand).

- ``broadcast.implicit``: a pointwise op broadcast its operands.
- ``broadcast.tensors``: ``torch.broadcast_tensors`` did (two ``expand`` ops, as the losses do).
"""

from __future__ import annotations

from ..core.notation import format_meta, format_shape
from ..core.records import M_SHAPE
from .phrases import place
from .rules import explains


@explains("broadcast.implicit", "broadcast.tensors")
def explain_broadcast(finding) -> tuple[str, str, str]:
    facts = finding.facts
    vector, column, dims, result = facts["vector"], facts["column"], facts["dims"], facts["result"]
    made = f" (made by {place(facts['made_by'])})" if facts["made_by"] else ""
    dims_text = ", ".join(str(len(result) + d) for d in dims)
    if finding.rule == "broadcast.tensors":
        returns = (
            f"this call broadcasts them together (torch.broadcast_tensors, as F.mse_loss, F.l1_loss, "
            f"F.smooth_l1_loss and F.huber_loss do with input and target: torch only warns) to {format_shape(result)}"
        )
    else:
        returns = f"{facts['op']} returns {format_shape(result)}"
    problem = (
        f"both operands were expanded: {format_meta(vector)} gets new leading dims and "
        f"{format_meta(column)}{made} is stretched along dim {dims_text}; "
        f"{returns}, {facts['growth']}x more elements than its largest input"
    )
    shape = format_shape(vector[M_SHAPE])
    expected = f"operands whose shapes already agree (e.g. {shape} with {shape}), or size-1 dims made on purpose with unsqueeze / None indexing"
    fix = (
        f"drop the size-1 dim where it is made (.squeeze({dims[0]}) or .view(-1) on the "
        f"{format_shape(column[M_SHAPE])} operand), or give the other side the same dim with .unsqueeze({dims[0]}); "
        f"if the {format_shape(result)} result is intended, write it with unsqueeze/None on both sides"
    )
    return problem, expected, fix
